"""A worker task of a parameter-server cluster: runs the functions the coordinator schedules
(`environment.WorkerEnvironment`), with `strategy.WorkerStrategy` as their strategy."""
