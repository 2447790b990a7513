"""What the custom-loop scripts share (preemption_loop.py, elastic_loop.py): the data, the
model and the training step of a loop driven by PreemptionCheckpointHandler.run.

Every step's global batch is fixed by the step number and split among the workers there are
at that step (read at every step: an elastic job's membership changes); the loss is divided by
the global batch, so the weights do not depend on how many workers computed them.
"""

import torch
from torch import nn

import phalanx


def data(steps, global_batch):
    """(inputs, targets): steps x global_batch x 5 and steps x global_batch x 1."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(steps, global_batch, 5, generator=g), torch.randn(steps, global_batch, 1, generator=g)


def build(strategy):
    """(model, optimizer, checkpoint), made in the strategy's scope (call it inside)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)


def train_step_of(strategy, model, optimizer, inputs, targets, before_backward=lambda step: None):
    """``train_step(step)`` for ``handler.run``; ``before_backward(step)`` runs after this
    worker's forward pass, before its gradients are all-reduced (a fault goes there)."""
    global_batch = inputs.shape[1]

    def train_step(step):
        me, workers = strategy.worker_rank, strategy.num_workers_in_sync  # as many as there are now
        rows = slice(me * global_batch // workers, (me + 1) * global_batch // workers)
        x, y = inputs[step, rows], targets[step, rows]

        def replica_step():
            loss = (model(x) - y).square().sum() / global_batch
            before_backward(step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step), axis=None)

    return train_step


def weights(model):
    """The model's weights, detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
