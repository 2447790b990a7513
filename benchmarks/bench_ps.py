"""The parameter-server path against raw gRPC and a plain PyTorch loop.

Run: python benchmarks/bench_ps.py [--quick]

1. Variable read: `PSClient.read` of one float32 variable (4 KB, 4 MB) from a ps task
   (phalanx's wire format, token check, handler) against a raw gRPC unary call echoing the
   same number of bytes on the same machine. ratio = raw time / phalanx time.
2. Training step: an MLP 784-256-10, batch 128 from a per-worker dataset, SGD, scheduled on
   one worker and joined (pickling the step, the worker's read of changed variables, the push
   of the gradients, the ps applying them and returning the new values) against the same
   steps in a plain PyTorch loop. ratio = plain time / phalanx time: the price of keeping the
   variables on a ps task, paid back only when several workers train at once.
3. Embedding step: a 100k x 32 table (12.8 MB) with Adam, 128 x 8 ids per step: the table
   split in 2 shards, looked up by rows on the worker, against the same table whole (read and
   returned whole). ratio = whole time / sharded time.

The cluster (coordinator, worker, ps) runs in this one process on 127.0.0.1 with real gRPC
servers, so its tasks share one interpreter lock: a pessimistic setting. Nothing is
asserted: the ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_time, report  # noqa: E402

import phalanx  # noqa: E402
from phalanx.cluster._ports import free_ports  # noqa: E402
from phalanx.cluster.resolvers import SimpleClusterResolver  # noqa: E402
from phalanx.ps.variables import VariableHandle  # noqa: E402
from phalanx.security.token import TOKEN_ENV  # noqa: E402


def _raw_echo_server(port: int) -> grpc.Server:
    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"echo": grpc.unary_unary_rpc_method_handler(echo, lambda b: b, lambda b: b)}
    )
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def _cluster() -> tuple[dict[str, list[str]], list[Any]]:
    ports = free_ports(3)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{ports[2]}"],
    }
    return spec, [phalanx.Server(spec, "ps", 0), phalanx.Server(spec, "worker", 0)]


def _embedding_step_time(partitioner: Any, repeats: int, inner: int) -> float:
    """Seconds per scheduled step of an embedding model, its table sharded or not."""
    spec, servers = _cluster()
    resolver = SimpleClusterResolver(spec, task_type="chief", task_id=0)
    strategy = phalanx.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    try:
        coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(100_000, 32), nn.Flatten(), nn.Linear(8 * 32, 1))
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

        def batches():  # noqa: ANN202 - a generator on the worker
            g = torch.Generator().manual_seed(0)
            while True:
                yield torch.randint(0, 100_000, (128, 8), generator=g)

        iterator = iter(coordinator.create_per_worker_dataset(batches))

        def step(iterator: Any) -> None:
            ids = next(iterator)
            loss = model(ids).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        def scheduled() -> None:
            coordinator.schedule(step, args=(iterator,))
            coordinator.join()

        return best_time(scheduled, repeats, inner)
    finally:
        strategy.close()
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, inner = (3, 5) if args.quick else (5, 20)
    os.environ.setdefault(TOKEN_ENV, "benchmark-secret")
    torch.set_num_threads(1)

    ports = free_ports(4)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{ports[2]}"],
    }
    servers = [phalanx.Server(spec, "ps", 0), phalanx.Server(spec, "worker", 0)]
    raw = _raw_echo_server(ports[3])
    channel = grpc.insecure_channel(
        f"127.0.0.1:{ports[3]}",
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    echo = channel.unary_unary(
        "/bench.Echo/echo", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    strategy = phalanx.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="chief", task_id=0))
    try:
        for name, numel in {"4KB": 1 << 10, "4MB": 1 << 20}.items():
            handle = VariableHandle(f"bench-{name}", 0, (numel,), "torch.float32")
            strategy._ps.create([handle], [torch.ones(numel)])
            payload = bytes(4 * numel)
            ours = best_time(lambda h=handle: strategy._ps.read([h]), repeats, inner)
            reference = best_time(lambda p=payload: echo(p, timeout=30), repeats, inner)
            report(f"ps read {name} (1 ps, gRPC)", ours, reference, ref_name="raw gRPC")

        coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
        with strategy.scope():
            model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def batches():  # the worker's input pipeline: the same batch, forever
            while True:
                yield x, y

        iterator = iter(coordinator.create_per_worker_dataset(batches))

        def step(iterator: Any) -> None:
            features, labels = next(iterator)
            loss = nn.functional.cross_entropy(model(features), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        def scheduled() -> None:
            coordinator.schedule(step, args=(iterator,))
            coordinator.join()

        plain = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)

        def plain_step() -> None:
            loss = nn.functional.cross_entropy(plain(x), y)
            plain_opt.zero_grad()
            loss.backward()
            plain_opt.step()

        ours = best_time(scheduled, repeats, inner)
        reference = best_time(plain_step, repeats, inner)
        report("train step MLP 784-256-10, 1 worker, 1 ps", ours, reference, unit="ms", ref_name="plain loop")
        sharded = _embedding_step_time(phalanx.partitioners.FixedShardsPartitioner(2), repeats, inner)
        whole = _embedding_step_time(None, repeats, inner)
        report("embedding 100k x 32 step: rows vs whole table", sharded, whole, unit="ms", ref_name="whole")
    finally:
        strategy.close()
        for server in servers:
            server.stop()
        raw.stop(0)
        channel.close()


if __name__ == "__main__":
    main()
