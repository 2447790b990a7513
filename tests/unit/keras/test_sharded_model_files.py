"""Model.save / save_weights to a ``.dcp`` path write a sharded folder (torch.distributed.checkpoint)
that load_model / load_weights read back, in one process. Sharded workers (where a folder is
written whatever the path): tests/multiprocess/test_sharded_checkpoints.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import phalanx
from phalanx.train import Checkpoint


def _trained_model() -> phalanx.Model:
    torch.manual_seed(0)
    model = phalanx.Model(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)))
    model.compile(optimizer=torch.optim.Adam(model.parameters(), lr=0.05), loss="mse")
    model.fit(torch.randn(16, 4).numpy(), torch.randn(16, 2).numpy(), batch_size=8, verbose=0)
    return model


def test_a_model_saved_to_a_dcp_path_loads_with_its_weights_and_optimizer_state(tmp_path):
    model = _trained_model()
    path = str(tmp_path / "model.dcp")
    model.save(path)
    assert os.path.isfile(os.path.join(path, ".metadata"))
    loaded = phalanx.load_model(path)  # rebuilt from the folder's description, no class needed
    torch.testing.assert_close(loaded.module.state_dict(), model.module.state_dict())
    saved_state = model.optimizer.state_dict()["state"]
    loaded_state = loaded.optimizer.state_dict()["state"]
    assert loaded_state.keys() == saved_state.keys()
    for index, moments in saved_state.items():
        for key, value in moments.items():
            torch.testing.assert_close(loaded_state[index][key], value)


def test_weights_saved_to_a_dcp_path_load_into_a_new_model(tmp_path):
    model = _trained_model()
    path = str(tmp_path / "w.dcp")
    model.save_weights(path)
    other = phalanx.Model(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)))
    other.load_weights(path)
    torch.testing.assert_close(other.module.state_dict(), model.module.state_dict())
    model.save(str(tmp_path / "m.dcp"))
    other.load_weights(str(tmp_path / "m.dcp"))  # a saved model's folder holds its weights too


def test_a_checkpoint_folder_is_not_taken_for_a_model(tmp_path):
    model = _trained_model()
    path = Checkpoint(net=model.module).save(str(tmp_path / "ckpt"), sharded=True)
    with pytest.raises(ValueError, match="is not a phalanx model folder"):
        phalanx.load_model(path)
    with pytest.raises(ValueError, match="holds no model weights saved by Model.save"):
        model.load_weights(path)
