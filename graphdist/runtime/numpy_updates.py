"""In-place numpy forms of the CPU optimizer-update kernels, for when a kernel does not run.

A program's first calls run while its Numba kernels load (runtime/warmup.py), and
`gd.config.set_fused_kernels(False)` runs no fused kernel at all. The update ops' numpy
impls (graphdist/ops/optim.py, host_collectives.py) are functional: every intermediate is a
new array and the results are then copied into the variables' storage, which made an
Adam step of the 4-replica MLP 2.8x slower than on the kernels (1.4x on these forms). These
forms run the kernels' own formulas (kernels/formulas.py) as `chunk_program`s: the same float
operations in the same order, so the kernels' bits, but as ufuncs writing `out=` into the
variables (updated in place) and per-thread scratch chunks, one CHUNK of elements at a time
so the scratch stays in cache.

Each takes the calling convention of its kernel adapter in runtime/adapters/, whose
registry entry names it as the kernel's exact numpy twin. Numba is never imported here: the point is to run without it.
"""

from __future__ import annotations

import threading

import numpy as np

from graphdist.kernels import formulas

# elements per pass: host_reduce_update of the 4-replica MLP's Adam, 1.86M parameters, took
# 10.2 ms at 32K (kernel: 3.0 ms), 10.7 at 64K, 15.6 at 8K, 12.1 in whole tensors
CHUNK = 1 << 15

_local = threading.local()    # executors run devices' programs on threads of their own


SCRATCH = 2      # scratch arrays an update program may use (the formulas need 2)


def _scratch(dtype, n: int) -> tuple:
    """Three scratch arrays of n (<= CHUNK) elements of `dtype`, this thread's own: the
    update programs use two, the fused all-reduce's sum the third."""
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
# multi-update op -> (its formula's array layout: "k" kept and updated in place, "r" read,
# "-" absent; the formula; its scalars from the hyper vector)
UPDATES = {
    "sgd_multi_update": ("k-r", formulas.sgd, formulas.sgd_scalars),
    "sgd_momentum_multi_update": ("kkr", formulas.sgd, formulas.sgd_scalars),
    "adam_multi_update": ("kkkr", formulas.adam, formulas.adam_scalars),
}


def _program(update: str, hyper, like, params: dict) -> tuple:
    """(the chunk program, its scalars) of one update's hyper vector;
    `like`, an array of the update's dtype, sets the scalars' rounding (as the kernels)."""
    layout, formula, scalars_of = UPDATES[update]
    scalars = scalars_of(hyper.tolist(), like)
    static = (bool(params.get("nesterov", False)),) if formula is formulas.sgd else ()
    program = formulas.chunk_program(formula, layout, scalars, static)
    if program.scratch > SCRATCH:
        raise ValueError(f"{update}: its formula needs {program.scratch} scratch arrays, "
                         f"numpy_updates keeps {SCRATCH}")
    return program, scalars


def _multi(update: str, arrays, n: int, params: dict) -> None:
    """Tensor by tensor, chunk by chunk: inputs grouped per tensor (p [m [v]] g), then the
    shared hyper vector, as the multi-tensor kernels take them."""
    if n == 0:
        return
    kept = UPDATES[update][0].count("k")
    k = kept + 1
    program, scalars = _program(update, arrays[n * k], arrays[0], params)
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
        scratch = _scratch(g.dtype, min(CHUNK, g.size))
        for a, b in _chunks(g.size):
            program([x[a:b] for x in xs], (g[a:b],), [x[:b - a] for x in scratch], scalars)


# ---------------------------------------------------------------- the adapters' conventions


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
    bufs = [np.asarray(b).reshape(-1) for b in bufs]
    programs = [_program(update, h, bufs[0], params) for h in hypers]
    kept = UPDATES[update][0].count("k")
    for j, offset in enumerate(offsets):
        xs = [[_flat("host_reduce_update", lists[q][k * n + j]) for q in range(kept)]
              for k in range(replicas)]
        size = xs[0][0].size
        if offset + size > bufs[0].size:
            raise ValueError(f"host_reduce_update: tensor {j} lies outside the gradient bucket")
        *scratch, acc = _scratch(bufs[0].dtype, min(CHUNK, size))
        for a, b in _chunks(size):
            _reduce_chunk(bufs, offset + a, offset + b, reduce == "mean", acc[:b - a])
            for k, (program, scalars) in enumerate(programs):
                program([x[a:b] for x in xs[k]], (acc[:b - a],), [x[:b - a] for x in scratch],
                        scalars)


def _reduce_chunk(bufs, start: int, stop: int, mean: bool, acc) -> None:
    """acc = bufs[0] + bufs[1] + ... over [start, stop), in replica order (/ count)."""
    np.copyto(acc, bufs[0][start:stop])
    for x in bufs[1:]:
        np.add(acc, x[start:stop], out=acc)
    if mean:
        np.divide(acc, acc.dtype.type(len(bufs)), out=acc)


def sharded_update(*ins, update, reduce, replicas, width, offsets, lengths, n, variables=(),
                   members=(), **params):
    """The reduce-scatter + each replica's update of its shard + the all-gather
    (host_reduce_scatter_update_all_gather), chunk by chunk as the kernel: member j's chunk
    r summed in replica order (/ replicas for a mean), replica r's parameter chunk (zeros
    past its size) and slot shards updated with its own hyper vector, and the new values
    written into every replica's parameter."""
    from graphdist.ops.zero_collectives import kernel_inputs

    params = dict(params, update=update, replicas=replicas, n=n)
    if reduce not in ("sum", "mean"):
        raise ValueError(f"{update}: expected reduce 'sum' or 'mean', got {reduce!r}")
    bufs, lists, hypers = kernel_inputs(ins, params)
    bufs = [np.asarray(b).reshape(-1) for b in bufs]
    programs = [_program(update, h, bufs[0], params) for h in hypers]
    kept = len(lists)
    for j, (offset, length) in enumerate(zip(offsets, lengths)):
        for r in range(replicas):
            ps = [_flat("host_sharded_update", lists[0][k * n + j]) for k in range(replicas)]
            slots = [_flat("host_sharded_update", lists[q][r * n + j]) for q in range(1, kept)]
            size = ps[r].size
            *scratch, acc = _scratch(bufs[0].dtype, min(CHUNK, length))
            p = np.empty(min(CHUNK, length), bufs[0].dtype)
            for a, b in _chunks(length):
                at = r * width + offset
                _reduce_chunk(bufs, at + a, at + b, reduce == "mean", acc[:b - a])
                lo, hi = min(r * length + a, size), min(r * length + b, size)
                p[:hi - lo] = ps[r][lo:hi]
                p[hi - lo:b - a] = 0
                program, scalars = programs[r]
                program([p[:b - a], *(s[a:b] for s in slots)], (acc[:b - a],),
                        [x[:b - a] for x in scratch], scalars)
                for k in range(replicas):
                    ps[k][lo:hi] = p[:hi - lo]
