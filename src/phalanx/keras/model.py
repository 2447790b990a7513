"""phalanx.Model: Keras' compile / fit / evaluate / predict around any torch module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import mixed_precision
from phalanx.keras import _model_files, optimizers
from phalanx.keras._accumulation import Accumulation, check_steps, check_strategy
from phalanx.keras._elastic_loop import MoveTo
from phalanx.keras._loops import TrainLoop, evaluate_loop, predict_loop, validation_pass
from phalanx.keras.compile_utils import LossContainer, identifier_config, resolve_metrics
from phalanx.keras.data_adapter import DataHandler, float_dtype_of, split_validation, unpack_batch
from phalanx.strategies.default import get_replica_context, get_strategy

__all__ = ["Model"]


def _callbacks_module() -> Any:
    from phalanx import callbacks

    return callbacks


class Model(nn.Module):
    """A Keras-style model around a torch module, bound to the strategy it was created in.

    Create it (and compile it) inside ``strategy.scope()``: the wrapped module's parameters
    are then distributed by that strategy, and ``fit``/``evaluate``/``predict`` run every
    step through ``strategy.run``. Losses follow the distributed convention (sum of
    per-example losses over the *global* batch); logged losses and metrics are global
    values over every replica and worker.

    As in Keras 3, a subclass may override ``train_step(data)``, ``test_step(data)`` or
    ``predict_step(data)``: each runs once per replica (replica context) on that replica's
    slice of the batch, ``data`` being ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.

    Args:
        module: The network. Kept as ``model.module``; ``model(x)`` calls it.
    """

    _call: Any
    _loss_tracker: Any

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Model wraps a torch.nn.Module. Received: {type(module).__name__}.")
        self.module = module
        self._strategy = get_strategy()
        self.optimizer: torch.optim.Optimizer | None = None
        self.stop_training = False
        self.compiled = False  # Keras 3's flag: `compile` ran
        self.history: Any = None
        self._losses: LossContainer | None = None
        self._compiled_metrics: list[Any] = []
        self._compile_config: dict[str, Any] = {}
        # Not submodules: they must not appear in state_dict() twice (or at all).
        object.__setattr__(self, "_loss_tracker", None)
        object.__setattr__(self, "_call", module)
        self._resume: tuple[int, int] | None = None  # where the fit now starting continues
        self._train_loop = TrainLoop()
        self._policy = mixed_precision.Policy("float32")  # the global policy at compile()
        self._loss_scale: mixed_precision.GradScaler | None = None
        self._accumulation = Accumulation()

    @property
    def strategy(self) -> Any:
        """The strategy this model was created under."""
        return self._strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    # ------------------------------------------------------------------ compile
    def compile(
        self,
        optimizer: str | torch.optim.Optimizer = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Any = None,
        jit_compile: bool = False,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        """Configures training: optimizer, loss(es) and metrics by Keras name or as objects.

        Optimizers, metrics and the loss tracker are created in the model's strategy scope,
        so their state is distributed like the model's. The global mixed-precision policy
        (`phalanx.mixed_precision.set_global_policy`) is read here: ``fit``, ``evaluate``
        and ``predict`` compute under its autocast, with float32 variables, outputs, losses
        and metrics; ``"mixed_float16"`` adds dynamic loss scaling, as TF's compile does.

        ``gradient_accumulation_steps=k`` (Keras 3's optimizer argument): the model updates
        every ``k`` training steps with the mean of their gradients, and the steps between
        updates move no gradients between replicas or workers (`phalanx.keras._accumulation`).

        Raises:
            TypeError: ``gradient_accumulation_steps`` is not an int.
            ValueError: ``gradient_accumulation_steps`` is below 1, or above 1 under a
                strategy whose ``fit`` cannot accumulate (ParameterServerStrategy, elastic jobs).
        """
        from phalanx import metrics as metrics_module

        steps = check_steps(gradient_accumulation_steps)
        check_strategy(steps, self._strategy)

        with self._strategy.scope():
            self.optimizer = optimizers.get(optimizer, self.parameters())
            self._losses = LossContainer(loss, loss_weights)
            self._compiled_metrics = resolve_metrics(metrics, loss)
            object.__setattr__(self, "_loss_tracker", metrics_module.Mean(name="loss"))
        self._policy = mixed_precision.global_policy()
        device = self._strategy.local_devices[0].type
        self._loss_scale = mixed_precision.GradScaler(device) if self._policy.needs_loss_scaling else None
        object.__setattr__(self, "_call", torch.compile(self.module) if jit_compile else self.module)
        self._compile_config = {
            "optimizer": optimizers.config_of(self.optimizer),
            "loss": identifier_config(loss),
            "metrics": identifier_config(metrics),
            "loss_weights": loss_weights,
            "jit_compile": jit_compile,
            "gradient_accumulation_steps": gradient_accumulation_steps,
        }
        self._accumulation = Accumulation(steps)
        self.compiled = True

    @property
    def metrics(self) -> list[Any]:
        """The loss tracker and the compiled metrics."""
        return ([self._loss_tracker] if self._loss_tracker is not None else []) + self._compiled_metrics

    @property
    def metrics_names(self) -> list[str]:
        return [m.name for m in self.metrics]

    def get_compile_config(self) -> dict[str, Any] | None:
        """The arguments `compile` was given, as saved with the model (Keras 3's
        ``get_compile_config``); None before `compile`."""
        return dict(self._compile_config) or None

    def _require_compiled(self) -> None:
        if self.optimizer is None or self._losses is None:
            raise RuntimeError(
                "The model must be compiled before training or evaluation. HINT: call "
                "model.compile(optimizer=..., loss=...) inside the strategy scope."
            )

    # ------------------------------------------------------------------ steps (in replica context)
    def _forward(self, x: Any) -> Any:
        """``self(x)`` under the policy's autocast, outputs in float32 (replica context)."""
        if self._policy.name == "float32":
            return self(x)
        ctx = get_replica_context()
        device = ctx.strategy.local_devices[ctx.local_replica_index].type if ctx is not None else "cpu"
        with self._policy.autocast(device):
            y_pred = self(x)
        return _to_float32(y_pred)

    def train_step(self, data: Any) -> None:
        """One training step on one replica's slice of the batch (replica context): the loss
        and its gradients, the update (every ``gradient_accumulation_steps``-th step), and the
        metrics. Keras 3's ``train_step``; override it to train differently. ``fit`` reads the
        logs from the metrics afterwards (`get_metrics_result`), so a value returned is unused.

        Args:
            data: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.
        """
        assert self._losses is not None
        assert self.optimizer is not None
        x, y, sample_weight = unpack_batch(data)
        y_pred = self._forward(x)
        loss, tracked, tracked_weight = self._losses.replica_loss(y, y_pred, sample_weight)
        accumulation = self._accumulation
        if accumulation.steps > 1:  # the update applies the mean of the steps' gradients
            loss = loss * accumulation.loss_factor
        scaler = self._loss_scale
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
        if accumulation.updates_now:
            if scaler is None:
                self.optimizer.step()
            else:  # an overflow anywhere skips the step on every replica (see mixed_precision)
                scaler.step(self.optimizer)
                scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self._update_metrics(y, _detach(y_pred), sample_weight, tracked.detach(), tracked_weight)

    def test_step(self, data: Any) -> None:
        """One evaluation step on one replica's slice of the batch (replica context, no
        gradients): updates the loss tracker and the metrics. Keras 3's ``test_step``.

        Args:
            data: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.
        """
        assert self._losses is not None
        x, y, sample_weight = unpack_batch(data)
        y_pred = self._forward(x)
        tracked, tracked_weight = self._losses.tracked(y, y_pred, sample_weight)
        self._update_metrics(y, y_pred, sample_weight, tracked, tracked_weight)

    def predict_step(self, data: Any) -> Any:
        """The outputs for one replica's slice of the batch (replica context, no gradients).
        Keras 3's ``predict_step``.

        Args:
            data: ``(x,)``, or a tuple whose first element is ``x``.
        """
        x, _, _ = unpack_batch(data)
        return self._forward(x)

    def train_function(self, data: Any) -> None:
        """Runs `train_step` on every local replica with its slice of ``data``, a distributed
        batch (cross-replica context; all workers): what ``fit`` and ``train_on_batch`` call
        per step, as Keras 3's ``train_function`` (whose logs ``fit`` reads here from
        `get_metrics_result`). Under gradient accumulation the steps between updates run
        inside ``strategy.no_sync()`` (`phalanx.keras._accumulation`)."""
        self._accumulation.run(self._strategy, self.train_step, data)

    def _update_metrics(
        self, y: Any, y_pred: Any, sample_weight: Any, tracked: torch.Tensor, tracked_weight: Any = None
    ) -> None:
        self._loss_tracker.update_state(tracked, sample_weight=tracked_weight)
        for metric in self._compiled_metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)

    def reset_metrics(self) -> None:
        """Resets the loss tracker and every metric (``fit`` at each epoch, ``evaluate`` at its start)."""
        for metric in self.metrics:
            metric.reset_state()

    def get_metrics_result(self) -> dict[str, float]:
        """The loss tracker's and the metrics' values, by name: global over every replica and
        worker (a metric's ``result()`` reads across workers: all workers call it). Keras 3's
        ``get_metrics_result``; the logs ``fit`` and ``evaluate`` hand the callbacks."""
        metrics = self.metrics
        # every metric's state in one cross-worker sum, not one each (read at every step by fit)
        states = (state for m in metrics for state in m.buffers())
        with self._strategy.variable_policy.reading_together(states):
            return {m.name: float(m.result()) for m in metrics}

    def resume_at(self, epoch: int, step: int) -> None:
        """Makes the ``fit`` now starting continue at ``step`` of ``epoch`` instead of at
        ``initial_epoch``. Called in ``on_train_begin`` (`phalanx.callbacks.BackupAndRestore`
        after restoring a backup); ``fit`` reads it once, right after."""
        self._resume = (epoch, step)

    # ------------------------------------------------------------------ fit / evaluate / predict
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: str | int = "auto",
        callbacks: list[Any] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_freq: int = 1,
        sample_weight: Any = None,
        validation_batch_size: int | None = None,
    ) -> Any:
        """Trains for ``epochs`` epochs; returns the `History` (``history.history['loss']``...).

        ``batch_size`` is the *global* batch size, split across replicas and workers.
        """
        self._require_compiled()
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split)
        handler = DataHandler(
            x, y, sample_weight, batch_size, shuffle, steps_per_epoch, float_dtype=float_dtype_of(self)
        )
        val_handler = self._validation_handler(
            validation_data, validation_batch_size or batch_size, validation_steps
        )
        cbs = self._callback_list(callbacks, verbose, epochs, handler.steps_per_epoch)
        self.stop_training = False
        self._resume = None
        self.train()
        cbs.on_train_begin()
        start_epoch, skip = self._resume or (initial_epoch, 0)
        logs: dict[str, float] = {}
        epoch = start_epoch
        while epoch < epochs:
            self.reset_metrics()
            cbs.on_epoch_begin(epoch)
            try:
                logs = self._train_loop.epoch(self, handler, epoch, skip, cbs)
            except MoveTo as move:  # an elastic job's chief is in another epoch: continue there
                epoch, skip = move.epoch, move.step
                continue
            skip = 0
            if val_handler is not None and (epoch + 1) % validation_freq == 0:
                val_logs = validation_pass(self, val_handler, _callbacks_module().CallbackList([]))
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            cbs.on_epoch_end(epoch, logs)
            if self.stop_training:
                break
            epoch += 1
        cbs.on_train_end(logs)
        return self.history

    def _validation_handler(self, data: Any, batch_size: int | None, steps: int | None) -> DataHandler | None:
        if data is None:
            return None
        if isinstance(data, tuple) and len(data) in (2, 3) and not hasattr(data, "_fields"):
            vx, vy, *rest = data
            return DataHandler(
                vx, vy, rest[0] if rest else None, batch_size, False, steps, float_dtype=float_dtype_of(self)
            )
        return DataHandler(data, steps_per_epoch=steps, float_dtype=float_dtype_of(self))

    def _callback_list(
        self,
        callbacks: list[Any] | None,
        verbose: str | int,
        epochs: int,
        steps: int | None,
        history: bool = True,
    ) -> Any:
        module = _callbacks_module()
        level = 1 if verbose == "auto" else int(verbose)
        return module.CallbackList(
            list(callbacks or []),
            add_history=history,
            add_progbar=level != 0,
            model=self,
            verbose=level,
            epochs=epochs,
            steps=steps,
        )

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: list[Any] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Global loss and metric values over the data; a list (loss first) or a dict."""
        self._require_compiled()
        handler = DataHandler(x, y, sample_weight, batch_size, False, steps, float_dtype=float_dtype_of(self))
        cbs = self._callback_list(callbacks, verbose, 1, handler.steps_per_epoch, history=False)
        logs = evaluate_loop(self, handler, cbs)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        steps: int | None = None,
        callbacks: list[Any] | None = None,
    ) -> Any:
        """Outputs for every example, in input order, gathered across replicas and workers."""
        handler = DataHandler(x, None, None, batch_size, False, steps, float_dtype=float_dtype_of(self))
        cbs = self._callback_list(callbacks, verbose, 1, handler.steps_per_epoch, history=False)
        return predict_loop(self, handler, cbs)

    def train_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """One training step on one global batch; returns its loss and metrics."""
        self._require_compiled()
        self.reset_metrics()
        self.train()
        handler = DataHandler(x, y, sample_weight, batch_size=_batch_len(x), float_dtype=float_dtype_of(self))
        self._train_loop.epoch(self, handler, 0, 0, _callbacks_module().CallbackList([]))
        logs = self.get_metrics_result()
        return logs if return_dict else [logs[n] for n in self.metrics_names]

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """Loss and metrics of one global batch, without training."""
        return self.evaluate(
            x, y, batch_size=_batch_len(x), verbose=0, sample_weight=sample_weight, return_dict=return_dict
        )

    def predict_on_batch(self, x: Any) -> Any:
        """Outputs for one global batch."""
        return self.predict(x, batch_size=_batch_len(x), verbose=0)

    # ------------------------------------------------------------------ inspection and saving
    def summary(self, print_fn: Any = print) -> None:
        """Prints the layers with their parameter counts (Keras' summary, without shapes)."""
        for line in _model_files.summary_lines(self):
            print_fn(line)

    def save(self, filepath: str) -> None:
        """Saves architecture reference, weights, compile config and optimizer state (all workers)."""
        _model_files.save_model(self, filepath)

    def save_weights(self, filepath: str) -> None:
        """Saves the wrapped module's state dict (plain tensors; chief's file kept)."""
        _model_files.save_weights(self, filepath)

    def load_weights(self, filepath: str) -> None:
        """Loads weights saved by `save_weights` (or `save`) into every replica."""
        _model_files.load_weights(self, filepath)

    def get_weights(self) -> list[Any]:
        """The module's parameters and buffers as NumPy arrays, in state-dict order."""
        return [t.detach().cpu().numpy() for t in self.module.state_dict().values()]

    def set_weights(self, weights: list[Any]) -> None:
        """Sets parameters and buffers from NumPy arrays in `get_weights` order."""
        keys = list(self.module.state_dict())
        if len(weights) != len(keys):
            raise ValueError(f"set_weights expects {len(keys)} arrays. Received: {len(weights)}.")
        self.module.load_state_dict({k: torch.as_tensor(w) for k, w in zip(keys, weights, strict=True)})


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _batch_len(x: Any) -> int:
    from phalanx.input.splitting import as_tensors, batch_size_of

    return batch_size_of(as_tensors(x))


def _to_float32(value: Any) -> Any:
    """Floating tensors of ``value`` (a tensor or nest) cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, dict):
        return type(value)((k, _to_float32(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_to_float32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
