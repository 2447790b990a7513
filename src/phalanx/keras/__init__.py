"""Keras-style training for torch modules: Model.compile / fit / evaluate / predict."""

from phalanx.keras.model import Model
from phalanx.keras.saving import load_model

__all__ = ["Model", "load_model"]
