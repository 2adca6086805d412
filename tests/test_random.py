"""gd.random (graphdist/random.py, graphdist/ops/random.py), gd.nn.dropout and
gd.initializers: distributions, reproducibility, eager == traced, per-replica streams under
MirroredStrategy, a failed step leaving the counter alone, dropout's mask and gradient, and
the initializers' Keras formulas. Statistical checks use fixed seeds and 100k samples, with
tolerances several standard errors wide: deterministic, so they cannot flake."""

from __future__ import annotations

import math

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.core import OPS, Op, bind
from graphdist.ops.random import draw

N = 100_000


def _devices(n):
    return [f"cpu:{i}" for i in range(n)]


def _philox(key, counter, shape, dtype=np.float32):
    """The stream a draw is defined to be: numpy's Philox at counter (0, 0, counter, 0)."""
    bits = np.random.Philox(key=np.asarray(key, np.uint64),
                            counter=np.array([0, 0, counter, 0], np.uint64))
    return np.random.Generator(bits).random(shape, dtype=dtype)


# ---------------------------------------------------------------- distributions


def test_uniform_range_and_moments():
    g = gd.random.Generator(seed=0)
    u = g.uniform((N,))
    assert u.dtype == np.float32 and u.shape == (N,)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    v = g.uniform((1000, 100), minval=-3.0, maxval=5.0, dtype="float64")
    assert v.dtype == np.float64 and v.min() >= -3 and v.max() < 5
    assert abs(v.mean() - 1.0) < 0.04 and abs(v.std() - 8 / math.sqrt(12)) < 0.02


def test_normal_and_truncated_normal_moments():
    g = gd.random.Generator(seed=1)
    z = g.normal((N,))
    assert z.dtype == np.float32
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.01
    y = g.normal((N,), mean=3.0, stddev=0.5, dtype="float64")
    assert abs(y.mean() - 3) < 0.01 and abs(y.std() - 0.5) < 0.005
    t = g.truncated_normal((N,), mean=1.0, stddev=2.0)
    assert np.abs(t - 1).max() <= 4.0                     # within 2 stddev
    assert abs(t.mean() - 1) < 0.03
    assert abs(t.std() - 2 * 0.87962566) < 0.02           # the std of N(0,1) cut at +-2
    assert np.abs(t - 1).max() > 3.9                      # and the tails are really used


def test_non_float_dtype_is_refused():
    with pytest.raises(TypeError, match="float"):
        gd.random.Generator(seed=0).uniform((2,), dtype="int32")


# ---------------------------------------------------------------- reproducibility


def test_the_stream_is_numpys_philox_with_one_counter_step_per_draw():
    g = gd.random.Generator(seed=7)
    key = g.key
    assert key.dtype == np.uint64 and key.shape == (2,) and g.counter == 0
    first, second = g.uniform((5,)), g.uniform((3, 2))
    np.testing.assert_array_equal(first, _philox(key, 0, (5,)))
    np.testing.assert_array_equal(second, _philox(key, 1, (3, 2)))
    assert g.counter == 2


def test_same_seed_same_numbers_different_seeds_differ():
    a, b, c = (gd.random.Generator(seed=s) for s in (3, 3, 4))
    for _ in range(2):
        x, y, z = a.normal((64,)), b.normal((64,)), c.normal((64,))
        np.testing.assert_array_equal(x, y)
        assert not np.any(x == z)
    g = gd.random.Generator(seed=3)
    g.uniform((4,))
    g.reset_from_seed(3)
    assert g.counter == 0
    np.testing.assert_array_equal(g.normal((64,)), gd.random.Generator(seed=3).normal((64,)))


def test_traced_draws_equal_eager_draws_and_the_state_advances_in_the_step():
    eager, traced = gd.random.Generator(seed=11), gd.random.Generator(seed=11)

    @gd.function
    def step():
        return (traced.uniform((8,)), traced.normal((2, 3), stddev=2.0),
                traced.truncated_normal((5,), mean=1.0))

    seen = []
    for k in range(3):
        got = step()
        want = (eager.uniform((8,)), eager.normal((2, 3), stddev=2.0),
                eager.truncated_normal((5,), mean=1.0))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert traced.counter == eager.counter == 3 * (k + 1)
        seen.append(got[0])
    assert step.trace_count == 1
    assert len(np.unique(np.concatenate(seen))) == 24      # no number repeats across steps
    ops = [e.op.name for e in step.graph.nodes]
    assert ops.count("philox_random") == 3 and ops.count("assign_var") >= 1


