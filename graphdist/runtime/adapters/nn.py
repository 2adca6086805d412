"""Kernel adapters of the network ops on the CPU: elementwise (where, relu's gradient),
pooling, the convolution's input gradient and the transformer blocks (gelu, layer_norm,
softmax). Each falls back to the op's numpy impl for operands its kernel refuses."""

from __future__ import annotations

import functools
import importlib

import numpy as np

from graphdist.runtime.adapters.registry import OP_IMPL, register_kernel


def _op(name: str):
    from graphdist.ops import OPS

    return OPS[name]


# ---------------------------------------------------------------- elementwise


@register_kernel("where", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def where_cpu(out, c, x, y):
    """One pass over cond, x and y where the shapes allow; else numpy's two masked copies.
    Never given an aliased `out`: the one-pass select vectorizes only on distinct buffers."""
    from graphdist.kernels.select import select_cpu

    if select_cpu(c, x, y, out):
        return
    np.copyto(out, y, where=np.logical_not(c))
    np.copyto(out, x, where=c)


@register_kernel("relu_grad", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def relu_grad_cpu(out, ct, y):
    """One parallel pass (numpy: a comparison into a bool array, then a masked copy)."""
    from graphdist.kernels.relu import relu_grad_cpu

    if not relu_grad_cpu(ct, y, out):
        _op("relu_grad").out_impl(np, out, ct, y)


# ---------------------------------------------------------------- pooling, convolution


@register_kernel("max_pool2d", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def max_pool2d_cpu(y, x, *, ksize, strides, padding):
    """One parallel pass over the windows (numpy: one strided maximum per window tap)."""
    from graphdist.kernels.pool import max_pool_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d", x.shape[1:3], ksize, strides, (1, 1), padding, "")
    max_pool_cpu(x, y, ksize, strides, (pads[0][0], pads[1][0]))


@register_kernel("max_pool2d_grad", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def max_pool2d_grad_cpu(dx, x, y, dy, *, ksize, strides, padding):
    """TF's MaxPoolGrad in one parallel pass (numpy's per-tap masks are ~16x slower)."""
    from graphdist.kernels.pool import max_pool_grad_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d_grad", x.shape[1:3], ksize, strides, (1, 1), padding,
                              "")
    max_pool_grad_cpu(x, y, dy, dx, ksize, strides, (pads[0][0], pads[1][0]))


@register_kernel("max_pool2d_argmax", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def max_pool2d_argmax_cpu(outs, x, *, ksize, strides, padding):
    """max_pool2d and each window's first max as its tap index, in one parallel pass."""
    from graphdist.kernels.pool import max_pool_argmax_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d_argmax", x.shape[1:3], ksize, strides, (1, 1),
                              padding, "")
    max_pool_argmax_cpu(x, *outs, ksize, strides, (pads[0][0], pads[1][0]))


@register_kernel("max_pool2d_grad_argmax", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def max_pool2d_grad_argmax_cpu(dx, idx, dy, *, input_size, ksize, strides, padding):
    """max_pool2d_grad routed by the forward pass's indices: one parallel pass writing dx
    (0.69 against 2.1 ms from the pool's input and output, tutorial CNN's first layer)."""
    from graphdist.kernels.pool import max_pool_grad_argmax_cpu
    from graphdist.ops.window import window_geometry

    _, pads = window_geometry("max_pool2d_grad_argmax", tuple(input_size), ksize, strides,
                              (1, 1), padding, "")
    max_pool_grad_argmax_cpu(idx, dy, dx, ksize, strides, (pads[0][0], pads[1][0]))


def _input_grad_split(dx, dy, f, col2im, params) -> None:
    """conv2d_backprop_input into dx with the batch split over the cores where the caller
    has them all (device/threads.py split_batch); the kernel and its twin split alike, so
    they give the same bits (a split moves the GEMMs' row blocks: its bits are its own)."""
    from graphdist.device.threads import split_batch
    from graphdist.ops.conv import input_grad_by_columns

    split_batch(dy.shape[0], lambda part: input_grad_by_columns(
        np, dx[part], dy[part], f, col2im=col2im, **params), dx.nbytes)


def _input_grad_numpy(dx, dy, f, **params):
    from graphdist.ops.conv import col2im_numpy

    _input_grad_split(dx, dy, f, functools.partial(col2im_numpy, np), params)


@register_kernel("conv2d_backprop_input", kind="cpu", out=True, numpy=_input_grad_numpy,
                 exact=True)
def conv2d_backprop_input_cpu(dx, dy, f, **params):
    """One GEMM into columns per chunk of images, then a parallel Numba col2im (its twin:
    numpy's strided add over dx per window tap, same bits)."""
    from graphdist.kernels.conv import col2im_cpu

    _input_grad_split(dx, dy, f, col2im_cpu, params)


# the filter gradient sums over the batch: where it is split (a caller with every core, as
# the convolutions above), it is split into a fixed number of parts, whatever the cores, so
# that its bits do not depend on the machine (each part's GEMMs, then the parts added in
# order); only above FEW_CHANNELS input channels (the first layer's one-channel gradient, a
# memory-bound pass, ran slower split: 2.3 against 1.9 ms)
FILTER_GRAD_PARTS = 2


def conv2d_backprop_filter_parts(dw, x, dy, **params):
    """conv2d_backprop_filter into dw: the batch in FILTER_GRAD_PARTS parts, each part's
    gradient made by the op's own form (on a thread of its own where the caller has every
    core: device/threads.py split_batch), then added in order. The second layer of the
    tutorial CNN (batch 256): 4.3 -> 3.5 ms on 2 cores."""
    from graphdist.device.threads import split_batch
    from graphdist.ops.conv import FEW_CHANNELS, conv2d_backprop_filter_p

    n = x.shape[0]
    if x.shape[3] < FEW_CHANNELS or n < FILTER_GRAD_PARTS:
        conv2d_backprop_filter_p.out_impl(np, dw, x, dy, **params)
        return
    sums = {}

    def part(rows):
        out = dw if rows.start == 0 else np.empty_like(dw)
        conv2d_backprop_filter_p.out_impl(np, out, x[rows], dy[rows], **params)
        sums[rows.start] = out

    split_batch(n, part, dy.nbytes, parts=FILTER_GRAD_PARTS)
    for start in sorted(sums)[1:]:
        dw += sums[start]


def _filter_grad(groups):
    """conv2d_backprop_filter's CPU form: with few input channels and taps (ops/conv.py
    filter_grad_groups_fit) `groups(x, dy, dw)` (kernels/conv_filter.py's kernel, 1.2
    against 1.7 ms for the tutorial CNN's first layer alone, 2.0 against 2.9 in its step;
    or the kernel's numpy twin), else the GEMMs in parts (the same in both forms)."""
    def run(dw, x, dy, **params):
        from graphdist.ops.conv import filter_grad_groups_fit, padded

        pads = filter_grad_groups_fit(x.shape, dy.shape[3], dtype=x.dtype, **params)
        if pads is None or dy.dtype != x.dtype or not (dy.flags.c_contiguous
                                                        and dw.flags.c_contiguous):
            conv2d_backprop_filter_parts(dw, x, dy, **params)
            return
        groups(padded(np, x, pads), dy, dw)

    run.__name__ = run.__qualname__ = \
        f"conv2d_backprop_filter_{'numpy' if groups is _groups_numpy else 'cpu'}"
    return run


def _groups_cpu(x, dy, dw):
    from graphdist.kernels.conv_filter import filter_grad_groups_cpu

    if not filter_grad_groups_cpu(x, dy, dw):
        raise ValueError(f"conv2d_backprop_filter: the groups kernel refused x:{x.shape} "
                         f"dy:{dy.shape} dw:{dw.shape}")


def _groups_numpy(x, dy, dw):
    from graphdist.ops.conv import filter_grad_groups_numpy

    filter_grad_groups_numpy(np, x, dy, dw)


register_kernel("conv2d_backprop_filter", kind="cpu", out=True, numpy=_filter_grad(_groups_numpy),
                exact=True, reduces=True)(_filter_grad(_groups_cpu))


def _pooled_filter_grad(twin: bool):
    """conv2d_backprop_filter_pooled's CPU form (ops/epilogue.py): kernels/conv_filter.py's
    pooled kernel where the filter gradient runs as groups; else, and as the numpy twin, the
    pool's gradient into a buffer, then the filter gradient, each in the same form (kernel
    or twin): the same bits whichever runs."""
    filter_grad = _filter_grad(_groups_numpy if twin else _groups_cpu)

    def run(dw, x, idx, g, *, input_size, members, **params):
        from graphdist.ops.conv import filter_grad_groups_fit, padded
        from graphdist.ops.epilogue import POOL

        pads = filter_grad_groups_fit(x.shape, g.shape[3], dtype=x.dtype, **params)
        if not twin and pads is not None and dw.flags.c_contiguous:
            from graphdist.kernels.conv_filter import pooled_filter_grad_cpu

            if pooled_filter_grad_cpu(padded(np, x, pads), np.ascontiguousarray(idx),
                                      np.ascontiguousarray(g), dw, tuple(input_size)):
                return
        if twin:
            dy = _op("max_pool2d_grad_argmax").impl(np, idx, g, input_size=input_size, **POOL)
        else:
            dy = np.empty((g.shape[0], *input_size, g.shape[3]), g.dtype)
            max_pool2d_grad_argmax_cpu(dy, idx, g, input_size=input_size, **POOL)
        filter_grad(dw, x, dy, **params)

    run.__name__ = run.__qualname__ = f"pooled_filter_grad_{'numpy' if twin else 'cpu'}"
    return run


register_kernel("conv2d_backprop_filter_pooled", kind="cpu", out=True,
                numpy=_pooled_filter_grad(True), exact=True,
                reduces=True)(_pooled_filter_grad(False))



# ---------------------------------------------------------------- transformer blocks


def _gelu_forms(module: str) -> tuple:
    """gelu and gelu_grad, both forms, through `module`: kernels/gelu.py's Numba kernels
    (float32 with a vectorized rational erf or tanh: 0.2-0.3 ms for 2048x512 on 2 cores;
    float64 with the C library's erfc or tanh, 5 ms; numpy's reference, erfc from array
    passes: 62 ms) or kernels/gelu_numpy.py's twins, which give their bits with nothing to
    load. Operands they refuse run the op's numpy impl."""
    def gelu(out, x, *, approximate):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if not forms.gelu_cpu(x, out, approximate):
            _op("gelu").out_impl(np, out, x, approximate=approximate)

    def gelu_grad(out, ct, x, *, approximate):
        forms = importlib.import_module(f"graphdist.kernels.{module}")
        if not forms.gelu_grad_cpu(ct, x, out, approximate):
            _op("gelu_grad").out_impl(np, out, ct, x, approximate=approximate)

    return gelu, gelu_grad


# the op's generic out_impl is an independent reference (Cody's float64 erfc), not the
# kernel's math: the twins are kernels/gelu_numpy.py's
gelu_cpu, gelu_grad_cpu = _gelu_forms("gelu")
gelu_numpy, gelu_grad_numpy = _gelu_forms("gelu_numpy")
register_kernel("gelu", kind="cpu", out=True, numpy=gelu_numpy, exact=True)(gelu_cpu)
register_kernel("gelu_grad", kind="cpu", out=True, numpy=gelu_grad_numpy,
                exact=True)(gelu_grad_cpu)


# not exact: the kernel sums with fastmath reassoc, in LLVM's order, so it loads before a
# program's first call
@register_kernel("layer_norm", kind="cpu", out=True)
def layer_norm_cpu(out, x, *affine, naxes, epsilon, scale, center):
    """One parallel pass over the rows (numpy's reference: about ten array passes)."""
    from graphdist.kernels.layer_norm import layer_norm_cpu

    gamma, beta = affine[0] if scale else None, affine[-1] if center else None
    if not layer_norm_cpu(x, gamma, beta, epsilon, naxes, out):
        out[...] = _op("layer_norm").impl(np, x, *affine, naxes=naxes, epsilon=epsilon,
                                          scale=scale, center=center)


@register_kernel("layer_norm_grad", kind="cpu", out=True)
def layer_norm_grad_cpu(outs, ct, x, *gamma, naxes, epsilon, scale, center):
    """dx, and dgamma and dbeta as per-row-block partial sums, in one pass over the rows."""
    from graphdist.kernels.layer_norm import layer_norm_grad_cpu

    outs = outs if isinstance(outs, tuple) else (outs,)      # dx alone: one buffer
    dx, *rest = outs
    dgamma = rest.pop(0) if scale else None
    dbeta = rest.pop(0) if center else None
    if not layer_norm_grad_cpu(ct, x, gamma[0] if scale else None, epsilon, naxes, dx, dgamma,
                               dbeta):
        made = _op("layer_norm_grad").impl(np, ct, x, *gamma, naxes=naxes, epsilon=epsilon,
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


# the op's generic impl sums with numpy's pairwise sums, not the kernel's order: the twins
# are kernels/softmax_numpy.py's
softmax_cpu, softmax_grad_cpu = _softmax_forms("softmax")
softmax_numpy, softmax_grad_numpy = _softmax_forms("softmax_numpy")
register_kernel("softmax", kind="cpu", out=True, numpy=softmax_numpy, exact=True)(softmax_cpu)
register_kernel("softmax_grad", kind="cpu", out=True, numpy=softmax_grad_numpy,
                exact=True)(softmax_grad_cpu)
