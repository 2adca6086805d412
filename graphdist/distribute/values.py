"""Enums of the distribution API and the per-replica value containers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class ReduceOp(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


def as_reduce_op(op) -> ReduceOp:
    """A ReduceOp, or its name in any case ("sum", "MEAN")."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use gd.ReduceOp.SUM or MEAN") from None


class VariableSynchronization(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    ON_WRITE = "on_write"
    ON_READ = "on_read"


class VariableAggregation(enum.Enum):
    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"


def _as_tensor_value(value):
    """Python numbers become numpy scalars of the dtypes TF gives them (float32, int32, bool),
    so that each replica is fed its own value instead of tracing replica 0's constant
    (PerReplica applies it to every leaf of its components)."""
    if isinstance(value, np.generic):      # np.float64 is a float too: keep its dtype
        return value
    if isinstance(value, bool):
        return np.bool_(value)
    if isinstance(value, int):
        return np.int32(value) if -2**31 <= value < 2**31 else np.int64(value)
    if isinstance(value, float):
        return np.float32(value)
    return value


class PerReplica:
    """One value per replica, in device order (`.values`; `.devices` where known)."""

    __slots__ = ("values", "devices")
    __array_ufunc__ = None      # numpy defers to the operators below, which explain the misuse

    def __init__(self, values, devices=None):
        # every Python number, at any depth of a structured component, becomes an array leaf
        self.values = tuple(map_structure(_as_tensor_value, v) for v in values)
        self.devices = tuple(devices) if devices is not None else None

    def __repr__(self) -> str:
        return f"PerReplica({', '.join(repr(v) for v in self.values)})"

    def __len__(self) -> int:
        return len(self.values)

    def tree_children(self) -> tuple:
        """The components a pytree flattens (a LocalValue has one: its local tensor)."""
        return self.values

    def _describe(self) -> str:
        """'a gd.PerReplica of 2 values (on cpu:0, cpu:1)', for error messages."""
        n, devices = len(self.values), getattr(self, "devices", None)
        where = f"on {', '.join(devices)}" if devices else "one per replica"
        return f"a gd.PerReplica of {n} values ({where})"

    def _misuse(self, what: str):
        """The TypeError for using one value per replica where one array is expected."""
        return TypeError(
            f"{what}: got {self._describe()}, not one array. Outside strategy.run combine its "
            "values with strategy.reduce(gd.ReduceOp.SUM or MEAN, value, axis=None) or "
            "strategy.gather(value, axis=0), take replica k's with .values[k], or pass it to "
            "strategy.run(fn, args=(value,)) to compute with it on every replica")

    def __array__(self, dtype=None, copy=None):
        raise self._misuse("a PerReplica used as an array (np.asarray or a gd op)")

    def _operator(symbol: str):
        def refuse(self, *other):
            raise self._misuse(f"'{symbol}' applied to a PerReplica")
        return refuse

    __add__ = __radd__ = _operator("+")
    __sub__ = __rsub__ = _operator("-")
    __mul__ = __rmul__ = _operator("*")
    __truediv__ = __rtruediv__ = _operator("/")
    __floordiv__ = __rfloordiv__ = _operator("//")
    __mod__ = __rmod__ = _operator("%")
    __pow__ = __rpow__ = _operator("**")
    __matmul__ = __rmatmul__ = _operator("@")
    __lt__ = __le__ = __gt__ = __ge__ = _operator("a comparison")
    __neg__ = __pos__ = __abs__ = _operator("a unary operator")
    del _operator

    def _conversion(name: str):
        def refuse(self):
            raise self._misuse(f"{name}() of a PerReplica (one number per replica)")
        return refuse

    # float(loss) of what strategy.run returned: say how to reduce it instead of Python's
    # bare "must be a real number" (and, for bool, instead of a silent True)
    __float__ = _conversion("float")
    __int__ = __index__ = _conversion("int")
    __complex__ = _conversion("complex")
    __bool__ = _conversion("bool")
    del _conversion


class LocalValue(PerReplica):
    """Inside a trace: a per-replica value, represented by this replica's tensor (`local`).

    Its `values` are what cross-replica code (merge_fn, the code around strategy.run) sees:
    with n replicas, component k is replica k's value broadcast to every replica, an explicit
    collective, so `v.values[0]` or `sum(v.values)` mean there what they mean in TF."""

    __slots__ = ("local",)

    def __init__(self, values):  # not super().__init__: it would set the `values` property
        (self.local,) = values

    def tree_children(self) -> tuple:
        return (self.local,)

    @property
    def values(self) -> tuple:
        from graphdist.ops.core import current_tracer

        tracer = current_tracer()
        strategy = getattr(tracer, "strategy", None)
        n = strategy.num_replicas_in_sync if strategy is not None else 1
        if n == 1:
            return (self.local,)
        from graphdist.ops.collectives import broadcast

        shapes = replica_shapes(tracer, self.local, n)
        if all(s == shapes[0] for s in shapes):
            return tuple(broadcast(self.local, k) for k in range(n))
        return _uneven_broadcasts(self.local, shapes)

    @property
    def devices(self):
        from graphdist.ops.core import current_tracer

        strategy = getattr(current_tracer(), "strategy", None)
        return strategy.devices if strategy is not None else None

    def _describe(self) -> str:
        devices = self.devices     # without .values: that would emit n broadcasts
        return (f"a gd.PerReplica of {len(devices) if devices else 'several'} values "
                f"({'on ' + ', '.join(devices) if devices else 'one per replica'}, in a trace)")


def replica_shapes(tracer, local, n: int) -> tuple:
    """Every replica's shape of a per-replica value whose components cross replicas (the
    k-th such crossing of this trace). Uneven shards trace each shape once, so replica 0's
    trace cannot see replica 1's shape: each trace records its own (`replica_shapes_seen`)
    and gd.function traces again with what all of them saw (`replica_shapes_known`)."""
    here = tuple(np.shape(local))
    seen = tracer.replica_shapes_seen
    seen.append(here)
    known = tracer.replica_shapes_known
    if known is not None and len(seen) <= len(known):
        return known[len(seen) - 1]
    return (here,) * n


def _uneven_broadcasts(local, shapes: tuple) -> tuple:
    """Every replica's value on every replica when their shapes differ: a collective moves
    one type, so each replica zero-pads its value to the largest shape, and replica k's
    broadcast is cut back to shapes[k]."""
    from graphdist.ops.array import concat, zeros
    from graphdist.ops.collectives import broadcast

    if len({len(s) for s in shapes}) > 1:
        raise ValueError(f"per-replica values of different ranks cannot cross replicas (replica "
                         f"shapes {list(shapes)}); give every replica's value the same rank")
    big = tuple(max(dims) for dims in zip(*shapes))
    padded = local
    for axis, (have, want) in enumerate(zip(np.shape(local), big)):
        if have < want:
            fill = zeros(big[:axis] + (want - have,) + tuple(np.shape(padded))[axis + 1:],
                         np.dtype(local.dtype))
            padded = concat([padded, fill], axis=axis)
    return tuple(broadcast(padded, k) if shape == big else
                 broadcast(padded, k)[tuple(slice(0, d) for d in shape)]
                 for k, shape in enumerate(shapes))


class Mirrored(PerReplica):
    """A PerReplica whose components are known to be equal."""

    __slots__ = ()


@dataclass(frozen=True)
class ValueContext:
    """What `experimental_distribute_values_from_function` tells its function."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def map_structure(fn, value):
    """fn applied to every leaf of nested tuples, lists and dicts; a PerReplica is a leaf."""
    if isinstance(value, PerReplica):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_structure(fn, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_structure(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_structure(fn, v) for k, v in value.items()}
    return fn(value)