def test_draws_never_repeat_across_steps():
    g = gd.random.Generator(seed=5)

    @gd.function
    def step():
        return g.uniform((4096,), dtype="float64")

    values = np.concatenate([step() for _ in range(8)])
    assert len(np.unique(values)) == values.size


# ---------------------------------------------------------------- under MirroredStrategy


def _replica_draws(n, seed=21, steps=2):
    strategy = gd.MirroredStrategy(_devices(n))
    with strategy.scope():
        g = gd.random.Generator(seed=seed)

    @gd.function
    def step():
        return strategy.run(lambda: (g.uniform((256,)), g.normal((4, 4))))

    draws = []
    for _ in range(steps):
        out = step()
        draws.append(out)
        components = g.state.values
        assert len(components) == n
        for c in components[1:]:
            assert c.tobytes() == components[0].tobytes()       # mirrored: bit-identical
    return g, draws


@pytest.mark.parametrize("n", [2, 4])
def test_each_replica_has_its_own_reproducible_stream(n):
    g, draws = _replica_draws(n)
    assert g.counter == 4
    _, again = _replica_draws(n)
    for step_out, step_again in zip(draws, again):
        for per_replica, per_replica_again in zip(step_out, step_again):
            values = [np.asarray(v) for v in per_replica.values]
            assert len(values) == n
            for d in range(n):
                np.testing.assert_array_equal(values[d], per_replica_again.values[d])
                for e in range(d):
                    assert not np.any(values[d] == values[e]), (d, e)
    # replica 0 draws the generator's own stream (what one device draws); others a fold
    np.testing.assert_array_equal(draws[0][0].values[0], _philox(g.key, 0, (256,)))
    assert not np.any(draws[1][0].values[0] == draws[0][0].values[0])


def test_replica_streams_depend_on_the_replica_count_only_through_the_id():
    _, two = _replica_draws(2, steps=1)
    _, four = _replica_draws(4, steps=1)
    for d in range(2):
        np.testing.assert_array_equal(two[0][0].values[d], four[0][0].values[d])


def test_a_checkpoint_saves_and_restores_the_state(tmp_path):
    g = gd.random.Generator(seed=1)
    g.uniform((2,))
    path = gd.Checkpoint(gen=g).save(str(tmp_path / "gen.npz"))
    after = g.uniform((3,))
    other = gd.random.Generator(seed=99)
    gd.Checkpoint(gen=other).restore(path)
    assert other.counter == 1
    np.testing.assert_array_equal(other.uniform((3,)), after)


def test_cross_replica_draws_use_the_generators_own_stream():
    strategy = gd.MirroredStrategy(_devices(2))
    with strategy.scope():
        g = gd.random.Generator(seed=2)
        eager = g.uniform((6,))                             # cross-replica, eagerly
    np.testing.assert_array_equal(eager, _philox(g.key, 0, (6,)))
    assert [int(c[0]) for c in g.state.values] == [1, 1]


@pytest.fixture
def fail_if_negative():
    op = Op("test_random_fail_if_negative")
    op.def_shape(lambda x: x)
    op.def_vjp(lambda ct, x: (ct,))

    @op.def_impl
    def _impl(xp, x):
        if x.reshape(-1)[0] < 0:
            raise FloatingPointError("negative input")
        return x.copy()

    yield lambda x: bind(op, x)
    del OPS["test_random_fail_if_negative"]


