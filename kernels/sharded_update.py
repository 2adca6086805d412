"""The sharded update of zero_stage > 0 in one pass, for replicas that share one host: a
gradient bucket's reduce-scatter, every replica's optimizer update of its shard and the
all-gather of the parameters (graphdist/ops/zero_collectives.py has the node's layout).

Apart, the reduce-scatter writes each replica's reduced shard, each update reads a copy of
its chunk of the parameter and writes a new chunk, and the all-gather copies every chunk
into every replica's parameter: three passes and four buffers per bucket. Here each chunk
of 64K elements of member j's shard r is summed once (replica order) into a buffer that
stays in cache, replica r's parameter chunk and slot shards are updated from it, and the
new parameter values are written straight into every replica's parameter. The float
operations are those of host_reduce_scatter and the multi-tensor update (the same compiled
formulas.sgd and formulas.adam), so the bits are the same.

Layout: `bufs` holds every replica's flat bucket, the (R, width) matrix whose row r holds
member j's chunk r at column offsets[j]; `ps` holds replica k's full parameter of member j
at k * n + j (flat), `ms`, `vs` its slot shards (lengths[j] elements each).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit, prange

from .adam import _adam_cpu_math
from .adam import _host_scalars as _adam_scalars
from .common import CHUNK, remembered, same_dtype, tensor_group, threads_for
from .reduce_update import _reduced
from .sgd import _host_scalars as _sgd_scalars
from .sgd import _sgd_cpu_math


@njit(error_model="numpy", cache=True)
def _scatter(ps, n, j, replicas, new, first, count):
    """new[:count] into every replica's parameter j at flat `first` (its chunk's valid part:
    the padding is nobody's)."""
    for k in range(replicas):
        dst = ps[k * n + j][first:first + count]
        for i in range(count):
            dst[i] = new[i]


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sharded_sgd(bufs, layout, table, ps, ms, n, zero, count, mean, lr, momentum, wd,
                 nesterov):
    replicas = len(bufs)
    for t in prange(table.shape[0]):
        r, j, start, stop = table[t, 0], table[t, 1], table[t, 2], table[t, 3]
        width, offset, length, size = layout[j, 0], layout[j, 1], layout[j, 2], layout[j, 3]
        at = r * width + offset
        g = _reduced(bufs, at + start, at + stop, count, mean)   # then the new values
        first = r * length + start
        valid = max(0, min(stop - start, size - first))
        source, m = ps[r * n + j][first:first + valid], ms[r * n + j][start:stop]
        for i in range(stop - start):
            g[i], mi = _sgd_cpu_math(source[i] if i < valid else zero, m[i], g[i], lr,
                                     momentum, wd, nesterov)
            if momentum != 0:
                m[i] = mi
        _scatter(ps, n, j, replicas, g, first, valid)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sharded_adam(bufs, layout, table, ps, ms, vs, n, zero, count, mean, lr_ts, b1, c1, b2,
                  c2, eps, wd):
    replicas = len(bufs)
    for t in prange(table.shape[0]):
        r, j, start, stop = table[t, 0], table[t, 1], table[t, 2], table[t, 3]
        width, offset, length, size = layout[j, 0], layout[j, 1], layout[j, 2], layout[j, 3]
        at = r * width + offset
        g = _reduced(bufs, at + start, at + stop, count, mean)   # then the new values
        first = r * length + start
        valid = max(0, min(stop - start, size - first))
        source = ps[r * n + j][first:first + valid]
        m, v = ms[r * n + j][start:stop], vs[r * n + j][start:stop]
        rate = lr_ts[r]
        for i in range(stop - start):
            g[i], m[i], v[i] = _adam_cpu_math(source[i] if i < valid else zero, m[i], v[i],
                                              g[i], rate, b1, c1, b2, c2, eps, wd)
        _scatter(ps, n, j, replicas, g, first, valid)


_prepared: OrderedDict = OrderedDict()   # a compiled step passes the same buffers every time


