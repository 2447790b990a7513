"""Distributed variables: parameters and buffers that live once per replica.

See docs/architecture.md, "Distributed variables".

A distributed variable is a `torch.Tensor` subclass that modules hold as their parameter or
buffer. Every torch operation on it goes through `__torch_function__`, which resolves it to
one plain component tensor:

* in a replica context of its strategy: that replica's component;
* anywhere else (cross-replica context): the primary for a `MirroredVariable`, the aggregate
  of all components for a `SyncOnReadVariable`.

Components other than the primary are made from the *initialised* primary before the first
replica step, and again after the primary was written in cross-replica context.

Modules do not pay for that dispatch inside a replica: a module whose tensors are distributed
variables reads them through `phalanx.nn._module_tensors.ReplicaTensors`, which hands the
replica its plain component (where `plain_in_replica`), so torch's fused kernels (the
``nn.MultiheadAttention`` fast path) run as on one device. `ReplicaWriteGuard` keeps the
rule that an in-place write of a mirrored parameter in a replica context needs an
aggregation, for writes through those plain components.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx import context

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = [
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "set_aggregation",
]

# Keys of phalanx's marks in a tensor's ``__dict__`` (`set_aggregation`, copies of variables):
# read with ``getattr(tensor, KEY, default)`` by the variable policies and the error messages.
AGGREGATION_MARK = "_phalanx_aggregation"
SYNCHRONIZATION_MARK = "_phalanx_synchronization"
COPY_MARK = "_phalanx_copy_of"


class VariableSynchronization(enum.Enum):
    """When replicas' copies of a variable are brought together (tf.VariableSynchronization)."""

    AUTO = "auto"
    NONE = "none"
    ON_WRITE = "on_write"
    ON_READ = "on_read"


class VariableAggregation(enum.Enum):
    """How replicas' values of a variable combine (tf.VariableAggregation)."""

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"

    @classmethod
    def coerce(cls, value: VariableAggregation | str | None) -> VariableAggregation:
        """Accepts the enum, its value/name in any case, or None (= NONE)."""
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        raise ValueError(f"aggregation must be one of {[m.name for m in cls]}. Received: {value!r}.")


def set_aggregation(
    tensor: torch.Tensor,
    aggregation: VariableAggregation | str | None = None,
    synchronization: VariableSynchronization | str | None = None,
) -> torch.Tensor:
    """Annotates a tensor, before a module registers it, with how it is to be distributed.

    Example: ``self.register_buffer("total", set_aggregation(torch.zeros(()), "sum"))``.

    Returns:
        The same tensor, annotated.
    """
    # phalanx's own marks on the user's tensor, read back with getattr by the variable policies
    tensor.__dict__[AGGREGATION_MARK] = VariableAggregation.coerce(aggregation)
    if synchronization is not None:
        sync = VariableSynchronization(
            synchronization.value
            if isinstance(synchronization, VariableSynchronization)
            else synchronization.lower()
        )
        tensor.__dict__[SYNCHRONIZATION_MARK] = sync
    return tensor


def Variable(  # TF's spelling (tf.Variable), hence the capital
    initial_value: Any,
    trainable: bool = True,
    dtype: torch.dtype | None = None,
    aggregation: VariableAggregation | str | None = None,
    synchronization: VariableSynchronization | str | None = None,
) -> torch.Tensor:
    """A variable outside any module (tf.Variable): distributed by the current strategy.

    In ``strategy.scope()`` it is made as a module's tensor would be: a trainable variable
    like a parameter (a `MirroredVariable` under MirroredStrategy), a non-trainable one like a
    buffer, mirrored on write unless ``synchronization="on_read"`` (TF's default for
    non-trainable variables). Outside any scope: a plain ``nn.Parameter`` (trainable) or tensor.

    Args:
        initial_value: A tensor, array or number (copied).
        trainable: Whether the optimizer trains it (a parameter with ``requires_grad``).
        dtype: Its dtype (default: ``initial_value``'s).
        aggregation: How replicas' writes combine in a replica context (`set_aggregation`).
        synchronization: ``"on_write"`` (mirrored) or ``"on_read"`` (per replica, aggregated
            when read outside ``run``).

    Returns:
        The variable.

    Raises:
        RuntimeError: Called inside ``strategy.run`` (variables are created in the scope).
    """
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None and not frame.strategy.is_default:
        raise RuntimeError(
            "Variables are created in the strategy's scope, once, not in each replica. Received: "
            f"phalanx.variables.Variable(...) inside {frame.strategy!r}.run. HINT: create it in "
            "`with strategy.scope():` before the training loop."
        )
    value = torch.as_tensor(initial_value, dtype=dtype).detach().clone()
    holder = torch.nn.Module()  # the strategies make tensors as modules register them
    if trainable:
        param = torch.nn.Parameter(value)
        if aggregation is not None or synchronization is not None:
            set_aggregation(param, aggregation, synchronization)
        holder.register_parameter("value", param)
    else:
        sync = VariableSynchronization.ON_WRITE if synchronization in (None, "auto") else synchronization
        if sync is VariableSynchronization.AUTO:
            sync = VariableSynchronization.ON_WRITE
        holder.register_buffer("value", set_aggregation(value, aggregation, sync))
    # iterating the module's tensors gives the variable itself, whatever context reads it
    return next(iter(holder.parameters() if trainable else holder.buffers()))


