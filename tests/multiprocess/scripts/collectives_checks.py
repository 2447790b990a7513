"""Collectives across workers: reduce, gather (uneven), replica-context all_reduce/all_gather and
their gradients, per-call options; with one local replica also the gradient buckets against a
plain per-tensor all-reduce. Writes ``checks-<rank>.json`` to OUT_DIR.

usage: collectives_checks.py OUT_DIR LOCAL_REPLICAS
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import phalanx

out_dir, local = sys.argv[1], int(sys.argv[2])
task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
torch.manual_seed(100 + task_index)  # different on every worker: the chief's values must win
options = phalanx.CommunicationOptions(bytes_per_pack=4096)  # several small buckets
strategy = phalanx.MultiWorkerMirroredStrategy(
    communication_options=options, devices=[f"cpu:{i}" for i in range(local)]
)
rank = strategy.cluster_resolver.worker_index
n = strategy.num_replicas_in_sync
result = {
    "replicas": n,
    "is_chief": strategy.is_chief,
    "should_checkpoint": strategy.should_checkpoint,
    "uses_shared_memory": strategy._group.uses_shared_memory,
}


# ---------------------------------------------------------------- cross-replica reduce and gather
# replica r holds r + 1 rows of value 10 r + row: uneven sizes across replicas and workers
def rows(ctx):
    r = ctx.replica_id_in_sync_group
    return torch.arange(r + 1, dtype=torch.float32) + 10 * r


values = strategy.experimental_distribute_values_from_function(rows)
result["gather"] = strategy.gather(values, axis=0).tolist()
result["reduce_sum_axis0"] = strategy.reduce("sum", values, axis=0).item()
result["reduce_mean_axis0"] = strategy.reduce("mean", values, axis=0).item()
ones = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group + 1))
)
result["reduce_sum"] = strategy.reduce("sum", ones, axis=None).tolist()
result["reduce_mean"] = strategy.reduce("mean", ones, axis=None).tolist()


# ---------------------------------------------------------------- replica context
def in_replica(v):
    ctx = phalanx.get_replica_context()
    rid = torch.tensor([float(ctx.replica_id_in_sync_group + 1)])
    x = torch.ones(3, requires_grad=True)
    total = ctx.all_reduce("sum", x * rid)  # every replica's loss depends on every replica's x
    total.sum().backward()
    gathered = ctx.all_gather(v, axis=0)
    return ctx.all_reduce("sum", rid), ctx.all_reduce("mean", rid), gathered, x.grad


s, m, g, grad = strategy.run(in_replica, args=(values,))
result["replica_sum"] = [t.item() for t in strategy.experimental_local_results(s)]
result["replica_mean"] = [t.item() for t in strategy.experimental_local_results(m)]
result["replica_gather"] = [t.tolist() for t in strategy.experimental_local_results(g)]
result["replica_grad"] = [t.tolist() for t in strategy.experimental_local_results(grad)]

# a per-call implementation other than the strategy's is refused on every worker, before any traffic
try:
    strategy.run(
        lambda: phalanx.get_replica_context().all_reduce(
            "sum", torch.ones(1), phalanx.CommunicationOptions(implementation="NCCL")
        )
    )
except ValueError as exc:
    result["implementation_error"] = str(exc)


# ---------------------------------------------------------------- gradient buckets (one local replica)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 30)  # 2.4 KB weight
        self.b = nn.Linear(30, 30)  # 3.6 KB weight: a bucket of its own
        self.only_chief = nn.Linear(30, 40)  # used by worker 0 only; 4.8 KB weight: solo, in place
        self.never = nn.Linear(3, 3)  # no gradient anywhere
        self.head = nn.Linear(30, 2)
        self.use_only_chief = rank == 0

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        out = self.head(h)
        return out + self.only_chief(h).sum() if self.use_only_chief else out


if local == 1:
    with strategy.scope():
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    strategy.run(lambda: None)  # the first run broadcasts the chief's initial values
    result["plain_parameters"] = all(type(p) is nn.Parameter for p in net.parameters())
    result["buckets"] = [[tuple(p.shape) for p in b] for b in strategy._buckets.buckets]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    chief = flat.clone()
    dist.broadcast(chief, 0)
    result["initial_values_from_chief"] = bool(torch.equal(flat, chief))

    reference = Net()  # outside the scope: plain, no hooks; same weights
    reference.load_state_dict(net.state_dict())

    def ref_grads(batches):
        """Local gradients (accumulated over batches) summed with one all-reduce per tensor."""
        reference.zero_grad(set_to_none=True)
        for x in batches:
            reference(x).square().mean().backward()
        out = {}
        for name, p in reference.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)  # plain per-tensor SUM
            used = torch.tensor([float(p.grad is not None)])
            dist.all_reduce(used)
            out[name] = g if used.item() > 0 else None
        return out

    def same_grad(got, want):
        if got is None or want is None:
            return got is want
        return torch.allclose(got, want, atol=1e-6)

    mismatches = []
    g = torch.Generator().manual_seed(rank)
    for step, accumulate in enumerate([1, 1, 2]):  # the last step accumulates two backward passes
        batches = [torch.randn(5, 20, generator=g) for _ in range(accumulate)]
        expected = ref_grads(batches)

        def train(batches=batches):
            for x in batches:
                net(x).square().mean().backward()
            opt.step()

        strategy.run(train)
        for name, p in net.named_parameters():
            if not same_grad(p.grad, expected[name]):
                mismatches.append(f"step {step} {name}")
        with torch.no_grad():  # the reference takes the same SGD step with its summed gradients
            for name, p in reference.named_parameters():
                if expected[name] is not None:
                    p.add_(expected[name], alpha=-0.1)
        opt.zero_grad()
        for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
            if not torch.allclose(p, q, atol=1e-6):
                mismatches.append(f"step {step} weight {name}")
    result["bucket_mismatches"] = mismatches

    # two optimizers stepping in one run: the second step finds its gradients already summed
    with strategy.scope():
        pair = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in pair]
    x = torch.full((1, 4), float(rank + 1))

    def two_steps():
        pair[1](pair[0](x)).sum().backward()
        for o in opts:
            o.step()
        return pair[1].bias.grad.clone()

    result["second_optimizer_bias_grad"] = strategy.run(two_steps).tolist()  # 1 per worker: 2.0

    # an optimizer over a parameter created outside the scope is refused
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        strategy.run(stray.step)
    except RuntimeError as exc:
        result["outside_scope_error"] = str(exc)

    dirpath = os.path.join(out_dir, "saved")
    path = strategy.write_dirpath(dirpath)
    result["write_dirpath"] = path
    result["write_dirpath_exists"] = os.path.isdir(path)
    strategy.remove_temp_dirpath(dirpath)
    result["temp_removed"] = not os.path.exists(os.path.join(dirpath, f"workertemp_{rank}"))

with open(os.path.join(out_dir, f"checks-{rank}.json"), "w") as f:
    json.dump(result, f)
strategy.close()
try:
    strategy.run(lambda: None)
except RuntimeError as exc:
    print("after close:", exc)
