"""In-place numpy forms of the CPU optimizer-update kernels, for when a kernel does not run.

A program's first calls run while its Numba kernels load (runtime/warmup.py), and
`gd.config.set_fused_kernels(False)` runs no fused kernel at all. The update ops' numpy
impls (graphdist/ops/optim.py, host_collectives.py) are functional: every intermediate is a
new array and the results are then copied into the variables' storage, which made an
Adam step of the 4-replica MLP 2.8x slower than on the kernels (1.4x on these forms). These forms compute the same float
operations in the same order as the kernels (kernels/sgd.py `_sgd_math`, adam.py
`_adam_math`, reduce_update.py), so they give the kernels' bits, but with ufuncs writing
`out=` into three per-thread scratch chunks and the variables updated in place, one
CHUNK of elements at a time so the scratch stays in cache. Only commutativity is used
(`m * b1` for `b1 * m`), never a change of association.

Each takes the calling convention of its kernel wrapper in kernel_table.py, which lists
them in NUMPY_KERNELS. Numba is never imported here: the point is to run without it.
"""

from __future__ import annotations

import threading

import numpy as np

# elements per pass: host_reduce_update of the 4-replica MLP's Adam, 1.86M parameters, took
# 10.2 ms at 32K (kernel: 3.0 ms), 10.7 at 64K, 15.6 at 8K, 12.1 in whole tensors
CHUNK = 1 << 15

_local = threading.local()    # executors run devices' programs on threads of their own


def _scratch(dtype, n: int) -> tuple:
    """Three scratch arrays of n (<= CHUNK) elements of `dtype`, this thread's own."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    if dtype not in bufs:
        bufs[dtype] = np.empty((3, CHUNK), dtype)
    return tuple(b[:n] for b in bufs[dtype])


def _flat(op_name: str, x) -> np.ndarray:
    """A 1-D view of an array updated in place (a copy would lose the update)."""
    if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
        raise TypeError(f"{op_name}: expected a C-contiguous numpy array to update in place, "
                        f"got {type(x).__name__} {getattr(x, 'shape', '')}")
    return x.reshape(-1)


def _owner(x):
    """The object holding x's memory (numpy points every view at the owning array)."""
    base = getattr(x, "base", None)
    return x if base is None else base


def _chunks(n: int):
    return ((a, min(a + CHUNK, n)) for a in range(0, n, CHUNK))


# ---------------------------------------------------------------- the update math, per chunk
# `kept` holds the chunk of p (and m, v), updated in place; g is read only; s, t scratch


def _sgd_scalars(hyper, dt, nesterov=False) -> tuple:
    values = hyper.tolist()      # [lr, wd] or [lr, momentum, wd], rounded as the kernels do
    lr, momentum, weight_decay = values if len(values) == 3 else (values[0], 0.0, values[1])
    return dt(lr), dt(momentum), dt(weight_decay), bool(nesterov)


def _sgd_chunk(kept, g, s, t, lr, momentum, weight_decay, nesterov) -> None:
    p = kept[0]
    if weight_decay != 0:
        np.multiply(p, weight_decay, out=s)
        g = np.add(g, s, out=s)                  # g + wd * p
    step = g
    if momentum != 0:
        m = kept[1]
        np.multiply(m, momentum, out=m)
        np.add(m, g, out=m)                      # momentum * m + g
        step = m
        if nesterov:
            np.multiply(m, momentum, out=t)
            step = np.add(g, t, out=t)           # g + momentum * m
    np.multiply(step, lr, out=t)
    np.subtract(p, t, out=p)                     # p - lr * step


def _adam_scalars(hyper, dt) -> tuple:
    lr_t, beta_1, beta_2, epsilon, *decay = hyper.tolist()
    return (dt(lr_t), dt(beta_1), dt(1 - beta_1), dt(beta_2), dt(1 - beta_2), dt(epsilon),
            dt(decay[0] if decay else 0.0))


def _adam_chunk(kept, g, s, t, lr_t, b1, c1, b2, c2, epsilon, weight_decay) -> None:
    p, m, v = kept
    if weight_decay != 0:                        # AdamW: p - wd * p, first
        np.multiply(p, weight_decay, out=t)
        np.subtract(p, t, out=p)
    np.multiply(m, b1, out=m)
    np.multiply(g, c1, out=t)
    np.add(m, t, out=m)                          # b1 * m + c1 * g
    np.multiply(v, b2, out=v)
    np.multiply(g, c2, out=t)
    np.multiply(t, g, out=t)
    np.add(v, t, out=v)                          # b2 * v + (c2 * g) * g
    np.sqrt(v, out=s)
    np.add(s, epsilon, out=s)
    np.multiply(m, lr_t, out=t)
    np.divide(t, s, out=t)
    np.subtract(p, t, out=p)                     # p - (lr_t * m) / (sqrt(v) + eps)


