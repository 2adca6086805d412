"""gd.optimizers.LossScaleOptimizer: dynamic loss scaling for float16 training (TF/Keras's).

The loss is multiplied by a scale so that small float16 gradients do not flush to zero; the
gradients are divided by it again before the update. A step whose gradients overflowed is
skipped on every replica (the update is computed, then selected against the old values with
gd.where) and halves the scale; `dynamic_growth_steps` finite steps in a row double it.
"""

from __future__ import annotations

import numpy as np

from graphdist import program_switch
from graphdist.distribute.context import get_replica_context
from graphdist.ops.array import cast
from graphdist.ops.core import current_tracer
from graphdist.ops.math import (
    abs,
    add,
    divide,
    equal,
    greater_equal,
    less,
    maximum,
    multiply,
    reduce_max,
    subtract,
    where,
)
from graphdist.ops.sparse import IndexedSlices
from graphdist.optimizers.optimizer import (accumulation_scope, apply_eagerly,
                                            warn_missing_gradients)
from graphdist.variables import Variable, assign_synced_if


class LossScaleOptimizer:
    """Wraps `inner_optimizer` with loss scaling, as tf.keras.mixed_precision's:

    >>> opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.1))
    >>> with gd.GradientTape() as tape:                                  # doctest: +SKIP
    ...     scaled_loss = opt.get_scaled_loss(loss)
    >>> grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables))
    >>> opt.apply_gradients(zip(grads, variables))                       # doctest: +SKIP

    `apply_gradients` takes the unscaled gradients (float32, as the master weights are),
    all-reduces them in a replica (as the inner optimizer would), checks that all are finite
    and all-reduces that flag too, so that every replica makes the same choice: apply the
    inner optimizer's update, or leave every variable, slot and the iteration count as they
    were. With `dynamic=False` the scale stays `initial_scale` and no step is skipped.
    The scale (`loss_scale`) and the count of finite steps are variables, so checkpoints
    keep them.
    """

    def __init__(self, inner_optimizer, dynamic: bool = True, initial_scale=2**15,
                 dynamic_growth_steps: int = 2000, name: str = "LossScaleOptimizer"):
        if not callable(getattr(inner_optimizer, "apply_gradients", None)):
            raise TypeError(f"LossScaleOptimizer: expected a gd.optimizers optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise TypeError("LossScaleOptimizer: the inner optimizer is already a "
                            "LossScaleOptimizer")
        initial_scale = float(initial_scale)
        if not (np.isfinite(initial_scale) and initial_scale >= 1):
            raise ValueError(f"LossScaleOptimizer: initial_scale must be a finite number >= 1, "
                             f"got {initial_scale}")
        if int(dynamic_growth_steps) < 1:
            raise ValueError(f"LossScaleOptimizer: dynamic_growth_steps must be >= 1, got "
                             f"{dynamic_growth_steps}")
        self.inner_optimizer = inner_optimizer
        self.name = name
        self.dynamic = bool(dynamic)
        self.initial_scale = initial_scale
        self._growth_steps = int(dynamic_growth_steps)
        self._scale = Variable(np.float32(initial_scale), name=f"{name}/current_loss_scale",
                               trainable=False)
        self._good_steps = (Variable(np.int64(0), name=f"{name}/good_steps", trainable=False)
                            if self.dynamic else None)
        self._eager_steps: dict = {}
        self._warned_no_gradient: set = set()

    # ------------------------------------------------------------ TF's attributes
    loss_scale = property(lambda self: self._scale, doc="the current loss scale (a Variable)")
    dynamic_counter = property(lambda self: self._good_steps,
                               doc="finite steps since the scale last changed (None: fixed)")
    iterations = property(lambda self: self.inner_optimizer.iterations)

    @property
    def dynamic_growth_steps(self) -> int | None:
        return self._growth_steps if self.dynamic else None

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    def variables(self) -> list:
        own = [self._scale] + ([self._good_steps] if self.dynamic else [])
        return own + list(self.inner_optimizer.variables())

    def _checkpoint_children(self):
        # what gd.Checkpoint saves: the inner optimizer (iterations, slots) and the scale state
        own = [("current_loss_scale", self._scale)]
        if self.dynamic:
            own.append(("good_steps", self._good_steps))
        return [("inner_optimizer", self.inner_optimizer)] + own

    # ------------------------------------------------------------ scaling
    def get_scaled_loss(self, loss):
        """loss * loss_scale (in the loss's dtype); a callable gives a callable."""
        if callable(loss):
            return lambda: self.get_scaled_loss(loss())
        dtype = getattr(loss, "dtype", None)
        return multiply(loss, self._scale if dtype is None else cast(self._scale, dtype))

    def get_unscaled_gradients(self, grads):
        """Each gradient divided by loss_scale (None stays None; IndexedSlices stay sparse)."""
        reciprocal = divide(np.float32(1.0), self._scale)

        def unscale(g):
            if g is None:
                return None
            if isinstance(g, IndexedSlices):
                return IndexedSlices(g.indices, unscale(g.values), g.dense_shape)
            dtype = getattr(g, "dtype", None)
            return multiply(g, reciprocal if dtype is None else cast(reciprocal, dtype))

        return [unscale(g) for g in grads]

    # ------------------------------------------------------------ the step
    def apply_gradients(self, grads_and_vars, all_reduce: bool = True,
                        skip_loss_scale_check: bool = True):
        """All-reduce the (unscaled) gradients, then apply the inner optimizer's update only if
        every gradient on every replica is finite; update the scale. Returns the iteration
        count after the step (unchanged by a skipped step). `None` gradients are skipped
        with a warning, as the inner optimizer's; `skip_loss_scale_check` is accepted for
        the inner optimizers' signature: this is the loss scaling it checks for."""
        grads_and_vars = list(grads_and_vars)
        if not self.dynamic:
            return self.inner_optimizer.apply_gradients(grads_and_vars, all_reduce,
                                                        skip_loss_scale_check=True)
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:            # the inner optimizer names the variables in its error
            return self.inner_optimizer.apply_gradients(grads_and_vars, all_reduce,
                                                        skip_loss_scale_check=True)
        for g, v in pairs:
            if isinstance(v, Variable) and np.dtype(getattr(g, "dtype", v.dtype)) != v.dtype:
                raise TypeError(f"{self.name}.apply_gradients: gradient is {g.dtype}, variable "
                                f"'{v.name}' is {v.dtype}: gradients of float32 master "
                                "weights are float32 (cast the weights, not the gradients)")
        warn_missing_gradients(self, grads_and_vars)
        if current_tracer() is None:
            return self._apply_eagerly(pairs, all_reduce)
        inner = self.inner_optimizer
        program_switch.record(inner)      # the program depends on k and the window position
        inner._applied_to.update(dict.fromkeys(v for _, v in pairs))
        if inner.gradient_accumulation_steps > 1:
            with accumulation_scope(inner):
                # a micro-step only accumulates (no check, no collective); a non-finite one
                # makes the window's sum non-finite, so the applying call skips that window
                pairs = inner._accumulate(pairs)
                if pairs is None:
                    return inner.iterations.read_value()
                return self._apply_reduced(pairs, all_reduce)
        return self._apply_reduced(pairs, all_reduce)

    def _apply_reduced(self, pairs, all_reduce: bool):
        """Reduce, check every replica's gradients are finite, apply or skip, rescale."""
        inner = self.inner_optimizer
        ctx = get_replica_context()
        n = ctx.num_replicas_in_sync if ctx is not None else 1
        reduced = inner._reduce(pairs, all_reduce)     # all-reduced, or sharded (ZeRO)
        grads = [g for g, _ in reduced] if isinstance(reduced, list) else reduced.gradients
        finite = self._all_finite(grads, ctx, n)
        with assign_synced_if(finite):
            step = inner._update(reduced)
        self._update_scale(finite)
        return where(finite, step, subtract(step, np.int64(1)))

    def _all_finite(self, grads, ctx, n: int):
        """A bool scalar, the same on every replica: are all gradients finite everywhere?"""
        worst = np.float32(0)
        for g in grads:
            values = g.values if isinstance(g, IndexedSlices) else g
            if 0 in tuple(values.shape):
                continue
            # the largest magnitude is inf or NaN if any entry is; maximum propagates NaN
            worst = maximum(worst, cast(reduce_max(abs(values)), "float32"))
        overflowed = where(less(worst, np.float32(np.inf)), np.float32(0), np.float32(1))
        if n > 1:                 # one small all-reduce: how many replicas overflowed
            overflowed = ctx.all_reduce("sum", overflowed)
        return equal(overflowed, np.float32(0))

    def _update_scale(self, finite) -> None:
        # TF's dynamic loss scale: after dynamic_growth_steps finite steps double the scale (if
        # the double is finite), on a non-finite step halve it (not below 1); either resets
        # the count
        scale, count = self._scale.read_value(), self._good_steps.read_value()
        count = add(count, np.int64(1))
        grow = greater_equal(count, np.int64(self._growth_steps))
        doubled = multiply(scale, np.float32(2))
        doubled = where(less(doubled, np.float32(np.inf)), doubled, scale)
        new_scale = where(finite, where(grow, doubled, scale),
                          maximum(multiply(scale, np.float32(0.5)), np.float32(1)))
        new_count = where(finite, where(grow, np.int64(0), count), np.int64(0))
        self._scale.assign_synced(new_scale)
        self._good_steps.assign_synced(new_count)

    def _apply_eagerly(self, pairs, all_reduce: bool):
        return apply_eagerly(self, pairs, all_reduce)

    def __repr__(self) -> str:
        return (f"<gd.optimizers.LossScaleOptimizer of {type(self.inner_optimizer).__name__}, "
                f"dynamic={self.dynamic}>")


__all__ = ["LossScaleOptimizer"]
