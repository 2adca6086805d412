"""Pooling in TF's NHWC layout, one block per op: max pooling with its gradient (and that
gradient's gradient, TF's MaxPoolGradGrad), average pooling with its gradient. Windows,
padding and strides follow TF exactly (graphdist/ops/window.py); on CPU devices the max
pool and its gradient run as Numba kernels (runtime/kernel_table.py)."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, bind, same_dtype
from graphdist.ops.window import (describe, fold_replicas, operands, pair, require_nhwc, taps,
                                  window_geometry)



def _pool_shape(op_name, x, *, ksize, strides, padding):
    where = describe(("x",), (x,), ksize=ksize, strides=strides, padding=padding)
    require_nhwc(op_name, "x", x, where)
    out_hw, _ = window_geometry(op_name, x.shape[1:3], ksize, strides, (1, 1), padding, where)
    return ArrayType((x.shape[0], *out_hw, x.shape[3]), x.dtype)


def _pool_taps(x_shape, ksize, strides, padding):
    out_hw, pads = window_geometry("", x_shape[1:3], ksize, strides, (1, 1), padding, "")
    return out_hw, list(taps(ksize, strides, (1, 1), pads, x_shape[1:3], out_hw))


def _pool_cost(ins, outs, *, ksize, **_):
    return outs[0].size * ksize[0] * ksize[1], sum(t.nbytes for t in (*ins, *outs))


def _pool_params(op_name, x, ksize, strides, padding):
    where = operands(("x",), (x,))
    return {"ksize": pair(op_name, "ksize", ksize, where),
            "strides": pair(op_name, "strides", strides, where),
            "padding": padding.upper() if isinstance(padding, str) else padding}


max_pool2d_p = Op("max_pool2d", cost_kind="reduce")
max_pool2d_p.def_shape(lambda x, **p: _pool_shape("max_pool2d", x, **p))


@max_pool2d_p.def_impl
def _max_pool2d_impl(xp, x, *, ksize, strides, padding):
    out_hw, taps = _pool_taps(x.shape, ksize, strides, padding)
    y = xp.full((x.shape[0], *out_hw, x.shape[3]), -np.inf, x.dtype)
    for _, at_out, at_in in taps:                    # one pass per tap, no window copy
        xp.maximum(y[at_out], x[at_in], out=y[at_out])
    return y


max_pool2d_p.def_vjp(lambda ct, x, **p: (
    bind(max_pool2d_grad_p, x, bind(max_pool2d_p, x, **p), ct, **p),))
max_pool2d_p.def_batch(lambda bx, x, **params: fold_replicas(bx, max_pool2d_p, (x,), params))
max_pool2d_p.def_cost(_pool_cost)


def _first_max(xp, x, y, taps):
    """Per tap, where it holds its window's max and no earlier tap did (TF's tie rule: the
    gradient goes to the first max in scan order)."""
    taken = xp.zeros(y.shape, dtype=bool)
    for _, at_out, at_in in taps:
        hit = (x[at_in] == y[at_out]) & ~taken[at_out]
        taken[at_out] |= hit
        yield at_out, at_in, hit


def _first_max_cost(ins, outs, *, ksize, **_):
    """Both gradient ops compare, mask and move one value per window tap of y."""
    return 3 * ins[1].size * ksize[0] * ksize[1], sum(t.nbytes for t in (*ins, *outs))


# TF's MaxPoolGrad(orig_input, orig_output, grad): each window's gradient to its first max
max_pool2d_grad_p = Op("max_pool2d_grad", cost_kind="reduce")


@max_pool2d_grad_p.def_shape
def _max_pool2d_grad_shape(x, y, dy, **p):
    want = _pool_shape("max_pool2d_grad", x, **p)
    same_dtype("max_pool2d_grad", x, y, dy, names=("x", "y", "dy"))
    if y.shape != want.shape or dy.shape != want.shape:
        raise ShapeError(f"max_pool2d_grad: y and dy must have the pooled shape {want}; "
                         + describe(("x", "y", "dy"), (x, y, dy), **p))
    return x


@max_pool2d_grad_p.def_impl
def _max_pool2d_grad_impl(xp, x, y, dy, *, ksize, strides, padding):
    dx = xp.zeros_like(x)
    zero = x.dtype.type(0)
    for at_out, at_in, hit in _first_max(xp, x, y, _pool_taps(x.shape, ksize, strides,
                                                              padding)[1]):
        dx[at_in] += xp.where(hit, dy[at_out], zero)     # windows may overlap: add
    return dx


# linear in dy; x and y only pick the positions (piecewise constant: no gradient)
max_pool2d_grad_p.def_vjp(lambda ct, x, y, dy, **p: (
    None, None, bind(max_pool2d_grad_grad_p, x, y, ct, **p)))
max_pool2d_grad_p.def_batch(
    lambda bx, x, y, dy, **params: fold_replicas(bx, max_pool2d_grad_p, (x, y, dy), params))
max_pool2d_grad_p.def_cost(_first_max_cost)

# TF's MaxPoolGradGrad: g (shaped like x) read at each window's first max
max_pool2d_grad_grad_p = Op("max_pool2d_grad_grad", cost_kind="reduce")


@max_pool2d_grad_grad_p.def_shape
def _max_pool2d_grad_grad_shape(x, y, g, **p):
    want = _pool_shape("max_pool2d_grad_grad", x, **p)
    same_dtype("max_pool2d_grad_grad", x, y, g, names=("x", "y", "g"))
    if y.shape != want.shape or g.shape != x.shape:
        raise ShapeError(f"max_pool2d_grad_grad: y must have the pooled shape {want} and g "
                         f"the shape of x; " + describe(("x", "y", "g"), (x, y, g), **p))
    return y


@max_pool2d_grad_grad_p.def_impl
def _max_pool2d_grad_grad_impl(xp, x, y, g, *, ksize, strides, padding):
    out = xp.zeros_like(y)
    for at_out, at_in, hit in _first_max(xp, x, y, _pool_taps(x.shape, ksize, strides,
                                                              padding)[1]):
        xp.copyto(out[at_out], g[at_in], where=hit)
    return out


max_pool2d_grad_grad_p.def_vjp(lambda ct, x, y, g, **p: (
    None, None, bind(max_pool2d_grad_p, x, y, ct, **p)))
max_pool2d_grad_grad_p.def_batch(
    lambda bx, x, y, g, **params: fold_replicas(bx, max_pool2d_grad_grad_p, (x, y, g), params))
max_pool2d_grad_grad_p.def_cost(_first_max_cost)


# ---------------------------------------------------------------- with the argmax
# Nobody writes these: passes/epilogue.py makes them from a max_pool2d and its gradient
# (after autodiff, on host devices, for windows that do not overlap). The forward pass
# also writes each window's first max as its tap index (int8; -1 for a window holding a
# NaN), and the gradient is routed by those indices, so the backward pass reads 1 byte a
# window rather than the pool's input and output (which can then be freed after the
# forward pass): the tutorial CNN's first layer, 22 MB at batch 256. The same y and dx as
# max_pool2d and max_pool2d_grad, bit for bit.

ARGMAX_TAPS = 127          # the most window taps an int8 index holds


def argmax_fits(ksize, strides) -> bool:
    """Windows that never overlap (so the gradient is a scatter) and whose taps an int8
    indexes."""
    return (ksize[0] * ksize[1] <= ARGMAX_TAPS and strides[0] >= ksize[0]
            and strides[1] >= ksize[1])


max_pool2d_argmax_p = Op("max_pool2d_argmax", num_outputs=2, cost_kind="reduce",
                         differentiable=False)


@max_pool2d_argmax_p.def_shape
def _max_pool2d_argmax_shape(x, **p):
    y = _pool_shape("max_pool2d_argmax", x, **p)
    return y, ArrayType(y.shape, np.dtype(np.int8))


@max_pool2d_argmax_p.def_impl
def _max_pool2d_argmax_impl(xp, x, *, ksize, strides, padding):
    y = _max_pool2d_impl(xp, x, ksize=ksize, strides=strides, padding=padding)
    idx = xp.full(y.shape, -1, np.int8)
    taps = _pool_taps(x.shape, ksize, strides, padding)[1]
    for ((p, q), _, _), (at_out, _, hit) in zip(taps, _first_max(xp, x, y, taps)):
        xp.copyto(idx[at_out], np.int8(p * ksize[1] + q), where=hit)
    return y, idx


max_pool2d_argmax_p.def_cost(_pool_cost)

max_pool2d_grad_argmax_p = Op("max_pool2d_grad_argmax", cost_kind="reduce",
                              differentiable=False)


@max_pool2d_grad_argmax_p.def_shape
def _max_pool2d_grad_argmax_shape(idx, dy, *, input_size, **p):
    x = ArrayType((dy.shape[0], *input_size, dy.shape[3]), dy.dtype)
    want = _pool_shape("max_pool2d_grad_argmax", x, **p)
    if idx.shape != want.shape or dy.shape != want.shape or idx.dtype != np.int8:
        raise ShapeError(f"max_pool2d_grad_argmax: idx (int8) and dy must have the pooled "
                         f"shape {want.shape}; " + describe(("idx", "dy"), (idx, dy), **p))
    return x


@max_pool2d_grad_argmax_p.def_impl
def _max_pool2d_grad_argmax_impl(xp, idx, dy, *, input_size, ksize, strides, padding):
    dx = xp.zeros((dy.shape[0], *input_size, dy.shape[3]), dy.dtype)
    zero = dy.dtype.type(0)
    for (p, q), at_out, at_in in _pool_taps(dx.shape, ksize, strides, padding)[1]:
        dx[at_in] += xp.where(idx[at_out] == p * ksize[1] + q, dy[at_out], zero)
    return dx


max_pool2d_grad_argmax_p.def_cost(lambda ins, outs, **_: (
    outs[0].size, sum(t.nbytes for t in (*ins, *outs))))


def _avg_counts(xp, x_shape, ksize, strides, padding, dtype):
    """How many input elements each window averages: with SAME only those inside the input
    (as TF does). A scalar where every window is whole."""
    out_hw, taps = _pool_taps(x_shape, ksize, strides, padding)
    counts = np.zeros(out_hw, dtype)
    for _, at_out, _ in taps:
        counts[at_out[1:]] += 1
    if counts.min() == ksize[0] * ksize[1]:
        return dtype.type(ksize[0] * ksize[1])
    return xp.asarray(counts[..., None])             # (OH, OW, 1)


avg_pool2d_p = Op("avg_pool2d")
avg_pool2d_p.def_shape(lambda x, **p: _pool_shape("avg_pool2d", x, **p))


@avg_pool2d_p.def_impl
def _avg_pool2d_impl(xp, x, *, ksize, strides, padding):
    out_hw, taps = _pool_taps(x.shape, ksize, strides, padding)
    y = xp.zeros((x.shape[0], *out_hw, x.shape[3]), x.dtype)
    for _, at_out, at_in in taps:
        y[at_out] += x[at_in]
    y /= _avg_counts(xp, x.shape, ksize, strides, padding, x.dtype)
    return y


avg_pool2d_p.def_vjp(lambda ct, x, **p: (
    bind(avg_pool2d_grad_p, ct, input_size=tuple(x.ty.shape[1:3]), **p),))
avg_pool2d_p.def_batch(lambda bx, x, **params: fold_replicas(bx, avg_pool2d_p, (x,), params))
avg_pool2d_p.def_cost(_pool_cost)

# TF's AvgPoolGrad: each window's gradient spread evenly over the elements it averaged
avg_pool2d_grad_p = Op("avg_pool2d_grad")


@avg_pool2d_grad_p.def_shape
def _avg_pool2d_grad_shape(dy, *, input_size, **p):
    where = describe(("dy",), (dy,), input_size=input_size, **p)
    require_nhwc("avg_pool2d_grad", "dy", dy, where)
    x = ArrayType((dy.shape[0], *input_size, dy.shape[3]), dy.dtype)
    if _pool_shape("avg_pool2d_grad", x, **p).shape != dy.shape:
        raise ShapeError(f"avg_pool2d_grad: an input of size {tuple(input_size)} does not "
                         f"pool to dy's size; {where}")
    return x


@avg_pool2d_grad_p.def_impl
def _avg_pool2d_grad_impl(xp, dy, *, input_size, ksize, strides, padding):
    shape = (dy.shape[0], *input_size, dy.shape[3])
    share = dy / _avg_counts(xp, shape, ksize, strides, padding, dy.dtype)
    dx = xp.zeros(shape, dy.dtype)
    for _, at_out, at_in in _pool_taps(shape, ksize, strides, padding)[1]:
        dx[at_in] += share[at_out]
    return dx


avg_pool2d_grad_p.def_vjp(lambda ct, dy, *, input_size, **p: (bind(avg_pool2d_p, ct, **p),))
avg_pool2d_grad_p.def_batch(
    lambda bx, dy, **params: fold_replicas(bx, avg_pool2d_grad_p, (dy,), params))
avg_pool2d_grad_p.def_cost(lambda ins, outs, *, ksize, **_: (
    ins[0].size * ksize[0] * ksize[1], ins[0].nbytes + outs[0].nbytes))


def max_pool2d(x, ksize, strides, padding):
    """Max over each `ksize` window of NHWC `x` (padding "SAME" or "VALID", as TF).

    >>> gd.nn.max_pool2d(np.arange(16.0).reshape(1, 4, 4, 1), 2, 2, "VALID")[0, ..., 0]
    array([[ 5.,  7.],
           [13., 15.]])
    """
    return bind(max_pool2d_p, x, **_pool_params("max_pool2d", x, ksize, strides, padding))


def avg_pool2d(x, ksize, strides, padding):
    """Mean over each `ksize` window of NHWC `x`; with SAME, of the elements inside the input.

    >>> gd.nn.avg_pool2d(np.arange(16.0).reshape(1, 4, 4, 1), 2, 2, "VALID")[0, ..., 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]])
    """
    return bind(avg_pool2d_p, x, **_pool_params("avg_pool2d", x, ksize, strides, padding))
