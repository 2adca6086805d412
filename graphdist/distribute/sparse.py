"""Gradients across replicas, sparse ones included: what apply_gradients all-reduces.

Dense gradients go through the bucketed all-reduce. A sparse gradient (gd.IndexedSlices,
from an embedding lookup) is all-gathered instead: every replica receives every replica's
rows and indices, in replica order, and rows with the same index are summed
(TF's `_deduplicate_indexed_slices`) and, for a mean, divided by the replica count. That
moves n x rows x (row + index) bytes into each replica, against the whole table for a
dense all-reduce, so the rule is simply the smaller of the two:

    sparse when  n * rows * (row_bytes + index_bytes)  <  table_bytes,  else dense

(a dense one joins the buckets of the other dense gradients). Shards of different sizes
give replicas different row counts; each pads its rows with zero rows to the largest
count, so one all-gather fits all of them.
"""

from __future__ import annotations

import math

import numpy as np

from graphdist.distribute.buckets import bucketed_all_reduce
from graphdist.distribute.values import replica_shapes
from graphdist.ops.array import concat, zeros
from graphdist.ops.collectives import all_gather
from graphdist.ops.core import current_tracer
from graphdist.ops.sparse import IndexedSlices, densify, sum_duplicates


def gathered_bytes(slices: IndexedSlices, n: int, rows: int | None = None) -> int:
    """Bytes the all-gather delivers into each replica (its own rows included)."""
    rows = slices.values.shape[0] if rows is None else rows
    row = math.prod(slices.dense_shape[1:]) * slices.dtype.itemsize
    return n * rows * (row + np.dtype(slices.indices.dtype).itemsize)


def dense_bytes(slices: IndexedSlices) -> int:
    return math.prod(slices.dense_shape) * slices.dtype.itemsize


def all_reduce_gradients(grads: list, op: str, bucket_bytes: int, n: int) -> list:
    """Every replica's gradients reduced by `op` ("sum" or "mean"): dense ones bucketed,
    sparse ones all-gathered (or densified, by the rule above)."""
    out = list(grads)
    dense = []
    for i, g in enumerate(grads):
        if isinstance(g, IndexedSlices):
            rows = max(s[0] for s in replica_shapes(current_tracer(), g.values, n))
            if gathered_bytes(g, n, rows) < dense_bytes(g):
                out[i] = all_reduce_slices(g, op, n, rows)
                continue
            out[i] = densify(g)
        dense.append(i)
    reduced = bucketed_all_reduce([out[i] for i in dense], op, bucket_bytes)
    for i, r in zip(dense, reduced):
        out[i] = r
    return out


def all_reduce_slices(g: IndexedSlices, op: str, n: int, rows: int) -> IndexedSlices:
    """The all-gathered, deduplicated sum (or mean) of every replica's sparse gradient."""
    indices, values = g.indices, g.values
    short = rows - values.shape[0]
    if short:             # an uneven shard: zero rows at index 0 change no sum
        indices = concat([indices, zeros((short,), indices.dtype)])
        values = concat([values, zeros((short,) + tuple(values.shape[1:]), values.dtype)])
    # a mean divides each distinct row's sum by n, as the dense all-reduce divides its sum
    return sum_duplicates(IndexedSlices(all_gather(indices, n), all_gather(values, n),
                                        g.dense_shape), divisor=n if op == "mean" else 1)
