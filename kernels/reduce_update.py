"""The gradient all-reduce fused with the optimizer update, for replicas that share one host.

Replicas on logical CPU devices all-reduce a gradient bucket and then each applies the same
update to its own parameters and slots. Done apart, the reduced gradient is written once per
replica and read back by every replica's update; here each 64K-element chunk of the bucket
is summed once (in replica order) into a buffer that stays in cache, and every replica's
update reads it from there. The sums and updates are the same float operations in the same
order as the separate all_reduce_cpu and sgd/adam kernels (the same compiled formulas.sgd and
formulas.adam), so the results are bit-identical.

Measured on the 2-core VM (bench/reduce_update.py, min of 30), 4 replicas x 1.86M float32
parameters: momentum 3.2 ms fused vs 5.2 ms for the all-reduce followed by 4 multi-tensor
updates, Adam 3.9 vs 6.6 ms; fused streams at 47-54 GB/s, the bandwidth limit here.

Layout: `bufs` holds every replica's flat gradient bucket; tensor j of the update is at
`offsets[j]` in it. `ps`, `ms`, `vs` hold replica k's tensor j at index k * n + j.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit, prange

from .adam import _adam_cpu_math
from .adam import _host_scalars as _adam_scalars
from .common import CHUNK, remembered, same_dtype, tensor_group, threads_for
from .reduce import reduce_chunk
from .sgd import _host_scalars as _sgd_scalars
from .sgd import _sgd_cpu_math


@njit(error_model="numpy", cache=True)
def _reduced(bufs, start, stop, count, mean):
    """One chunk of the all-reduce, in a buffer of its own (it stays in cache)."""
    acc = np.empty(stop - start, bufs[0].dtype)
    reduce_chunk(bufs, start, stop, count, mean, acc)
    return acc


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _reduce_sgd(bufs, offsets, table, ps, ms, n, count, mean, lr, momentum, wd, nesterov):
    for r in prange(table.shape[0]):
        j, start, stop = table[r, 0], table[r, 1], table[r, 2]
        g = _reduced(bufs, offsets[j] + start, offsets[j] + stop, count, mean)
        for k in range(len(bufs)):
            p, m = ps[k * n + j][start:stop], ms[k * n + j][start:stop]
            for i in range(stop - start):
                pi, mi = _sgd_cpu_math(p[i], m[i], g[i], lr, momentum, wd, nesterov)
                p[i] = pi
                if momentum != 0:
                    m[i] = mi


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _reduce_adam(bufs, offsets, table, ps, ms, vs, n, count, mean, lr_ts, b1, c1, b2, c2, eps,
                 wd):
    for r in prange(table.shape[0]):
        j, start, stop = table[r, 0], table[r, 1], table[r, 2]
        g = _reduced(bufs, offsets[j] + start, offsets[j] + stop, count, mean)
        for k in range(len(bufs)):
            p, m = ps[k * n + j][start:stop], ms[k * n + j][start:stop]
            v = vs[k * n + j][start:stop]
            for i in range(stop - start):
                p[i], m[i], v[i] = _adam_cpu_math(p[i], m[i], v[i], g[i], lr_ts[k], b1, c1, b2,
                                                  c2, eps, wd)


_prepared: OrderedDict = OrderedDict()   # a compiled step passes the same buffers every time


def _prepare(bufs, offsets, lists, n: int):
    """(bucket tuple, offsets, chunk table, typed Lists), made once per set of arrays."""
    def make():
        for lst in lists:
            if len(lst) != len(bufs) * n:
                raise ValueError(f"reduce_update: expected {len(bufs)} replicas x {n} tensors, "
                                 f"got {len(lst)}")
        flats = tensor_group(*lists)     # padded tuples up to 16 tensors: no typed List
        sizes = [flats[0][j].size for j in range(n)]
        if any(o + s > bufs[0].size for o, s in zip(offsets, sizes)):
            raise ValueError("reduce_update: a tensor lies outside the gradient bucket")
        table = np.array([(j, start, min(start + CHUNK, size)) for j, size in enumerate(sizes)
                          for start in range(0, size, CHUNK)], np.int64).reshape(-1, 3)
        return tuple(b.reshape(-1) for b in bufs), np.asarray(offsets, np.int64), table, flats
    return remembered(_prepared, [bufs, *lists, [offsets]], make)


def reduce_sgd_cpu(bufs, offsets, ps, ms, op, lr, momentum=0.0, nesterov=False,
                   weight_decay=0.0) -> None:
    """All-reduce the buckets `bufs` (op "sum" or "mean") and apply SGD (with momentum when
    ms is given) to every replica's tensors in place, in one parallel pass.

    >>> g = [np.ones(3, np.float32), np.full(3, 3, np.float32)]
    >>> ps = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    >>> reduce_sgd_cpu(g, [0], ps, None, "mean", lr=0.5); ps[1]
    array([-1., -1., -1.], dtype=float32)
    """
    n = len(offsets)
    same_dtype("reduce_sgd_cpu", *bufs, *ps, *(ms or ()))
    bucket, offs, table, (pl, ml) = _prepare(bufs, offsets, [ps, ps if ms is None else ms], n)
    scalars = _sgd_scalars(bucket[0], lr, momentum, weight_decay, ms)
    with threads_for(len(bufs) * 3 * bucket[0].nbytes):
        _reduce_sgd(bucket, offs, table, pl, ml, n, bucket[0].dtype.type(len(bufs)),
                    op == "mean", *scalars, bool(nesterov))


def reduce_adam_cpu(bufs, offsets, ps, ms, vs, lr_ts, op, beta_1, beta_2, epsilon,
                    weight_decay_lr=0.0) -> None:
    """All-reduce the buckets and apply Adam (AdamW when weight_decay_lr) to every replica's
    tensors in place, in one parallel pass; lr_ts holds each replica's bias-corrected rate.

    >>> g = [np.ones(2, np.float32), np.ones(2, np.float32)]
    >>> ps = [np.ones(2, np.float32), np.ones(2, np.float32)]
    >>> zs = [np.zeros(2, np.float32) for _ in range(4)]
    >>> reduce_adam_cpu(g, [0], ps, zs[:2], zs[2:], [0.1, 0.1], "mean", 0.0, 0.0, 0.0); ps[0]
    array([0.9, 0.9], dtype=float32)
    """
    n = len(offsets)
    same_dtype("reduce_adam_cpu", *bufs, *ps, *ms, *vs)
    bucket, offs, table, (pl, ml, vl) = _prepare(bufs, offsets, [ps, ms, vs], n)
    dtype = bucket[0].dtype
    scalars = _adam_scalars(bucket[0], 0.0, beta_1, beta_2, epsilon, weight_decay_lr)[1:]
    rates = np.array([float(x) for x in lr_ts], dtype)
    with threads_for(len(bufs) * 5 * bucket[0].nbytes):
        _reduce_adam(bucket, offs, table, pl, ml, vl, n, dtype.type(len(bufs)), op == "mean",
                     rates, *scalars)
