"""gd.Variable: named, persistent state with one component array per replica device.

Outside a trace a Variable is its numpy value; inside one, reads and assigns become
read_var/assign_var eqns on the variable's state (see graphdist/ops/state.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import numpy as np

from graphdist.distribute import context, sync
from graphdist.distribute.values import (PerReplica, VariableAggregation,
                                         VariableSynchronization)
from graphdist.errors import TraceError
from graphdist.ir import StateRef
from graphdist.ir.types import DEFAULT_FLOAT, as_dtype, is_float
from graphdist.ops.core import Symbolic, current_tracer
from graphdist.ops.math import add, subtract, where
from graphdist.ops.operators import Operators
from graphdist.device.backends import backend_for, host_value

_ids = itertools.count()


def _initial_array(initial_value, dtype) -> np.ndarray:
    if callable(initial_value):
        initial_value = initial_value()
    if isinstance(initial_value, Symbolic) and not isinstance(initial_value, Variable):
        raise TraceError("gd.Variable needs a concrete initial value (a numpy array or "
                         "number), not a symbolic tensor; create variables outside traced code")
    if isinstance(initial_value, Variable):
        initial_value = initial_value.numpy()
    if dtype is None and _python_scalars(initial_value):   # numpy scalars keep their dtype
        kind = np.asarray(initial_value).dtype.kind        # Python numbers: float32 / int32
        dtype = {"f": DEFAULT_FLOAT, "i": np.int32}.get(kind)
    value = np.array(host_value(initial_value), dtype=None if dtype is None else as_dtype(dtype))
    as_dtype(value.dtype)
    return value


class _Conditions(threading.local):
    def __init__(self):
        self.stack: list = []


_conditions = _Conditions()


@contextlib.contextmanager
def assign_synced_if(condition):
    """In traced code inside this block, every `assign_synced` (the optimizers' updates)
    stores where(condition, new value, current value): `condition`, a bool scalar every
    replica agrees on, decides whether the update happens. LossScaleOptimizer skips the
    steps whose gradients overflowed with it."""
    _conditions.stack.append(condition)
    try:
        yield
    finally:
        _conditions.stack.pop()


def _python_scalars(x) -> bool:
    """A Python number, or a (nested) list/tuple of them: TF/JAX give these 32-bit dtypes."""
    if isinstance(x, (list, tuple)):
        return all(_python_scalars(e) for e in x)
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def _enum(kind, value, what: str):
    try:
        return kind(value) if not isinstance(value, kind) else value
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; use one of "
                         f"{[m.name for m in kind]}") from None


class Variable(Operators, Symbolic):
    """A mutable tensor that lives across steps.

    >>> w = gd.Variable(np.zeros((2, 3), np.float32), name="w"); w.shape
    (2, 3)
    """

    __slots__ = ("_values", "_name", "_trainable", "_sync", "_aggregation", "_devices",
                 "_uid", "_strategy", "_lagging", "_ref", "__weakref__")

    def __init__(self, initial_value, name=None, trainable=True, dtype=None,
                 synchronization=VariableSynchronization.AUTO,
                 aggregation=VariableAggregation.NONE, *, _devices=None, _strategy=None):
        tracer = current_tracer()
        if tracer is not None:      # a gd.function's retrace may not make one (trace.py)
            tracer.creating_variable(name)
        value = _initial_array(initial_value, dtype)
        self._sync = _enum(VariableSynchronization, synchronization, "synchronization")
        self._aggregation = _enum(VariableAggregation, aggregation, "aggregation")
        strategy = _strategy or context.get_strategy()
        self._strategy = strategy
        self._name = name or "Variable"
        value = strategy._initial_value(value, self)    # the workers agree on name, shape..
        self._devices = tuple(_devices or strategy.devices)
        if self._sync is VariableSynchronization.NONE and len(self._devices) > 1:
            raise ValueError(f"Variable {name!r}: synchronization=NONE is not supported under "
                             f"{type(strategy).__name__}; use AUTO, ON_WRITE or ON_READ")
        if (self._aggregation is VariableAggregation.MEAN and len(self._devices) > 1
                and not is_float(value.dtype)):
            raise TypeError(f"Variable {name!r}: aggregation MEAN needs a float dtype, got "
                            f"{value.dtype}; use SUM or ONLY_FIRST_REPLICA, or a float variable")
        if self._sync is VariableSynchronization.ON_READ:
            trainable = False
        self._uid = next(_ids)
        self._trainable = bool(trainable)
        self._values = [backend_for(d).from_host(value) for d in self._devices]
        self._ref = StateRef(self._uid, self._name, self._devices, self.on_read,
                             "parameter" if self._trainable else "")
        # a merged step (passes/merge.py) updates only component 0 of a mirrored variable;
        # the others are brought up to date when read: catch_up()
        self._lagging = False
        strategy._track(self)                   # for strategy.check_mirrored()

    # ------------------------------------------------------------ properties
    name = property(lambda self: self._name)
    trainable = property(lambda self: self._trainable)
    synchronization = property(lambda self: self._sync)
    aggregation = property(lambda self: self._aggregation)
    devices = property(lambda self: self._devices)
    shape = property(lambda self: tuple(self._values[0].shape))
    dtype = property(lambda self: self._values[0].dtype)
    device = property(lambda self: self._devices[0])
    ref = property(lambda self: self._ref, doc="how graphs name this variable's state")

    @property
    def values(self) -> tuple:
        """The per-device component arrays (live storage, in device order): numpy arrays on
        cpu:N, CuPy arrays on gpu:N."""
        if self._lagging:
            self.catch_up()
        return tuple(self._values)

    def catch_up(self) -> None:
        """Copy component 0 into the others after merged steps wrote only it (mirrored
        components are equal whenever anyone looks)."""
        self._lagging = False
        for device, dst in zip(self._devices[1:], self._values[1:]):
            backend_for(device).copy_in(dst, self._values[0])

    def _host(self, k: int) -> np.ndarray:
        if k and self._lagging:
            self.catch_up()
        return backend_for(self._devices[k]).to_host(self._values[k])

    @property
    def on_read(self) -> bool:
        return self._sync is VariableSynchronization.ON_READ

    # ------------------------------------------------------------ reads
    def _replicas(self) -> tuple[int, int]:
        """(every replica's count, this process's first replica): the strategy's, for a
        variable on its devices (other workers hold the rest under a multi-worker one)."""
        strategy = self._strategy
        if tuple(strategy.devices) == self._devices:
            return strategy.num_replicas_in_sync, strategy._first_replica
        return len(self._devices), 0

    def eager_value(self) -> np.ndarray:
        total, first = self._replicas()
        if not self.on_read or total == 1:
            return self._host(0)
        sync.check_cross_replica_read(self)
        agg = self._aggregation
        parts = [self._host(k) for k in range(len(self._values))]
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._strategy._from_chief(parts[0]) if total > len(parts) else parts[0]
        across = self._strategy if total > len(parts) else None   # other workers' parts too
        if agg is VariableAggregation.MEAN:
            return sync.exact_eager_mean(parts, total, across)
        local = np.sum(parts, axis=0, dtype=self.dtype)
        return local if across is None else across._sum_across_workers(local)

    def numpy(self) -> np.ndarray:
        """A copy of the value (the aggregate, for sync-on-read variables)."""
        sync.check_strategy(self)
        return np.array(self.eager_value())

    def read_value(self):
        tracer = current_tracer()
        return sync.read(tracer, self) if tracer is not None else self.numpy()

    def traced_read(self, tracer):
        return sync.read(tracer, self)

    value = read_value

    def __array__(self, dtype=None, copy=None):
        if current_tracer() is not None:
            raise TraceError(f"variable '{self._name}' cannot become a numpy array inside a "
                             "trace; use it as a tensor")
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    # ------------------------------------------------------------ writes
    def assign(self, value):
        """Set the value. In traced code this becomes an assign_var eqn."""
        tracer = current_tracer()
        if tracer is not None:
            return sync.assign(tracer, self, value, "assign")
        sync.check_strategy(self)
        if isinstance(value, PerReplica):
            sync.refuse_per_replica(self)
        if isinstance(value, (list, tuple)):    # Python data converts to the variable's dtype
            value = np.asarray(value, dtype=self.dtype)
        new = np.asarray(value.eager_value() if isinstance(value, Variable) else host_value(value))
        if new.shape != self.shape:
            raise ValueError(f"assign: variable '{self._name}' has shape {self.shape}, "
                             f"the value has {new.shape}")
        if new.dtype != self.dtype and not (np.ndim(value) == 0 and not isinstance(
                value, (np.ndarray, np.generic))):
            raise TypeError(f"assign: variable '{self._name}' is {self.dtype}, the value is "
                            f"{new.dtype}; use gd.cast")
        self.assign_components(self.components_for(new.astype(self.dtype)))
        return self

    # eagerly as in a trace: gd.add/subtract apply the dtype rules (no silent casts)
    def assign_add(self, delta):
        tracer = current_tracer()
        if tracer is not None:
            return sync.assign(tracer, self, delta, "add")
        return self.assign(add(self.read_value(), delta))

    def assign_sub(self, delta):
        tracer = current_tracer()
        if tracer is not None:
            return sync.assign(tracer, self, delta, "sub")
        return self.assign(subtract(self.read_value(), delta))

    def assign_synced(self, value):
        """Assign a value every replica already agrees on (optimizer updates): no collective."""
        tracer = current_tracer()
        if tracer is None:
            return self.assign(value)
        sync.check_strategy(self)
        if _conditions.stack:                   # inside assign_synced_if: maybe keep the old
            value = where(_conditions.stack[-1], value, sync.read(tracer, self))
        return tracer.assign(self, value)

    def components_for(self, new: np.ndarray) -> list:
        """What each component holds after a cross-replica write of `new`."""
        n = len(self._values)
        total, first = self._replicas()
        if self.on_read and self._aggregation is VariableAggregation.SUM and total > 1:
            return sync.sum_shares(new, total)[first:first + n]
        return [new] * n

    def assign_components(self, arrays) -> None:
        """Overwrite every component at once (all checks happen before any write)."""
        self._lagging = False
        for device, dst, src in zip(self._devices, self._values, arrays):
            backend_for(device).copy_in(dst, src)

    # ------------------------------------------------------------ printing
    def param_text(self) -> str:
        return self._name

    def __repr__(self) -> str:
        text = f"<gd.Variable '{self._name}' shape={self.shape} dtype={self.dtype}"
        if current_tracer() is not None:
            return text + ">"
        if self.on_read and self._aggregation is VariableAggregation.NONE \
                and len(self._values) > 1:    # no cross-replica value to show
            return text + f" values={[self._host(k) for k in range(len(self._values))]!r}>"
        return text + f" numpy={np.array(self.eager_value())!r}>"   # unchecked: any scope

    def __bool__(self):
        raise TypeError(f"the truth value of variable '{self._name}' is ambiguous")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of scalar variable '{self._name}'")
        return self.shape[0]

    def __iter__(self):   # as gd.Tensor: without it, iteration runs getitem out of bounds
        return (self[i] for i in range(len(self)))
