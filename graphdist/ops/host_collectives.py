"""Fused host collectives: one placed node that reads every replica's host buffer and writes
every replica's result in one parallel pass (the CPU counterpart of an NCCL node). Made by
`HostAllReduce` when it lowers an all_reduce, never by user code; the Numba kernel is compiled
on first use, so importing this module does not import numba.
"""

from __future__ import annotations

from graphdist.ops.collectives import reduce_types
from graphdist.ops.core import Op

# below this many input bytes a few numpy passes over buffers still in cache beat waking a
# thread team. With OpenMP threads waiting passively and logical CPU devices run as one
# program, the kernel wins from about 1 MiB (4 x 7.1 MiB: 2.0 ms vs 2.9 ms for numpy).
PARALLEL_MIN_BYTES = 1 << 20

# inputs: one flat buffer per replica (each on its device); outputs: one result per replica,
# each a Var on its replica's device, all written by the eqn's device.
host_all_reduce_p = Op("host_all_reduce", collective=True, num_outputs=None,
                       differentiable=False)


host_all_reduce_p.def_shape(lambda *xs, op: reduce_types("host_all_reduce", xs, op))


@host_all_reduce_p.def_impl
def _host_all_reduce_impl(xp, *xs, op):   # xs: n x (size,)
    acc = xs[0].copy()
    for x in xs[1:]:                      # replica order, as the kernel adds
        acc += x
    if op == "mean":
        acc /= acc.dtype.type(len(xs))
    return tuple(acc.copy() for _ in xs)  # every replica owns its result


@host_all_reduce_p.def_out(may_alias=True)   # outs[k] may be xs[k]: chunk-wise in place
def _host_all_reduce_out(xp, outs, *xs, op):   # outs: n x (size,), one per replica
    if xp.__name__ != "numpy" or sum(x.nbytes for x in xs) < PARALLEL_MIN_BYTES:
        acc = outs[0]                           # a few passes over buffers still in cache
        xp.copyto(acc, xs[0])
        for x in xs[1:]:
            xp.add(acc, x, out=acc)
        if op == "mean":
            xp.divide(acc, acc.dtype.type(len(xs)), out=acc)
        for out in outs[1:]:
            xp.copyto(out, acc)
        return
    import numba

    from graphdist.kernels.reduce import all_reduce_cpu

    # the other replicas wait for this node, so it may use every core, not one worker's share
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        all_reduce_cpu([xp.ascontiguousarray(x) for x in xs], op, outs=outs)
    finally:
        numba.set_num_threads(before)


host_all_reduce_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                   2 * sum(t.nbytes for t in ins)))


def host_all_reduce_ref(xs, op: str = "sum"):
    """The spec the kernel matches: the sum (or mean) of `xs` added in list order, one copy
    per input.

    >>> import numpy as np; host_all_reduce_ref([np.ones(2), np.ones(2)])[1]
    array([2., 2.])
    """
    import numpy as np

    return _host_all_reduce_impl(np, *xs, op=op)
