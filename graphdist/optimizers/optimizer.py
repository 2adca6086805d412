"""gd.optimizers: SGD (momentum, nesterov, coupled weight decay), Adam and AdamW.

apply_gradients emits one update eqn per variable (sgd_update, sgd_momentum_update,
adam_update) followed by assigns; in a replica context the gradients are first all-reduced
(unless all_reduce=False), then clipped (clipnorm / global_clipnorm).
"""

from __future__ import annotations

import numpy as np

from graphdist.distribute.context import get_replica_context
from graphdist.ops import optim
from graphdist.ops.array import cast
from graphdist.distribute.sparse import all_reduce_gradients
from graphdist.ops.core import bind, current_tracer
from graphdist.ops.math import (add, divide, maximum, multiply, power, reduce_sum, sqrt, square,
                                subtract)
from graphdist.variables import Variable


class Optimizer:
    """Shared machinery: slots, iteration count, gradient reduction and eager application."""

    def __init__(self, name: str, gradient_reduction: str = "mean", clipnorm=None,
                 global_clipnorm=None):
        if gradient_reduction not in ("mean", "sum"):
            raise ValueError(f"{name}: gradient_reduction must be 'mean' or 'sum', got "
                             f"{gradient_reduction!r}")
        if clipnorm is not None and global_clipnorm is not None:
            raise ValueError(f"{name}: pass clipnorm or global_clipnorm, not both")
        self.name = name
        self.gradient_reduction = gradient_reduction
        self.clipnorm = _positive(f"{name}: clipnorm", clipnorm)
        self.global_clipnorm = _positive(f"{name}: global_clipnorm", global_clipnorm)
        self.iterations = Variable(np.int64(0), name=f"{name}/iterations", trainable=False)
        self._slots: dict = {}
        self._eager_steps: dict = {}

    def slot(self, var: Variable, name: str) -> Variable:
        """The optimizer's `name` slot for `var` (a zero-initialized mirrored variable)."""
        key = (var, name)
        if key not in self._slots:
            self._slots[key] = Variable(np.zeros(var.shape, var.dtype), trainable=False,
                                        name=f"{var.name}/{self.name}/{name}",
                                        _devices=var.devices, _strategy=var._strategy)
        return self._slots[key]

    def slots(self) -> dict:
        return {f"{var.name}/{name}": v for (var, name), v in self._slots.items()}

    def apply_gradients(self, grads_and_vars, all_reduce: bool = True):
        """Apply one update; returns the new iteration count. `None` gradients are skipped.
        In a replica, the gradients are all-reduced first (by `gradient_reduction`); with
        `all_reduce=False` they are taken as already reduced (equal on every replica), as
        TF's experimental_aggregate_gradients=False. clipnorm/global_clipnorm clip after.

        >>> opt.apply_gradients(zip(grads, variables), all_reduce=False)   # doctest: +SKIP
        """
        grads_and_vars = list(grads_and_vars)
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if grads_and_vars and not pairs:
            names = ", ".join(repr(getattr(v, "name", v)) for _, v in grads_and_vars)
            raise ValueError(f"{self.name}.apply_gradients: no gradients provided for any "
                             f"variable ({names}): does the loss depend on them?")
        for g, v in pairs:
            if not isinstance(v, Variable):
                raise TypeError(f"{self.name}.apply_gradients: expected gd.Variable, got "
                                f"{type(v).__name__}")
            if tuple(np.shape(g)) != v.shape:    # np.shape: numbers and lists too
                raise ValueError(f"{self.name}.apply_gradients: gradient {tuple(np.shape(g))} "
                                 f"does not match variable '{v.name}' {v.shape}")
            if np.dtype(getattr(g, "dtype", v.dtype)) != v.dtype:   # lists take v's dtype
                raise TypeError(f"{self.name}.apply_gradients: gradient is {g.dtype}, variable "
                                f"'{v.name}' is {v.dtype}; use gd.cast")
        if current_tracer() is None:
            return self._apply_eagerly(pairs, all_reduce)
        ctx = get_replica_context()
        if all_reduce and ctx is not None and ctx.num_replicas_in_sync > 1:
            bucket_bytes = getattr(ctx.strategy, "bucket_bytes", 25 * 2**20)
            reduced = all_reduce_gradients([g for g, _ in pairs], self.gradient_reduction,
                                           bucket_bytes, ctx.num_replicas_in_sync)
            pairs = list(zip(reduced, (v for _, v in pairs)))
        pairs = self._clip(pairs)
        step = self.iterations.read_value() + np.int64(1)
        self._apply(pairs, step)
        self.iterations.assign_synced(step)
        return step

    def _apply_eagerly(self, pairs, all_reduce: bool = True):
        variables = tuple(v for _, v in pairs)
        fn = self._eager_steps.get((variables, all_reduce))
        if fn is None:
            from graphdist.function import function

            fn = function(lambda grads: self.apply_gradients(zip(grads, variables), all_reduce))
            self._eager_steps[(variables, all_reduce)] = fn
        return fn([np.asarray(g, dtype=v.dtype) for g, v in pairs])

    def _clip(self, pairs) -> list:
        """Keras's clipnorm (each gradient to norm <= clipnorm) and global_clipnorm (all of
        them scaled together to a global norm <= global_clipnorm): g * c / max(norm, c)."""
        if self.clipnorm is None and self.global_clipnorm is None:
            return pairs
        # sums of squares in float32 at least (float16 squares overflow), float64 if any is
        norm_dtype = np.result_type(np.float32, *(v.dtype for _, v in pairs))
        squares = [reduce_sum(square(cast(g, norm_dtype))) for g, _ in pairs]
        if self.clipnorm is not None:
            limit = self.clipnorm
            scales = [divide(limit, maximum(sqrt(s), limit)) for s in squares]
        else:
            limit = self.global_clipnorm
            total = squares[0]
            for s in squares[1:]:
                total = add(total, s)
            scales = [divide(limit, maximum(sqrt(total), limit))] * len(pairs)
        return [(multiply(g, cast(scale, v.dtype)), v) for (g, v), scale in zip(pairs, scales)]

    def _apply(self, pairs, step) -> None:
        raise NotImplementedError

    def variables(self) -> list:
        return [self.iterations, *self._slots.values()]


