"""gd.nn: the cross-entropy losses, composed from primitive ops so their gradients come from
the primitives' vjp rules (and CSE shares the forward work). float16/bfloat16 logits are
computed in float32 and the losses return float32 (as Keras computes losses under mixed
precision). softmax and log_softmax live in ops/softmax.py and are re-exported here."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ops.array import cast, one_hot_p
from graphdist.ops.core import bind
from graphdist.ops.math import multiply, negative, reduce_sum
from graphdist.ops.naming import user_op
from graphdist.ops.softmax import log_softmax, low_precision, softmax  # noqa: F401


@user_op("softmax_cross_entropy")
def softmax_cross_entropy(labels, logits):
    """Per-example cross entropy with one-hot or probability `labels` (same shape as logits).
    float16/bfloat16 logits (and labels of their dtype) are computed in float32, and the loss
    is float32."""
    label_shape = tuple(getattr(labels, "shape", np.shape(labels)))
    if label_shape != tuple(logits.shape):
        raise ShapeError(f"softmax_cross_entropy: labels {label_shape} and logits "
                         f"{tuple(logits.shape)} must have the same shape")
    low = low_precision(logits)
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
    if low_precision(logits) is not None:
        logits = cast(logits, "float32")
    # labels outside [0, classes) raise, eagerly now and in traced code when the step runs
    picked = bind(one_hot_p, labels, depth=int(logits.shape[-1]), dtype=np.dtype(logits.dtype),
                  checked_for="sparse_softmax_cross_entropy")
    return negative(reduce_sum(multiply(picked, log_softmax(logits)), axis=-1))
