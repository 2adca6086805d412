"""Masks for attention: softmax and log_softmax over a bool mask (masked entries get
probability exactly 0, a fully masked row all zeros rather than NaN) or an additive float
mask, and the causal mask. gd.nn.softmax(mask=) calls here. Softmax over the last axis (a
bool mask or none) is one op and its gradient another, so attention's softmax runs as one
row-wise kernel each way on CPU (kernels/softmax.py); the rest are compositions of primitive
ops."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType, as_dtype
from graphdist.ops.array import cast, expand_dims, stop_gradient
from graphdist.ops.construct import arange
from graphdist.ops.core import Op, bind, require_float, same_dtype
from graphdist.ops.math import (
    add,
    divide,
    exp,
    greater,
    greater_equal,
    log,
    multiply,
    reduce_max,
    reduce_sum,
    subtract,
    where,
)

_NEG_INF = float("-inf")


def masked_softmax(logits, axis, mask, log_probs: bool = False):
    """softmax (or log_softmax) of `logits` along `axis` under `mask`."""
    shape = tuple(logits.shape)
    mask_shape = tuple(getattr(mask, "shape", np.shape(mask)))
    dtype = np.dtype(mask.dtype if hasattr(mask, "dtype") else np.asarray(mask).dtype)
    try:
        fits = tuple(np.broadcast_shapes(mask_shape, shape)) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ShapeError(f"softmax: mask of shape {mask_shape} does not broadcast to the "
                         f"logits' shape {shape}")
    if dtype.kind in "iu":
        raise TypeError(f"softmax: mask must be bool (True keeps an entry) or float (added to "
                        f"the logits), got {dtype}")
    if dtype != np.dtype(bool):            # additive: -inf (or -1e9) where masked
        return _softmax(add(logits, cast(mask, logits.dtype)), axis, log_probs)
    if not log_probs and last_axis(axis, len(shape)):
        return bind(softmax_p, logits, mask)
    # the max over kept entries only; a fully masked row's max is -inf, and where() keeps
    # the resulting inf out of every kept value and every gradient
    top = stop_gradient(reduce_max(where(mask, logits, _NEG_INF), axis=axis, keepdims=True))
    shifted = where(mask, subtract(logits, top), _NEG_INF)
    e = exp(shifted)
    total = reduce_sum(e, axis=axis, keepdims=True)
    total = where(greater(total, 0.0), total, 1.0)          # 0 for a fully masked row
    if log_probs:
        return where(mask, subtract(shifted, log(total)), _NEG_INF)
    return divide(e, total)


def _softmax(logits, axis, log_probs):
    from graphdist.ops.nn import log_softmax, softmax

    return (log_softmax if log_probs else softmax)(logits, axis)


def last_axis(axis, ndim: int) -> bool:
    """Is `axis` the last of `ndim` axes (where the softmax op applies)?"""
    return isinstance(axis, (int, np.integer)) and ndim > 0 and axis in (-1, ndim - 1)


# ---------------------------------------------------------------- softmax as one op

def _row_sum(xp, v):
    return v.sum(axis=-1, keepdims=True)


def softmax_ref(xp, x, mask=None):
    """softmax of x over its last axis, 0 where the bool `mask` (broadcasting to x) is False
    and in a row with no kept entry: the composition masked_softmax builds, as one impl."""
    if mask is None:
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        return e / _row_sum(xp, e)
    top = xp.where(mask, x, -np.inf).max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):                 # rows with no kept entry: -inf top
        e = xp.exp(xp.where(mask, x - top, -np.inf))
    total = _row_sum(xp, e)
    return e / xp.where(total > 0, total, 1).astype(x.dtype)


softmax_p = Op("softmax")       # logits[, bool mask] -> probabilities over the last axis


@softmax_p.def_shape
def _softmax_shape(x, *mask):
    require_float("softmax", x)
    for m in mask:
        if m.dtype != np.dtype(bool) or len(m.shape) > len(x.shape) or tuple(
                np.broadcast_shapes(m.shape, x.shape)) != tuple(x.shape):
            raise ShapeError(f"softmax: mask must be bool and broadcast to the logits, got "
                             f"logits:{x}, mask:{m}")
    if len(mask) > 1:
        raise ShapeError(f"softmax: expected logits and at most one mask, got {1 + len(mask)}")
    if not x.shape:
        raise ShapeError(f"softmax: logits need at least one axis, got {x}")
    return x


softmax_p.def_impl(lambda xp, x, *mask: softmax_ref(xp, x, *mask).astype(x.dtype))
softmax_p.def_vjp(lambda ct, x, *mask: (
    softmax_grad(ct, bind(softmax_p, x, *mask)),) + (None,) * len(mask))
softmax_p.def_cost(lambda ins, outs, **_: (5 * outs[0].size,
                                           sum(t.nbytes for t in (*ins, *outs))))
softmax_p.def_batch(lambda bx, x, *mask: (
    bx.add(softmax_p, x, *mask) if bx.batched(x) and not any(map(bx.batched, mask))
    else bx.per_replica(softmax_p, (x, *mask), {})))

# y (g - sum(g y)) over the last axis: the gradient g of softmax's output y taken back to its
# logits
softmax_grad_p = Op("softmax_grad")


@softmax_grad_p.def_shape
def _softmax_grad_shape(g, y):
    dtype = same_dtype("softmax_grad", g, y, names=("ct", "y"))
    require_float("softmax_grad", y)
    if g.shape != y.shape or not y.shape:
        raise ShapeError(f"softmax_grad: ct and y must have one shape with an axis, got "
                         f"ct:{g}, y:{y}")
    return ArrayType(y.shape, dtype)


softmax_grad_p.def_impl(lambda xp, g, y: (y * (g - _row_sum(xp, g * y))).astype(y.dtype))
softmax_grad_p.def_cost(lambda ins, outs, **_: (4 * outs[0].size,
                                                sum(t.nbytes for t in (*ins, *outs))))
softmax_grad_p.def_batch(lambda bx, g, y: (
    bx.add(softmax_grad_p, g, y) if bx.batched(g) and bx.batched(y)
    else bx.per_replica(softmax_grad_p, (g, y), {})))


@softmax_grad_p.def_vjp
def _softmax_grad_vjp(a, g, y):
    # out = y g - y s with s = sum(g y): d g = y (a - sum(a y)), and
    # d y = a (g - s) - g sum(a y)
    def row_sum(v):
        return reduce_sum(v, axis=-1, keepdims=True)

    ay = row_sum(multiply(a, y))
    dy = subtract(multiply(a, subtract(g, row_sum(multiply(g, y)))), multiply(g, ay))
    return softmax_grad(a, y), dy


def softmax_grad(g, y):
    return bind(softmax_grad_p, g, y)


def causal_mask(length: int, dtype="bool"):
    """The [length, length] lower-triangular mask of causal attention: entry [query, key]
    is True (1) where key <= query.

    >>> gd.nn.causal_mask(3)
    array([[ True, False, False],
           [ True,  True, False],
           [ True,  True,  True]])
    """
    positions = arange(int(length))
    mask = greater_equal(expand_dims(positions, 1), expand_dims(positions, 0))
    return mask if as_dtype(dtype) == np.dtype(bool) else cast(mask, dtype)
