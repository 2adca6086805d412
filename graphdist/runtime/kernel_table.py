"""Which kernel runs an op on which device kind: the only place that knows.

An op's registry entry (graphdist/ops) says what the op means, with a numpy/CuPy impl that
works on any backend. Where a faster kernel exists for a backend, it is listed here:

- KERNELS[(kind, op)]: the op runs as `kernel(*inputs, **params)` updating the inputs that
  `op.inplace` names in place (optimizer updates, the fused all-reduce + update), or, for a
  collective with several outputs, as `kernel(outs, *inputs, **params)` (NCCL);
- OUT_KERNELS[(kind, op)]: `kernel(out, *inputs, **params)` writing into `out` (or a tuple
  of outputs), in place of the op's generic `out_impl`;
- NUMPY_KERNELS[(kind, op)]: in-place numpy forms of the update kernels, called like them,
  giving their bits; they run where the kernel does not (a first call, fused=False);
- NUMPY_OUT_KERNELS[(kind, op)]: numpy twins of out kernels, likewise, for a first call.

Kernels come from graphdist.kernels (Numba, CPU and CUDA) and are imported only when a
program that uses them is lowered, so `import graphdist` compiles nothing.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from graphdist.ir.types import LOW_PRECISION
from graphdist.runtime import numpy_updates

# ---------------------------------------------------------------- optimizer updates (CPU)
# `hyper` is the update's float64 hyper-parameter vector (kernels/formulas.py's SGDHyper,
# MomentumHyper, AdamHyper): the kernels read it themselves, rounded to the parameters'
# dtype. The kernels take the ops' argument order (p, m, v, g).


def sgd_cpu(p, g, hyper):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, None, g, hyper=hyper)


def sparse_sgd_cpu(p, indices, rows, hyper):
    """p[indices] -= lr * rows in place, whole rows at a time; with weight decay (every row
    decays) the op's dense reference."""
    from graphdist.kernels.formulas import SGDHyper
    from graphdist.kernels.sparse import add_scaled_rows_cpu
    from graphdist.ops.optim import _sparse_sgd_impl
    from graphdist.ops.sparse import check_slices

    named = SGDHyper.decode(hyper)
    if named.weight_decay or p.dtype.kind != "f" or not p.flags.c_contiguous:
        p[...] = _sparse_sgd_impl(np, p, indices, rows, hyper)
        return
    check_slices(np, indices, p.shape[0])
    add_scaled_rows_cpu(p, indices, rows, -p.dtype.type(named.lr))


def momentum_cpu(p, m, g, hyper, *, nesterov):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, m, g, nesterov=nesterov, hyper=hyper)


def adam_cpu(p, m, v, g, hyper):
    from graphdist.kernels.adam import adam_cpu

    adam_cpu(p, m, v, g, hyper=hyper)


# multi-tensor forms: inputs grouped per variable (p0 m0 v0 g0 p1 ...), then the hyper vector

def sgd_multi_cpu(*arrays, n):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:2 * n:2], None, arrays[1:2 * n:2], hyper=arrays[2 * n])


def momentum_multi_cpu(*arrays, n, nesterov):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(*_per_kind(arrays, n, 3), nesterov=nesterov, hyper=arrays[3 * n])


def adam_multi_cpu(*arrays, n):
    from graphdist.kernels.adam import adam_multi_cpu

    adam_multi_cpu(*_per_kind(arrays, n, 4), hyper=arrays[4 * n])


def _per_kind(arrays, n: int, k: int) -> list:
    """The multi-tensor op's inputs (k per variable, then the hyper vector) as k lists: every
    variable's p, every m, ..., every g (the kernels' lists, in the op's order)."""
    return [arrays[i:k * n:k] for i in range(k)]


# ---------------------------------------------------------------- optimizer updates (GPU)
# launched on the stream of the device running the node, in place on the donated buffers;
# the kernels read the hyper vector on the device (no host sync)

