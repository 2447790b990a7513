"""The TF1 article's Estimator program, ported: a canned DNNClassifier trained with
train_and_evaluate. The same program runs on every task; TF_CONFIG says which role it plays.

Locally (no TF_CONFIG): trains, evaluating after checkpoints, and prints the evaluation.
On a cluster: start it on every task with TF_CONFIG (chief, worker, ps, and an evaluator whose
TF_CONFIG has the same "cluster" and "task": {"type": "evaluator", "index": 0}) and one
PHALANX_CLUSTER_TOKEN; the chief and workers train (variables on the ps tasks), the
evaluator evaluates each new checkpoint.

Run: python examples/estimator_train_and_evaluate.py --model-dir /tmp/digits_model
or: phalanx launch --chief --workers 1 --ps 1 examples/estimator_train_and_evaluate.py
(the launcher starts chief, worker and ps; start an evaluator yourself as above).
"""

import argparse

import torch
from sklearn.datasets import load_digits

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--model-dir", default="/tmp/digits_model")
parser.add_argument("--max-steps", type=int, default=300, help="global steps to train")
args = parser.parse_args()

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]


def train_input_fn(input_context):
    # Each training task reads its own shard, shuffled and repeated (TF: dataset.shard().repeat()).
    rows = torch.arange(len(train_x))[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        order = rows[torch.randperm(len(rows), generator=generator)]
        for start in range(0, len(order) - 31, 32):
            batch = order[start : start + 32]
            yield {"pixels": train_x[batch]}, train_y[batch]


def eval_input_fn():
    for start in range(0, len(test_x), 100):
        yield {"pixels": test_x[start : start + 100]}, test_y[start : start + 100]


config = phalanx.estimator.RunConfig(save_checkpoints_steps=100, tf_random_seed=0)
classifier = phalanx.estimator.DNNClassifier(
    hidden_units=[64, 32],
    feature_columns=[phalanx.estimator.numeric_column("pixels", shape=64)],
    n_classes=10,
    optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
    model_dir=args.model_dir,
    config=config,
)
train_spec = phalanx.estimator.TrainSpec(input_fn=train_input_fn, max_steps=args.max_steps)
eval_spec = phalanx.estimator.EvalSpec(
    input_fn=eval_input_fn, steps=None, start_delay_secs=0, throttle_secs=1
)
result, _ = phalanx.estimator.train_and_evaluate(classifier, train_spec, eval_spec)
print(f"{config.task_type or 'local'} done; evaluation: {result}")
if result is not None:
    print(f"accuracy {result['accuracy']:.3f} at global step {result['global_step']}")
