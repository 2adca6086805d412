"""How variables synchronize inside traced code (docs/api.md "Variables"): which reads aggregate
across replicas and what an assign does in replica and in cross-replica context. Everything
here emits ordinary collectives into the SPMD graph; with one replica it emits none."""

from __future__ import annotations

import numpy as np

from graphdist.distribute.context import get_replica_context
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
        return all_reduce(value, "mean")
    return broadcast(value, 0)


def sum_shares(value: np.ndarray, n: int) -> list:
    """What each of n components of a SUM sync-on-read variable holds so that it reads
    `value`: value/n for floats (as TF does); an integer or bool value is held whole by the
    first replica (value/n would be truncated), the others hold zero."""
    if is_float(value.dtype):
        return [value / value.dtype.type(n)] * n
    return [value] + [np.zeros_like(value)] * (n - 1)


def _sum_share(variable, value, n: int):
    """sum_shares in traced (SPMD) code: this replica's share of `value`."""
    if is_float(variable.dtype):
        return value / float(n)
    from graphdist.ops.collectives import replica_id
    from graphdist.ops.math import equal, where

    return where(equal(replica_id(), np.int32(0)), value, np.zeros((), variable.dtype))


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


def read(tracer, variable):
    """The variable's value as this code sees it: a sync-on-read variable read in
    cross-replica context is the aggregate of the replicas' components."""
    local = tracer.read(variable)
    if variable._replicas()[0] == 1 or not variable.on_read or in_replica_context(variable):
        return local
    check_cross_replica_read(variable)
    return _aggregate(local, variable.aggregation, variable._replicas()[0])


def assign(tracer, variable, value, mode: str):
    """assign / assign_add / assign_sub with the aggregation rules; returns the variable."""
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
        value = _sum_share(variable, value, n)     # so that the read gives the value back
    if mode != "assign":
        local = tracer.read(variable)
        value = local + value if mode == "add" else local - value
    tracer.assign(variable, value)
    return variable
