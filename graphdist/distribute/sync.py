"""How variables synchronize inside traced code (docs/api.md "Variables"): which reads aggregate
across replicas and what an assign does in replica and in cross-replica context. Everything
here emits ordinary collectives into the SPMD graph; with one replica it emits none."""

from __future__ import annotations

import numpy as np

from graphdist.distribute.context import get_replica_context, require_current
from graphdist.distribute.values import LocalValue, PerReplica
from graphdist.distribute.values import VariableAggregation as Agg
from graphdist.ir.types import is_float
from graphdist.ops.collectives import all_reduce, broadcast
from graphdist.ops.core import Symbolic, is_python_scalar, scalar_dtype


def in_replica_context(variable) -> bool:
    ctx = get_replica_context()
    return ctx is not None and tuple(ctx.strategy.devices) == tuple(variable.devices)


def _aggregate(value, aggregation, n: int):
    if aggregation is Agg.SUM:
        return all_reduce(value, "sum")
    if aggregation is Agg.MEAN:
        return _exact_mean(value)
    return broadcast(value, 0)


def sum_shares(value: np.ndarray, n: int) -> list:
    """What each of n components of a SUM sync-on-read variable holds so that it reads
    `value` exactly: the first replica holds it whole, the others an additive identity
    (-0.0 for floats, so that even -0.0 and every summation order give `value` back bit
    for bit; value/n per replica, TF's choice, sums back 1 ulp off in 14% of entries on 3
    replicas). Per-replica updates then add to each replica's own component."""
    return [value] + [_additive_identity(value.dtype, value.shape)] * (n - 1)


def _additive_identity(dtype, shape=()) -> np.ndarray:
    """x + this == x for every x, bit for bit: -0.0 for floats (0.0 would turn -0.0 into
    +0.0), 0 for integers, False for bools."""
    return np.full(shape, -0.0 if is_float(dtype) else 0, dtype)


def _sum_share(variable, value):
    """sum_shares in traced (SPMD) code: this replica's share of `value`."""
    from graphdist.ops.collectives import replica_id
    from graphdist.ops.math import equal, where

    return where(equal(replica_id(), np.int32(0)), value,
                 _additive_identity(variable.dtype))


def _exact_mean(local):
    """all_reduce(local, "mean") that gives back exactly the value every replica holds when
    they hold the same one (a MEAN variable after a cross-replica assign or a restore); a
    float32 sum over 3 replicas divided by 3 is not always that value. Floats of 32 bits or
    fewer are averaged in float64, where n equal values sum exactly (n < 2**29); a float64
    mean is the first replica's value wherever every replica holds it. Values that differ
    get their rounded mean."""
    from graphdist.ops.array import cast
    from graphdist.ops.math import equal, not_equal, where

    if not isinstance(local, Symbolic):      # a constant: the same on every replica
        return all_reduce(local, "mean")
    dtype = np.dtype(local.dtype)
    if dtype.itemsize <= 4:
        return cast(all_reduce(cast(local, "float64"), "mean"), dtype)
    first = broadcast(local, 0)
    differing = all_reduce(cast(not_equal(local, first), dtype), "sum")
    return where(equal(differing, dtype.type(0)), first, all_reduce(local, "mean"))


def exact_eager_mean(parts: list, total: int, strategy=None):
    """_exact_mean of host components: `parts` are this process's, `total` every replica's
    count; under a multi-worker strategy (`strategy`) the other workers hold the rest."""
    dtype = parts[0].dtype
    whole = strategy._sum_across_workers if strategy is not None else (lambda a: a)
    if dtype.itemsize <= 4:
        return np.asarray(whole(np.sum(parts, axis=0, dtype=np.float64)) / total, dtype)
    first = strategy._from_chief(parts[0]) if strategy is not None else parts[0]
    differing = whole(np.sum([np.not_equal(p, first) for p in parts], axis=0, dtype=np.int64))
    with np.errstate(over="ignore"):        # where all hold the largest float, it is kept
        mean = np.asarray(whole(np.sum(parts, axis=0, dtype=dtype)) / dtype.type(total), dtype)
    return np.where(differing == 0, first, mean).astype(dtype)


