"""gd.metrics: Keras's streaming metrics on sync-on-read state.

Every metric keeps its state in sync-on-read SUM variables (`Metric.add_state`), made under
the strategy whose scope the metric was made in. So one metric works everywhere a TF user
tries it: inside `strategy.run` (compiled or not) each replica adds to its own component, no
collective; in cross-replica context (eagerly, or in a gd.function outside run) an update
adds to the global total (TF's SyncOnReadVariable refuses assign_add there); and `result()`
read in cross-replica context sums the replicas' components, so it is the global value.
The update arithmetic is written with gd ops, so it runs eagerly on numpy and in traced
code alike.
"""

from __future__ import annotations

import re

import numpy as np

from graphdist.distribute.values import VariableAggregation, VariableSynchronization
from graphdist.ops.array import cast, expand_dims, reshape
from graphdist.ops.core import current_tracer
from graphdist.ops.math import (argmax, divide, equal, greater, matmul, multiply, reduce_sum,
                                square, subtract, where)
from graphdist.variables import Variable


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _size(x) -> int:
    return int(np.prod(_shape(x), dtype=np.int64))


def _as(x, dtype):
    """`x` (a tensor, array or number) in `dtype`."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    return x if np.dtype(x.dtype) == np.dtype(dtype) else cast(x, np.dtype(dtype))


def _div_no_nan(a, b):
    """a / b, and 0 where b is 0 (TF's divide_no_nan: a metric with no examples reads 0)."""
    zero = np.zeros((), np.dtype(b.dtype))
    empty = equal(b, zero)
    return where(empty, zero, divide(a, where(empty, np.ones((), np.dtype(b.dtype)), b)))


def _concrete(value):
    """Eager results as numpy scalars (0-d arrays become np.float32, say)."""
    if current_tracer() is None and isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


class Metric:
    """Base class: a name, sync-on-read SUM state made by `add_state`, and Keras's
    `update_state` / `result` / `reset_state`; calling the metric updates it and returns
    the result. Subclasses define `update_state` and `result`.

    >>> m = gd.metrics.Mean(); m.update_state([1.0, 2.0, 3.0]); m.result()
    2.0
    """

    def __init__(self, name: str | None = None, dtype="float32"):
        self.name = name or re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()
        self.dtype = np.dtype(dtype)
        self._state: dict[str, Variable] = {}

    def add_state(self, name: str, shape=(), dtype=None) -> Variable:
        """A zero-initialized sync-on-read SUM variable on the current strategy."""
        v = Variable(np.zeros(shape, dtype or self.dtype), name=f"{self.name}/{name}",
                     trainable=False, synchronization=VariableSynchronization.ON_READ,
                     aggregation=VariableAggregation.SUM)
        self._state[name] = v
        return v

    @property
    def variables(self) -> list:
        return list(self._state.values())

    def update_state(self, *args, **kwargs):
        raise NotImplementedError

    def result(self):
        raise NotImplementedError

    def reset_state(self) -> None:
        """Every state variable back to zero (on every replica)."""
        for v in self._state.values():
            v.assign(np.zeros(v.shape, v.dtype))

    reset_states = reset_state             # Keras 2's name

    def __call__(self, *args, **kwargs):
        self.update_state(*args, **kwargs)
        return self.result()

    def _checkpoint_children(self):
        """gd.Checkpoint saves the state by its short name (BackupAndRestore resumes it)."""
        return list(self._state.items())

    def __repr__(self) -> str:
        return f"<gd.metrics.{type(self).__name__} '{self.name}'>"


class Sum(Metric):
    """The running sum of the values (weighted by `sample_weight`)."""

    def __init__(self, name: str | None = None, dtype="float32"):
        super().__init__(name, dtype)
        self.total = self.add_state("total")

    def update_state(self, values, sample_weight=None):
        values = _as(values, self.dtype)
        if sample_weight is not None:
            values = multiply(values, _as(sample_weight, self.dtype))
        self.total.assign_add(reduce_sum(values))

    def result(self):
        return _concrete(self.total.read_value())


class Mean(Metric):
    """The running (weighted) mean of the values: total / count, 0 before any value."""

    def __init__(self, name: str | None = None, dtype="float32"):
        super().__init__(name, dtype)
        self.total = self.add_state("total")
        self.count = self.add_state("count")

    def update_state(self, values, sample_weight=None):
        values = _as(values, self.dtype)
        if sample_weight is None:
            self.total.assign_add(reduce_sum(values))
            self.count.assign_add(np.asarray(_size(values), self.dtype))
            return
        weight = multiply(_as(sample_weight, self.dtype), np.ones(_shape(values), self.dtype))
        self.total.assign_add(reduce_sum(multiply(values, weight)))
        self.count.assign_add(reduce_sum(weight))

    def add_sum(self, total, count) -> None:
        """Add a sum of values and how many they were (Model.fit's loss: the per-example
        losses' sum and the shard's size)."""
        self.total.assign_add(_as(total, self.dtype))
        self.count.assign_add(_as(count, self.dtype))

    def result(self):
        return _concrete(_div_no_nan(self.total.read_value(), self.count.read_value()))


class _MeanOf(Mean):
    """The mean over examples of a per-example value `values(y_true, y_pred)`."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(self.values(y_true, y_pred), sample_weight)

    def values(self, y_true, y_pred):
        raise NotImplementedError


def _sparse_labels(y_true, y_pred):
    if len(_shape(y_true)) == len(_shape(y_pred)) and _shape(y_true)[-1:] == (1,):
        y_true = reshape(y_true, _shape(y_true)[:-1])
    return _as(y_true, np.int64)


class SparseCategoricalAccuracy(_MeanOf):
    """How often argmax(y_pred) equals the integer label."""

    def values(self, y_true, y_pred):
        return equal(argmax(y_pred, axis=-1), _sparse_labels(y_true, y_pred))


class CategoricalAccuracy(_MeanOf):
    """How often argmax(y_pred) equals argmax(y_true) (one-hot labels)."""

    def values(self, y_true, y_pred):
        return equal(argmax(y_pred, axis=-1), argmax(y_true, axis=-1))


class BinaryAccuracy(_MeanOf):
    """How often (y_pred > threshold) equals the 0/1 label, over every element."""

    def __init__(self, name: str | None = None, dtype="float32", threshold: float = 0.5):
        super().__init__(name, dtype)
        self.threshold = float(threshold)

    def values(self, y_true, y_pred):
        predicted = greater(y_pred, np.asarray(self.threshold, np.dtype(y_pred.dtype)
                                               if hasattr(y_pred, "dtype") else np.float32))
        return equal(_as(predicted, self.dtype), _as(y_true, self.dtype))


class MeanSquaredError(_MeanOf):
    """The mean over examples of the mean squared error over the last axis."""

    def values(self, y_true, y_pred):
        from graphdist.ops.math import reduce_mean

        error = square(subtract(_as(y_true, self.dtype), _as(y_pred, self.dtype)))
        return reduce_mean(error, axis=-1) if len(_shape(error)) >= 2 else error


class _Confusion(Metric):
    """Counts of true/false positives/negatives of (y_pred > threshold) against 0/1 labels,
    over every element (Keras's thresholded metrics, one threshold)."""

    kinds: tuple = ()

    def __init__(self, thresholds=None, name: str | None = None, dtype="float32"):
        super().__init__(name, dtype)
        self.thresholds = 0.5 if thresholds is None else float(thresholds)
        for kind in self.kinds:
            setattr(self, kind, self.add_state(kind))

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = _as(y_pred, y_pred.dtype if hasattr(y_pred, "dtype") else np.float32)
        threshold = np.asarray(self.thresholds, np.dtype(y_pred.dtype))
        predicted = _as(greater(y_pred, threshold), self.dtype)
        actual = _as(y_true, self.dtype)
        weight = (np.ones((), self.dtype) if sample_weight is None
                  else _as(sample_weight, self.dtype))
        one = np.ones((), self.dtype)
        counts = {"true_positives": multiply(predicted, actual),
                  "false_positives": multiply(predicted, subtract(one, actual)),
                  "false_negatives": multiply(subtract(one, predicted), actual)}
        for kind in self.kinds:
            self._state[kind].assign_add(reduce_sum(multiply(counts[kind], weight)))


class Precision(_Confusion):
    """true positives / (true positives + false positives)."""

    kinds = ("true_positives", "false_positives")

    def result(self):
        tp = self.true_positives.read_value()
        return _concrete(_div_no_nan(tp, tp + self.false_positives.read_value()))


class Recall(_Confusion):
    """true positives / (true positives + false negatives)."""

    kinds = ("true_positives", "false_negatives")

    def result(self):
        tp = self.true_positives.read_value()
        return _concrete(_div_no_nan(tp, tp + self.false_negatives.read_value()))


class AUC(Metric):
    """The area under the ROC curve, as Keras's AUC (curve="ROC",
    summation_method="interpolation"): confusion counts at `num_thresholds` thresholds
    (0 - 1e-7, i / (num_thresholds - 1), 1 + 1e-7) and the trapezoidal rule over them.

    An approximation of the exact ROC AUC: a positive and a negative whose scores fall
    between the same two thresholds count as a tie (half a correctly ordered pair), so the
    result differs from the exact AUC by at most half the share of (positive, negative)
    pairs that share a bucket; with the default 200 thresholds and scores spread over
    [0, 1], about 1e-3 (tests/test_metrics.py checks that bound).
    """

    def __init__(self, num_thresholds: int = 200, curve: str = "ROC",
                 summation_method: str = "interpolation", name: str | None = None,
                 dtype="float32"):
        super().__init__(name or "auc", dtype)
        if int(num_thresholds) < 2:
            raise ValueError(f"AUC: num_thresholds must be > 1, got {num_thresholds}")
        if curve != "ROC" or summation_method != "interpolation":
            raise ValueError(f"AUC: only curve='ROC' with summation_method='interpolation' is "
                             f"supported, got curve={curve!r}, "
                             f"summation_method={summation_method!r}")
        self.num_thresholds = int(num_thresholds)
        inner = [i / (self.num_thresholds - 1) for i in range(1, self.num_thresholds - 1)]
        self.thresholds = np.array([0.0 - 1e-7] + inner + [1.0 + 1e-7])
        shape = (self.num_thresholds,)
        self.true_positives = self.add_state("true_positives", shape)
        self.false_positives = self.add_state("false_positives", shape)
        self.true_negatives = self.add_state("true_negatives", shape)
        self.false_negatives = self.add_state("false_negatives", shape)

    def update_state(self, y_true, y_pred, sample_weight=None):
        scores = reshape(_as(y_pred, np.float32), (-1,))
        labels = reshape(_as(y_true, self.dtype), (-1,))
        one = np.ones((), self.dtype)
        weight = (np.ones((_size(scores),), self.dtype) if sample_weight is None else
                  reshape(multiply(_as(sample_weight, self.dtype),
                                   np.ones(_shape(y_pred), self.dtype)), (-1,)))
        positive = multiply(labels, weight)
        negative = multiply(subtract(one, labels), weight)
        # (thresholds, examples): is the example predicted positive at each threshold?
        above = _as(greater(expand_dims(scores, 0),
                            self.thresholds.astype(np.float32).reshape(-1, 1)), self.dtype)
        tp = matmul(above, expand_dims(positive, 1))
        fp = matmul(above, expand_dims(negative, 1))
        tp, fp = reshape(tp, (-1,)), reshape(fp, (-1,))
        self.true_positives.assign_add(tp)
        self.false_positives.assign_add(fp)
        self.false_negatives.assign_add(subtract(reduce_sum(positive), tp))
        self.true_negatives.assign_add(subtract(reduce_sum(negative), fp))

    def result(self):
        tp, fp = self.true_positives.read_value(), self.false_positives.read_value()
        tn, fn = self.true_negatives.read_value(), self.false_negatives.read_value()
        tpr = _div_no_nan(tp, tp + fn)
        fpr = _div_no_nan(fp, fp + tn)
        n = self.num_thresholds
        heights = divide(tpr[: n - 1] + tpr[1:], np.asarray(2.0, self.dtype))
        return _concrete(reduce_sum(multiply(subtract(fpr[: n - 1], fpr[1:]), heights)))


_ACCURACY = {"sparse_categorical_crossentropy": SparseCategoricalAccuracy,
             "categorical_crossentropy": CategoricalAccuracy,
             "binary_crossentropy": BinaryAccuracy}
_BY_NAME = {"sparse_categorical_accuracy": SparseCategoricalAccuracy,
            "categorical_accuracy": CategoricalAccuracy, "binary_accuracy": BinaryAccuracy,
            "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError,
            "precision": Precision, "recall": Recall, "auc": AUC}


def get(metric, loss_name: str = ""):
    """compile's metric entries -> Metric objects (made under the current strategy):
    "accuracy"/"acc" picks the accuracy that fits the loss, as Keras does; other names
    make their class, named as written; Metric objects are taken as they are."""
    if isinstance(metric, Metric):
        return metric
    if not isinstance(metric, str):
        raise TypeError(f"compile: a metric must be a name or a gd.metrics.Metric, got "
                        f"{type(metric).__name__}")
    if metric in ("accuracy", "acc"):
        kind = _ACCURACY.get(loss_name)
        if kind is None:
            raise ValueError(f"compile: metric {metric!r} with loss {loss_name!r}: say which "
                             "accuracy (e.g. 'sparse_categorical_accuracy' or "
                             "gd.metrics.BinaryAccuracy())")
        return kind(name=metric)
    if metric not in _BY_NAME:
        raise ValueError(f"compile: unknown metric {metric!r}; use 'accuracy' or one of "
                         f"{sorted(_BY_NAME)}, or a gd.metrics.Metric")
    return _BY_NAME[metric](name=metric)


__all__ = ["AUC", "BinaryAccuracy", "CategoricalAccuracy", "Mean", "MeanSquaredError",
           "Metric", "Precision", "Recall", "Sum", "SparseCategoricalAccuracy", "get"]
