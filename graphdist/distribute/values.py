"""Enums of the distribution API and the per-replica value containers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReduceOp(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


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


class PerReplica:
    """One value per replica, in device order (`.values`)."""

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = tuple(values)

    def __repr__(self) -> str:
        return f"PerReplica({', '.join(repr(v) for v in self.values)})"

    def __len__(self) -> int:
        return len(self.values)


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
