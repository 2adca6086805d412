"""Masks for attention: softmax and log_softmax over a bool mask (masked entries get
probability exactly 0, a fully masked row all zeros rather than NaN) or an additive float
mask, and the causal mask. Compositions of primitive ops; gd.nn.softmax(mask=) calls here."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import as_dtype
from graphdist.ops.array import cast, expand_dims, stop_gradient
from graphdist.ops.construct import arange
from graphdist.ops.math import (
    add,
    divide,
    exp,
    greater,
    greater_equal,
    log,
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
