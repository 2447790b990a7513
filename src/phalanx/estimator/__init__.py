"""``phalanx.estimator``: TF's Estimator API on phalanx's parameter-server machinery (tf.estimator).

`Estimator(model_fn, model_dir, config)` trains, evaluates, predicts and exports;
`train_and_evaluate(estimator, TrainSpec, EvalSpec)` runs each ``TF_CONFIG`` task's role
(chief, worker, ps, evaluator); `DNNClassifier` and `LinearClassifier` are canned over
`numeric_column`\\ s. Distributed training is between-graph replication
(`phalanx.train.BetweenGraphStrategy`, `phalanx.train.MonitoredTrainingSession`).
docs/tf1_cluster_and_estimator.md walks through them.
"""

from phalanx.estimator.canned import DNNClassifier, LinearClassifier, NumericColumn, numeric_column
from phalanx.estimator.estimator import Estimator
from phalanx.estimator.graph import get_module, get_optimizer
from phalanx.estimator.run_config import RunConfig
from phalanx.estimator.specs import EstimatorSpec, EvalSpec, ModeKeys, TrainSpec
from phalanx.estimator.training import train_and_evaluate

__all__ = [
    "DNNClassifier",
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "LinearClassifier",
    "ModeKeys",
    "NumericColumn",
    "RunConfig",
    "TrainSpec",
    "get_module",
    "get_optimizer",
    "numeric_column",
    "train_and_evaluate",
]
