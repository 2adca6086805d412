"""gd.nn: softmax and the cross-entropy losses, composed from primitive ops so their
gradients come from the primitives' vjp rules (and CSE shares the forward work).
float16/bfloat16 logits are computed in float32: softmax and log_softmax cast the result
back, the losses return float32 (as Keras computes losses under mixed precision)."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import LOW_PRECISION, ArrayType
from graphdist.ops.array import cast, one_hot_p, stop_gradient
from graphdist.ops.attention import last_axis, masked_softmax, softmax_p
from graphdist.ops.core import bind, normalize_axis, require_float
from graphdist.ops.naming import user_op
from graphdist.ops.math import (divide, exp, log, multiply, negative, reduce_max, reduce_sum,
                                subtract)


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _low_precision(x) -> np.dtype | None:
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


@user_op("log_softmax")
def log_softmax(logits, axis=-1, mask=None):
    """log(softmax(logits)) along `axis`, computed stably (float16/bfloat16: in float32);
    `mask` as softmax's (masked entries: -inf).

    >>> gd.nn.log_softmax(np.zeros((1, 2), np.float32))
    array([[-0.6931472, -0.6931472]], dtype=float32)
    """
    _check_logits("log_softmax", logits, axis)
    low = _low_precision(logits)
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
    low = _low_precision(logits)
    if low is not None:
        return cast(softmax(cast(logits, "float32"), axis, mask), low)
    if mask is not None:
        return masked_softmax(logits, axis, mask)
    if last_axis(axis, len(logits.shape)):
        return bind(softmax_p, logits)
    e = exp(subtract(logits, stop_gradient(reduce_max(logits, axis=axis, keepdims=True))))
    return divide(e, reduce_sum(e, axis=axis, keepdims=True))


@user_op("softmax_cross_entropy")
def softmax_cross_entropy(labels, logits):
    """Per-example cross entropy with one-hot or probability `labels` (same shape as logits).
    float16/bfloat16 logits (and labels of their dtype) are computed in float32, and the loss
    is float32."""
    label_shape = tuple(getattr(labels, "shape", np.shape(labels)))
    if label_shape != tuple(logits.shape):
        raise ShapeError(f"softmax_cross_entropy: labels {label_shape} and logits "
                         f"{tuple(logits.shape)} must have the same shape")
    low = _low_precision(logits)
    if low is not None:
        label_dtype = getattr(labels, "dtype", None)
        if label_dtype is not None and np.dtype(label_dtype) != low:
            raise TypeError(f"softmax_cross_entropy: labels are {np.dtype(label_dtype)}, "
                            f"logits {low}; use gd.cast to make them agree")
        labels, logits = cast(labels, "float32"), cast(logits, "float32")
    return negative(reduce_sum(multiply(labels, log_softmax(logits)), axis=-1))


@user_op("sparse_softmax_cross_entropy")
def sparse_softmax_cross_entropy(labels, logits):
    """Per-example cross entropy with integer class `labels` of shape logits.shape[:-1];
    float16/bfloat16 logits are computed in float32, and the loss is float32.

    >>> gd.nn.sparse_softmax_cross_entropy(np.array([1]), np.zeros((1, 2), np.float32))
    array([0.6931472], dtype=float32)
    """
    label_shape = tuple(getattr(labels, "shape", np.shape(labels)))
    if label_shape != tuple(logits.shape[:-1]):
        raise ShapeError(f"sparse_softmax_cross_entropy: labels {label_shape} must have the "
                         f"shape of logits {tuple(logits.shape)} without its last axis")
    if _low_precision(logits) is not None:
        logits = cast(logits, "float32")
    # labels outside [0, classes) raise, eagerly now and in traced code when the step runs
    picked = bind(one_hot_p, labels, depth=int(logits.shape[-1]), dtype=np.dtype(logits.dtype),
                  checked_for="sparse_softmax_cross_entropy")
    return negative(reduce_sum(multiply(picked, log_softmax(logits)), axis=-1))