def _positive(name: str, value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not (value > 0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive number or None, got {value}")
    return value


def _float(name: str, value) -> float:
    value = float(value)
    if value < 0 or not np.isfinite(value):
        raise ValueError(f"{name} must be a finite non-negative number, got {value}")
    return value


class SGD(Optimizer):
    """p -= lr * (g + weight_decay*p), with optional (Nesterov) momentum, as torch.optim.SGD.

    >>> opt = gd.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, weight_decay=0.0,
                 gradient_reduction="mean", clipnorm=None, global_clipnorm=None, name="SGD"):
        super().__init__(name, gradient_reduction, clipnorm, global_clipnorm)
        self.learning_rate = _float("learning_rate", learning_rate)
        self.momentum = _float("momentum", momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = _float("weight_decay", weight_decay)
        if self.nesterov and not self.momentum:
            raise ValueError("SGD: nesterov=True needs momentum > 0")

    def _apply(self, pairs, step) -> None:
        for g, v in pairs:
            if self.momentum:
                m = self.slot(v, "momentum")
                new_v, new_m = bind(optim.momentum_p, v, m, g, lr=self.learning_rate,
                                    momentum=self.momentum, nesterov=self.nesterov,
                                    weight_decay=self.weight_decay)
                m.assign_synced(new_m)
            else:
                new_v = bind(optim.sgd_p, v, g, lr=self.learning_rate,
                             weight_decay=self.weight_decay)
            v.assign_synced(new_v)


class Adam(Optimizer):
    """Adam with TF's epsilon placement: p -= lr_t * m / (sqrt(v) + eps),
    lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t).

    >>> opt = gd.optimizers.Adam(learning_rate=1e-3)
    """

    weight_decay = 0.0

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 gradient_reduction="mean", clipnorm=None, global_clipnorm=None, name="Adam"):
        super().__init__(name, gradient_reduction, clipnorm, global_clipnorm)
        self.learning_rate = _float("learning_rate", learning_rate)
        self.beta_1 = _float("beta_1", beta_1)
        self.beta_2 = _float("beta_2", beta_2)
        self.epsilon = _float("epsilon", epsilon)
        if not (self.beta_1 < 1 and self.beta_2 < 1):
            raise ValueError(f"{name}: betas must be < 1, got {beta_1}, {beta_2}")

    def _apply(self, pairs, step) -> None:
        t = cast(step, "float64")
        lr_t64 = divide(self.learning_rate * sqrt(subtract(1.0, power(self.beta_2, t))),
                        subtract(1.0, power(self.beta_1, t)))
        lr_t = {}
        for g, v in pairs:
            if v.dtype not in lr_t:
                lr_t[v.dtype] = cast(lr_t64, v.dtype)
            m, s = self.slot(v, "m"), self.slot(v, "v")
            new_v, new_m, new_s = bind(optim.adam_p, v, m, s, g, lr_t[v.dtype],
                                       lr=self.learning_rate, beta_1=self.beta_1,
                                       beta_2=self.beta_2, epsilon=self.epsilon,
                                       weight_decay=self.weight_decay)
            v.assign_synced(new_v)
            m.assign_synced(new_m)
            s.assign_synced(new_s)


class AdamW(Adam):
    """Adam with decoupled weight decay: p -= lr * weight_decay * p, then the Adam step."""

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.004, gradient_reduction="mean", clipnorm=None,
                 global_clipnorm=None, name="AdamW"):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, gradient_reduction, clipnorm,
                         global_clipnorm, name)
        self.weight_decay = _float("weight_decay", weight_decay)


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
