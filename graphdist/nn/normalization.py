"""Normalization, in one home: gd.nn.moments and gd.nn.batch_normalization (TF's functions)
and the BatchNorm and LayerNorm layers (Keras's), with layer_norm re-exported from its op.

The functions are composed from primitive ops, so their gradients come from the primitives'
vjp rules; BatchNorm builds on them (its synchronized form adds one all-reduce of the
per-replica sums). Layer normalization is one op each way (ops/layer_norm.py, with a fused
CPU kernel); the op stays with the other ops, as every op's rules do, and LayerNorm calls it.
"""

from __future__ import annotations

import numpy as np

from graphdist.distribute.context import get_replica_context
from graphdist.distribute.values import VariableAggregation, VariableSynchronization
from graphdist.errors import ShapeError
from graphdist.ir.types import LOW_PRECISION
from graphdist.nn.layers import Layer, _dtype, _initial, _shape
from graphdist.ops.array import cast, concat, reshape, split, squeeze, stop_gradient
from graphdist.ops.core import normalize_axis
from graphdist.ops.layer_norm import layer_norm  # noqa: F401  (gd.nn.layer_norm)
from graphdist.ops.math import (add, divide, maximum, multiply, reduce_mean, reduce_sum, sqrt,
                                square, subtract)


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
    y = cast(x, "float32") if dtype in LOW_PRECISION else x
    mean = reduce_mean(y, axis=axes, keepdims=True)
    # the variance's gradient through the mean is zero (deviations sum to zero): skip it
    variance = reduce_mean(square(subtract(y, stop_gradient(mean))), axis=axes, keepdims=True)
    if not keepdims:
        mean, variance = squeeze(mean, axis=axes), squeeze(variance, axis=axes)
    if dtype in LOW_PRECISION:
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


def _global_moments(x, axes):
    """Mean and variance of the global batch: one all-reduce of [sum, sum of squares,
    count] (counts differ when shards do)."""
    count = float(np.prod([_shape(x)[a] for a in axes]))
    x32 = cast(x, "float32") if np.dtype(x.dtype).itemsize < 4 else x
    total, squares = reduce_sum(x32, axis=axes), reduce_sum(square(x32), axis=axes)
    ctx = get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        size = _shape(total)[0]
        packed = concat([total, squares, np.full((1,), count, x32.dtype)], axis=0)
        total, squares, count = split(ctx.all_reduce("sum", packed), [size, size, 1])
    mean = divide(total, count)
    variance = maximum(subtract(divide(squares, count), square(mean)), 0.0)
    if x32 is not x:
        mean, variance = cast(mean, x.dtype), cast(variance, x.dtype)
    return mean, variance


