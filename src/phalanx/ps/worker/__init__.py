"""A worker task of a parameter-server cluster: runs the functions the coordinator schedules."""
