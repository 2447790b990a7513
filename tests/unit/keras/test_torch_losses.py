"""PyTorch losses in compile: torch's argument order, torch's own reduction, TF's global batch."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import phalanx
from phalanx.losses.torch_loss import TorchLoss

STRATEGIES = ["one_device", "mirrored_2cpu"]


def _data(n=44, features=5, classes=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def fit_history(strategy, loss, metrics=None, epochs=3, batch_size=8, y=None, lr=0.5):
    """``fit``'s history for ``loss`` (a module-level function: the worker processes import it)."""
    x, labels = _data()
    with strategy.scope():
        torch.manual_seed(1)
        model = phalanx.Model(nn.Linear(5, 3))
        model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=lr), loss=loss, metrics=metrics)
    history = model.fit(
        x, labels if y is None else y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False
    )
    return history.history, [p.detach().clone() for p in model.module.parameters()]


def torch_loop(loss_fn, y, epochs=3, batch_size=8, lr=0.5):
    """Plain PyTorch on one device: the losses per step (with batch sizes) and the final weights."""
    x, _ = _data()
    torch.manual_seed(1)
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = []
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append((loss.item(), len(xb)))
    return steps, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_torch_cross_entropy_module_function_and_keras_loss_train_alike(runner):
    keras, _ = runner.run(fit_history, phalanx.losses.SparseCategoricalCrossentropy(from_logits=True))[0]
    module, _ = runner.run(fit_history, nn.CrossEntropyLoss())[0]
    function, _ = runner.run(fit_history, F.cross_entropy)[0]
    for history in (module, function):
        assert history["loss"] == pytest.approx(keras["loss"], abs=1e-4)
    assert keras["loss"][-1] < keras["loss"][0]


def _labels_with_ignored():
    _, y = _data()
    y = y.clone()
    y[::5] = -100  # torch's default ignore_index
    return y


REDUCTIONS = {
    "weighted_mean_ignore_index": (
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0])),
        _labels_with_ignored,
    ),
    "sum": (lambda: nn.CrossEntropyLoss(reduction="sum"), lambda: _data()[1]),
    "partial_weight_smoothing": (
        lambda: functools.partial(F.cross_entropy, weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.1),
        _labels_with_ignored,
    ),
    "mse_mean_per_element": (lambda: nn.MSELoss(), lambda: F.one_hot(_data()[1], 3).float()),
    "l1_sum_per_element": (lambda: nn.L1Loss(reduction="sum"), lambda: F.one_hot(_data()[1], 3).float()),
    "kl_div_batchmean": (
        lambda: nn.KLDivLoss(reduction="batchmean"),
        lambda: torch.softmax(_data()[0][:, :3], dim=1),
    ),
}


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
@pytest.mark.parametrize("case", sorted(REDUCTIONS))
def test_a_torch_loss_trains_as_plain_torch_does_on_the_global_batch(runner, case):
    make_loss, make_y = REDUCTIONS[case]
    y, loss = make_y(), make_loss()
    steps, want = torch_loop(loss, y)  # 44 examples in batches of 8: the last one is partial
    history, got = runner.run(fit_history, loss, None, 3, 8, y)[0]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    last_epoch = steps[-(len(steps) // 3) :]
    logged = sum(v * n for v, n in last_epoch) / sum(
        n for _, n in last_epoch
    )  # Keras: weighted by batch size
    assert history["loss"][-1] == pytest.approx(logged, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    "identifier",
    [
        nn.CrossEntropyLoss(),
        nn.MSELoss,
        F.binary_cross_entropy_with_logits,
        functools.partial(F.cross_entropy, label_smoothing=0.1),
    ],
    ids=["module", "module_class", "function", "partial"],
)
def test_losses_get_recognises_torch_losses_by_identity(identifier):
    assert isinstance(phalanx.losses.get(identifier), TorchLoss)


def test_other_callables_stay_keras_functions():
    def my_loss(y_true, y_pred):
        return (y_true - y_pred) ** 2

    assert isinstance(phalanx.losses.get(my_loss), phalanx.losses.LossFunctionWrapper)
    # not a recognised torch loss: three inputs
    assert not isinstance(phalanx.losses.get(F.gaussian_nll_loss), TorchLoss)


def test_calling_a_torch_loss_gives_torch_s_value_keras_order():
    logits, y = torch.randn(6, 3), torch.tensor([0, 2, 1, -100, 2, 0])
    module = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 0.5, 2.0]))
    torch.testing.assert_close(TorchLoss(module)(y, logits), module(logits, y))
    for reduction in ("sum", "none"):
        torch.testing.assert_close(
            TorchLoss(functools.partial(F.cross_entropy, reduction=reduction))(y, logits),
            F.cross_entropy(logits, y, reduction=reduction),
        )
    kl = nn.KLDivLoss(reduction="batchmean")
    p = torch.softmax(torch.randn(6, 3), 1)
    torch.testing.assert_close(TorchLoss(kl)(p, logits), kl(logits, p))