class BatchNorm(Layer):
    """Batch normalization over every axis but `axis` (Keras's BatchNormalization).

    Training: normalize with the batch's mean and (biased) variance and move the moving
    statistics toward them (moving = moving * momentum + batch * (1 - momentum)). Inference:
    normalize with the moving statistics. Under a strategy the moving statistics are
    sync-on-read MEAN variables: each replica updates its own component from its own batch,
    and cross-replica reads and checkpoints see the mean over replicas (inference inside
    strategy.run reads the replica's own component, as in TF). With
    `synchronized=True` the batch statistics are those of the global batch: the per-replica
    sums, sums of squares and counts cross replicas in one all-reduce.

    >>> bn = gd.nn.BatchNorm(); y = bn(np.ones((4, 3), np.float32), training=True)
    """

    default_name = "batch_normalization"

    def __init__(self, axis: int = -1, momentum: float = 0.99, epsilon: float = 1e-3,
                 center: bool = True, scale: bool = True, synchronized: bool = False,
                 name=None, dtype=None):
        super().__init__(name, dtype)
        self.axis, self.momentum, self.epsilon = int(axis), float(momentum), float(epsilon)
        self.center, self.scale, self.synchronized = bool(center), bool(scale), synchronized

    def build(self, input_shape):
        ndim = len(input_shape)
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"BatchNorm '{self.name}': axis {self.axis} is out of range for "
                             f"inputs of shape {input_shape} (rank {ndim})")
        size, dtype = input_shape[self.axis], self.dtype
        if self.scale:
            self.gamma = self.add_weight("gamma", np.ones(size, dtype))
        if self.center:
            self.beta = self.add_weight("beta", np.zeros(size, dtype))
        stats = {"trainable": False, "synchronization": VariableSynchronization.ON_READ,
                 "aggregation": VariableAggregation.MEAN}
        self.moving_mean = self.add_weight("moving_mean", np.zeros(size, dtype), **stats)
        self.moving_variance = self.add_weight("moving_variance", np.ones(size, dtype), **stats)
        self.rank = ndim
        self._fixed_axes = {self.axis: size}

    def call(self, x, training=False):
        low = _dtype(x) if _dtype(x) in LOW_PRECISION else None
        if low is not None:     # as Keras: normalize float16/bfloat16 inputs in float32
            x = cast(x, self.dtype)
        y = self._normalize(x, training)
        return cast(y, low) if low is not None else y

    def _normalize(self, x, training):
        ndim = len(_shape(x))
        axis = self.axis % ndim
        reduce_axes = tuple(a for a in range(ndim) if a != axis)
        if training:
            mean, variance = (_global_moments(x, reduce_axes) if self.synchronized
                              else moments(x, reduce_axes))
            for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
                # TF's assign_moving_average: moving -= (moving - batch) * (1 - momentum)
                moving.assign_sub(multiply(subtract(moving, stop_gradient(batch)),
                                           1.0 - self.momentum))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        params = [mean, variance, getattr(self, "beta", None), getattr(self, "gamma", None)]
        if axis != ndim - 1:        # per-channel vectors broadcast along `axis`
            shape = tuple(-1 if a == axis else 1 for a in range(ndim))
            params = [None if p is None else reshape(p, shape) for p in params]
        mean, variance, beta, gamma = params
        return batch_normalization(x, mean, variance, beta, gamma, self.epsilon)


class LayerNorm(Layer):
    """Normalize over `axis` (the last axis, or a tuple of trailing axes), then scale by
    gamma and shift by beta (Keras's LayerNormalization; one fused op).

    >>> y = gd.nn.LayerNorm()(np.ones((2, 4), np.float32))
    """

    default_name = "layer_normalization"

    def __init__(self, axis=-1, epsilon: float = 1e-5, center: bool = True, scale: bool = True,
                 beta_initializer="zeros", gamma_initializer="ones", name=None, dtype=None):
        super().__init__(name, dtype)
        self.axis = axis if isinstance(axis, (int, np.integer)) else tuple(axis)
        self.epsilon, self.center, self.scale = float(epsilon), bool(center), bool(scale)
        self.beta_initializer, self.gamma_initializer = beta_initializer, gamma_initializer

    def build(self, input_shape):
        ndim = len(input_shape)
        axes = normalize_axis(f"LayerNorm '{self.name}'", self.axis, ndim, input_shape)
        if axes != tuple(range(ndim - len(axes), ndim)):
            raise ShapeError(f"LayerNorm '{self.name}': axis must be the last axis or trailing "
                             f"axes, got {self.axis} for inputs of shape {input_shape}")
        shape = tuple(input_shape[a] for a in axes)
        if self.scale:
            self.gamma = self.add_weight("gamma", _initial(self.gamma_initializer, shape,
                                                           self.dtype))
        if self.center:
            self.beta = self.add_weight("beta", _initial(self.beta_initializer, shape,
                                                         self.dtype))
        given = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        if any(a >= 0 for a in given):          # axes counted from the front: a fixed rank
            self.rank = ndim
        self._fixed_axes = {a - ndim: input_shape[a] for a in axes}

    def call(self, x, training=False):
        gamma, beta = (cast(w, _dtype(x)) if w is not None else None
                       for w in (getattr(self, "gamma", None), getattr(self, "beta", None)))
        axes = tuple(range(-len(self._fixed_axes), 0))
        return layer_norm(x, gamma, beta, axis=axes, epsilon=self.epsilon)


__all__ = ["BatchNorm", "LayerNorm", "batch_normalization", "layer_norm", "moments"]
