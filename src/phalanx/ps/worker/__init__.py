"""A worker task of a parameter-server cluster: runs the functions the coordinator schedules
(`environment.WorkerEnvironment`), with `phalanx.strategies.parameter_server_worker.WorkerStrategy`
as their strategy."""
