"""The TensorFlow reference of `bench_ps_tf.py`: tf.distribute's ParameterServerStrategy on the
same workloads, the same local cluster (one process per task), the same timing.

Run from an environment with TensorFlow (never a phalanx dependency), e.g.

    python3 -m venv /work/tfvenv && /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /work/tfvenv/bin/python benchmarks/_ps_tf_reference.py --workload emb --workers 2 --ps 1

or let ``bench_ps_tf.py`` run it side by side with phalanx (``PHALANX_TF_PYTHON`` or
``--tf-python``). Every task is a ``tf.distribute.Server`` with one intra-op thread and two
inter-op threads (with one, a worker deadlocks); the chief uses ``SimpleClusterResolver``, a
``ClusterCoordinator`` and a ``tf.function`` step per workload, scheduled and joined like phalanx's:

* mlp: 784-1024-1024-10, batch 256 of a fixed batch, cross-entropy, SGD (lr 0.01);
* emb: a 100k x 32 table (``tf.nn.embedding_lookup`` on the ps: the worker sends the ids, the
  ps gathers the rows) + dense 256 -> 1, loss mean(out^2), Adagrad (lr 0.1, accumulators 0,
  epsilon 1e-10: torch's) with TF's sparse kernel on the table; ids cycle through 64 batches;
* emb_split: the same, ``FixedShardsPartitioner(2)`` on every variable.

The optimizer updates are TF's own kernels (``ResourceApplyGradientDescent``,
``ResourceSparseApplyAdagradV2``, ``ResourceApplyAdagradV2``) on the variables' ps tasks,
which is what Keras' optimizers run, without their Python bookkeeping.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ps_cluster as cluster  # noqa: E402

LR_SGD, LR_ADAGRAD, EPSILON = 0.01, 0.1, 1e-10


def _serve(tf, spec: dict, job: str, index: int) -> None:  # noqa: ANN001 - the tensorflow module
    # One intra-op thread; two inter-op threads, because with one a TF 2.21 worker deadlocks
    # (its only executor thread waits for the ps while the function's remote reads need it).
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=index, config=config)
    server.join()


def _mlp(tf, strategy, coordinator):  # noqa: ANN001, ANN202
    with strategy.scope():
        sizes = [784, 1024, 1024, 10]
        init = tf.keras.initializers.GlorotUniform(seed=0)
        weights = []
        for fan_in, fan_out in zip(sizes, sizes[1:], strict=False):
            weights.append(tf.Variable(init((fan_in, fan_out))))
            weights.append(tf.Variable(tf.zeros((fan_out,))))

    def dataset_fn():
        x = tf.random.stateless_normal((256, 784), seed=(0, 1))
        y = tf.random.stateless_uniform((256,), seed=(0, 2), maxval=10, dtype=tf.int64)
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_fn(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            h = x
            for i in range(0, len(weights), 2):
                h = tf.matmul(h, weights[i]) + weights[i + 1]
                if i + 2 < len(weights):
                    h = tf.nn.relu(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        grads = tape.gradient(loss, weights)
        for variable, grad in zip(weights, grads, strict=True):
            tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=LR_SGD, delta=grad)

    @tf.function
    def step(iterator):
        strategy.run(replica_fn, args=(next(iterator),))

    return step, iterator


def _shards(variable) -> list:  # noqa: ANN001
    """The variables that hold ``variable`` on the ps tasks (a ShardedVariable's, or itself)."""
    return list(getattr(variable, "variables", [variable]))


def _embedding(tf, strategy, coordinator):  # noqa: ANN001, ANN202
    with strategy.scope():
        table = tf.Variable(tf.random.stateless_normal((100_000, 32), seed=(0, 3)))
        kernel = tf.Variable(tf.random.stateless_uniform((256, 1), seed=(0, 4), minval=-0.06, maxval=0.06))
        bias = tf.Variable(tf.zeros((1,)))
    trained = [table, kernel, bias]
    # One accumulator per physical variable, on its ps task: TF's sparse and dense Adagrad
    # kernels need both on one device. Created over the whole variables, the partitioner would
    # split the accumulators too and round-robin could put a shard's accumulator on the other
    # ps task ("Cannot place the graph ... incompatible assigned devices" with 2 ps tasks).
    accumulators = []
    with strategy.scope():
        for shard in (s for v in trained for s in _shards(v)):
            with strategy.extended.colocate_vars_with(shard):
                accumulators.append(tf.Variable(tf.zeros(shard.shape)))

    def dataset_fn():
        ids = tf.random.stateless_uniform(
            (cluster.IDS_POOL, 256, 8), seed=(0, 5), maxval=100_000, dtype=tf.int64
        )
        return tf.data.Dataset.from_tensor_slices(ids).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_fn(ids):
        physical = [s for v in trained for s in _shards(v)]
        with tf.GradientTape() as tape:
            rows = tf.nn.embedding_lookup(table, ids)  # gathered on the ps
            out = tf.matmul(tf.reshape(rows, (256, 256)), tf.convert_to_tensor(kernel)) + bias
            loss = tf.reduce_mean(tf.square(out))
        grads = tape.gradient(loss, physical)
        for variable, accum, grad in zip(physical, accumulators, grads, strict=True):
            if isinstance(grad, tf.IndexedSlices):
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=variable.handle,
                    accum=accum.handle,
                    lr=LR_ADAGRAD,
                    epsilon=EPSILON,
                    grad=grad.values,
                    indices=grad.indices,
                )
            else:
                tf.raw_ops.ResourceApplyAdagradV2(
                    var=variable.handle, accum=accum.handle, lr=LR_ADAGRAD, epsilon=EPSILON, grad=grad
                )

    @tf.function
    def step(iterator):
        strategy.run(replica_fn, args=(next(iterator),))

    return step, iterator


