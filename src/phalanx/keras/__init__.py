"""Keras-style training for torch modules: Model.compile / fit / evaluate / predict."""

from phalanx.keras.model import Model
from phalanx.keras.saving import load_model
from phalanx.keras.sidecar_evaluator import SidecarEvaluator

__all__ = ["Model", "SidecarEvaluator", "load_model"]
