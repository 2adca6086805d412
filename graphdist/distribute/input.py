"""Splitting global batches into per-replica shards."""

from __future__ import annotations

import numpy as np

from graphdist.distribute.values import PerReplica, map_structure


def shard_sizes(n_rows: int, n: int) -> list[int]:
    """Near-equal shard sizes; the first shards get one extra row (10 on 4 -> 3, 3, 2, 2)."""
    base, extra = divmod(n_rows, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split_array(a, n: int) -> PerReplica:
    a = np.asarray(a)
    if a.ndim == 0:
        raise ValueError(f"cannot split a scalar across {n} replicas; batches need axis 0")
    bounds = np.cumsum([0] + shard_sizes(a.shape[0], n))
    return PerReplica(tuple(a[bounds[i]:bounds[i + 1]] for i in range(n)))


def distribute_batch(batch, n: int):
    """The same structure as `batch` with every array replaced by a PerReplica of shards."""
    return map_structure(lambda v: v if isinstance(v, PerReplica) else split_array(v, n), batch)
