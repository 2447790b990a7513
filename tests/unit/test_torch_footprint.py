"""phalanx leaves torch as it found it: its changes to torch's global
behaviour (`phalanx._hooks`) are installed when a strategy's scope opens or it runs, and
removed once no strategy is alive, or at once by `phalanx.remove_torch_hooks()`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

import phalanx

_REGISTRIES = (
    (module_hooks, "_global_parameter_registration_hooks"),
    (module_hooks, "_global_buffer_registration_hooks"),
    (module_hooks, "_global_module_registration_hooks"),
    (module_hooks, "_global_forward_pre_hooks"),
    (module_hooks, "_global_forward_hooks"),
    (optimizer_hooks, "_global_optimizer_pre_hooks"),
    (optimizer_hooks, "_global_optimizer_post_hooks"),
)
_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale")


def _torch_globals() -> tuple[object, ...]:
    hooks = tuple(tuple(getattr(owner, name).values()) for owner, name in _REGISTRIES)
    return hooks, tuple(torch.amp.GradScaler.__dict__.get(name) for name in _SCALER_METHODS)


# Run in a fresh interpreter: in the test process other tests' strategies may still be alive.
_AUTOMATIC = textwrap.dedent(
    """
    import gc, torch
    from torch import nn
    import phalanx
    from phalanx.ps.worker import embedding
    from tests.unit.test_torch_footprint import _torch_globals

    before = _torch_globals()
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    assert _torch_globals() == before, "made, not yet used: nothing changed"
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    embedding.install()  # what a parameter-server worker adds while its strategy lives

    def step(x):
        scaler.scale(phalanx.compute_average_loss(model(x).squeeze(1), global_batch_size=4)).backward()
        scaler.step(optimizer)
        scaler.update()

    for batch in strategy.experimental_distribute_dataset([torch.randn(4, 2)]):
        strategy.run(step, args=(batch,))
    during = _torch_globals()
    assert all(len(hooks) == 1 for hooks in during[0]), during[0]
    assert all(m is not o for m, o in zip(during[1], before[1])), "GradScaler's methods replaced"
    assert type(scaler) is not torch.amp.GradScaler  # adopted: per-replica state
    del strategy, model, optimizer, batch, step, scaler
    gc.collect()
    assert _torch_globals() == before, (_torch_globals(), before)
    assert not phalanx._hooks.installed()
    fresh = nn.Linear(2, 1)
    assert all(type(p) is nn.Parameter for p in fresh.parameters())
    print("ok")
    """
)


def test_the_last_strategy_gone_leaves_torch_its_own_hooks_and_grad_scaler():
    done = subprocess.run(
        [sys.executable, "-c", _AUTOMATIC], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_remove_torch_hooks_removes_them_now_and_the_next_scope_installs_them_again(mirrored_2cpu):
    with mirrored_2cpu.scope():
        nn.Linear(2, 1)
    mirrored_2cpu.run(lambda: None)
    assert phalanx._hooks.installed()
    phalanx.remove_torch_hooks()
    assert not phalanx._hooks.installed()
    hooks, scaler_methods = _torch_globals()
    assert not any(hooks)  # the strategy is alive, yet torch's registries are empty again
    assert all(type(p) is nn.Parameter for p in nn.Linear(2, 1).parameters())
    assert not any(hasattr(m, "__wrapped__") for m in scaler_methods)  # torch's own, not phalanx's wrappers
    with mirrored_2cpu.scope():
        again = nn.Linear(2, 1)
    assert isinstance(again.weight, phalanx.MirroredVariable)
    assert phalanx._hooks.installed()


def test_the_default_strategy_changes_nothing():
    phalanx.remove_torch_hooks()
    before = _torch_globals()
    with phalanx.get_strategy().scope():
        layer = nn.Linear(2, 1)
    phalanx.get_strategy().run(lambda: layer(torch.ones(1, 2)))
    assert _torch_globals() == before
    assert type(layer.weight) is nn.Parameter