# The property accessors torch routes through __torch_function__ (typed as Any: stubs
# describe the properties' values, not their descriptors). They are method-wrappers, new
# objects on every access: compare them with ==, never with `is`.
_TENSOR: Any = torch.Tensor
_GRAD_GET = _TENSOR.grad.__get__
_GRAD_SET = _TENSOR.grad.__set__
_DATA_GET = _TENSOR.data.__get__
_DATA_SET = _TENSOR.data.__set__
_REQUIRES_GRAD_SET = _TENSOR.requires_grad.__set__
_OVERWRITES = frozenset({"copy_", "fill_", "zero_"})
# Reads of one variable that every kind answers from the replica's component; the optimizer
# and zero_grad make several per parameter per step, so they skip the general dispatch.
_COMPONENT_READS = frozenset(
    {
        _GRAD_GET,
        _TENSOR.requires_grad.__get__,
        _TENSOR.is_sparse.__get__,
        _TENSOR.dtype.__get__,
        _TENSOR.device.__get__,
        torch.is_complex,
        torch.is_floating_point,
    }
)
_tls = threading.local()  # .in_optimizer_step: replica is inside optimizer.step()


def is_inplace(func: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    """Whether a torch function writes into its first argument."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or "out" in kwargs:
        return True
    return name.endswith("_") and not name.endswith("__")


def in_optimizer_step() -> bool:
    """True while this thread runs an `optimizer.step()` on distributed variables."""
    return getattr(_tls, "in_optimizer_step", False)


def set_in_optimizer_step(value: bool) -> None:
    _tls.in_optimizer_step = value


class DistributedVariable(torch.Tensor):
    """Base of tensors with one component per local replica.

    The object itself aliases the primary component's storage, so it prints, pickles and
    saves like a plain tensor; all computation happens on the resolved component.

    Besides what users read (`primary`, `components`, `replica_leaf`), a variable offers its
    strategy and the strategy's parts (`phalanx.protocols.VariableHome`, the gradient path,
    ``nn``'s replica reads) a small API: `strategy`, `aggregation`, `plain_in_replica`,
    `stored_components`, `holds`, `resolve`, and the dirty flag (`dirty`, `mark_dirty`,
    `mark_clean`).
    """

    _strategy: DistributionStrategy
    _components: list[torch.Tensor]
    _aggregation: VariableAggregation
    _dirty: bool  # the primary was written in cross-replica context: re-mirror before a step
    _plain_in_replica: bool

    @staticmethod
    def __new__(
        cls,
        primary: torch.Tensor,
        strategy: DistributionStrategy,
        aggregation: VariableAggregation = VariableAggregation.NONE,
        is_parameter: bool = True,
    ) -> DistributedVariable:
        return torch.Tensor._make_subclass(cls, primary.detach(), primary.requires_grad)

    def __init__(
        self,
        primary: torch.Tensor,
        strategy: DistributionStrategy,
        aggregation: VariableAggregation = VariableAggregation.NONE,
        is_parameter: bool = True,
    ) -> None:
        self._strategy = strategy
        self._components = [primary]
        self._aggregation = aggregation
        self._is_param = is_parameter  # torch's mark: isinstance(var, nn.Parameter) holds for it
        self._dirty = True
        self._plain_in_replica = self._serves_plain(aggregation, is_parameter)

    @classmethod
    def _serves_plain(cls, aggregation: VariableAggregation, is_parameter: bool) -> bool:
        """Whether modules may hand a replica its plain component (see `plain_in_replica`)."""
        return False

    # ------------------------------------------------------------------ the strategy's API
    @property
    def strategy(self) -> DistributionStrategy:
        """The strategy that made this variable (in its scope)."""
        return self._strategy

    @property
    def aggregation(self) -> VariableAggregation:
        """How replicas' writes combine, and a sync-on-read read aggregates (tf.Variable's)."""
        return self._aggregation

    @property
    def plain_in_replica(self) -> bool:
        """Whether modules hand a replica its plain component (`phalanx.nn._module_tensors`):
        only where every write a replica can make to it is a per-replica write anyway, or is
        guarded (`ReplicaWriteGuard`)."""
        return self._plain_in_replica

    @property
    def dirty(self) -> bool:
        """Whether the primary may differ from the other components (it was written in
        cross-replica context, or the variable is new): the policy re-mirrors before a step."""
        return self._dirty

    def mark_dirty(self) -> None:
        """Notes that the primary was written (the chief's broadcast): re-mirror before a step."""
        self._dirty = True

    def mark_clean(self) -> None:
        """Notes that every component holds the primary's value (the policy mirrored them, or
        an update wrote each one)."""
        self._dirty = False

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor`` is one of this variable's stored tensors (a component)."""
        return any(tensor is component for component in self._components)

    def __hash__(self) -> int:
        # Identity hash everywhere: optimizer state built in one context must be found in
        # another (torch.Tensor.__hash__ would dispatch to the resolved component).
        return id(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling (torch.save of a whole module) stores the cross-replica value.
        with torch._C.DisableTorchFunctionSubclass():
            value = self._cross_replica_value().detach().clone()
        if self._is_param:
            return (torch.nn.Parameter, (value, self.requires_grad))
        return (_identity, (value,))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A copy of the cross-replica value: a new variable of the same strategy inside its
        scope (cross-replica context), so cloned layers (``nn.TransformerEncoder``'s
        ``_get_clones``) train distributed; a plain tensor elsewhere (saving, an EMA copy),
        marked so that an optimizer error can say it is a copy."""
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            value = self._cross_replica_value().detach().clone()
        plain: torch.Tensor = (
            torch.nn.Parameter(value, requires_grad=self.requires_grad) if self._is_param else value
        )
        frame = context.current_frame()
        copy: torch.Tensor = plain
        if frame is not None and frame.replica_context is None and frame.strategy is self._strategy:
            copy = self._same_kind_in_scope(plain)
        else:
            plain.__dict__[COPY_MARK] = repr(self._strategy)
        memo[id(self)] = copy
        return copy

    def _same_kind_in_scope(self, plain: torch.Tensor) -> torch.Tensor:
        """A new variable made from ``plain`` by this variable's strategy, with this one's
        aggregation and synchronization (the policy reads them from the tensor's annotations)."""
        if self._aggregation is not VariableAggregation.NONE or not self._is_param:
            set_aggregation(plain, self._aggregation)
        if isinstance(self, MirroredVariable) and not self._is_param:
            plain.__dict__[SYNCHRONIZATION_MARK] = VariableSynchronization.ON_WRITE
        made = self._strategy.create_variable(plain, is_parameter=self._is_param)
        return plain if made is None else made

    @property
    def primary(self) -> torch.Tensor:
        """The component of local replica 0 (plain tensor)."""
        return self._components[0]

    def replica_leaf(self, index: int) -> torch.Tensor:
        """The autograd leaf replica ``index`` computes with (its gradient lands there)."""
        return self._components[index]

    @property
    def stored_components(self) -> list[torch.Tensor]:
        """The local components as stored, not materialised: the list the variable's policy
        (`phalanx.protocols.VariableHome`) fills, re-mirrors and writes."""
        return self._components

    @property
    def components(self) -> tuple[torch.Tensor, ...]:
        """All local components, in replica order (materialised first if needed)."""
        self._strategy.variable_policy.materialize(self)
        return tuple(self._components)

    # ----------------------------------------------------------------- dispatch
    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        replica = context.current_replica()
        first = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes tensor=
        if isinstance(first, DistributedVariable):
            return first.dispatch(func, args, kwargs, replica)
        return func(*_resolve_all(args, replica), **_resolve_kwargs(kwargs, replica))

    def dispatch(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        replica: tuple[Any, int] | None,
    ) -> Any:
        """Runs torch's ``func`` whose first argument is this variable, in ``replica``
        (`context.current_replica()`): on its component there, else in cross-replica context
        (where writes re-mirror or set the aggregate). Called by ``__torch_function__``."""
        if replica is not None and replica[0] is self._strategy:
            if func in _COMPONENT_READS and len(args) == 1 and not kwargs:
                return func(self.resolve(replica))
            return self._replica_call(func, args, kwargs, replica[1])
        return self._cross_replica_call(func, args, kwargs)

    def resolve(self, replica: tuple[Any, int] | None) -> torch.Tensor:
        """The plain tensor this variable is in ``replica`` (a ``(strategy, local index)`` pair,
        as `context.current_replica()` gives, or None): the replica's component in a replica of
        its strategy, else the cross-replica value."""
        if replica is not None and replica[0] is self._strategy:
            return self._components[replica[1]]
        return self._cross_replica_value()

    def _replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], index: int
    ) -> Any:
        replica = (self._strategy, index)
        return func(*_resolve_all(args, replica), **_resolve_kwargs(kwargs, replica))

    def _cross_replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        replica = context.current_replica()
        resolved = _resolve_all(args, replica)
        result = func(*resolved, **_resolve_kwargs(kwargs, replica))
        if resolved and args[0] is self and result is resolved[0]:
            return self  # a no-op conversion (.to/.float/.cpu of the same kind) keeps the variable
        return result

    def _cross_replica_value(self) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            inner = repr(self._cross_replica_value())
        return f"{type(self).__name__}({inner})"


def _identity(value: torch.Tensor) -> torch.Tensor:
    return value


def _resolve_all(args: Sequence[Any], replica: tuple[Any, int] | None) -> list[Any]:
    out = []
    for a in args:
        if isinstance(a, DistributedVariable):
            a = a.resolve(replica)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, DistributedVariable) for x in a):
            a = type(a)(x.resolve(replica) if isinstance(x, DistributedVariable) else x for x in a)
        out.append(a)
    return out


