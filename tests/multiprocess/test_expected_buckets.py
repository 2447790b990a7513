"""Two models in one MultiWorkerMirroredStrategy scope, one trained: after the first step the
other's gradient buckets stop moving, and a worker that trains it after all (here only one
worker, as data-dependent control flow does) has it summed on every worker; passes that
alternate between two sets (a GAN's two steps) send each set only in the passes that write to
it. On shared memory and on gloo, whose announced passes must follow the change of buckets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.multiprocess
WIDE = 1 << 14  # 16 x WIDE float32 weights: 1 MiB, a bucket of its own


def trains_one_model_then_the_other_on_one_worker(strategy):
    import phalanx

    rank = strategy.cluster_resolver.worker_index
    with strategy.scope():
        torch.manual_seed(0)
        idle = nn.Sequential(nn.Linear(16, WIDE), nn.Linear(WIDE, 4))  # its first weight: a solo bucket
        trained = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    traffic = strategy._buckets.traffic  # bytes handed to all-reduces (the measurement's own counter)

    def step(x, y):
        loss = phalanx.compute_average_loss((trained(x) - y).square().sum(1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    sent = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        before = traffic.bytes_uncompressed
        strategy.run(step, args=(x, y))
        sent.append(traffic.bytes_uncompressed - before)

    # worker 1 alone goes through ``idle``: a bucket no worker expected
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + rank))
    local = copy.deepcopy(idle)
    local(x).square().sum().backward()

    def surprise():
        loss = trained(x).sum()
        if rank == 1:
            loss = loss + idle(x).square().sum()
        loss.backward()

    strategy.run(surprise)
    return {
        "sent": sent,
        "idle_grads": [None if p.grad is None else p.grad.clone() for p in idle.parameters()],
        "local": [p.grad for p in local.parameters()],
        "weights": [p.detach().clone() for p in trained.parameters()],
    }


@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_an_idle_model_stops_moving_and_a_surprise_is_summed_everywhere(mwms_2workers, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    results = mwms_2workers.run(trains_one_model_then_the_other_on_one_worker, env=env)
    solo = 16 * WIDE * 4  # the rest of ``idle`` shares the bucket that carries the flags
    for result in results:
        first, *rest = result["sent"]
        assert rest
        assert all(n == rest[0] for n in rest)
        # the first step moved the idle model's solo bucket, the later ones did not
        assert first == rest[0] + solo
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        torch.testing.assert_close(a, b)
    # worker 1's gradient of ``idle``, summed: the same on both workers (worker 0 sent zeros)
    for p0, p1, want in zip(
        results[0]["idle_grads"], results[1]["idle_grads"], results[1]["local"], strict=True
    ):
        torch.testing.assert_close(p0, want)
        torch.testing.assert_close(p1, want)


def alternates_two_steps_like_a_gan(strategy):
    """Even steps train ``a`` alone, odd steps ``a`` and ``b`` through both (a GAN's
    discriminator and generator steps); a one-device copy trains on the global batches."""
    import phalanx

    def models():
        torch.manual_seed(0)
        return nn.Linear(16, WIDE), nn.Sequential(nn.Linear(WIDE, 8), nn.Linear(8, 4))  # b, a

    with strategy.scope():
        b, a = models()
        optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1e-4)
    ref_b, ref_a = models()
    ref_optimizer = torch.optim.SGD([*ref_a.parameters(), *ref_b.parameters()], lr=1e-4)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, WIDE, generator=g) / 128, torch.randn(8, 16, generator=g)) for _ in range(12)]
    traffic = strategy._buckets.traffic

    def loss_of(net_a, net_b, h, z, through_b):
        per_example = net_a(h).square().sum(1)
        if through_b:
            per_example = per_example + net_a(net_b(z)).square().sum(1)
        return per_example

    def step(h, z, through_b):
        loss = phalanx.compute_average_loss(loss_of(a, b, h, z, through_b), global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    sent = []
    for n, (h, z) in enumerate(strategy.experimental_distribute_dataset(batches)):
        before = traffic.bytes_uncompressed
        strategy.run(step, args=(h, z, n % 2 == 1))
        sent.append(traffic.bytes_uncompressed - before)
    for n, (h, z) in enumerate(batches):
        loss_of(ref_a, ref_b, h, z, n % 2 == 1).mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    return {
        "sent": sent,
        "weights": [p.detach().clone() for p in [*a.parameters(), *b.parameters()]],
        "reference": [p.detach().clone() for p in [*ref_a.parameters(), *ref_b.parameters()]],
    }


@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_alternating_passes_send_each_set_in_the_passes_that_write_it(mwms_2workers, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    results = mwms_2workers.run(alternates_two_steps_like_a_gan, env=env)
    solo = WIDE * 16 * 4  # b's weight: a bucket of its own
    for result in results:
        for got, want in zip(result["weights"], result["reference"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # once four passes show the alternation, b's bucket moves only in the passes through b
        without_b, with_b = result["sent"][4::2], result["sent"][5::2]
        assert len(set(without_b)) == 1
        assert set(with_b) == {without_b[0] + solo}