def _stream():
    from graphdist.device.gpu import current_numba_stream

    return current_numba_stream()


def sgd_multi_gpu(*arrays, n):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:2 * n:2], None, arrays[1:2 * n:2], stream=_stream(),
                  hyper=arrays[2 * n])


def momentum_multi_gpu(*arrays, n, nesterov):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(*_per_kind(arrays, n, 3), nesterov=nesterov, stream=_stream(),
                  hyper=arrays[3 * n])


def adam_multi_gpu(*arrays, n):
    from graphdist.kernels.adam import adam_multi_gpu

    adam_multi_gpu(*_per_kind(arrays, n, 4), stream=_stream(), hyper=arrays[4 * n])


def sgd_gpu(p, g, hyper):
    sgd_multi_gpu(p, g, hyper, n=1)


def momentum_gpu(p, m, g, hyper, *, nesterov):
    momentum_multi_gpu(p, m, g, hyper, n=1, nesterov=nesterov)


def adam_gpu(p, m, v, g, hyper):
    adam_multi_gpu(p, m, v, g, hyper, n=1)


# ---------------------------------------------------------------- collectives (CPU)

# below this many input bytes a few numpy passes over buffers still in cache beat waking a
# thread team. With OpenMP threads waiting passively and logical CPU devices run as one
# program, the kernel wins from about 1 MiB (4 x 7.1 MiB: 2.0 ms vs 2.9 ms for numpy).
PARALLEL_MIN_BYTES = 1 << 20


def host_all_reduce_cpu(outs, *xs, op):
    """outs[k] = reduce(xs) for every replica k, in one parallel pass (outs[k] may be xs[k])."""
    if sum(x.nbytes for x in xs) < PARALLEL_MIN_BYTES:
        from graphdist.ops import OPS

        OPS["host_all_reduce"].out_impl(np, outs, *xs, op=op)
        return
    import numba

    from graphdist.kernels.reduce import all_reduce_cpu

    # the other replicas wait for this node, so it may use every core, not one worker's share
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        all_reduce_cpu([np.ascontiguousarray(x) for x in xs], op, outs=outs)
    finally:
        numba.set_num_threads(before)


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


def nccl_all_reduce_gpu(outs, *xs, op, devices):
    from graphdist.runtime.gpu_collectives import nccl_all_reduce

    nccl_all_reduce(outs, *xs, op=op, devices=devices)


# ---------------------------------------------------------------- elementwise (CPU)


def where_cpu(out, c, x, y):
    """One pass over cond, x and y where the shapes allow; else numpy's two masked copies.
    Never given an aliased `out`: the one-pass select vectorizes only on distinct buffers."""
    from graphdist.kernels.select import select_cpu

    if select_cpu(c, x, y, out):
        return
    np.copyto(out, y, where=np.logical_not(c))
    np.copyto(out, x, where=c)


def relu_grad_cpu(out, ct, y):
    """One parallel pass (numpy: a comparison into a bool array, then a masked copy)."""
    from graphdist.kernels.relu import relu_grad_cpu

    if not relu_grad_cpu(ct, y, out):
        from graphdist.ops import OPS

        OPS["relu_grad"].out_impl(np, out, ct, y)


def max_pool2d_cpu(y, x, *, ksize, strides, padding):
    """One parallel pass over the windows (numpy: one strided maximum per window tap)."""
    from graphdist.kernels.pool import max_pool_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d", x.shape[1:3], ksize, strides, (1, 1), padding, "")
    max_pool_cpu(x, y, ksize, strides, (pads[0][0], pads[1][0]))


def max_pool2d_grad_cpu(dx, x, y, dy, *, ksize, strides, padding):
    """TF's MaxPoolGrad in one parallel pass (numpy's per-tap masks are ~16x slower)."""
    from graphdist.kernels.pool import max_pool_grad_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d_grad", x.shape[1:3], ksize, strides, (1, 1), padding,
                              "")
    max_pool_grad_cpu(x, y, dy, dx, ksize, strides, (pads[0][0], pads[1][0]))


