"""Clipping by norm, as TF's: gd.clip_by_global_norm (and global_norm, which it uses). Built
from ops in math.py and array.py; the optimizer's clipnorm/global_clipnorm use it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphdist.ops.array import cast
from graphdist.ops.math import add, divide, maximum, multiply, reduce_sum, sqrt, square, subtract
from graphdist.ops.sparse import IndexedSlices, sum_duplicates


def _merged(t):
    # a sparse gradient (gd.IndexedSlices) is clipped through its rows, as TF does, once
    # repeated indices are summed (TF sums their squares instead, overstating the norm)
    return sum_duplicates(t) if isinstance(t, IndexedSlices) else t


def _values(t):
    return t.values if isinstance(t, IndexedSlices) else t


def norm_dtype(dtypes) -> np.dtype:
    """Sums of squares in float32 at least (float16 squares overflow), float64 if any is."""
    return np.result_type(np.float32, *(np.dtype(d) for d in dtypes))


def global_norm(t_list):
    """sqrt(sum of every entry's squared L2 norm); None entries are skipped.

    >>> gd.clip_by_global_norm([np.array([3.0]), np.array([4.0])], 10.0)[1]
    array(5.)
    """
    values = [_values(_merged(t)) for t in t_list if t is not None]
    if not values:
        raise ValueError("global_norm: no tensors (every entry is None)")
    dtype = norm_dtype(getattr(v, "dtype", np.float64) for v in values)
    total = None
    for v in values:
        s = reduce_sum(square(cast(v, dtype)))
        total = s if total is None else add(total, s)
    return sqrt(total)


def clip_by_global_norm(t_list, clip_norm, use_norm=None):
    """Scale every tensor of `t_list` by clip_norm / max(global_norm, clip_norm), so that
    their global norm is at most `clip_norm`; returns (clipped list, global norm). As TF:
    None entries stay None, `use_norm` replaces the computed norm, and a non-finite norm
    makes every entry NaN.

    >>> clipped, norm = gd.clip_by_global_norm([np.array([3.0]), np.array([4.0])], 1.0)
    >>> clipped[1], norm
    (array([0.8]), array(5.))
    """
    if isinstance(t_list, (str, bytes)) or not isinstance(t_list, Sequence):
        raise TypeError(f"clip_by_global_norm: t_list must be a sequence of tensors, got "
                        f"{type(t_list).__name__}")
    t_list = [None if t is None else _merged(t) for t in t_list]
    norm = global_norm(t_list) if use_norm is None else use_norm
    if isinstance(clip_norm, (int, float, np.number)):   # a number takes the norm's dtype
        clip_norm = float(clip_norm)
        if not clip_norm > 0:
            raise ValueError(f"clip_by_global_norm: clip_norm must be positive, got "
                             f"{clip_norm}")
    # + (norm - norm): 0 for a finite norm, NaN for inf or NaN (c / max(inf, c) would be 0)
    scale = add(divide(clip_norm, maximum(norm, clip_norm)), subtract(norm, norm))
    out = []
    for t in t_list:
        if t is None:
            out.append(None)
            continue
        values = _values(t)
        clipped = multiply(values, cast(scale, getattr(values, "dtype", np.float64)))
        out.append(clipped if values is t else IndexedSlices(t.indices, clipped, t.dense_shape,
                                                             unique=True))
    return out, norm


__all__ = ["clip_by_global_norm", "global_norm"]
