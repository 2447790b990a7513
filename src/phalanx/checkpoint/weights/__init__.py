"""Model weights in the files other tools write, loaded straight into each worker's shards and
saved with no worker holding the whole model (docs/big_models.md).

- ``model.load_state_dict(torch.load(path, mmap=True, weights_only=True))``: under
  FullyShardedStrategy each worker copies only its rows out of the mapped file
  (`slices.local_part`); a model built on the meta device gets memory for its shards only.
- `load_safetensors` / `save_safetensors`: a ``.safetensors`` file or a Hugging Face folder
  (``model.safetensors.index.json``), each worker reading or writing only its rows;
  ``phalanx.Model.load_weights``, ``save_weights`` (a ``.safetensors`` path) and
  ``phalanx.checkpoint.Checkpoint.read`` take them too.
"""

from phalanx.checkpoint.weights.safetensors_files import is_safetensors, load_safetensors, save_safetensors

__all__ = ["is_safetensors", "load_safetensors", "save_safetensors"]
