"""gd.optimizers.schedules against the formulas, eagerly (Keras's learning_rate_schedule_test
cases, ported) and inside a compiled training loop, where the rate each update used is read
back from the change of a plain SGD parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

import graphdist as gd
from graphdist.optimizers import schedules

# ---------------------------------------------------------------- the formulas (references)


def exponential_ref(step, lr, decay_steps, rate, staircase=False):
    p = step / decay_steps
    return lr * rate ** (math.floor(p) if staircase else p)


def piecewise_ref(step, boundaries, values):
    for boundary, value in zip(boundaries, values):
        if step <= boundary:
            return value
    return values[-1]


def cosine_ref(step, lr, decay_steps, alpha=0.0, warmup_target=None, warmup_steps=0):
    """Keras 3's CosineDecay, written out: linear warmup, then the cosine from the target."""
    if warmup_target is not None:
        step = min(step, decay_steps + warmup_steps)
        if step < warmup_steps:
            return lr + (warmup_target - lr) * step / warmup_steps
        step, lr = step - warmup_steps, warmup_target
    step = min(step, decay_steps)
    return lr * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * step / decay_steps)) + alpha)


def _close(actual, expected, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=1e-12)


# ---------------------------------------------------------------- Keras's cases, eagerly


def test_exponential_continuous():
    _close(schedules.ExponentialDecay(0.05, 10, 0.96)(5), 0.05 * 0.96 ** (5.0 / 10.0))


