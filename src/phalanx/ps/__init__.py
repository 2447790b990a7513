"""The parameter-server cluster: everything behind ParameterServerStrategy, in one package.

Where things happen ("Flow 2" in docs/architecture.md follows one scheduled function through them):

* ``coordinator/`` - the chief. `chief.Chief` is what ParameterServerStrategy delegates to and
  what `cluster_coordinator.ClusterCoordinator` talks to; `local_copies` (placement, refresh,
  push of the chief's writes), `optimizer_state` (optimizer state on the ps tasks), `closure`
  (the queue), `remote_value`, `remote_worker` (one worker's connection, heartbeats),
  `worker_loss` (the state machine and `FailurePolicy` for lost workers).
* ``worker/`` - a worker task. `environment.WorkerEnvironment` runs a closure: reads the
  variables, pushes gradients and buffer changes; `embedding`
  (row lookups of sharded tables), `context` (the environment of the running closure). Its
  strategy is `phalanx.strategies.parameter_server_worker.WorkerStrategy`.
* ``pickling`` - the by-reference contract, both halves: what the chief sends as a reference,
  what a worker resolves it to.
* ``store`` and ``messages`` - a ps task: its variables and optimizers, and the messages of its
  RPC table. ``variables`` - `VariableHandle` and `PSClient` (the ps tasks' client);
  ``partitioners`` and ``sharding`` - variables split over several ps tasks.
* ``server`` - `phalanx.Server`, what a worker or ps task runs; ``transport`` (gRPC, token
  check) and ``wire`` (message bytes) carry every call.

Public names: `phalanx.ParameterServerStrategy`, `phalanx.coordinator`, `phalanx.Server`,
`phalanx.partitioners`; per-worker datasets live in `phalanx.input.per_worker`.
"""
