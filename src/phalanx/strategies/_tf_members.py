"""The rest of tf.distribute.Strategy's and StrategyExtended's members, with TF's meaning.

`Strategy` inherits these from `TFStrategyMembers`: deprecated aliases TF 2 still has
(``unwrap``, ``experimental_distribute_datasets_from_function``), the variable questions of
``strategy.extended`` (``value_container``, ``variable_created_in_scope``,
``parameter_devices``, ``colocate_vars_with``), ``group`` and ``configure``. A strategy
changes one by overriding a hook: ``_parameter_devices`` and ``_colocate_vars_with``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from phalanx.variables import DistributedVariable

if TYPE_CHECKING:
    from phalanx.input.input_options import InputContext, InputOptions
    from phalanx.strategies.replicas.variable_policy import VariablePolicy

__all__ = ["TFStrategyMembers"]


class TFStrategyMembers:
    """tf.distribute.Strategy/StrategyExtended members that need no strategy-specific state."""

    if TYPE_CHECKING:  # what `Strategy` provides

        @property
        def variable_policy(self) -> VariablePolicy: ...
        @property
        def worker_devices(self) -> tuple[str, ...]: ...
        def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...
        def distribute_datasets_from_function(
            self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
        ) -> Any: ...

    # ------------------------------------------------------------------ deprecated spellings
    def unwrap(self, value: Any) -> tuple[Any, ...]:
        """TF's deprecated name of `experimental_local_results` (warns, then calls it)."""
        warnings.warn(
            "Strategy.unwrap is deprecated (as in TensorFlow): use experimental_local_results.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.experimental_local_results(value)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """TF's deprecated name of `distribute_datasets_from_function` (warns, then calls it)."""
        warnings.warn(
            "experimental_distribute_datasets_from_function is deprecated (as in TensorFlow): "
            "use distribute_datasets_from_function.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.distribute_datasets_from_function(dataset_fn, options)

    def configure(
        self,
        session_config: Any = None,
        cluster_spec: Any = None,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> NoReturn:
        """Refused: TF's ``configure`` fills a TF1 session's ConfigProto, and phalanx has none.

        Raises:
            NotImplementedError: Always, naming what to use instead.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.configure configures a TensorFlow session's ConfigProto "
            "(deprecated in TF 2); PyTorch has no session to configure. HINT: give the cluster "
            "to the strategy's constructor (cluster_resolver=phalanx.cluster_resolver."
            "SimpleClusterResolver(cluster_spec, task_type=..., task_id=...)) and set torch's "
            "own options (torch.set_num_threads, torch.backends) directly."
        )

    def group(self, value: Any, name: str | None = None) -> None:
        """Waits for the local components of ``value`` (TF 2 eager: ``tf.group`` returns None).

        PyTorch runs eagerly, so CPU values are ready; CUDA values are waited for on their
        devices' current streams.
        """
        del name  # TF names the grouping op; there is no op here
        devices = {
            leaf.device
            for component in self.experimental_local_results(value)
            for leaf in torch.utils._pytree.tree_leaves(component)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda"
        }
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    # ------------------------------------------------------------------ variables (extended)
    def value_container(self, value: Any) -> Any:
        """The distributed variable ``value`` is a component of, else ``value`` itself."""
        if isinstance(value, DistributedVariable):
            return value
        for var in self.variable_policy.variables():
            if var.holds(value):
                return var
        return value

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a variable this strategy made (in its ``scope()``)."""
        return bool(self.variable_policy.owns(v))

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices that hold variables: the replicas' devices (mirrored strategies), the
        parameter device (CentralStorage) or the ps tasks (ParameterServer)."""
        return self._parameter_devices()

    def _parameter_devices(self) -> tuple[str, ...]:
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: replicas take batches of any shape (only TF's TPUs require static shapes)."""
        return False

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        """Places variables created inside on the devices of ``colocate_with_variable``.

        Mirrored strategies keep every variable on all their devices (CentralStorage: on the
        parameter device), so the variables are colocated already, as in TF; under
        ParameterServerStrategy they go to the ps task of ``colocate_with_variable``.

        Raises:
            ValueError: ``colocate_with_variable`` is not a variable of this strategy.
        """
        if not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(
                "colocate_vars_with needs a variable created in this strategy's scope. Received: "
                f"{type(colocate_with_variable).__name__}. HINT: pass a parameter of a module "
                f"built inside {self!r}.scope()."
            )
        return self._colocate_vars_with(colocate_with_variable)

    def _colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        del colocate_with_variable  # every variable is on the same devices already
        return contextlib.nullcontext()