def _resolve_kwargs(kwargs: dict[str, Any], replica: tuple[Any, int] | None) -> dict[str, Any]:
    if not kwargs:
        return kwargs
    return {k: v.resolve(replica) if isinstance(v, DistributedVariable) else v for k, v in kwargs.items()}


class MirroredVariable(DistributedVariable):
    """A variable kept identical on every replica (sync on write).

    In a replica context, in-place writes are allowed inside ``optimizer.step()`` (every
    replica applies the same reduced update to its own component). Elsewhere in a replica
    context, ``copy_``/``add_``/``sub_`` need an aggregation (SUM, MEAN, ONLY_FIRST_REPLICA)
    and are merged across replicas, as TF's ``assign`` is; other writes raise.
    """

    @classmethod
    def _serves_plain(cls, aggregation: VariableAggregation, is_parameter: bool) -> bool:
        # A parameter without aggregation: replicas only read it outside optimizer.step()
        # (ReplicaWriteGuard raises for other writes). Aggregated variables merge their
        # writes across replicas: they keep the dispatch.
        return is_parameter and aggregation is VariableAggregation.NONE

    def _cross_replica_value(self) -> torch.Tensor:
        return self._components[0]

    def _replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], index: int
    ) -> Any:
        if is_inplace(func, kwargs) and not in_optimizer_step() and func.__name__ != ("requires_grad_"):
            return self._strategy.variable_policy.merged_assign(self, func, args, kwargs, index)
        return super()._replica_call(func, args, kwargs, index)

    def _cross_replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        if func in (_GRAD_SET, _REQUIRES_GRAD_SET):
            for component in self._components:
                func(component, *args[1:])
            return None
        if getattr(func, "__name__", "") == "requires_grad_":
            for component in self._components[1:]:
                func(component, *args[1:], **kwargs)
        elif func in (_DATA_GET, _DATA_SET) or is_inplace(func, kwargs):
            self._dirty = True  # the primary may change: re-mirror before the next step
        return super()._cross_replica_call(func, args, kwargs)


