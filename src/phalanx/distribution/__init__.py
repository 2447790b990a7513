"""Keras 3's distribution names on torch: `DeviceMesh`, `TensorLayout`, `LayoutMap`.

Pure data describing how a model is laid out over the job's workers; `ModelParallelStrategy`
(`phalanx.strategies.model_parallel`) applies them with torch's DTensor, tensor parallelism
and FSDP2. Exported as ``phalanx.experimental.DeviceMesh`` and so on.
"""

from phalanx.distribution.layouts import LayoutMap, TensorLayout
from phalanx.distribution.mesh import DeviceMesh

__all__ = ["DeviceMesh", "LayoutMap", "TensorLayout"]
