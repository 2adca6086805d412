"""gd.nn: softmax and the cross-entropy losses, composed from primitive ops so their
gradients come from the primitives' vjp rules (and CSE shares the forward work)."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ops.array import one_hot_p, stop_gradient
from graphdist.ops.core import bind
from graphdist.ops.math import (divide, exp, log, multiply, negative, reduce_max, reduce_sum,
                                subtract)


def log_softmax(logits, axis=-1):
    """log(softmax(logits)) along `axis`, computed stably.

    >>> gd.nn.log_softmax(np.zeros((1, 2), np.float32))
    array([[-0.6931472, -0.6931472]], dtype=float32)
    """
    shifted = subtract(logits, stop_gradient(reduce_max(logits, axis=axis, keepdims=True)))
    return subtract(shifted, log(reduce_sum(exp(shifted), axis=axis, keepdims=True)))


def softmax(logits, axis=-1):
    """exp(logits) normalized along `axis`.

    >>> gd.nn.softmax(np.zeros((1, 2), np.float32))
    array([[0.5, 0.5]], dtype=float32)
    """
    e = exp(subtract(logits, stop_gradient(reduce_max(logits, axis=axis, keepdims=True))))
    return divide(e, reduce_sum(e, axis=axis, keepdims=True))


def softmax_cross_entropy(labels, logits):
    """Per-example cross entropy with one-hot or probability `labels` (same shape as logits)."""
    label_shape = tuple(getattr(labels, "shape", np.shape(labels)))
    if label_shape != tuple(logits.shape):
        raise ShapeError(f"softmax_cross_entropy: labels {label_shape} and logits "
                         f"{tuple(logits.shape)} must have the same shape")
    return negative(reduce_sum(multiply(labels, log_softmax(logits)), axis=-1))


def sparse_softmax_cross_entropy(labels, logits):
    """Per-example cross entropy with integer class `labels` of shape logits.shape[:-1].

    >>> gd.nn.sparse_softmax_cross_entropy(np.array([1]), np.zeros((1, 2), np.float32))
    array([0.6931472], dtype=float32)
    """
    label_shape = tuple(getattr(labels, "shape", np.shape(labels)))
    if label_shape != tuple(logits.shape[:-1]):
        raise ShapeError(f"sparse_softmax_cross_entropy: labels {label_shape} must have the "
                         f"shape of logits {tuple(logits.shape)} without its last axis")
    # labels outside [0, classes) raise, eagerly now and in traced code when the step runs
    picked = bind(one_hot_p, labels, depth=int(logits.shape[-1]), dtype=np.dtype(logits.dtype),
                  checked_for="sparse_softmax_cross_entropy")
    return negative(reduce_sum(multiply(picked, log_softmax(logits)), axis=-1))