def conv2d_backprop_input_cpu(dx, dy, f, **params):
    """One GEMM into columns per chunk of images, then a parallel Numba col2im (numpy: a
    strided add over dx per window tap, same bits)."""
    from graphdist.kernels.conv import col2im_cpu
    from graphdist.ops.conv import input_grad_by_columns

    input_grad_by_columns(np, dx, dy, f, col2im=col2im_cpu, **params)


# ---------------------------------------------------------------- row-sparse values (CPU)


def scatter_rows_cpu(out, indices, rows, *, shape):
    """Whole rows at a time (np.add.at goes element by element, ~20x slower)."""
    from graphdist.kernels.sparse import scatter_rows_cpu
    from graphdist.ops.sparse import check_slices

    check_slices(np, indices, shape[0])
    scatter_rows_cpu(out, indices, rows)


def sum_duplicates_cpu(outs, indices, rows, *, divisor=1, table_rows=None):
    """One pass with a slot table (numpy: a sort and np.add.at, ~10x slower)."""
    from graphdist.kernels.sparse import sum_duplicates_cpu
    from graphdist.ops.sparse import check_slices

    check_slices(np, indices, table_rows)
    sum_duplicates_cpu(outs, indices, rows, divisor)


# ---------------------------------------------------------------- transformer blocks (CPU)


def _gelu_forms(module: str) -> tuple:
    """gelu and gelu_grad through `module`'s exact forms: kernels/gelu.py's Numba kernels
    (float32 with a vectorized rational erf, 0.2 ms for 32x64x512 on 2 cores; float64 with
    the C library's erfc, 5 ms; numpy's reference, erfc from array passes: 62 ms) or
    kernels/gelu_numpy.py's twins, which give their bits with nothing to load. The tanh
    form, and operands they refuse, run the op's numpy impl (6 ms against 8 ms)."""
    def gelu(out, x, *, approximate):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if approximate or not forms.gelu_cpu(x, out):
            _op("gelu").out_impl(np, out, x, approximate=approximate)

    def gelu_grad(out, ct, x, *, approximate):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if approximate or not forms.gelu_grad_cpu(ct, x, out):
            _op("gelu_grad").out_impl(np, out, ct, x, approximate=approximate)

    return gelu, gelu_grad


def _op(name: str):
    from graphdist.ops import OPS

    return OPS[name]


gelu_cpu, gelu_grad_cpu = _gelu_forms("gelu")
gelu_numpy, gelu_grad_numpy = _gelu_forms("gelu_numpy")


def layer_norm_cpu(out, x, *affine, naxes, epsilon, scale, center):
    """One parallel pass over the rows (numpy's reference: about ten array passes)."""
    from graphdist.kernels.layer_norm import layer_norm_cpu
    from graphdist.ops import OPS

    gamma, beta = affine[0] if scale else None, affine[-1] if center else None
    if not layer_norm_cpu(x, gamma, beta, epsilon, naxes, out):
        out[...] = OPS["layer_norm"].impl(np, x, *affine, naxes=naxes, epsilon=epsilon,
                                          scale=scale, center=center)


def layer_norm_grad_cpu(outs, ct, x, *gamma, naxes, epsilon, scale, center):
    """dx, and dgamma and dbeta as per-row-block partial sums, in one pass over the rows."""
    from graphdist.kernels.layer_norm import layer_norm_grad_cpu
    from graphdist.ops import OPS

    outs = outs if isinstance(outs, tuple) else (outs,)      # dx alone: one buffer
    dx, *rest = outs
    dgamma = rest.pop(0) if scale else None
    dbeta = rest.pop(0) if center else None
    if not layer_norm_grad_cpu(ct, x, gamma[0] if scale else None, epsilon, naxes, dx, dgamma,
                               dbeta):
        made = OPS["layer_norm_grad"].impl(np, ct, x, *gamma, naxes=naxes, epsilon=epsilon,
                                           scale=scale, center=center)
        for out, value in zip(outs, made):
            out[...] = value