# multi-update op -> (arrays kept per tensor besides the gradient, scalars, chunk update)
UPDATES = {
    "sgd_multi_update": (1, _sgd_scalars, _sgd_chunk),
    "sgd_momentum_multi_update": (2, _sgd_scalars, _sgd_chunk),
    "adam_multi_update": (3, _adam_scalars, _adam_chunk),
}


def _multi(update: str, arrays, n: int, params: dict) -> None:
    """Tensor by tensor, chunk by chunk: inputs grouped per tensor (p [m [v]] g), then the
    shared hyper vector, as the multi-tensor kernels take them."""
    kept, scalars_of, chunk = UPDATES[update]
    k = kept + 1
    if n == 0:
        return
    scalars = scalars_of(arrays[n * k], arrays[0].dtype.type, **params)
    written = {id(_owner(x)) for j in range(n) for x in arrays[j * k:j * k + kept]}
    for j in range(n):
        group = arrays[j * k:(j + 1) * k]
        xs = [_flat(update, x) for x in group[:kept]]
        g = np.asarray(group[kept]).reshape(-1)    # a 0-d gradient may be a numpy scalar
        if id(_owner(g)) in written:    # a variable's own read: read it all before writing
            g = g.copy()
        if any(x.size != g.size for x in xs):
            raise ValueError(f"{update}: tensor {j}'s buffers differ in size: "
                             f"{[x.size for x in xs]} and gradient {g.size}")
        s, t, _ = _scratch(g.dtype, min(CHUNK, g.size))
        for a, b in _chunks(g.size):
            chunk([x[a:b] for x in xs], g[a:b], s[:b - a], t[:b - a], *scalars)


# ---------------------------------------------------------------- kernel_table conventions


def sgd(p, g, hyper):
    _multi("sgd_multi_update", (p, g, hyper), 1, {})


def momentum(p, m, g, hyper, *, nesterov):
    _multi("sgd_momentum_multi_update", (p, m, g, hyper), 1, {"nesterov": nesterov})


def adam(p, m, v, g, hyper):
    _multi("adam_multi_update", (p, m, v, g, hyper), 1, {})


def sgd_multi(*arrays, n):
    _multi("sgd_multi_update", arrays, n, {})


def momentum_multi(*arrays, n, nesterov):
    _multi("sgd_momentum_multi_update", arrays, n, {"nesterov": nesterov})


def adam_multi(*arrays, n):
    _multi("adam_multi_update", arrays, n, {})


def reduce_update(*ins, update, reduce, offsets, replicas, n, **params):
    """The all-reduce + every replica's update (host_reduce_update), chunk by chunk as the
    kernel: a chunk of the buckets summed in replica order (then / replicas for a mean),
    then each replica's update of its tensors' chunk from it, with its own hyper vector."""
    from graphdist.ops.host_collectives import update_inputs

    if reduce not in ("sum", "mean"):
        raise ValueError(f"host_reduce_update: expected reduce 'sum' or 'mean', got {reduce!r}")
    bufs, lists, hypers = update_inputs(ins, update, replicas, n)
    kept, scalars_of, chunk = UPDATES[update]
    bufs = [np.asarray(b).reshape(-1) for b in bufs]
    dt = bufs[0].dtype.type
    scalars = [scalars_of(h, dt, **params) for h in hypers]
    for j, offset in enumerate(offsets):
        xs = [[_flat("host_reduce_update", lists[q][k * n + j]) for q in range(kept)]
              for k in range(replicas)]
        size = xs[0][0].size
        if offset + size > bufs[0].size:
            raise ValueError(f"host_reduce_update: tensor {j} lies outside the gradient bucket")
        s, t, g = _scratch(bufs[0].dtype, min(CHUNK, size))
        for a, b in _chunks(size):
            acc = g[:b - a]
            _reduce_chunk(bufs, offset + a, offset + b, reduce == "mean", acc)
            for k in range(replicas):
                chunk([x[a:b] for x in xs[k]], acc, s[:b - a], t[:b - a], *scalars[k])


def _reduce_chunk(bufs, start: int, stop: int, mean: bool, acc) -> None:
    """acc = bufs[0] + bufs[1] + ... over [start, stop), in replica order (/ count)."""
    np.copyto(acc, bufs[0][start:stop])
    for x in bufs[1:]:
        np.add(acc, x[start:stop], out=acc)
    if mean:
        np.divide(acc, acc.dtype.type(len(bufs)), out=acc)