def refuse_per_replica(variable):
    """A cross-replica write takes one value for every replica, not a PerReplica."""
    raise TypeError(f"assign: variable '{variable.name}' cannot take a PerReplica value in "
                    "cross-replica context; reduce it first (strategy.reduce) or pick one "
                    "component with .values[k]")


def check_cross_replica_read(variable) -> None:
    """A sync-on-read variable with aggregation NONE has no cross-replica value (TF raises
    too): only its replicas may read it, each its own component."""
    if variable.aggregation is Agg.NONE:
        raise ValueError(f"cannot read sync-on-read variable '{variable.name}' in cross-replica "
                         "context: it has aggregation NONE, so there is no way to combine its "
                         f"{len(variable.devices)} replicas' components; pass "
                         "aggregation=gd.VariableAggregation.SUM, MEAN or ONLY_FIRST_REPLICA "
                         "when creating it, or read it inside strategy.run")


def check_strategy(variable) -> None:
    """A variable of one strategy read or written inside another strategy's scope or run
    raises RuntimeError, as TF's "Mixing different tf.distribute.Strategy objects"."""
    require_current(variable._strategy, f"variable '{variable.name}'")


def read(tracer, variable):
    """The variable's value as this code sees it: a sync-on-read variable read in
    cross-replica context is the aggregate of the replicas' components."""
    check_strategy(variable)
    local = tracer.read(variable)
    if variable._replicas()[0] == 1 or not variable.on_read or in_replica_context(variable):
        return local
    check_cross_replica_read(variable)
    return _aggregate(local, variable.aggregation, variable._replicas()[0])


def assign(tracer, variable, value, mode: str):
    """assign / assign_add / assign_sub with the aggregation rules; returns the variable."""
    check_strategy(variable)
    n = variable._replicas()[0]          # every worker's replicas, under a multi-worker one
    if is_python_scalar(value):
        # weakly typed: the number takes the variable's dtype before an aggregation (an
        # all-reduce or broadcast) would give it one of its own (int32, float32)
        method = {"assign": "assign", "add": "assign_add", "sub": "assign_sub"}[mode]
        value = np.asarray(value, scalar_dtype(f"{method} to variable '{variable.name}'",
                                               value, [variable.dtype]))
    if isinstance(value, PerReplica):     # only a replica may assign its own component
        if not (isinstance(value, LocalValue) and in_replica_context(variable)):
            refuse_per_replica(variable)
        value = value.local
    if n > 1 and in_replica_context(variable) and not variable.on_read:
        agg = variable.aggregation
        if agg is Agg.NONE:
            raise ValueError(f"assign to mirrored variable '{variable.name}' in a replica "
                             "context: specify an aggregation (SUM, MEAN or "
                             "ONLY_FIRST_REPLICA) when creating it")
        if agg is Agg.SUM and not isinstance(value, Symbolic):
            raise ValueError(f"assign to mirrored variable '{variable.name}' with SUM "
                             "aggregation: a Python number or numpy constant would be summed "
                             f"over {n} replicas; pass a tensor or use MEAN")
        value = _aggregate(value, agg, n)
    elif n > 1 and variable.on_read and variable.aggregation is Agg.SUM \
            and not in_replica_context(variable):
        if mode != "assign":       # assign(read() +- delta): the total, exactly, not a share
            total = read(tracer, variable)
            value, mode = (total + value if mode == "add" else total - value), "assign"
        value = _sum_share(variable, value)        # so that the read gives the value back
    if mode != "assign":
        local = tracer.read(variable)
        value = local + value if mode == "add" else local - value
    tracer.assign(variable, value)
    return variable
