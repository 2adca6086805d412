"""Attention's masks: the causal mask. Softmax under a mask (gd.nn.softmax(mask=)) and the
softmax op with its gradient op live in ops/softmax.py, softmax's one home; their names are
re-exported here for the callers that found them here."""

from __future__ import annotations

import numpy as np

from graphdist.ir.types import as_dtype
from graphdist.ops.array import cast, expand_dims
from graphdist.ops.construct import arange
from graphdist.ops.math import greater_equal
from graphdist.ops.softmax import (last_axis, masked_softmax, softmax_grad,  # noqa: F401
                                   softmax_grad_p, softmax_p, softmax_ref)


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
