"""gd.optimizers.schedules: learning rates as functions of the optimizer's step (Keras 3's
formulas, in float64). Built from gd ops, so a schedule evaluates inside the compiled step
from `opt.iterations` (no retrace as the step advances) and eagerly on a number.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from graphdist.ops.array import cast
from graphdist.ops.core import Symbolic
from graphdist.ops.math import add, divide, greater, less, minimum, multiply, power, subtract, where
from graphdist.ops.special import cos
from graphdist.trace import name_scope


def _float64(step):
    if isinstance(step, Symbolic):          # a traced step, or a Variable
        return cast(step, "float64")
    return np.asarray(step, np.float64)


def _floor(x):
    t = cast(cast(x, "int64"), "float64")   # rounds toward zero: one less below zero
    return where(less(x, t), subtract(t, 1.0), t)


def _positive_steps(name: str, what: str, steps) -> None:
    if not steps > 0:
        raise ValueError(f"{name}: {what} must be > 0, got {steps}")


class LearningRateSchedule:
    """Base class: a schedule maps the step (the number of updates applied so far) to a
    learning rate, and is passed to an optimizer as its `learning_rate`.

    >>> class Inverse(gd.optimizers.schedules.LearningRateSchedule):
    ...     def __call__(self, step):
    ...         return 0.1 / (gd.cast(step, "float64") + 1.0)
    """

    def __call__(self, step):
        raise NotImplementedError(f"learning rate schedule {type(self).__name__} must "
                                  "override __call__(self, step)")

    def get_config(self) -> dict:
        raise NotImplementedError(f"learning rate schedule {type(self).__name__} must "
                                  "override get_config()")

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


class ExponentialDecay(LearningRateSchedule):
    """initial_learning_rate * decay_rate ** (step / decay_steps); with staircase=True the
    exponent is floor(step / decay_steps).

    >>> float(gd.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)(20))
    0.025
    """

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="ExponentialDecay"):
        _positive_steps(name, "decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = bool(staircase)
        self.name = name

    def __call__(self, step):
        with name_scope(self.name):
            p = divide(_float64(step), float(self.decay_steps))
            if self.staircase:
                p = _floor(p)
            return multiply(float(self.initial_learning_rate), power(float(self.decay_rate), p))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "decay_rate": self.decay_rate,
                "staircase": self.staircase, "name": self.name}


class PiecewiseConstantDecay(LearningRateSchedule):
    """values[0] while step <= boundaries[0], values[i] while boundaries[i-1] < step <=
    boundaries[i], values[-1] after the last boundary.

    >>> sched = gd.optimizers.schedules.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])
    >>> [float(sched(s)) for s in (10, 11, 21)]
    [1.0, 0.5, 0.1]
    """

    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        boundaries, values = list(boundaries), list(values)
        if len(boundaries) != len(values) - 1:
            raise ValueError(f"{name}: expected one more value than boundaries, got "
                             f"{len(boundaries)} boundaries and {len(values)} values")
        if any(b >= c for b, c in itertools.pairwise(boundaries)):
            raise ValueError(f"{name}: boundaries must increase strictly, got {boundaries}")
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step):
        with name_scope(self.name):
            x = _float64(step)
            rate = np.float64(self.values[0])
            for boundary, value in zip(self.boundaries, self.values[1:]):
                rate = where(greater(x, float(boundary)), np.float64(value), rate)
            return rate

    def get_config(self) -> dict:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class CosineDecay(LearningRateSchedule):
    """Cosine decay over `decay_steps` from the start rate to alpha * start rate, then
    constant (Keras 3). With `warmup_target`, first a linear warmup over `warmup_steps` from
    initial_learning_rate to warmup_target, which is then the start rate of the decay:

        decay(s) = start * ((1 - alpha) * 0.5 * (1 + cos(pi * min(s, decay_steps) /
                   decay_steps)) + alpha)
        rate(s)  = initial + (warmup_target - initial) * s / warmup_steps  (s < warmup_steps)
                   decay(s - warmup_steps)                                  (afterwards)

    >>> float(gd.optimizers.schedules.CosineDecay(1.0, 100)(50))
    0.5
    """

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay",
                 warmup_target=None, warmup_steps=0):
        if not isinstance(name, str):
            raise TypeError(f"CosineDecay: name must be a string, got {name!r} (warmup_target "
                            "and warmup_steps are keyword arguments)")
        _positive_steps(name, "decay_steps", decay_steps)
        if warmup_steps < 0:
            raise ValueError(f"{name}: warmup_steps must be >= 0, got {warmup_steps}")
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_target = warmup_target
        self.warmup_steps = warmup_steps

    def _decay(self, step, start: float):
        fraction = divide(step, float(self.decay_steps))
        cosine = multiply(0.5, add(1.0, cos(multiply(math.pi, fraction))))
        return multiply(start, add(multiply(1.0 - self.alpha, cosine), float(self.alpha)))

    def __call__(self, step):
        with name_scope(self.name):
            x = _float64(step)
            initial, steps = float(self.initial_learning_rate), float(self.decay_steps)
            if self.warmup_target is None:
                return self._decay(minimum(x, steps), initial)
            target, warmup = float(self.warmup_target), float(self.warmup_steps)
            x = minimum(x, steps + warmup)
            if not warmup:         # no warmup phase: the decay starts from the target
                return self._decay(x, target)
            rising = add(multiply(target - initial, divide(x, warmup)), initial)
            return where(less(x, warmup), rising, self._decay(subtract(x, warmup), target))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "alpha": self.alpha, "name": self.name,
                "warmup_target": self.warmup_target, "warmup_steps": self.warmup_steps}


__all__ = ["CosineDecay", "ExponentialDecay", "LearningRateSchedule", "PiecewiseConstantDecay"]