def _prepare(bufs, width: int, offsets, lengths, lists):
    """(bucket tuple, layout, chunk table, tensor tuples), made once per set of arrays."""
    def make():
        replicas, n = len(bufs), len(offsets)
        for lst in lists:
            if len(lst) != replicas * n:
                raise ValueError(f"sharded_update: expected {replicas} replicas x {n} tensors, "
                                 f"got {len(lst)}")
        for j, (offset, length) in enumerate(zip(offsets, lengths)):
            size = lists[0][j].size
            if offset + length > width or replicas * width > bufs[0].size:
                raise ValueError(f"sharded_update: member {j} lies outside the gradient bucket")
            if size > replicas * length or any(s[k * n + j].size != length
                                               for s in lists[1:] for k in range(replicas)):
                raise ValueError(f"sharded_update: member {j}'s shards are not {length} long")
        layout = np.array([(width, o, length, lists[0][j].size)
                           for j, (o, length) in enumerate(zip(offsets, lengths))],
                          np.int64).reshape(-1, 4)
        table = np.array([(r, j, start, min(start + CHUNK, length)) for r in range(replicas)
                          for j, length in enumerate(lengths)
                          for start in range(0, length, CHUNK)], np.int64).reshape(-1, 4)
        flats = tensor_group(*lists)     # padded tuples up to 16 tensors: no typed List
        return tuple(b.reshape(-1) for b in bufs), layout, table, flats
    return remembered(_prepared, [bufs, *lists, [width, offsets, lengths]], make)


_DUMMIES: dict = {}


def _dummy_slots(lengths: tuple, replicas: int, dtype) -> list:
    """Slot shards for plain SGD, which keeps none (read, never written): the same arrays
    for the same layout, so the prepared tables are found again."""
    key = (lengths, replicas, np.dtype(dtype).str)
    if key not in _DUMMIES:
        _DUMMIES[key] = [np.zeros(length, dtype) for _ in range(replicas) for length in lengths]
    return _DUMMIES[key]


def sharded_sgd_cpu(bufs, width, offsets, lengths, ps, ms, op, lr, momentum=0.0,
                    nesterov=False, weight_decay=0.0) -> None:
    """Reduce-scatter the buckets `bufs` (op "sum" or "mean"), apply SGD (with momentum when
    ms is given) to each replica's shard and write the new values into every replica's
    parameters `ps`, in one parallel pass.

    >>> g = [np.arange(4, dtype=np.float32), np.ones(4, np.float32)]   # 2 replicas, width 2
    >>> ps = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    >>> sharded_sgd_cpu(g, 2, [0], [2], ps, None, "sum", lr=1.0); ps[1]
    array([-1., -2., -3.], dtype=float32)
    """
    same_dtype("sharded_sgd_cpu", *bufs, *ps, *(ms or ()))
    slots = ms if ms is not None else _dummy_slots(tuple(lengths), len(bufs), ps[0].dtype)
    bucket, layout, table, (pl, ml) = _prepare(bufs, width, tuple(offsets), tuple(lengths),
                                               [ps, slots])
    scalars = _sgd_scalars(bucket[0], lr, momentum, weight_decay, ms)
    with threads_for(len(bufs) * 3 * bucket[0].nbytes):
        _sharded_sgd(bucket, layout, table, pl, ml, len(offsets), bucket[0].dtype.type(0),
                     bucket[0].dtype.type(len(bufs)), op == "mean", *scalars, bool(nesterov))


def sharded_adam_cpu(bufs, width, offsets, lengths, ps, ms, vs, lr_ts, op, beta_1, beta_2,
                     epsilon, weight_decay_lr=0.0) -> None:
    """Reduce-scatter the buckets, apply Adam (AdamW when weight_decay_lr) to each replica's
    shard with its own bias-corrected rate lr_ts[r], and write the new values into every
    replica's parameters, in one parallel pass.

    >>> g = [np.ones(2, np.float32), np.ones(2, np.float32)]          # 2 replicas, width 1
    >>> ps = [np.ones(2, np.float32), np.ones(2, np.float32)]
    >>> zs = [np.zeros(1, np.float32) for _ in range(4)]
    >>> sharded_adam_cpu(g, 1, [0], [1], ps, zs[:2], zs[2:], [0.1, 0.1], "mean", 0., 0., 0.)
    >>> ps[1]
    array([0.9, 0.9], dtype=float32)
    """
    same_dtype("sharded_adam_cpu", *bufs, *ps, *ms, *vs)
    bucket, layout, table, (pl, ml, vl) = _prepare(bufs, width, tuple(offsets), tuple(lengths),
                                                   [ps, ms, vs])
    dtype = bucket[0].dtype
    scalars = _adam_scalars(bucket[0], 0.0, beta_1, beta_2, epsilon, weight_decay_lr)[1:]
    rates = np.array([float(x) for x in lr_ts], dtype)
    with threads_for(len(bufs) * 5 * bucket[0].nbytes):
        _sharded_adam(bucket, layout, table, pl, ml, vl, len(offsets), dtype.type(0),
                      dtype.type(len(bufs)),
                      op == "mean", rates, *scalars)