def test_a_three_input_torch_loss_is_refused():
    with pytest.raises(ValueError, match="three inputs"):
        phalanx.losses.get(nn.MarginRankingLoss())


def test_a_torch_loss_with_an_unknown_reduction_is_refused():
    loss = nn.MSELoss()
    loss.reduction = "median"
    with pytest.raises(ValueError, match="reduction must be one of"):
        TorchLoss(loss)


def test_torch_loss_refuses_other_objects():
    with pytest.raises(ValueError, match="TorchLoss takes a torch.nn loss module"):
        TorchLoss(lambda a, b: a)


class _AlwaysMean(nn.modules.loss._Loss):
    def forward(self, input, target):
        return ((input - target) ** 2).mean()


def test_a_custom_torch_loss_that_ignores_reduction_none_is_named():
    loss = TorchLoss(_AlwaysMean())
    with pytest.raises(ValueError, match="returned a scalar with reduction='none'"):
        loss.per_example(torch.zeros(4, 2), torch.ones(4, 2))


def test_sample_weight_scales_each_example_of_a_torch_loss(one_device):
    x, y = _data()
    weights = torch.linspace(0.0, 2.0, len(x))
    with one_device.scope():
        torch.manual_seed(1)
        model = phalanx.Model(nn.Linear(5, 3))
        model.compile(optimizer="sgd", loss=nn.CrossEntropyLoss())
    got = model.evaluate(x, y, sample_weight=weights, batch_size=len(x), verbose=0)
    want = (F.cross_entropy(model(x), y, reduction="none") * weights).mean()
    assert got == pytest.approx(want.item(), rel=1e-5)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 4)

    def forward(self, x):
        out = self.body(x)
        return out[:, :3], out[:, 3:]


def _two_heads_fit(strategy, x, labels, targets):
    with strategy.scope():
        torch.manual_seed(2)
        model = phalanx.Model(_TwoHeads())
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
            loss=[nn.CrossEntropyLoss(reduction="sum"), "mse"],
            loss_weights=[1.0, 0.5],
        )
    history = model.fit(x, (labels, targets), batch_size=8, epochs=2, verbose=0, shuffle=False).history
    return history, [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_a_torch_loss_beside_a_keras_loss_trains_as_plain_torch(runner):
    x, labels = _data()
    targets = torch.randn(len(x), 1)
    torch.manual_seed(2)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(2):
        for start in range(0, len(x), 8):
            head, value = model(x[start : start + 8])
            loss = F.cross_entropy(head, labels[start : start + 8], reduction="sum") + 0.5 * F.mse_loss(
                value, targets[start : start + 8]
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
    _, got = runner.run(_two_heads_fit, x, labels, targets)[0]
    for g, w in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, w.detach(), rtol=1e-4, atol=1e-5)
