"""Kernel adapters of the collectives: the host all-reduce and the fused all-reduce +
optimizer update (kernels/reduce.py, kernels/reduce_update.py) on the CPU, NCCL on GPUs
(runtime/gpu_collectives.py). A collective's kernel is its CPU lowering: it runs with fused
kernels off too (runtime/kernel_table.py)."""

from __future__ import annotations

import contextlib

import numpy as np

from graphdist.device.gpu import CUDA_KERNELS
from graphdist.runtime import numpy_updates
from graphdist.runtime.adapters.registry import OP_IMPL, register_kernel

# below this many input bytes a few numpy passes over buffers still in cache beat waking a
# thread team. With OpenMP threads waiting passively and logical CPU devices run as one
# program, the kernel wins from about 1 MiB (4 x 7.1 MiB: 2.0 ms vs 2.9 ms for numpy).
PARALLEL_MIN_BYTES = 1 << 20


@register_kernel("host_all_reduce", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def host_all_reduce_cpu(outs, *xs, op):
    """outs[k] = reduce(xs) for every replica k, in one parallel pass (outs[k] may be xs[k])."""
    if sum(x.nbytes for x in xs) < PARALLEL_MIN_BYTES:
        from graphdist.ops.host_collectives import host_all_reduce_p

        host_all_reduce_p.out_impl(np, outs, *xs, op=op)
        return
    from graphdist.kernels.reduce import all_reduce_cpu

    with every_core():
        all_reduce_cpu([np.ascontiguousarray(x) for x in xs], op, outs=outs)


@contextlib.contextmanager
def every_core():
    """The other replicas wait for a collective node (with a thread per device it runs in
    the first device's), so its kernel may use every core, not one worker's share (also
    a decorator)."""
    from graphdist.kernels.common import want_numba_threads

    before = want_numba_threads(None)
    try:
        yield
    finally:
        want_numba_threads(before)


@register_kernel("host_reduce_update", kind="cpu", numpy=numpy_updates.reduce_update,
                 exact=True)
@every_core()
def reduce_update_cpu(*ins, update, reduce, offsets, replicas, n, **params):
    """The fused all-reduce + every replica's optimizer update (updated in place)."""
    from graphdist.kernels.formulas import AdamHyper, MomentumHyper, SGDHyper
    from graphdist.kernels.reduce_update import reduce_adam_cpu, reduce_sgd_cpu
    from graphdist.ops.host_collectives import update_inputs

    bufs, lists, hypers = update_inputs(ins, update, replicas, n)
    # every replica's hyper vector holds the same numbers (made from mirrored variables by
    # the same ops): replica 0's serve all, but Adam's rate is taken per replica as before
    if update == "adam_multi_update":
        rates = [AdamHyper.decode(h).lr_t for h in hypers]
        h = AdamHyper.decode(hypers[0])
        reduce_adam_cpu(bufs, offsets, *lists, rates, reduce, h.beta_1, h.beta_2, h.epsilon,
                        h.weight_decay_lr or 0.0)
    elif update == "sgd_momentum_multi_update":
        h = MomentumHyper.decode(hypers[0])
        reduce_sgd_cpu(bufs, offsets, lists[0], lists[1], reduce, h.lr, h.momentum,
                       params["nesterov"], h.weight_decay)
    else:
        h = SGDHyper.decode(hypers[0])
        reduce_sgd_cpu(bufs, offsets, lists[0], None, reduce, h.lr, 0.0, False, h.weight_decay)


@register_kernel("nccl_all_reduce", kind=CUDA_KERNELS)
def nccl_all_reduce_gpu(outs, *xs, op, devices):
    from graphdist.runtime.gpu_collectives import nccl_all_reduce

    nccl_all_reduce(outs, *xs, op=op, devices=devices)


@register_kernel("host_reduce_scatter_update_all_gather", kind="cpu",
                 numpy=numpy_updates.sharded_update, exact=True)
@every_core()
def sharded_update_cpu(*ins, update, reduce, replicas, width, offsets, lengths, n, variables,
                       members, **params):
    """The fused reduce-scatter + each replica's update of its shard + all-gather of the
    parameters (zero_stage > 0; updated in place)."""
    from graphdist.kernels.formulas import AdamHyper, MomentumHyper, SGDHyper
    from graphdist.kernels.sharded_update import sharded_adam_cpu, sharded_sgd_cpu
    from graphdist.ops.zero_collectives import kernel_inputs

    bufs, lists, hypers = kernel_inputs(ins, dict(update=update, replicas=replicas, n=n))
    layout = (bufs, width, offsets, lengths)
    if update == "adam_multi_update":
        h = AdamHyper.decode(hypers[0])
        sharded_adam_cpu(*layout, *lists, [AdamHyper.decode(x).lr_t for x in hypers], reduce,
                         h.beta_1, h.beta_2, h.epsilon, h.weight_decay_lr or 0.0)
    elif update == "sgd_momentum_multi_update":
        h = MomentumHyper.decode(hypers[0])
        sharded_sgd_cpu(*layout, lists[0], lists[1], reduce, h.lr, h.momentum,
                        params["nesterov"], h.weight_decay)
    else:
        h = SGDHyper.decode(hypers[0])
        sharded_sgd_cpu(*layout, lists[0], None, reduce, h.lr, 0.0, False, h.weight_decay)
