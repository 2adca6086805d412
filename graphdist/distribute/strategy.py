"""Strategy (the shared machinery), the default strategy and OneDeviceStrategy, and
ReplicaContext. MirroredStrategy builds on the same base with more than one replica."""

from __future__ import annotations

from graphdist.distribute import context
from graphdist.distribute.devices import canonical, default_device
from graphdist.distribute.values import PerReplica, ReduceOp, ValueContext
from graphdist.ops.core import Symbolic, current_tracer


def _reduce_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use gd.ReduceOp.SUM or MEAN") from None


class ReplicaContext:
    """What a replica function sees of the strategy running it."""

    def __init__(self, strategy, replica_id: int = 0):
        self.strategy = strategy
        self._replica_id = replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self):
        """The replica's index; symbolic (an int32 scalar tensor) in traced code."""
        if current_tracer() is not None and self.num_replicas_in_sync > 1:
            from graphdist.ops.collectives import replica_id

            return replica_id()
        return self._replica_id

    def all_reduce(self, op, value):
        """Reduce `value` (a tensor or a nested structure of them) across replicas."""
        from graphdist.ops.collectives import all_reduce

        op = _reduce_op(op)
        return _map_structure(lambda v: all_reduce(v, op.value), value)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Call merge_fn(strategy, *args) once in cross-replica context; each replica gets its
        part of the result."""
        kwargs = kwargs or {}
        with context.entered(self.strategy, None):
            return merge_fn(self.strategy, *args, **kwargs)


def _map_structure(fn, value):
    if isinstance(value, (list, tuple)):
        return type(value)(_map_structure(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_structure(fn, v) for k, v in value.items()}
    return fn(value)


class Strategy:
    """The distribution API common to every strategy; one replica per device in `devices`."""

    def __init__(self, devices):
        self._devices = tuple(canonical(d) for d in devices)
        self._run_functions: dict = {}
        self.default_replica_context = ReplicaContext(self, 0)

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    def scope(self):
        """Variables created inside are placed by this strategy (cross-replica context)."""
        return context.entered(self, None)

    def run(self, fn, args=(), kwargs=None):
        """Run `fn` once per replica. Inside gd.function it joins that trace; on its own it is
        traced and compiled once per input signature."""
        args = args if isinstance(args, (tuple, list)) else (args,)
        kwargs = kwargs or {}
        if current_tracer() is not None:
            with context.entered(self, ReplicaContext(self, 0)):
                return fn(*_first_replica(args), **_first_replica(kwargs))
        compiled = self._run_functions.get(fn)
        if compiled is None:
            from graphdist.trace import function

            compiled = function(lambda *a, **k: self.run(fn, a, k))
            self._run_functions[fn] = compiled
        return compiled(*_first_replica(args), **_first_replica(kwargs))

    def reduce(self, op, value, axis=None):
        """Reduce a per-replica value across replicas (and along `axis` of each component)."""
        from graphdist.ops.math import reduce_mean, reduce_sum

        op = _reduce_op(op)
        value = value.values[0] if isinstance(value, PerReplica) else value
        if axis is None:
            return value
        reduce = reduce_sum if op is ReduceOp.SUM else reduce_mean
        return reduce(value, axis=axis)

    def gather(self, value, axis=0):
        return value.values[0] if isinstance(value, PerReplica) else value

    def experimental_distribute_dataset(self, iterable):
        return iterable

    def experimental_distribute_values_from_function(self, fn):
        return fn(ValueContext(0, 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._devices)})"


def _first_replica(value):
    if isinstance(value, PerReplica):
        return value.values[0]
    if isinstance(value, (list, tuple)) and not isinstance(value, Symbolic):
        return type(value)(_first_replica(v) for v in value)
    if isinstance(value, dict):
        return {k: _first_replica(v) for k, v in value.items()}
    return value


class OneDeviceStrategy(Strategy):
    """All variables and computation on one device.

    >>> s = gd.OneDeviceStrategy("cpu:0"); s.num_replicas_in_sync
    1
    """

    def __init__(self, device):
        super().__init__([device])


class _DefaultStrategy(OneDeviceStrategy):
    pass


_default = []


def default_strategy() -> Strategy:
    if not _default:
        _default.append(_DefaultStrategy(default_device()))
    return _default[0]
