"""Which kernel runs an op on which device kind: the only place that knows.

An op's registry entry (graphdist/ops) says what the op means, with a numpy/CuPy impl that
works on any backend. Where a faster kernel exists for a backend, it is listed here:

- KERNELS[(kind, op)]: the op runs as `kernel(*inputs, **params)` updating the inputs that
  `op.inplace` names in place (optimizer updates, the fused all-reduce + update), or, for a
  collective with several outputs, as `kernel(outs, *inputs, **params)` (NCCL);
- OUT_KERNELS[(kind, op)]: `kernel(out, *inputs, **params)` writing into `out` (or a tuple
  of outputs), in place of the op's generic `out_impl`.

Kernels come from graphdist.kernels (Numba, CPU and CUDA) and are imported only when a
program that uses them is lowered, so `import graphdist` compiles nothing.
"""

from __future__ import annotations

import functools

import numpy as np

# ---------------------------------------------------------------- optimizer updates (CPU)


def sgd_cpu(p, g, *, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, g, None, lr, 0.0, False, weight_decay)


def momentum_cpu(p, m, g, *, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, g, m, lr, momentum, nesterov, weight_decay)


def adam_cpu(p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_cpu

    adam_cpu(p, g, m, v, lr_t, beta_1, beta_2, epsilon, lr * weight_decay)


# multi-tensor forms: inputs grouped per variable (p0 m0 v0 g0 p1 ...), then shared scalars

def sgd_multi_cpu(*arrays, n, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:2 * n:2], arrays[1:2 * n:2], None, lr, 0.0, False, weight_decay)


def momentum_multi_cpu(*arrays, n, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:3 * n:3], arrays[2:3 * n:3], arrays[1:3 * n:3], lr, momentum,
                  nesterov, weight_decay)


def adam_multi_cpu(*arrays, n, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_multi_cpu

    adam_multi_cpu(arrays[0:4 * n:4], arrays[3:4 * n:4], arrays[1:4 * n:4], arrays[2:4 * n:4],
                   arrays[4 * n], beta_1, beta_2, epsilon, lr * weight_decay)


# ---------------------------------------------------------------- optimizer updates (GPU)
# launched on the stream of the device running the node, in place on the donated buffers

def _stream():
    from graphdist.device.gpu import current_numba_stream

    return current_numba_stream()


def sgd_multi_gpu(*arrays, n, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:2 * n:2], arrays[1:2 * n:2], None, lr, 0.0, False, weight_decay,
                  stream=_stream())


def momentum_multi_gpu(*arrays, n, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:3 * n:3], arrays[2:3 * n:3], arrays[1:3 * n:3], lr, momentum,
                  nesterov, weight_decay, stream=_stream())


def adam_multi_gpu(*arrays, n, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_multi_gpu

    adam_multi_gpu(arrays[0:4 * n:4], arrays[3:4 * n:4], arrays[1:4 * n:4], arrays[2:4 * n:4],
                   arrays[4 * n], beta_1, beta_2, epsilon, lr * weight_decay, stream=_stream())


def sgd_gpu(p, g, *, lr, weight_decay):
    sgd_multi_gpu(p, g, n=1, lr=lr, weight_decay=weight_decay)


def momentum_gpu(p, m, g, *, lr, momentum, nesterov, weight_decay):
    momentum_multi_gpu(p, m, g, n=1, lr=lr, momentum=momentum, nesterov=nesterov,
                       weight_decay=weight_decay)


def adam_gpu(p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    adam_multi_gpu(p, m, v, g, lr_t, n=1, lr=lr, beta_1=beta_1, beta_2=beta_2,
                   epsilon=epsilon, weight_decay=weight_decay)


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


def reduce_update_cpu(*ins, update, reduce, offsets, replicas, n, **hyper):
    """The fused all-reduce + every replica's optimizer update (updated in place)."""
    from graphdist.kernels.reduce_update import reduce_adam_cpu, reduce_sgd_cpu
    from graphdist.ops.host_collectives import update_inputs

    bufs, lists, rates = update_inputs(ins, update, replicas, n)
    if update == "adam_multi_update":
        reduce_adam_cpu(bufs, offsets, *lists, rates, reduce, hyper["beta_1"], hyper["beta_2"],
                        hyper["epsilon"], hyper["lr"] * hyper["weight_decay"])
    elif update == "sgd_momentum_multi_update":
        reduce_sgd_cpu(bufs, offsets, lists[0], lists[1], reduce, hyper["lr"], hyper["momentum"],
                       hyper["nesterov"], hyper["weight_decay"])
    else:
        reduce_sgd_cpu(bufs, offsets, lists[0], None, reduce, hyper["lr"], 0.0, False,
                       hyper["weight_decay"])


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


# ---------------------------------------------------------------- the tables


def kernel(backend, op):
    """The kernel that runs `op` on `backend`'s device kind, if one is listed."""
    return KERNELS.get((backend.kind, op.name))


def out_impl(backend, op):
    """`fn(out, *inputs, **params)` writing `op`'s result into `out`: a kernel listed for the
    backend's device kind, else the op's generic out_impl on the backend's array module."""
    fn = OUT_KERNELS.get((backend.kind, op.name))
    if fn is None and op.out_impl is not None:
        fn = functools.partial(op.out_impl, backend.xp)
    return fn


KERNELS = {
    ("cpu", "sgd_update"): sgd_cpu,
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

OUT_KERNELS = {
    ("cpu", "host_all_reduce"): host_all_reduce_cpu,
    ("cpu", "where"): where_cpu,
    ("cpu", "relu_grad"): relu_grad_cpu,
    ("cpu", "max_pool2d"): max_pool2d_cpu,
    ("cpu", "max_pool2d_grad"): max_pool2d_grad_cpu,
}
