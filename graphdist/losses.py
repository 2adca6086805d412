"""gd.losses: Keras's losses as per-example functions, for `Model.compile(loss=...)`.

A loss here maps (y_true, y_pred) to one value per example; the model owns the reduction
(the sum over the replica's examples divided by the global batch size, so that N replicas
update as one device). The crossentropy names take probabilities, as Keras's defaults do;
the class forms take `from_logits=True` for logits. Every loss computes in float32 at least
(float16 predictions are cast up first), so a scaled loss cannot overflow.
"""

from __future__ import annotations

import numpy as np

from graphdist.ir.types import is_float
from graphdist.ops.array import cast, one_hot, reshape
from graphdist.ops.math import (abs, add, clip_by_value, divide, exp, log, maximum, multiply,
                                negative, reduce_mean, reduce_sum, square, subtract)
from graphdist.ops.nn import softmax_cross_entropy, sparse_softmax_cross_entropy

EPSILON = 1e-7          # Keras's backend epsilon: probabilities are clipped to [eps, 1 - eps]


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _float(x):
    """`x` as a float tensor of at least 32 bits (numbers, ints and float16 go to float32)."""
    dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    if is_float(dtype) and dtype.itemsize >= 4:
        return x
    return cast(x, "float32")


def _like(x, value: float):
    return np.asarray(value, np.dtype(x.dtype))


def _labels(y_true, y_pred):
    """Sparse integer labels of shape (batch,) (Keras also takes (batch, 1))."""
    if len(_shape(y_true)) == len(_shape(y_pred)) and _shape(y_true)[-1:] == (1,):
        y_true = reshape(y_true, _shape(y_true)[:-1])
    return cast(y_true, "int32")


def _normalized_log(y_pred):
    """log of probabilities rescaled to sum 1 over the last axis and clipped to [eps, 1-eps]
    (Keras's crossentropy on probabilities)."""
    p = _float(y_pred)
    p = divide(p, reduce_sum(p, axis=-1, keepdims=True))
    return log(clip_by_value(p, _like(p, EPSILON), _like(p, 1 - EPSILON)))


def sparse_categorical_crossentropy(y_true, y_pred, from_logits: bool = False):
    """-log p[label] per example; y_pred holds probabilities (or logits with from_logits)."""
    labels = _labels(y_true, y_pred)
    if from_logits:
        return sparse_softmax_cross_entropy(labels, _float(y_pred))
    logp = _normalized_log(y_pred)
    return negative(reduce_sum(multiply(one_hot(labels, _shape(y_pred)[-1], dtype=logp.dtype),
                                        logp), axis=-1))


def categorical_crossentropy(y_true, y_pred, from_logits: bool = False):
    """-sum(y_true * log p) per example over the last axis."""
    if from_logits:
        logits = _float(y_pred)
        return softmax_cross_entropy(cast(y_true, np.dtype(logits.dtype)), logits)
    logp = _normalized_log(y_pred)
    return negative(reduce_sum(multiply(cast(y_true, np.dtype(logp.dtype)), logp), axis=-1))


def binary_crossentropy(y_true, y_pred, from_logits: bool = False):
    """The mean over the last axis of -(y log p + (1-y) log(1-p)), p clipped to [eps,
    1-eps]; with logits x the stable form max(x, 0) - x*y + log(1 + exp(-|x|))."""
    x = _float(y_pred)
    y = cast(y_true, np.dtype(x.dtype))
    if from_logits:
        per = add(subtract(maximum(x, _like(x, 0.0)), multiply(x, y)),
                  log(add(_like(x, 1.0), exp(negative(abs(x))))))
    else:
        p = clip_by_value(x, _like(x, EPSILON), _like(x, 1 - EPSILON))
        per = negative(add(multiply(y, log(p)),
                           multiply(subtract(_like(x, 1.0), y),
                                    log(subtract(_like(x, 1.0), p)))))
    return _per_example(per)


def mean_squared_error(y_true, y_pred):
    """The mean over the last axis of (y_true - y_pred)**2 (per element for 1-D targets)."""
    x = _float(y_pred)
    return _per_example(square(subtract(cast(y_true, np.dtype(x.dtype)), x)))


def mean_absolute_error(y_true, y_pred):
    x = _float(y_pred)
    return _per_example(abs(subtract(cast(y_true, np.dtype(x.dtype)), x)))


def _per_example(values):
    """Keras's mean over the last axis; 1-D values are already one per example."""
    return reduce_mean(values, axis=-1) if len(_shape(values)) >= 2 else values


class Loss:
    """A loss object, as Keras's: `call(y_true, y_pred)` gives the per-example losses (what
    Model.compile uses), calling the object gives their mean."""

    fn = None

    def __init__(self, from_logits: bool = False, name: str | None = None):
        self.from_logits = bool(from_logits)
        self.name = name or _NAMES[type(self)]

    def call(self, y_true, y_pred):
        return type(self).fn(y_true, y_pred, from_logits=self.from_logits)

    def __call__(self, y_true, y_pred):
        return reduce_mean(self.call(y_true, y_pred))

    def __repr__(self) -> str:
        return f"gd.losses.{type(self).__name__}(from_logits={self.from_logits})"


class SparseCategoricalCrossentropy(Loss):
    fn = staticmethod(sparse_categorical_crossentropy)


class CategoricalCrossentropy(Loss):
    fn = staticmethod(categorical_crossentropy)


class BinaryCrossentropy(Loss):
    fn = staticmethod(binary_crossentropy)


class MeanSquaredError(Loss):
    def __init__(self, name: str | None = None):
        super().__init__(False, name)

    def call(self, y_true, y_pred):
        return mean_squared_error(y_true, y_pred)


class MeanAbsoluteError(Loss):
    def __init__(self, name: str | None = None):
        super().__init__(False, name)

    def call(self, y_true, y_pred):
        return mean_absolute_error(y_true, y_pred)


_NAMES = {SparseCategoricalCrossentropy: "sparse_categorical_crossentropy",
          CategoricalCrossentropy: "categorical_crossentropy",
          BinaryCrossentropy: "binary_crossentropy", MeanSquaredError: "mean_squared_error",
          MeanAbsoluteError: "mean_absolute_error"}

BY_NAME = {"sparse_categorical_crossentropy": sparse_categorical_crossentropy,
           "categorical_crossentropy": categorical_crossentropy,
           "binary_crossentropy": binary_crossentropy,
           "mse": mean_squared_error, "mean_squared_error": mean_squared_error,
           "mae": mean_absolute_error, "mean_absolute_error": mean_absolute_error}


def get(loss):
    """compile's `loss` -> (per-example function, name): a name, a Loss object or a callable
    (y_true, y_pred) -> per-example losses."""
    if isinstance(loss, str):
        if loss not in BY_NAME:
            raise ValueError(f"unknown loss {loss!r}; use one of {sorted(BY_NAME)}, a "
                             "gd.losses object or a callable (y_true, y_pred) -> per-example "
                             "loss")
        return BY_NAME[loss], loss
    if isinstance(loss, Loss):
        return loss.call, loss.name
    if callable(loss):
        return loss, getattr(loss, "__name__", "loss")
    raise TypeError(f"loss must be a name, a gd.losses object or a callable, got "
                    f"{type(loss).__name__}")


__all__ = ["BinaryCrossentropy", "CategoricalCrossentropy", "Loss", "MeanAbsoluteError",
           "MeanSquaredError", "SparseCategoricalCrossentropy", "binary_crossentropy",
           "categorical_crossentropy", "get", "mean_absolute_error", "mean_squared_error",
           "sparse_categorical_crossentropy"]