def _dropout_steps(fail_if_negative, mode: str, fail_first: bool) -> list:
    """A training step with dropout and a draw on 4 replicas: optionally a step where
    replica 2 raises first (the counter must not move), then a good step's draws."""
    strategy = gd.MirroredStrategy(_devices(4))
    with strategy.scope():
        g = gd.random.Generator(seed=9)
        w = gd.Variable(np.ones((3, 5), np.float32), name="w")
        opt = gd.optimizers.SGD(0.1)

    def replica_fn(x):
        with gd.GradientTape() as tape:
            h = gd.nn.dropout(fail_if_negative(x) @ w, 0.5, generator=g)
            noise = g.normal((2,))
            loss = gd.reduce_mean(h * h)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        return h, noise

    step = gd.function(lambda batch: strategy.run(replica_fn, args=(batch,)))
    x = np.ones((8, 3), np.float32)
    if fail_first:
        x_bad = x.copy()
        x_bad[4] = -1.0                                  # replica 2's first row
        bad = next(iter(strategy.experimental_distribute_dataset([x_bad])))
        before = [c.copy() for c in g.state.values]
        with pytest.raises(FloatingPointError, match="negative input"):
            step(bad)
        for now, then in zip(g.state.values, before):
            assert now.tobytes() == then.tobytes()
    good = next(iter(strategy.experimental_distribute_dataset([x])))
    out = [[np.asarray(v) for v in part.values] for part in step(good)]
    assert step.replicated_graph.merged == (mode == "merged")
    assert [int(c[0]) for c in g.state.values] == [2] * 4
    return out


@pytest.mark.parametrize("mode", ["auto", "threads", "merged"])
def test_a_failed_step_leaves_the_counter_and_the_rerun_draws_the_same(fail_if_negative,
                                                                        mode):
    old = gd.config.device_concurrency()
    gd.config.set_device_concurrency(mode)
    try:
        rerun = _dropout_steps(fail_if_negative, mode, fail_first=True)
        never_failed = _dropout_steps(fail_if_negative, mode, fail_first=False)
    finally:
        gd.config.set_device_concurrency(old)
    for got, want in zip(rerun, never_failed):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- dropout


def test_dropout_keeps_one_minus_rate_and_scales_exactly():
    x = np.random.default_rng(0).uniform(0.5, 2.0, (200, 500)).astype(np.float32)
    for rate in (0.1, 0.5, 0.9):
        y = gd.nn.dropout(x, rate, seed=3)
        kept = y != 0
        assert abs(kept.mean() - (1 - rate)) < 0.01
        np.testing.assert_array_equal(y[kept], x[kept] / np.float32(1 - rate))
        mask = draw(np.concatenate([[0], gd.random._key(3)]), 0, "uniform", x.shape,
                    np.dtype("float32")) >= np.float32(rate)
        np.testing.assert_array_equal(kept, mask)


def test_dropout_rate_zero_is_identity_and_bad_rates_raise():
    x = np.arange(6, dtype=np.float32)
    assert gd.nn.dropout(x, 0.0) is x
    for rate in (1.0, -0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="rate"):
            gd.nn.dropout(x, rate)
    with pytest.raises(ValueError, match="seed or generator"):
        gd.nn.dropout(x, 0.5, seed=1, generator=gd.random.Generator(seed=1))
    with pytest.raises(ValueError, match="noise_shape"):
        gd.nn.dropout(np.ones((2, 3), np.float32), 0.5, noise_shape=(2, 2))


def test_dropout_seed_is_stateless_generator_advances_noise_shape_broadcasts():
    x = np.ones((64, 32), np.float32)
    np.testing.assert_array_equal(gd.nn.dropout(x, 0.5, seed=1), gd.nn.dropout(x, 0.5, seed=1))
    assert not np.array_equal(gd.nn.dropout(x, 0.5, seed=1), gd.nn.dropout(x, 0.5, seed=2))
    g = gd.random.Generator(seed=1)
    a, b = gd.nn.dropout(x, 0.5, generator=g), gd.nn.dropout(x, 0.5, generator=g)
    assert g.counter == 2 and not np.array_equal(a, b)
    rows = gd.nn.dropout(x, 0.5, noise_shape=(64, 1), seed=4)
    assert np.all((rows == 0).all(axis=1) | (rows == 2).all(axis=1))
    cols = gd.nn.dropout(x, 0.5, noise_shape=(None, 1), seed=4)
    np.testing.assert_array_equal(rows, cols)
    c, d = gd.nn.dropout(x, 0.5), gd.nn.dropout(x, 0.5)       # the global generator
    assert not np.array_equal(c, d)


