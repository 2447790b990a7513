"""The chief's side of a parameter-server cluster: the coordinator and its worker threads."""
