"""phalanx.metrics: Keras' documented values, additive state, batch-split invariance, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx import losses as L
from phalanx import metrics as M
from phalanx.variables import VariableAggregation

T = torch.tensor


def value(metric, *args, **kwargs):
    metric.update_state(*args, **kwargs)
    return metric.result().tolist()


# Keras' docstring examples: (metric, y_true, y_pred, result, sample_weight, weighted result)
KERAS_EXAMPLES = [
    (M.Accuracy, [[1], [2], [3], [4]], [[0], [2], [3], [4]], 0.75, [1, 1, 0, 0], 0.5),
    (M.BinaryAccuracy, [[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]], 0.75, [1, 0, 0, 1], 0.5),
    (M.CategoricalAccuracy, [[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]], 0.5, [0.7, 0.3], 0.3),
    (M.SparseCategoricalAccuracy, [[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]], 0.5, [0.7, 0.3], 0.3),
    (
        lambda: M.TopKCategoricalAccuracy(k=1),
        [[0, 0, 1], [0, 1, 0]],
        [[0.1, 0.9, 0.8], [0.05, 0.95, 0]],
        0.5,
        [0.7, 0.3],
        0.3,
    ),
    (
        lambda: M.SparseTopKCategoricalAccuracy(k=1),
        [2, 1],
        [[0.1, 0.9, 0.8], [0.05, 0.95, 0]],
        0.5,
        [0.7, 0.3],
        0.3,
    ),
    (M.MeanSquaredError, [[0, 1], [0, 0]], [[1, 1], [0, 0]], 0.25, [1, 0], 0.5),
    (M.MeanAbsoluteError, [[0, 1], [0, 0]], [[1, 1], [0, 0]], 0.25, [1, 0], 0.5),
    (M.RootMeanSquaredError, [[0, 1], [0, 0]], [[1, 1], [0, 0]], 0.5, [1, 0], 0.70710677),
    (M.Precision, [0, 1, 1, 1], [1, 0, 1, 1], 0.6666667, [0, 0, 1, 0], 1.0),
    (M.Recall, [0, 1, 1, 1], [1, 0, 1, 1], 0.6666667, [0, 0, 1, 0], 1.0),
    (lambda: M.AUC(num_thresholds=3), [0, 0, 1, 1], [0, 0.5, 0.3, 0.9], 0.75, [1, 0, 0, 1], 1.0),
]


@pytest.mark.parametrize(("make", "y_true", "y_pred", "expected", "weights", "weighted"), KERAS_EXAMPLES)
def test_keras_documented_values(make, y_true, y_pred, expected, weights, weighted):
    assert value(make(), T(y_true), T(y_pred, dtype=torch.float32)) == pytest.approx(expected, abs=1e-6)
    assert value(
        make(), T(y_true), T(y_pred, dtype=torch.float32), sample_weight=T(weights)
    ) == pytest.approx(weighted, abs=1e-6)


def test_mean_and_sum_keras_values():
    assert value(M.Mean(), T([1.0, 3.0, 5.0, 7.0])) == 4.0
    assert value(M.Mean(), T([1.0, 3.0, 5.0, 7.0]), sample_weight=T([1, 1, 0, 0])) == 2.0
    assert value(M.Sum(), T([1.0, 3.0, 5.0, 7.0])) == 16.0
    assert value(M.Sum(), T([1.0, 3.0, 5.0, 7.0]), sample_weight=T([1, 1, 0, 0])) == 4.0
    assert value(M.Mean(), np.array([[1.0, 3.0], [5.0, 7.0]])) == 4.0  # per example first
    assert value(M.Mean(), T(5.0)) == 5.0  # a scalar counts as one value


def test_precision_top_k_keras_values():
    assert value(M.Precision(top_k=2), T([0, 0, 1, 1]), T([1.0, 1.0, 1.0, 1.0])) == 0.0
    assert value(M.Precision(top_k=4), T([0, 0, 1, 1]), T([1.0, 1.0, 1.0, 1.0])) == 0.5
    recall = M.Recall(class_id=1)
    assert value(recall, T([[0, 1], [0, 1], [1, 0]]), T([[0.2, 0.8], [0.9, 0.1], [0.1, 0.9]])) == 0.5


def test_thresholds_keep_their_given_order():
    y = T([0, 1, 1, 0, 1])
    p = T([0.2, 0.4, 0.8, 0.6, 0.95])
    precision = M.Precision(thresholds=[0.7, 0.3, 0.5])
    assert value(precision, y, p) == pytest.approx([1.0, 0.75, 2 / 3])
    assert value(M.Recall(thresholds=[0.9, 0.1]), y, p) == pytest.approx([1 / 3, 1.0])


def test_empty_metrics_are_zero():
    for metric in (M.Mean(), M.SparseCategoricalAccuracy(), M.RootMeanSquaredError(), M.Precision(), M.AUC()):
        assert metric.result().item() == 0.0


def test_auc_matches_sklearn():
    from sklearn.metrics import average_precision_score, roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    p = np.clip(y * 0.35 + rng.random(400) * 0.65, 0, 1)
    roc, pr = M.AUC(num_thresholds=500), M.AUC(curve="PR", num_thresholds=500)
    assert value(roc, T(y), T(p)) == pytest.approx(roc_auc_score(y, p), abs=1e-2)
    assert value(pr, T(y), T(p)) == pytest.approx(average_precision_score(y, p), abs=1e-2)
    logits = M.AUC(num_thresholds=500, from_logits=True)
    assert value(logits, T(y), torch.logit(T(p).clamp(1e-6, 1 - 1e-6))) == pytest.approx(
        roc.result().item(), abs=1e-4
    )
    weights = rng.random(400)
    weighted = M.AUC(num_thresholds=1000)
    assert value(weighted, T(y), T(p), sample_weight=T(weights)) == pytest.approx(
        roc_auc_score(y, p, sample_weight=weights), abs=1e-2
    )


def test_auc_summation_methods_bracket_the_area():
    y, p = T([0, 0, 1, 1, 1, 0]), T([0.1, 0.6, 0.35, 0.8, 0.7, 0.2])
    low, mid, high = (
        value(M.AUC(num_thresholds=5, summation_method=s), y, p)
        for s in ("minoring", "interpolation", "majoring")
    )
    assert low <= mid <= high
    assert low < high
    pr_low = value(M.AUC(num_thresholds=5, curve="PR", summation_method="minoring"), y, p)
    pr_high = value(M.AUC(num_thresholds=5, curve="pr", summation_method="Majoring"), y, p)
    assert pr_low < pr_high


def test_auc_explicit_thresholds_and_multi_label():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, (300, 3))
    p = np.clip(y * 0.3 + rng.random((300, 3)) * 0.7, 0, 1)
    grid = [i / 999 for i in range(1, 999)]
    explicit, default = M.AUC(thresholds=grid), M.AUC(num_thresholds=1000)
    assert value(explicit, T(y), T(p)) == pytest.approx(value(default, T(y), T(p)), abs=1e-6)
    assert explicit.thresholds[0] < 0 < 1 < explicit.thresholds[-1]
    multi = M.AUC(num_thresholds=1000, multi_label=True, num_labels=3)
    assert value(multi, T(y), T(p)) == pytest.approx(roc_auc_score(y, p, average="macro"), abs=1e-2)
    weighted = M.AUC(num_thresholds=1000, multi_label=True, num_labels=3, label_weights=[1.0, 0.0, 0.0])
    assert value(weighted, T(y), T(p)) == pytest.approx(roc_auc_score(y[:, 0], p[:, 0]), abs=1e-2)
    only_first = M.AUC(num_thresholds=1000, label_weights=[1.0, 0.0, 0.0])
    assert value(only_first, T(y), T(p)) == pytest.approx(roc_auc_score(y[:, 0], p[:, 0]), abs=1e-2)
    uneven = M.AUC(thresholds=[0.1, 0.5, 0.55])
    assert 0.5 < value(uneven, T(y), T(p)) <= 1.0


def test_top_k_counts_ties_as_in():
    # Keras' in_top_k: a target whose score ties the k-th largest is in the top k.
    assert value(M.SparseTopKCategoricalAccuracy(k=1), T([1]), T([[0.5, 0.5, 0.0]])) == 1.0
    assert value(M.SparseTopKCategoricalAccuracy(k=2), T([2]), T([[0.1, 0.5, 0.4]])) == 1.0
    assert value(M.TopKCategoricalAccuracy(k=10), T([[0, 0, 1]]), T([[0.5, 0.4, 0.1]])) == 1.0  # k > classes


def test_sequence_accuracy_averages_per_example():
    y = T([[1, 2], [0, 0]])
    pred = torch.zeros(2, 2, 3)
    pred[0, 0, 1] = pred[0, 1, 0] = pred[1, 0, 0] = pred[1, 1, 0] = 1.0
    metric = M.SparseCategoricalAccuracy()
    assert value(metric, y, pred, sample_weight=T([0.0, 1.0])) == 1.0
    assert metric.count.item() == 1.0


BATCH = 25
SPLIT_CASES = [
    (
        M.SparseCategoricalAccuracy,
        lambda g: torch.randint(0, 3, (BATCH,), generator=g),
        lambda g: torch.rand(BATCH, 3, generator=g),
    ),
    (
        M.BinaryAccuracy,
        lambda g: torch.randint(0, 2, (BATCH, 1), generator=g),
        lambda g: torch.rand(BATCH, 1, generator=g),
    ),
    (
        M.MeanSquaredError,
        lambda g: torch.rand(BATCH, 2, generator=g),
        lambda g: torch.rand(BATCH, 2, generator=g),
    ),
    (
        M.RootMeanSquaredError,
        lambda g: torch.rand(BATCH, 2, generator=g),
        lambda g: torch.rand(BATCH, 2, generator=g),
    ),
    (M.AUC, lambda g: torch.randint(0, 2, (BATCH,), generator=g), lambda g: torch.rand(BATCH, generator=g)),
    (
        M.Precision,
        lambda g: torch.randint(0, 2, (BATCH,), generator=g),
        lambda g: torch.rand(BATCH, generator=g),
    ),
    (
        M.Recall,
        lambda g: torch.randint(0, 2, (BATCH,), generator=g),
        lambda g: torch.rand(BATCH, generator=g),
    ),
]


@pytest.mark.parametrize(
    ("make", "make_true", "make_pred"), SPLIT_CASES, ids=lambda c: getattr(c, "__name__", "")
)
@pytest.mark.parametrize("weighted", [False, True])
def test_two_updates_equal_one(make, make_true, make_pred, weighted):
    g = torch.Generator().manual_seed(3)
    y, p = make_true(g), make_pred(g)
    w = torch.rand(BATCH, generator=g) if weighted else None
    whole, split = make(), make()
    whole.update_state(y, p, sample_weight=w)
    for part in (slice(0, 13), slice(13, BATCH)):
        split.update_state(y[part], p[part], sample_weight=None if w is None else w[part])
    torch.testing.assert_close(split.result(), whole.result())


def test_count_weighted_not_mean_of_ratios():
    y = torch.zeros(BATCH, dtype=torch.long)
    pred = torch.zeros(BATCH, 3)
    pred[0, 0] = 1.0
    pred[1:, 1] = 1.0
    metric = M.SparseCategoricalAccuracy()
    metric.update_state(y[:13], pred[:13])  # 1 of 13 correct
    metric.update_state(y[13:], pred[13:])  # 0 of 12
    assert metric.result().item() == pytest.approx(0.04)  # 1 of 25, not (1/13 + 0) / 2


def test_state_is_additive_in_place_and_marked_sum():
    metric = M.AUC(num_thresholds=7)
    states = dict(metric.named_buffers())
    assert set(states) == {"true_positives", "false_positives", "true_negatives", "false_negatives"}
    assert set(metric.state_dict()) == set(states)
    for tensor in states.values():
        assert tensor._phalanx_aggregation is VariableAggregation.SUM
        assert tensor.dtype == torch.float32
        assert tensor.shape == (7,)
    logits = torch.randn(8, requires_grad=True)
    metric.update_state(torch.randint(0, 2, (8,)), logits.sigmoid())
    metric.reset_state()
    for name, tensor in metric.named_buffers():
        assert tensor is states[name]  # updated and reset in place, never replaced
        assert not tensor.requires_grad
        assert tensor.sum().item() == 0.0


def test_load_state_dict_carries_totals():
    a, b = M.Mean(), M.Mean()
    a.update_state(T([1.0, 2.0, 6.0]))
    b.load_state_dict(a.state_dict())
    assert b.result().item() == 3.0


def test_call_is_update_then_result_and_dtype():
    mean = M.Mean(dtype=torch.float64)
    assert mean(T([1.0, 2.0])).item() == 1.5
    assert mean(T([6.0])).item() == 3.0
    assert mean.total.dtype == torch.float64
    assert mean.get_config() == {"name": "mean", "dtype": "float64"}
    assert M.Mean(dtype="float64").dtype == torch.float64


def test_metric_on_the_inputs_device_is_moved_to_the_state():
    metric = M.Sum()
    metric.update_state(T([1.0, 2.0], dtype=torch.float64))
    assert metric.total.dtype == torch.float32
    assert metric.result().item() == 3.0


def test_custom_metric_with_add_state():
    class Positives(M.Metric):
        def __init__(self, name="positives"):
            super().__init__(name=name)
            self.hits = self.add_state("hits")
            self.seen = self.add_state("seen", dtype=torch.float64)

        def update_state(self, values):
            self._add(self.hits, (torch.as_tensor(values) > 0).sum())
            self._add(self.seen, torch.as_tensor(values).numel())

        def result(self):
            hits, seen = self._read("hits", "seen")
            return hits / seen

    metric = Positives()
    assert metric(T([1.0, -1.0, 2.0, 0.0])).item() == 0.5
    assert metric.seen.dtype == torch.float64
    metric.reset_state()
    assert metric.hits.item() == 0.0


def test_get_resolves_accuracy_from_the_loss():
    sparse = M.get("accuracy", loss="sparse_categorical_crossentropy")
    assert type(sparse) is M.SparseCategoricalAccuracy
    assert sparse.name == "accuracy"
    assert (
        type(M.get("acc", loss=L.SparseCategoricalCrossentropy(from_logits=True)))
        is M.SparseCategoricalAccuracy
    )
    assert M.get("acc", loss="SparseCategoricalCrossentropy").name == "acc"
    assert type(M.get("accuracy", loss="categorical_crossentropy")) is M.CategoricalAccuracy
    assert type(M.get("accuracy", loss=L.categorical_crossentropy)) is M.CategoricalAccuracy
    assert type(M.get("accuracy", loss=L.BinaryCrossentropy())) is M.BinaryAccuracy
    assert type(M.get("accuracy", loss="bce")) is M.BinaryAccuracy
    assert type(M.get("accuracy", loss=L.LossFunctionWrapper(L.binary_crossentropy))) is M.BinaryAccuracy


def test_accuracy_for_other_losses_reads_shapes():
    metric = M.get("accuracy", loss="mse")
    assert metric.name == "accuracy"
    assert value(metric, T([[1.0], [0.0]]), T([[0.9], [0.7]])) == 0.5  # one column: binary
    sparse = M.get("accuracy")
    assert value(sparse, T([2, 0]), T([[0.1, 0.2, 0.7], [0.1, 0.8, 0.1]])) == 0.5
    one_hot = M.get("accuracy", loss=lambda t, p: (t - p) ** 2)
    assert value(one_hot, T([[0, 0, 1], [1, 0, 0]]), T([[0.1, 0.2, 0.7], [0.1, 0.8, 0.1]])) == 0.5


def test_get_resolves_names_classes_configs_and_callables():
    cases = {
        "sparse_categorical_accuracy": M.SparseCategoricalAccuracy,
        "categorical_accuracy": M.CategoricalAccuracy,
        "binary_accuracy": M.BinaryAccuracy,
        "mae": M.MeanAbsoluteError,
        "MAE": M.MeanAbsoluteError,
        "mean_absolute_error": M.MeanAbsoluteError,
        "mse": M.MeanSquaredError,
        "mean_squared_error": M.MeanSquaredError,
        "root_mean_squared_error": M.RootMeanSquaredError,
        "auc": M.AUC,
        "AUC": M.AUC,
        "precision": M.Precision,
        "Recall": M.Recall,
        "top_k_categorical_accuracy": M.TopKCategoricalAccuracy,
        "SparseTopKCategoricalAccuracy": M.SparseTopKCategoricalAccuracy,
    }
    for name, cls in cases.items():
        metric = M.get(name)
        assert type(metric) is cls, name
        assert metric.name == name  # a name given in compile is the name in the logs
    auc = M.AUC()
    assert M.get(auc) is auc
    assert M.get(M.Recall).name == "recall"
    assert M.get({"class_name": "AUC", "config": {"curve": "PR"}}).curve == "PR"

    def hits(y_true, y_pred):
        return (y_true == y_pred).float()

    wrapped = M.get(hits)
    assert isinstance(wrapped, M.MeanMetricWrapper)
    assert wrapped.name == "hits"
    assert value(wrapped, T([1, 2]), T([1, 3])) == 0.5


@pytest.mark.parametrize(
    "metric",
    [
        M.Mean(name="m", dtype="float64"),
        M.Sum(),
        M.Accuracy(),
        M.BinaryAccuracy(threshold=0.3),
        M.SparseTopKCategoricalAccuracy(k=3),
        M.TopKCategoricalAccuracy(k=2, name="top2"),
        M.RootMeanSquaredError(),
        M.Precision(thresholds=[0.2, 0.8], class_id=1),
        M.Recall(top_k=2),
        M.AUC(num_thresholds=10, curve="PR", summation_method="minoring", from_logits=True),
        M.AUC(thresholds=[0.25, 0.5], multi_label=True, num_labels=2, label_weights=[1.0, 2.0]),
        M.MeanMetricWrapper(M.binary_accuracy, threshold=0.7),
    ],
    ids=lambda m: type(m).__name__,
)
def test_config_round_trip(metric):
    again = type(metric).from_config(metric.get_config())
    assert again.get_config() == metric.get_config()
    assert type(again) is type(metric)


def test_errors_name_the_rule():
    with pytest.raises(ValueError, match="must start at 'zeros'"):
        M.Mean().add_state("x", initializer="ones")
    with pytest.raises(NotImplementedError, match="must implement update_state"):
        M.Metric().update_state(1)
    with pytest.raises(NotImplementedError, match="must implement result"):
        M.Metric().result()
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        M.Mean(dtype=torch.int64)
    with pytest.raises(ValueError, match="Unknown metric 'nope'"):
        M.get("nope")
    with pytest.raises(ValueError, match="Unknown metric 'Mean'"):
        M.get("Mean")  # takes values, not (y_true, y_pred): not a compile metric
    with pytest.raises(ValueError, match="A metric must be a name"):
        M.get(3)
    with pytest.raises(ValueError, match="can only rebuild phalanx's metric functions"):
        M.MeanMetricWrapper.from_config({"name": "x", "fn": "<lambda>"})
    with pytest.raises(ValueError, match="k must be a positive integer"):
        M.TopKCategoricalAccuracy(k=0)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        M.SparseTopKCategoricalAccuracy(k=True)
    with pytest.raises(ValueError, match=r"sample_weight must broadcast.*\(3,\)"):
        M.Mean().update_state(T([1.0, 2.0]), sample_weight=T([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"sample_weight must broadcast.*\(2, 2, 2\)"):
        M.Mean().update_state(T([1.0, 2.0]), sample_weight=torch.ones(2, 2, 2))


def test_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="use categorical_accuracy"):
        M.SparseCategoricalAccuracy().update_state(torch.ones(2, 3), torch.rand(2, 3))
    with pytest.raises(ValueError, match="use sparse_categorical_accuracy"):
        M.CategoricalAccuracy().update_state(T([0, 1]), torch.rand(2, 3))
    with pytest.raises(ValueError, match="use top_k_categorical_accuracy"):
        M.SparseTopKCategoricalAccuracy().update_state(torch.ones(2, 3), torch.rand(2, 3))
    with pytest.raises(ValueError, match="use sparse_top_k_categorical_accuracy"):
        M.TopKCategoricalAccuracy().update_state(T([0, 1]), torch.rand(2, 3))
    with pytest.raises(ValueError, match="same shape"):
        M.Precision().update_state(T([0, 1]), torch.rand(2, 3))
    with pytest.raises(ValueError, match="class_id must index the last axis"):
        M.Recall(class_id=3).update_state(torch.ones(2, 3), torch.rand(2, 3))
    with pytest.raises(ValueError, match="class_id must index the last axis"):
        M.Recall(class_id=0).update_state(torch.ones(2), torch.rand(2))


def test_confusion_argument_errors():
    with pytest.raises(ValueError, match=r"Threshold values must be in \[0, 1\]"):
        M.Precision(thresholds=2.0)
    with pytest.raises(ValueError, match=r"Threshold values must be in \[0, 1\]"):
        M.AUC(thresholds=[0.5, -0.1])
    with pytest.raises(ValueError, match="num_thresholds must be an integer > 1"):
        M.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match="curve must be one of"):
        M.AUC(curve="XY")
    with pytest.raises(ValueError, match="summation_method must be one of"):
        M.AUC(summation_method="simpson")
    with pytest.raises(ValueError, match="needs num_labels"):
        M.AUC(multi_label=True)
    with pytest.raises(ValueError, match="only when multi_label is True"):
        M.AUC(num_labels=3)
    with pytest.raises(ValueError, match="label_weights must be 2 non-negative"):
        M.AUC(multi_label=True, num_labels=2, label_weights=[1.0])
    with pytest.raises(ValueError, match="label_weights must be one per label non-negative"):
        M.AUC(label_weights=[-1.0])
    with pytest.raises(ValueError, match=r"needs y_pred of shape \[batch, 2\]"):
        M.AUC(multi_label=True, num_labels=2).update_state(torch.ones(4, 3), torch.rand(4, 3))
    with pytest.raises(ValueError, match="one weight per entry of y_pred's last axis"):
        M.AUC(label_weights=[1.0, 2.0]).update_state(torch.ones(4, 3), torch.rand(4, 3))