class _Alone:
    """What `_mlp` and `_embedding` take of a coordinator, for their model trained alone."""

    @staticmethod
    def create_per_worker_dataset(dataset_fn):  # noqa: ANN001, ANN205
        return dataset_fn()


def _kernel_ms(tf, workload: str) -> float:  # noqa: ANN001
    """ms per step of ``workload``'s model trained alone here (one process, one thread, the
    default strategy): the same ``tf.function`` step, its variables local."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    build = _mlp if workload == "mlp" else _embedding
    step, iterator = build(tf, tf.distribute.get_strategy(), _Alone())
    return cluster.time_kernel(lambda: step(iterator))


def _chief(tf, args, spec: dict) -> dict:  # noqa: ANN001
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    partitioner = None
    if args.workload == "emb_split":
        partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    build = _mlp if args.workload == "mlp" else _embedding
    step, iterator = build(tf, strategy, coordinator)

    def run_steps(n: int) -> None:
        for _ in range(n):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()

    return run_steps


def main() -> None:
    args = cluster.parse_common()
    import tensorflow as tf

    if args.serve:
        _serve(tf, json.loads(args.cluster), args.serve[0], int(args.serve[1]))
        return
    if args.kernels:
        print("RESULT " + json.dumps({w: _kernel_ms(tf, w) for w in args.kernels.split(",")}), flush=True)
        return
    spec = cluster.cluster_spec(args.workers, args.ps)
    tasks = cluster.start_tasks(__file__, spec, [], {})
    try:
        tasks.wait_until_listening()
        run_steps = _chief(tf, args, spec)
        steps = args.steps or cluster.default_steps(args.workload, args.quick)
        result = cluster.measure(
            run_steps,
            tasks.pids(),
            steps,
            warmup=cluster.warmup_steps(steps, args.workers),
            rounds=args.rounds,
        )
    finally:
        tasks.stop()
    result.update(
        workload=args.workload,
        workers=args.workers,
        ps=args.ps,
        steps=steps,
        versions=f"TensorFlow {tf.__version__}, Python {sys.version.split()[0]}",
        threads="intra-op 1 per task, inter-op 2 on ps/workers (1 deadlocks), 1 on the chief",
    )
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    else:
        print(f"# {cluster.host_line()}; {result['versions']}; {result['threads']}")
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in result["cpu_ms_per_step"].items())
        print(
            f"TF {cluster.WORKLOADS[args.workload]}, {args.workers} workers, {args.ps} ps: "
            f"{result['steps_per_s']:.1f} steps/s; CPU ms/step: {cpu}"
        )


if __name__ == "__main__":
    main()