def _softmax_forms(module: str) -> tuple:
    """softmax and softmax_grad through `module`: kernels/softmax.py's row-wise Numba
    kernels (numpy's reference: five to eight array passes) or kernels/softmax_numpy.py's
    twins with their bits; operands they refuse run the op's numpy impl."""
    def softmax(out, x, *mask):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if not forms.softmax_cpu(x, mask[0] if mask else None, out):
            out[...] = _op("softmax").impl(np, x, *mask)

    def softmax_grad(out, g, y):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if not forms.softmax_grad_cpu(g, y, out):
            out[...] = _op("softmax_grad").impl(np, g, y)

    return softmax, softmax_grad


softmax_cpu, softmax_grad_cpu = _softmax_forms("softmax")
softmax_numpy, softmax_grad_numpy = _softmax_forms("softmax_numpy")


# ---------------------------------------------------------------- the tables


def _compiled_dtypes(types) -> bool:
    # the Numba kernels compile for float32/float64 (and ints, bool): float16 and bfloat16
    # operands take the op's generic numpy impl
    return not any(t.dtype in LOW_PRECISION for t in types)


def kernel(backend, op, types=(), deferred=False, fused=True):
    """The kernel that runs `op` on `backend`'s device kind, if one is listed for operands of
    these types (ArrayTypes of the inputs and outputs). deferred=True (a program's first
    calls, runtime/warmup.py) for an op whose numpy form gives the kernel's bits, or
    fused=False for an in-place update: its in-place numpy form if NUMPY_KERNELS has one
    (same calling convention), else None (the op's generic impl)."""
    if not _compiled_dtypes(types):
        return None
    if deferred and op.name in EXACT_FALLBACK or not fused and op.inplace:
        return NUMPY_KERNELS.get((backend.kind, op.name))
    return KERNELS.get((backend.kind, op.name))


def out_kernel(backend, op, types=(), fused=True, deferred=False):
    """The OUT_KERNELS entry for `op` on `backend`'s device kind and these operand types, if
    any. fused=False (gd.config.set_fused_kernels(False)) passes over the kernels of all but
    collectives (whose CPU lowering the kernel is): every op then runs its numpy form.
    deferred=True passes over those with an exact numpy form, collectives included, to
    their NUMPY_OUT_KERNELS twin if one is listed (else None: the op's generic out_impl)."""
    if not (fused or op.collective) or not _compiled_dtypes(types):
        return None
    if deferred and op.name in EXACT_FALLBACK:
        return NUMPY_OUT_KERNELS.get((backend.kind, op.name))
    return OUT_KERNELS.get((backend.kind, op.name))


def out_impl(backend, op, types=(), fused=True, deferred=False):
    """`fn(out, *inputs, **params)` writing `op`'s result into `out`: a kernel listed for the
    backend's device kind (and these operand types), else the op's generic out_impl on the
    backend's array module."""
    fn = out_kernel(backend, op, types, fused, deferred)
    if fn is None and op.out_impl is not None:
        fn = functools.partial(op.out_impl, backend.xp)
    return fn


