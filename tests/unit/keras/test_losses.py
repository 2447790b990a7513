"""phalanx.losses: Keras' numbers (its documented examples), reductions, per-example values, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx import losses as L

T = torch.tensor


def close(actual, expected, atol=1e-3):
    torch.testing.assert_close(
        torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0
    )


# Keras' docstring examples: (loss, y_true, y_pred, mean, weighted by [0.7, 0.3] or given, sum, none)
REGRESSION = dict(y_true=[[0.0, 1.0], [0.0, 0.0]], y_pred=[[1.0, 1.0], [1.0, 0.0]])
PROBS = dict(y_true=[[0.0, 1.0], [0.0, 0.0]], y_pred=[[0.6, 0.4], [0.4, 0.6]])
CATEGORICAL = [[0.05, 0.95, 0.0], [0.1, 0.8, 0.1]]
KERAS_EXAMPLES = [
    (L.MeanSquaredError, REGRESSION, [0.7, 0.3], 0.5, 0.25, 1.0, [0.5, 0.5]),
    (L.MeanAbsoluteError, REGRESSION, [0.7, 0.3], 0.5, 0.25, 1.0, [0.5, 0.5]),
    (L.BinaryCrossentropy, PROBS, [1.0, 0.0], 0.815, 0.458, 1.630, [0.916, 0.714]),
    (L.Huber, PROBS, [1.0, 0.0], 0.155, 0.09, 0.31, [0.18, 0.13]),
    (
        L.CategoricalCrossentropy,
        dict(y_true=[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], y_pred=CATEGORICAL),
        [0.3, 0.7],
        1.177,
        0.814,
        2.354,
        [0.0513, 2.303],
    ),
    (
        L.SparseCategoricalCrossentropy,
        dict(y_true=[1, 2], y_pred=CATEGORICAL),
        [0.3, 0.7],
        1.177,
        0.814,
        2.354,
        [0.0513, 2.303],
    ),
]


@pytest.mark.parametrize(("cls", "data", "weights", "mean", "weighted", "total", "none"), KERAS_EXAMPLES)
def test_keras_documented_values(cls, data, weights, mean, weighted, total, none):
    y_true, y_pred = T(data["y_true"]), T(data["y_pred"])
    close(cls()(y_true, y_pred), mean)
    close(cls()(y_true, y_pred, sample_weight=T(weights)), weighted)
    close(cls(reduction="sum")(y_true, y_pred), total)
    close(cls(reduction="none")(y_true, y_pred), none)
    close(cls(reduction=None)(y_true, y_pred), none)
    close(cls(reduction="mean")(y_true, y_pred), mean)


def test_binary_crossentropy_from_logits_keras_example():
    # Keras' docstring: y_true=[0, 1, 0, 0], logits [-18.6, 0.51, 2.94, -12.8] -> 0.865
    loss = L.BinaryCrossentropy(from_logits=True)
    close(loss(T([0.0, 1.0, 0.0, 0.0]), T([-18.6, 0.51, 2.94, -12.8])), 0.865)


def test_crossentropies_match_torch():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = T([0, 1, 2, 3, 0, 1])
    per = L.SparseCategoricalCrossentropy(from_logits=True).per_example(y, logits)
    torch.testing.assert_close(per, F.cross_entropy(logits, y, reduction="none"))
    onehot = F.one_hot(y, 4).float()
    torch.testing.assert_close(L.CategoricalCrossentropy(from_logits=True).per_example(onehot, logits), per)
    probs = logits.softmax(-1)
    torch.testing.assert_close(L.SparseCategoricalCrossentropy()(y, probs), F.cross_entropy(logits, y))
    torch.testing.assert_close(
        L.SparseCategoricalCrossentropy()(y[:, None], probs), F.cross_entropy(logits, y)
    )
    targets = torch.rand(6, 4, generator=torch.Generator().manual_seed(1)).round()
    torch.testing.assert_close(
        L.BinaryCrossentropy(from_logits=True)(targets, logits),
        F.binary_cross_entropy_with_logits(logits, targets),
    )


def test_probabilities_are_clipped_by_epsilon():
    # p = 0 for the true class: Keras clips to 1e-7, giving -log(1e-7) = 16.118, not inf.
    close(L.CategoricalCrossentropy()(T([[1.0, 0.0]]), T([[0.0, 1.0]])), 16.118)
    close(L.SparseCategoricalCrossentropy()(T([0]), T([[0.0, 1.0]])), 16.118)
    close(L.BinaryCrossentropy()(T([1.0]), T([0.0])), 16.118)


def test_label_smoothing():
    smoothed = L.CategoricalCrossentropy(label_smoothing=0.1)(T([[0.0, 1.0]]), T([[0.2, 0.8]]))
    expected = -(0.05 * torch.log(T(0.2)) + 0.95 * torch.log(T(0.8)))
    close(smoothed, expected, atol=1e-6)
    binary = L.BinaryCrossentropy(label_smoothing=0.2)(T([1.0]), T([0.7]))
    close(binary, -(0.9 * torch.log(T(0.7)) + 0.1 * torch.log(T(0.3))), atol=1e-6)


def test_ignore_class_leaves_the_average():
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    y = T([0, 1, 2, 1, 0])
    loss = L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=1)
    torch.testing.assert_close(loss(y, logits), F.cross_entropy(logits, y, ignore_index=1))
    per_example = L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=1, reduction="none")
    none = per_example(y, logits)
    assert none[1].item() == 0.0
    assert none[3].item() == 0.0
    total = L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=1, reduction="sum")(y, logits)
    torch.testing.assert_close(total, F.cross_entropy(logits, y, ignore_index=1, reduction="sum"))
    # all ignored: 0, not NaN
    assert loss(T([1, 1]), logits[:2]).item() == 0.0


def test_per_example_is_weighted_and_sums_to_the_distributed_mean():
    loss = L.MeanSquaredError()
    y_true, y_pred = torch.zeros(4, 3), torch.arange(12.0).reshape(4, 3)
    weights = T([1.0, 0.0, 2.0, 1.0])
    per = loss.per_example(y_true, y_pred, weights)
    assert per.shape == (4,)
    torch.testing.assert_close(per, (y_pred**2).mean(-1) * weights)
    # two replicas with half the global batch each: sum(per-example) / global batch = the mean
    halves = [loss.per_example(y_true[i : i + 2], y_pred[i : i + 2], weights[i : i + 2]) for i in (0, 2)]
    torch.testing.assert_close(sum(h.sum() for h in halves) / 4, loss(y_true, y_pred, weights))


def test_trailing_axes_are_averaged_and_temporal_weights_apply():
    y_pred = torch.arange(24.0).reshape(2, 3, 4)
    y_true = torch.zeros(2, 3, 4)
    loss = L.MeanSquaredError()
    per = loss.per_example(y_true, y_pred)
    torch.testing.assert_close(per, (y_pred**2).mean(dim=(1, 2)))
    weights = T([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    weighted = loss(y_true, y_pred, sample_weight=weights)
    keras = ((y_pred**2).mean(-1) * weights).sum() / 6  # Keras: sum / number of [batch, time] values
    torch.testing.assert_close(weighted, keras)
    expected = ((y_pred**2).mean(-1) * weights).sum() / weights.sum()
    torch.testing.assert_close(
        L.MeanSquaredError(reduction="mean_with_sample_weight")(y_true, y_pred, weights), expected
    )


def test_sample_weight_shapes_and_scalar():
    loss = L.MeanAbsoluteError()
    y_true, y_pred = torch.zeros(3, 2), torch.ones(3, 2)
    for weights in (T([1.0, 2.0, 3.0]), T([[1.0], [2.0], [3.0]])):
        close(loss(y_true, y_pred, weights), 2.0, atol=1e-6)
    close(loss(y_true, y_pred, 0.5), 0.5, atol=1e-6)
    close(L.MeanSquaredError()(T([1.0, 2.0]), T([[1.0], [4.0]])), 2.0, atol=1e-6)  # [batch] vs [batch, 1]


def test_empty_batch_gives_zero_with_a_gradient():
    logits = torch.zeros(0, 3, requires_grad=True)
    value = L.SparseCategoricalCrossentropy(from_logits=True)(torch.zeros(0, dtype=torch.long), logits)
    assert value.item() == 0.0
    value.backward()
    assert logits.grad is not None
    assert L.MeanSquaredError()(torch.zeros(0, 2), torch.zeros(0, 2)).item() == 0.0
    assert (
        L.MeanSquaredError(reduction="mean_with_sample_weight")(
            torch.zeros(0), torch.zeros(0), torch.zeros(0)
        ).item()
        == 0.0
    )


def test_dtype_casts_predictions():
    loss = L.MeanSquaredError(dtype="float64")
    assert loss.dtype == torch.float64
    assert loss(torch.zeros(2), torch.ones(2)).dtype == torch.float64
    assert L.MeanSquaredError()(torch.zeros(2), torch.ones(2, dtype=torch.float64)).dtype == torch.float64
    assert L.MeanSquaredError(dtype=torch.float64).get_config()["dtype"] == "float64"
    assert (
        L.MeanSquaredError()(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)).item() == 1.0
    )


def test_function_forms():
    close(L.mean_squared_error(T(REGRESSION["y_true"]), T(REGRESSION["y_pred"])), [0.5, 0.5])
    close(L.mean_absolute_error(T([1.0, 2.0]), T([2.0, 2.0])), [1.0, 0.0])  # rank 1: one value per example
    close(L.huber(T([[0.0]]), T([[3.0]]), delta=1.0), [2.5])
    close(L.sparse_categorical_crossentropy(T([1, 2]), T(CATEGORICAL)), [0.0513, 2.303])
    close(L.categorical_crossentropy(T([[0.0, 1.0, 0.0]]), T([CATEGORICAL[0]])), [0.0513])
    close(L.binary_crossentropy(T([[1.0]]), T([[0.0]]), from_logits=True), [0.6931])
    assert (
        L.sparse_categorical_crossentropy(T([[0], [1]]), torch.zeros(2, 3), ignore_class=1)[1].item() == 0.0
    )


def test_get_resolves_keras_names():
    cases = {
        "mse": L.MeanSquaredError,
        "MSE": L.MeanSquaredError,
        "mean_squared_error": L.MeanSquaredError,
        "MeanSquaredError": L.MeanSquaredError,
        "mae": L.MeanAbsoluteError,
        "MeanAbsoluteError": L.MeanAbsoluteError,
        "bce": L.BinaryCrossentropy,
        "binary_crossentropy": L.BinaryCrossentropy,
        "categorical_crossentropy": L.CategoricalCrossentropy,
        "CategoricalCrossentropy": L.CategoricalCrossentropy,
        "sparse_categorical_crossentropy": L.SparseCategoricalCrossentropy,
        "SparseCategoricalCrossentropy": L.SparseCategoricalCrossentropy,
        "huber": L.Huber,
        "Huber": L.Huber,
    }
    for name, cls in cases.items():
        assert type(L.get(name)) is cls, name
    loss = L.Huber(delta=2.0)
    assert L.get(loss) is loss
    assert type(L.get(L.Huber)) is L.Huber
    assert type(L.get(L.mean_absolute_error)) is L.MeanAbsoluteError
    rebuilt = L.get({"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}})
    assert rebuilt.get_config()["from_logits"] is True


def test_plain_callables_are_wrapped():
    wrapped = L.get(lambda t, p: (t - p) ** 2)
    assert isinstance(wrapped, L.LossFunctionWrapper)
    assert wrapped.name == "<lambda>"
    close(wrapped(torch.ones(3), torch.zeros(3)), 1.0)

    def squared(t, p):
        return (t - p) ** 2

    close(L.get(squared).per_example(torch.ones(2, 3), torch.zeros(2, 3)), [1.0, 1.0])
    assert L.get(squared).name == "squared"


def test_custom_subclass_call_and_trailing_axes():
    class Cubed(L.Loss):
        def call(self, y_true, y_pred):
            return (y_pred - y_true) ** 3  # [batch, d]: averaged per example

    loss = Cubed()
    assert loss.name == "cubed"
    close(loss.per_example(torch.zeros(2, 2), T([[1.0, 3.0], [2.0, 0.0]])), [14.0, 4.0])
    assert Cubed.from_config(loss.get_config()).get_config() == loss.get_config()


@pytest.mark.parametrize(
    "loss",
    [
        L.MeanSquaredError(reduction="sum", name="m"),
        L.MeanAbsoluteError(),
        L.Huber(delta=0.5),
        L.BinaryCrossentropy(from_logits=True, label_smoothing=0.1),
        L.CategoricalCrossentropy(label_smoothing=0.2, dtype="float64"),
        L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=3),
        L.LossFunctionWrapper(L.huber, delta=3.0),
    ],
    ids=lambda loss: type(loss).__name__,
)
def test_config_round_trip(loss):
    again = type(loss).from_config(loss.get_config())
    assert again.get_config() == loss.get_config()
    y_true, y_pred = T([[0.0, 1.0, 0.0, 0.0]]), T([[0.1, 0.6, 0.2, 0.1]])
    if isinstance(loss, L.SparseCategoricalCrossentropy):
        y_true = T([1])
    torch.testing.assert_close(again(y_true, y_pred), loss(y_true, y_pred))


def test_loss_errors():
    with pytest.raises(ValueError, match="reduction must be one of"):
        L.MeanSquaredError(reduction="avg")
    with pytest.raises(ValueError, match="Unknown loss 'nope'"):
        L.get("nope")
    with pytest.raises(ValueError, match="Unknown loss 'Nope'"):
        L.get({"class_name": "Nope"})
    with pytest.raises(ValueError, match="A loss must be a name"):
        L.get(3)
    with pytest.raises(ValueError, match="gave a scalar"):
        L.get(lambda t, p: ((t - p) ** 2).mean())(torch.ones(3), torch.zeros(3))
    with pytest.raises(NotImplementedError, match="must implement call"):
        L.Loss()(torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        L.MeanSquaredError(dtype="int64")
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        L.MeanSquaredError(dtype="float_please")
    with pytest.raises(ValueError, match="delta must be > 0"):
        L.Huber(delta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        L.BinaryCrossentropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        L.categorical_crossentropy(torch.ones(1, 2), torch.ones(1, 2), label_smoothing=-0.1)
    with pytest.raises(ValueError, match="can only rebuild phalanx's loss functions"):
        L.LossFunctionWrapper.from_config({"fn": "<lambda>", "name": "x"})


def test_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="use sparse_categorical_crossentropy"):
        L.CategoricalCrossentropy()(T([0, 1]), torch.rand(2, 3))
    with pytest.raises(ValueError, match="use categorical_crossentropy"):
        L.SparseCategoricalCrossentropy()(torch.ones(2, 3), torch.rand(2, 3))
    with pytest.raises(ValueError, match="use categorical_crossentropy"):
        L.sparse_categorical_crossentropy(T(1), T(0.5))
    with pytest.raises(ValueError, match="binary_crossentropy needs y_true and y_pred of the same shape"):
        L.BinaryCrossentropy()(torch.ones(2, 3), torch.rand(2, 2))
    with pytest.raises(ValueError, match=r"sample_weight must broadcast.*\(3,\)"):
        L.MeanSquaredError()(torch.zeros(2, 2), torch.ones(2, 2), sample_weight=T([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"sample_weight must broadcast.*shape=\(3, 2\)"):
        L.MeanSquaredError()(torch.zeros(3, 2), torch.ones(3, 2), sample_weight=torch.ones(3, 2))
