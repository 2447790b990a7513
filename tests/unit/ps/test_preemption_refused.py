"""Preemption handling needs workers that step together: ParameterServerStrategy is refused."""

import pytest
from torch import nn

from phalanx.checkpoint import Checkpoint
from phalanx.experimental import PreemptionCheckpointHandler


def test_the_preemption_handler_refuses_parameter_server_strategy(ps_2workers_1ps, tmp_path):
    strategy = ps_2workers_1ps.strategy()
    with strategy.scope():
        model = nn.Linear(2, 2)
        with pytest.raises(NotImplementedError, match="needs workers that step together") as refused:
            PreemptionCheckpointHandler(strategy.cluster_resolver, Checkpoint(model=model), str(tmp_path))
    assert "HINT: under ParameterServerStrategy the coordinator retries" in str(refused.value)
