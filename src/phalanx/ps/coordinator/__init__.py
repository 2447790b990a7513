"""The chief's side of a parameter-server cluster: the `Chief` behind ParameterServerStrategy,
the `ClusterCoordinator` and its worker threads, and the worker-loss policy (see `phalanx.ps`)."""
