"""gd.nn.moments and gd.nn.batch_normalization (TF's functions), composed from primitive ops
so their gradients come from the primitives' vjp rules. The BatchNorm layer is in layers.py."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ops.array import cast, squeeze, stop_gradient
from graphdist.ops.math import add, divide, multiply, reduce_mean, sqrt, square, subtract

_LOW_PRECISION = ("float16", "bfloat16")


def _axes(where: str, axes, ndim: int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    out = []
    for a in axes:
        if not -ndim <= int(a) < ndim:
            raise ShapeError(f"{where}: axis {a} is out of range for a rank-{ndim} tensor")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"{where}: repeated axis in {axes}")
    return tuple(sorted(out))


def moments(x, axes, keepdims=False):
    """(mean, variance) of `x` over `axes`, as tf.nn.moments (the biased variance); float16
    and bfloat16 inputs are reduced in float32.

    >>> mean, var = gd.nn.moments(np.array([[1., 3.], [3., 5.]], np.float32), axes=[0])
    >>> mean, var
    (array([2., 4.], dtype=float32), array([1., 1.], dtype=float32))
    """
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    axes = _axes("moments", axes, len(np.shape(x) if not hasattr(x, "shape") else x.shape))
    y = cast(x, "float32") if dtype.name in _LOW_PRECISION else x
    mean = reduce_mean(y, axis=axes, keepdims=True)
    # the variance's gradient through the mean is zero (deviations sum to zero): skip it
    variance = reduce_mean(square(subtract(y, stop_gradient(mean))), axis=axes, keepdims=True)
    if not keepdims:
        mean, variance = squeeze(mean, axis=axes), squeeze(variance, axis=axes)
    if dtype.name in _LOW_PRECISION:
        mean, variance = cast(mean, dtype), cast(variance, dtype)
    return mean, variance


def batch_normalization(x, mean, variance, offset, scale, variance_epsilon):
    """(x - mean) * scale / sqrt(variance + variance_epsilon) + offset, as
    tf.nn.batch_normalization; `offset` and `scale` may be None; all broadcast against x.

    >>> gd.nn.batch_normalization(np.array([1., 3.], np.float32), 2.0, 1.0, None, None, 0.0)
    array([-1.,  1.], dtype=float32)
    """
    inv = divide(1.0, sqrt(add(variance, variance_epsilon)))
    if scale is not None:
        inv = multiply(inv, scale)
    shift = multiply(mean, inv)
    shift = subtract(offset, shift) if offset is not None else multiply(shift, -1.0)
    return add(multiply(x, inv), shift)


__all__ = ["batch_normalization", "moments"]