def test_dropout_gradient_is_mask_over_keep_probability():
    rate = 0.3
    x = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    c = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    g = gd.random.Generator(seed=6)
    mask = _philox(g.key, 0, x.shape) >= np.float32(rate)

    @gd.function
    def grad(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            loss = gd.reduce_sum(gd.nn.dropout(x, rate, generator=g) * c)
        return tape.gradient(loss, x)

    np.testing.assert_allclose(grad(x), mask * c / np.float32(1 - rate), rtol=1e-6)
    assert g.counter == 1


def test_dropout_under_a_strategy_gives_each_replica_its_own_mask():
    strategy = gd.MirroredStrategy(_devices(2))
    with strategy.scope():
        g = gd.random.Generator(seed=8)

    @gd.function
    def step(x):
        return strategy.run(lambda x: (gd.nn.dropout(x, 0.5, generator=g),
                                       gd.nn.dropout(x, 0.5, seed=3),
                                       gd.nn.dropout(x, 0.5)), args=(x,))

    x = np.ones((4, 64), np.float32)
    for out in step(x):                          # generator, seed, global generator
        a, b = out.values
        assert not np.array_equal(a, b) and set(np.unique(a)) == {0.0, 2.0}
    a, b = step(x)[1].values                     # a seed: the same masks on every call
    np.testing.assert_array_equal(a, step(x)[1].values[0])


# ---------------------------------------------------------------- initializers


def test_compute_fans_dense_and_conv():
    fans = gd.initializers.compute_fans
    assert fans(()) == (1, 1) and fans((7,)) == (7, 7)
    assert fans((784, 10)) == (784, 10)
    assert fans((3, 3, 16, 32)) == (144, 288)               # HWIO: H*W*I, H*W*O
    assert fans((5, 2, 8)) == (10, 40)


@pytest.mark.parametrize("shape", [(784, 10), (3, 3, 16, 32)])
def test_glorot_uniform_limit(shape):
    fan_in, fan_out = gd.initializers.compute_fans(shape)
    limit = math.sqrt(6 / (fan_in + fan_out))
    w = gd.initializers.glorot_uniform(shape, seed=0)
    assert w.shape == shape and w.dtype == np.float32
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.99 * limit
    assert abs(w.std() - limit / math.sqrt(3)) < 0.02 * limit
    np.testing.assert_array_equal(w, gd.initializers.glorot_uniform(shape, seed=0))
    u = _philox(gd.random.Generator(seed=0).key, 0, shape)
    np.testing.assert_array_equal(w, u * np.float32(2 * limit) + np.float32(-limit))


@pytest.mark.parametrize("shape", [(1000, 100), (3, 3, 64, 32)])
def test_he_normal_stddev(shape):
    fan_in, _ = gd.initializers.compute_fans(shape)
    stddev = math.sqrt(2 / fan_in)
    w = gd.initializers.he_normal(shape, seed=1)
    assert w.shape == shape and w.dtype == np.float32
    assert abs(w.std() - stddev) < 0.02 * stddev          # Keras: the truncated samples' std
    assert abs(w.mean()) < 0.02 * stddev
    assert np.abs(w).max() <= 2 * stddev / 0.87962566103423978 * (1 + 1e-6)


def test_initializers_with_a_generator_zeros_ones():
    g = gd.random.Generator(seed=2)
    a, b = gd.initializers.he_uniform((8, 4), generator=g), gd.initializers.glorot_normal(
        (8, 4), generator=g)
    assert g.counter == 2 and a.shape == b.shape == (8, 4)
    assert np.abs(a).max() <= math.sqrt(6 / 8)
    with pytest.raises(ValueError, match="seed or generator"):
        gd.initializers.glorot_uniform((2, 2), seed=1, generator=g)
    np.testing.assert_array_equal(gd.initializers.zeros((2, 3)), np.zeros((2, 3), np.float32))
    ones = gd.initializers.ones((4,), dtype="float64")
    assert ones.dtype == np.float64 and np.all(ones == 1)


def test_initializers_draw_eagerly_inside_a_trace():
    g = gd.random.Generator(seed=3)
    made = []

    @gd.function
    def step():
        drawn = g.uniform((2,))
        made.append(gd.initializers.glorot_uniform((4, 4), generator=g))
        return drawn

    with pytest.raises(gd.TraceError, match="generator"):
        step()                                   # the step uses g: no eager draw from it
    own = gd.random.Generator(seed=3)

    @gd.function
    def other():
        made.append(gd.initializers.glorot_uniform((4, 4), seed=5))
        made.append(gd.initializers.glorot_uniform((4, 4), generator=own))
        return gd.reduce_sum(made[-1])

    other()
    assert isinstance(made[-1], np.ndarray) and own.counter == 1