def test_exponential_staircase_and_a_variable_step():
    step = gd.Variable(1.0)
    decayed = schedules.ExponentialDecay(0.1, 3, 0.96, staircase=True)
    _close(decayed(step), 0.1)
    step.assign(2.0)
    _close(decayed(step), 0.1)                       # no change within a stair
    step.assign(100.0)
    _close(decayed(step), 0.1 * 0.96 ** (100 // 3))
    # the stairs are floors, below zero too (one step below, not toward zero)
    _close(decayed(-1), 0.1 * 0.96 ** -1)
    _close(decayed(-3), 0.1 * 0.96 ** -1)
    _close(decayed(-4), 0.1 * 0.96 ** -2)


def test_piecewise_values():
    x = gd.Variable(-999.0)
    decayed = schedules.PiecewiseConstantDecay([100, 110, 120], [1.0, 0.1, 0.01, 0.001])
    for step, expected in [(-999, 1.0), (100, 1.0), (105, 0.1), (110, 0.1), (120, 0.01),
                           (999, 0.001)]:
        x.assign(float(step))
        _close(decayed(x), expected)


def test_piecewise_boundary_values_with_an_int64_step():
    x = gd.Variable(np.int64(0), trainable=False)
    decayed = schedules.PiecewiseConstantDecay([1, 2, 3], [0.4, 0.5, 0.6, 0.7])
    for step, expected in [(0, 0.4), (1, 0.4), (2, 0.5), (3, 0.6), (4, 0.7)]:
        x.assign(np.int64(step))
        _close(decayed(x), expected)
        assert np.asarray(decayed(x)).dtype == np.float64


@pytest.mark.parametrize("alpha", [0.0, 0.1])
@pytest.mark.parametrize("initial", [1.0, np.float64(1.0)])
def test_cosine_decay_and_alpha(alpha, initial):
    for step in range(0, 1500, 250):
        decayed = schedules.CosineDecay(initial, 1000, alpha)
        step_c = min(step, 1000) / 1000
        expected = (1 - alpha) * 0.5 * (1 + math.cos(math.pi * step_c)) + alpha
        _close(decayed(step), expected)


def test_cosine_warmup():
    for step in range(0, 1500, 250):
        lr = schedules.CosineDecay(0.0, 10, warmup_target=10.0, warmup_steps=1500)
        _close(lr(step), step / 1500 * 10.0)


def test_cosine_warmup_then_decay():
    for step in range(0, 3000, 250):
        lr = schedules.CosineDecay(0.0, 1000, warmup_target=10.0, warmup_steps=2000)
        if step < 2000 + 1:
            expected = step / 2000 * 10.0
        else:
            expected = 10.0 * 0.5 * (1 + math.cos(math.pi * min(step - 2000, 1000) / 1000))
        _close(lr(step), expected)


def test_cosine_warmup_from_a_nonzero_start_and_zero_warmup_steps():
    lr = schedules.CosineDecay(0.1, 50, alpha=0.2, warmup_target=1.0, warmup_steps=10)
    for step in (0, 3, 9, 10, 11, 35, 60, 61, 1000):
        _close(lr(step), cosine_ref(step, 0.1, 50, 0.2, 1.0, 10))
    _close(lr(5), 0.1 + 0.9 * 0.5)                   # halfway up from 0.1, not from 0
    no_warmup = schedules.CosineDecay(0.1, 50, warmup_target=1.0, warmup_steps=0)
    for step in (0, 25, 50, 70):
        _close(no_warmup(step), cosine_ref(step, 0.1, 50, 0.0, 1.0, 0))


@pytest.mark.parametrize("sched", [
    schedules.ExponentialDecay(0.05, 10, 0.96, staircase=True, name="my_ed"),
    schedules.PiecewiseConstantDecay([10, 20], [1, 2, 3], name="my_pcd"),
    schedules.CosineDecay(0.05, 10, alpha=0.1, warmup_target=0.2, warmup_steps=2,
                          name="my_cd")], ids=["exponential", "piecewise", "cosine"])
def test_config_round_trip(sched):
    config = sched.get_config()
    again = type(sched).from_config(config)
    assert again.get_config() == config and config["name"].startswith("my_")
    for step in (0, 5, 15, 30):
        np.testing.assert_array_equal(again(step), sched(step))


@pytest.mark.parametrize("make", [
    lambda: schedules.ExponentialDecay(0.1, 0, 0.5),
    lambda: schedules.CosineDecay(0.1, -1),
    lambda: schedules.CosineDecay(0.1, 10, warmup_target=1.0, warmup_steps=-1),
    lambda: schedules.PiecewiseConstantDecay([1, 2], [1.0, 2.0]),
    lambda: schedules.PiecewiseConstantDecay([2, 1], [1.0, 2.0, 3.0])],
    ids=["exp_steps", "cos_steps", "cos_warmup", "pw_lengths", "pw_order"])
def test_bad_arguments(make):
    with pytest.raises(ValueError):
        make()


def test_cosine_name_is_keras_fourth_argument():
    with pytest.raises(TypeError, match="keyword"):
        schedules.CosineDecay(0.1, 10, 0.0, 0.5)       # warmup_target passed as the name


def test_base_class_needs_call_and_config():
    with pytest.raises(NotImplementedError):
        schedules.LearningRateSchedule()(1)
    with pytest.raises(NotImplementedError):
        schedules.LearningRateSchedule().get_config()


# ---------------------------------------------------------------- inside a compiled loop

STEPS = 40
SCHEDULES = {
    "exponential": (lambda: schedules.ExponentialDecay(0.5, 7, 0.8),
                    lambda s: exponential_ref(s, 0.5, 7, 0.8)),
    "staircase": (lambda: schedules.ExponentialDecay(0.5, 7, 0.8, staircase=True),
                  lambda s: exponential_ref(s, 0.5, 7, 0.8, staircase=True)),
    "piecewise": (lambda: schedules.PiecewiseConstantDecay([3, 10, 25], [0.4, 0.3, 0.2, 0.1]),
                  lambda s: piecewise_ref(s, [3, 10, 25], [0.4, 0.3, 0.2, 0.1])),
    "cosine": (lambda: schedules.CosineDecay(0.3, 30, alpha=0.1),
               lambda s: cosine_ref(s, 0.3, 30, 0.1)),
    "cosine_warmup": (lambda: schedules.CosineDecay(0.01, 25, 0.05, warmup_target=0.4,
                                                    warmup_steps=8),
                      lambda s: cosine_ref(s, 0.01, 25, 0.05, 0.4, 8)),
    "callable": (lambda: (lambda step: 0.2 / (gd.cast(step, "float64") + 1.0)),
                 lambda s: 0.2 / (s + 1.0)),
}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_rate_used_by_each_compiled_step_follows_the_formula(name, fused, devices):
    """Plain SGD on a float64 parameter with gradient 1: each update lowers it by exactly the
    rate it used, which must be schedule(iterations before the update), step after step,
    with one trace."""
    make, ref = SCHEDULES[name]
    gd.config.set_fused_kernels(fused)
    try:
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)])
        with strategy.scope():
            w = gd.Variable(np.zeros(3), name="w")
            opt = gd.optimizers.SGD(learning_rate=make())

        @gd.function
        def step():
            strategy.run(lambda: opt.apply_gradients([(gd.ones_like(w), w)]))
            return opt.iterations.read_value()

        before = w.numpy()
        for t in range(STEPS):
            assert int(step()) == t + 1
            after = w.numpy()
            for component in w.values:
                np.testing.assert_array_equal(component, after)
            _close(before - after, np.full(3, ref(t)), rtol=1e-9)
            before = after
        assert step.trace_count == 1
    finally:
        gd.config.set_fused_kernels(True)


def test_schedule_with_adam_uses_the_scheduled_rate_in_the_bias_correction():
    sched = schedules.ExponentialDecay(0.1, 2, 0.5)
    w = gd.Variable(np.array([1.0, -2.0]))
    opt = gd.optimizers.Adam(learning_rate=sched)
    step = gd.function(lambda g: opt.apply_gradients([(g, w)]))
    p, m, v = w.numpy(), np.zeros(2), np.zeros(2)
    rng = np.random.default_rng(0)
    for t in range(1, 6):
        g = rng.normal(size=2)
        step(g)
        lr = exponential_ref(t - 1, 0.1, 2, 0.5)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - lr * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (np.sqrt(v) + 1e-7)
        _close(w.numpy(), p, rtol=1e-12)
    assert step.trace_count == 1
