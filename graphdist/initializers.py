"""gd.initializers: initial values for weights, as numpy arrays, with Keras's formulas (fans
as Keras computes them: a conv kernel HWIO has fan_in H*W*I and fan_out H*W*O). They draw
from gd.random (graphdist/random.py) now, even when called inside a trace."""

from __future__ import annotations

import math

import numpy as np

from graphdist.ir.types import as_dtype
from graphdist.random import draw_now

# stddev of a standard normal truncated to [-2, 2]: Keras divides by it so that the
# truncated samples have the variance asked for
_TRUNCATED_STDDEV = 0.87962566103423978


def compute_fans(shape) -> tuple[int, int]:
    """(fan_in, fan_out) of a kernel shape: dense (in, out); conv (*spatial, in, out).

    >>> compute_fans((3, 3, 16, 32))
    (144, 288)
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def _variance_scaling(shape, dtype, seed, generator, scale: float, mode: str,
                      distribution: str) -> np.ndarray:
    fan_in, fan_out = compute_fans(shape)
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    variance = scale / max(1.0, n)
    dtype = as_dtype(dtype)
    if distribution == "uniform":
        limit = math.sqrt(3 * variance)
        u = draw_now("uniform", shape, dtype, seed, generator)
        return (u * dtype.type(2 * limit) + dtype.type(-limit)).astype(dtype)  # TF's rounding
    stddev = math.sqrt(variance) / _TRUNCATED_STDDEV
    return (draw_now("truncated_normal", shape, dtype, seed, generator)
            * dtype.type(stddev)).astype(dtype)


def glorot_uniform(shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Uniform in [-limit, limit), limit = sqrt(6 / (fan_in + fan_out)) (Keras GlorotUniform).

    >>> gd.initializers.glorot_uniform((784, 10), seed=0).shape
    (784, 10)
    """
    return _variance_scaling(shape, dtype, seed, generator, 1.0, "fan_avg", "uniform")


def glorot_normal(shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Truncated normal with stddev sqrt(2 / (fan_in + fan_out)) (Keras GlorotNormal)."""
    return _variance_scaling(shape, dtype, seed, generator, 1.0, "fan_avg", "truncated_normal")


def he_normal(shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Truncated normal with stddev sqrt(2 / fan_in) (Keras HeNormal: the truncated
    samples have that stddev; none is beyond 2 / 0.8796 of it).

    >>> gd.initializers.he_normal((3, 3, 16, 32), seed=0).shape
    (3, 3, 16, 32)
    """
    return _variance_scaling(shape, dtype, seed, generator, 2.0, "fan_in", "truncated_normal")


def he_uniform(shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Uniform in [-limit, limit), limit = sqrt(6 / fan_in) (Keras HeUniform)."""
    return _variance_scaling(shape, dtype, seed, generator, 2.0, "fan_in", "uniform")


def random_uniform(shape, dtype="float32", minval=-0.05, maxval=0.05, seed=None,
                   generator=None) -> np.ndarray:
    """Uniform in [minval, maxval) (Keras RandomUniform; Embedding's default, "uniform").

    >>> float(np.abs(gd.initializers.random_uniform((100,), seed=0)).max()) <= 0.05
    True
    """
    dtype = as_dtype(dtype)
    u = draw_now("uniform", tuple(shape), dtype, seed, generator)
    return (u * dtype.type(maxval - minval) + dtype.type(minval)).astype(dtype)


uniform = random_uniform     # Keras's string name for it


def random_normal(shape, dtype="float32", mean=0.0, stddev=0.05, seed=None,
                  generator=None) -> np.ndarray:
    """Normal with `mean` and `stddev` (Keras RandomNormal)."""
    dtype = as_dtype(dtype)
    z = draw_now("normal", tuple(shape), dtype, seed, generator)
    return (z * dtype.type(stddev) + dtype.type(mean)).astype(dtype)


def zeros(shape, dtype="float32") -> np.ndarray:
    return np.zeros(tuple(shape) if not isinstance(shape, int) else (shape,), as_dtype(dtype))


def ones(shape, dtype="float32") -> np.ndarray:
    return np.ones(tuple(shape) if not isinstance(shape, int) else (shape,), as_dtype(dtype))


__all__ = ["compute_fans", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform", "ones",
           "random_normal", "random_uniform", "uniform", "zeros"]