class SyncOnReadVariable(DistributedVariable):
    """A variable each replica updates on its own; reading it outside a replica aggregates.

    Used for buffers (BatchNorm statistics: MEAN) and metric state (SUM). A write in
    cross-replica context sets the aggregate: with SUM the primary takes the value and the
    other components zero, otherwise every component takes it.
    """

    @classmethod
    def _serves_plain(cls, aggregation: VariableAggregation, is_parameter: bool) -> bool:
        return True  # each replica reads and writes its own component anyway

    def _cross_replica_value(self) -> torch.Tensor:
        return self._strategy.variable_policy.aggregate_sync_on_read(self)

    def _cross_replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        if not is_inplace(func, kwargs) and func != _DATA_SET:
            return super()._cross_replica_call(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if func == _DATA_SET:
            new = args[1].detach()
        elif name in _OVERWRITES:
            new = func(torch.empty_like(self._components[0]), *_resolve_all(args[1:], None))
        else:
            new = self._cross_replica_value().clone()
            func(new, *_resolve_all(args[1:], None), **_resolve_kwargs(kwargs, None))
        self._write_aggregate(new)
        return self

    def _write_aggregate(self, value: torch.Tensor) -> None:
        self._strategy.variable_policy.forget_read(self)  # an aggregate read before is stale
        sum_like = self._aggregation is VariableAggregation.SUM
        first_worker = self._strategy.worker_rank == 0
        with torch.no_grad():
            for i, component in enumerate(self._components):
                if component.dtype != value.dtype or component.shape != value.shape:
                    # converted (model.double()) or resized: the components follow the value
                    component.data = torch.empty_like(value, device=component.device)
                if sum_like and (i > 0 or not first_worker):
                    component.zero_()
                else:
                    component.copy_(value)