KERNELS = {
    ("cpu", "sgd_update"): sgd_cpu,
    ("cpu", "sparse_sgd_update"): sparse_sgd_cpu,
    ("cpu", "sgd_momentum_update"): momentum_cpu,
    ("cpu", "adam_update"): adam_cpu,
    ("cpu", "sgd_multi_update"): sgd_multi_cpu,
    ("cpu", "sgd_momentum_multi_update"): momentum_multi_cpu,
    ("cpu", "adam_multi_update"): adam_multi_cpu,
    ("cpu", "host_reduce_update"): reduce_update_cpu,
    ("gpu", "sgd_update"): sgd_gpu,
    ("gpu", "sgd_momentum_update"): momentum_gpu,
    ("gpu", "adam_update"): adam_gpu,
    ("gpu", "sgd_multi_update"): sgd_multi_gpu,
    ("gpu", "sgd_momentum_multi_update"): momentum_multi_gpu,
    ("gpu", "adam_multi_update"): adam_multi_gpu,
    ("gpu", "nccl_all_reduce"): nccl_all_reduce_gpu,
}

# In-place numpy forms of the CPU update kernels (runtime/numpy_updates.py): the same bits,
# with the kernels' calling conventions, where those kernels do not run (deferred or unfused).
# Only numpy: nothing for the warm-up to load.
NUMPY_KERNELS = {
    ("cpu", "sgd_update"): numpy_updates.sgd,
    ("cpu", "sgd_momentum_update"): numpy_updates.momentum,
    ("cpu", "adam_update"): numpy_updates.adam,
    ("cpu", "sgd_multi_update"): numpy_updates.sgd_multi,
    ("cpu", "sgd_momentum_multi_update"): numpy_updates.momentum_multi,
    ("cpu", "adam_multi_update"): numpy_updates.adam_multi,
    ("cpu", "host_reduce_update"): numpy_updates.reduce_update,
}

OUT_KERNELS = {
    ("cpu", "host_all_reduce"): host_all_reduce_cpu,
    ("cpu", "where"): where_cpu,
    ("cpu", "relu_grad"): relu_grad_cpu,
    ("cpu", "max_pool2d"): max_pool2d_cpu,
    ("cpu", "max_pool2d_grad"): max_pool2d_grad_cpu,
    ("cpu", "conv2d_backprop_input"): conv2d_backprop_input_cpu,
    ("cpu", "gelu"): gelu_cpu,
    ("cpu", "gelu_grad"): gelu_grad_cpu,
    ("cpu", "layer_norm"): layer_norm_cpu,
    ("cpu", "layer_norm_grad"): layer_norm_grad_cpu,
    ("cpu", "softmax"): softmax_cpu,
    ("cpu", "softmax_grad"): softmax_grad_cpu,
    ("cpu", "scatter_rows"): scatter_rows_cpu,
    ("cpu", "sum_duplicates"): sum_duplicates_cpu,
}

# numpy twins of out kernels whose op's generic out_impl is an independent reference (gelu's:
# Cody's float64 erfc; softmax's: numpy's pairwise sums) rather than the kernel's math: called like the kernels, giving their
# bits, where those kernels do not run yet (deferred). Only numpy: nothing to load.
NUMPY_OUT_KERNELS = {
    ("cpu", "gelu"): gelu_numpy,
    ("cpu", "gelu_grad"): gelu_grad_numpy,
    ("cpu", "softmax"): softmax_numpy,
    ("cpu", "softmax_grad"): softmax_grad_numpy,
}

# The ops whose numpy form (their NUMPY_KERNELS / NUMPY_OUT_KERNELS twin, else their generic
# impl) computes the same float operations in the same order as their CPU kernel, so either
# gives the same bits (tests/test_warmup.py checks each on whole training steps). Not here:
# layer_norm (the kernel sums with fastmath reassoc, in LLVM's order): it loads before a
# first call.
EXACT_FALLBACK = frozenset({
    "sgd_update", "sparse_sgd_update", "sgd_momentum_update", "adam_update",
    "sgd_multi_update", "sgd_momentum_multi_update", "adam_multi_update",
    "host_reduce_update", "host_all_reduce", "where", "relu_grad", "max_pool2d",
    "max_pool2d_grad", "conv2d_backprop_input", "scatter_rows", "sum_duplicates",
    "gelu", "gelu_grad", "softmax", "softmax_grad",
})
