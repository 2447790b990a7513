"""phalanx.data: the tf.data subset the distribution guides use, built on torch.utils.data."""

from phalanx.data.dataset import AUTOTUNE, INFINITE, UNKNOWN, Dataset
from phalanx.data.options import DistributeOptions, Options

__all__ = ["AUTOTUNE", "INFINITE", "UNKNOWN", "Dataset", "DistributeOptions", "Options"]
