"""softmax and log_softmax, in one home: the user functions (gd.nn.softmax, mask= included),
the masked compositions, and softmax over the last axis as one op with its gradient as
another, so attention's softmax runs as one row-wise kernel each way on CPU
(kernels/softmax.py, through runtime/kernel_table.py). ops/nn.py (the cross-entropy
losses) and ops/attention.py (the causal mask) build on it.

The compositions are made of primitive ops, so their gradients come from the primitives'
vjp rules (and CSE shares the forward work). float16/bfloat16 logits are computed in
float32 and cast back. A bool mask gives masked entries probability exactly 0 and a fully
masked row all zeros rather than NaN; a float mask is added to the logits."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import LOW_PRECISION, ArrayType
from graphdist.ops.array import cast, stop_gradient
from graphdist.ops.core import Op, bind, normalize_axis, require_float, same_dtype
from graphdist.ops.math import (
    add,
    divide,
    exp,
    greater,
    log,
    multiply,
    reduce_max,
    reduce_sum,
    subtract,
    where,
)
from graphdist.ops.naming import user_op

_NEG_INF = float("-inf")


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def low_precision(x) -> np.dtype | None:
    """x's dtype if it is float16 or bfloat16 (computed in float32), else None."""
    dtype = _dtype(x)
    return dtype if dtype in LOW_PRECISION else None


def _check_logits(name: str, logits, axis) -> None:
    """softmax's logits and axis, checked up front: the ops it is built from would name
    themselves, and a scalar has no axis to normalize over."""
    shape = tuple(getattr(logits, "shape", np.shape(logits)))
    require_float(name, ArrayType(shape, _dtype(logits)))
    if not shape:
        raise ShapeError(f"{name}: logits need at least one axis, got shape ()")
    normalize_axis(name, axis, len(shape), shape)


def last_axis(axis, ndim: int) -> bool:
    """Is `axis` the last of `ndim` axes (where the softmax op applies)?"""
    return isinstance(axis, (int, np.integer)) and ndim > 0 and axis in (-1, ndim - 1)


# ---------------------------------------------------------------- the user functions

@user_op("log_softmax")
def log_softmax(logits, axis=-1, mask=None):
    """log(softmax(logits)) along `axis`, computed stably (float16/bfloat16: in float32);
    `mask` as softmax's (masked entries: -inf).

    >>> gd.nn.log_softmax(np.zeros((1, 2), np.float32))
    array([[-0.6931472, -0.6931472]], dtype=float32)
    """
    _check_logits("log_softmax", logits, axis)
    low = low_precision(logits)
    if low is not None:
        return cast(log_softmax(cast(logits, "float32"), axis, mask), low)
    if mask is not None:
        return masked_softmax(logits, axis, mask, log_probs=True)
    shifted = subtract(logits, stop_gradient(reduce_max(logits, axis=axis, keepdims=True)))
    return subtract(shifted, log(reduce_sum(exp(shifted), axis=axis, keepdims=True)))


@user_op("softmax")
def softmax(logits, axis=-1, mask=None):
    """exp(logits) normalized along `axis` (float16/bfloat16: computed in float32). `mask`
    broadcasts to the logits: bool (True keeps an entry; masked ones get probability 0, a
    fully masked row all zeros) or float (added to the logits).

    >>> gd.nn.softmax(np.zeros((1, 2), np.float32), mask=np.array([True, False]))
    array([[1., 0.]], dtype=float32)
    """
    _check_logits("softmax", logits, axis)
    low = low_precision(logits)
    if low is not None:
        return cast(softmax(cast(logits, "float32"), axis, mask), low)
    if mask is not None:
        return masked_softmax(logits, axis, mask)
    if last_axis(axis, len(logits.shape)):
        return bind(softmax_p, logits)
    e = exp(subtract(logits, stop_gradient(reduce_max(logits, axis=axis, keepdims=True))))
    return divide(e, reduce_sum(e, axis=axis, keepdims=True))


def masked_softmax(logits, axis, mask, log_probs: bool = False):
    """softmax (or log_softmax) of `logits` along `axis` under `mask`."""
    shape = tuple(logits.shape)
    mask_shape = tuple(getattr(mask, "shape", np.shape(mask)))
    dtype = _dtype(mask)
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
        logits = add(logits, cast(mask, logits.dtype))
        return (log_softmax if log_probs else softmax)(logits, axis)
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


# logits[, bool mask] -> probabilities over the last axis
softmax_p = Op("softmax", cost_kind="reduce")


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
softmax_grad_p = Op("softmax_grad", cost_kind="reduce")


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


__all__ = ["last_axis", "log_softmax", "masked_softmax", "softmax", "softmax_grad",
           "softmax_grad_p", "softmax_p", "softmax_ref"]
