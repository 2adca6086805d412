"""gd.optimizers.LossScaleOptimizer: cases ported from TF's and Keras's tests, skipped steps
that leave every variable, slot and the iteration count untouched, agreement of all replicas
when only one overflows, checkpoints of the scale, and mixed_float16 training.

TF: tensorflow/python/keras/mixed_precision/loss_scale_optimizer_test.py
(LossScaleOptimizerTest); Keras 3: keras/src/optimizers/loss_scale_optimizer_test.py
(LossScaleOptimizerTest). Each ported test names its source method."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

DEV2 = ["cpu:0", "cpu:1"]


@pytest.fixture(autouse=True)
def _defaults():
    yield
    gd.config.set_precision("float32")
    gd.config.set_fused_kernels(True)


def _identity_step(var, opt, factor=1.0, strategy=None):
    """TF's `loss = var * factor` through the documented recipe: scale, unscale, apply (on
    every replica of `strategy`, if given)."""
    def replica_fn(k):
        with gd.GradientTape() as tape:
            scaled = opt.get_scaled_loss(gd.reduce_sum(var * k) * factor)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [var]))
        return opt.apply_gradients(zip(grads, [var]))

    if strategy is None:
        return gd.function(replica_fn)
    return gd.function(lambda k: strategy.run(replica_fn, args=(k,)))


def test_get_scaled_loss():
    # TF testGetScaledLoss
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0), dynamic=False,
                                           initial_scale=2.0)
    assert float(opt.get_scaled_loss(np.float32(5.0))) == 10.0
    assert float(opt.get_scaled_loss(lambda: np.float32(5.0))()) == 10.0
    half = opt.get_scaled_loss(np.float16(5.0))
    assert half.dtype == np.float16 and float(half) == 10.0


def test_get_unscaled_gradients():
    # TF testGetUnscaledGradients and testGetUnscaledSparseGradients
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0), dynamic=False,
                                           initial_scale=2)
    grads = opt.get_unscaled_gradients([np.float32(3.0), None, np.float16(-4.0)])
    assert float(grads[0]) == 1.5 and grads[1] is None
    assert grads[2].dtype == np.float16 and float(grads[2]) == -2.0
    sparse = gd.IndexedSlices(np.array([1, 3]), np.array([[4.0, 2.0], [8.0, 5.0]], np.float32),
                              (5, 2))
    (unscaled,) = opt.get_unscaled_gradients([sparse])
    assert isinstance(unscaled, gd.IndexedSlices) and unscaled.dense_shape == (5, 2)
    np.testing.assert_array_equal(unscaled.values, [[2.0, 1.0], [4.0, 2.5]])


def test_default_values():
    # TF testDynamicLossScaleDefaultValues
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD())
    assert opt.initial_scale == 2**15 and opt.dynamic_growth_steps == 2000 and opt.dynamic
    assert opt.loss_scale.numpy() == 2**15 and opt.dynamic_counter.numpy() == 0
    fixed = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(), dynamic=False,
                                             initial_scale=2.0)
    assert fixed.dynamic_growth_steps is None and fixed.dynamic_counter is None


@pytest.mark.parametrize("strategy_fn", [gd.get_strategy, lambda: gd.MirroredStrategy(DEV2)],
                         ids=["default", "mirrored"])
def test_dynamic_loss_scale(strategy_fn):
    # TF testDynamicLossScale: the loss is the variable, so the gradient is 1 and each step
    # subtracts lr * 1, while the scale doubles every step (dynamic_growth_steps=1)
    strategy = strategy_fn()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        var = gd.Variable(np.array([5.0], np.float32))
        opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0), initial_scale=2,
                                               dynamic_growth_steps=1)
    step = _identity_step(var, opt, strategy=strategy if n > 1 else None)
    step(np.float32(1))
    np.testing.assert_allclose(var.numpy(), [3.0])
    assert opt.loss_scale.numpy() == 4.0
    step(np.float32(1))
    np.testing.assert_allclose(var.numpy(), [1.0])
    assert opt.loss_scale.numpy() == 8.0 and opt.iterations.numpy() == 2


def test_dynamic_update_skips_a_nan_step_and_halves_the_scale():
    # TF testDynamicUpdate
    var = gd.Variable(np.array([1.0, 2.0], np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(1.0), initial_scale=2,
                                           dynamic_growth_steps=1)
    step = _identity_step(var, opt)
    assert int(step(np.float32(2.0))) == 1
    np.testing.assert_array_equal(var.numpy(), [-1.0, 0.0])
    assert opt.loss_scale.numpy() == 4.0
    assert int(step(np.float32(np.nan))) == 1                   # skipped: still step 1
    np.testing.assert_array_equal(var.numpy(), [-1.0, 0.0])
    assert opt.loss_scale.numpy() == 2.0 and opt.iterations.numpy() == 1


def test_downscaling_and_upscaling():
    # Keras test_downscaling: four infinite steps from 400 -> 25
    var = gd.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.5), initial_scale=400.0)
    for _ in range(4):
        opt.apply_gradients([(np.full(4, np.inf, np.float32), var)])   # eagerly, too
    assert float(opt.get_scaled_loss(np.float32(1.0))) == 25.0
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0, 3.0, 4.0])  # Keras test_infinite_step
    # Keras test_upscaling: from 2, doubling every 2 finite steps: 8 steps -> 32
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.5), initial_scale=2.0,
                                           dynamic_growth_steps=2)
    counts = []
    for _ in range(8):
        opt.apply_gradients([(np.array([1.0, 6.0, 7.0, 2.0], np.float32), var)])
        counts.append(int(opt.dynamic_counter.numpy()))
    assert float(opt.get_scaled_loss(np.float32(1.0))) == 32.0
    assert counts == [1, 0] * 4
    np.testing.assert_allclose(var.numpy(), np.array([1.0, 2.0, 3.0, 4.0]) -
                               8 * 0.5 * np.array([1.0, 6.0, 7.0, 2.0]))


def test_scale_never_drops_below_one():
    # TF's dynamic loss scale: max(scale / 2, 1)
    var = gd.Variable(np.ones(2, np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.5), initial_scale=2.0)
    for _ in range(3):
        opt.apply_gradients([(np.array([np.nan, 1.0], np.float32), var)])
    assert opt.loss_scale.numpy() == 1.0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_skipped_step_leaves_variables_slots_and_iterations_bit_identical(fused):
    gd.config.set_fused_kernels(fused)
    rng = np.random.default_rng(0)
    w = gd.Variable(rng.normal(size=(64, 64)).astype(np.float32), name="w")
    b = gd.Variable(rng.normal(size=(64,)).astype(np.float32), name="b")
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(1e-2), initial_scale=2.0**10,
                                           dynamic_growth_steps=3)
    x = rng.normal(size=(32, 64)).astype(np.float32)

    @gd.function
    def step(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(x @ w + b))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [w, b]))
        opt.apply_gradients(zip(grads, [w, b]))
        return loss

    step(x)
    step(x)                                    # slots now hold nonzero moments
    state = {v.name: v.numpy().copy() for v in [w, b, *opt.variables()]}
    bad = x.copy()
    bad[3, 7] = np.inf
    step(bad)
    for v in [w, b, *opt.inner_optimizer.variables()]:
        np.testing.assert_array_equal(v.numpy(), state[v.name], err_msg=v.name)
    assert opt.iterations.numpy() == 2 and opt.loss_scale.numpy() == 2.0**9
    assert opt.dynamic_counter.numpy() == 0
    step(x)                                    # a finite step applies again
    assert opt.iterations.numpy() == 3 and not np.array_equal(w.numpy(), state["w"])
    assert np.all(np.isfinite(w.numpy()))


def test_clipping_in_the_inner_optimizer_and_inf_still_skipped():
    # TF testClipping (clipnorm)
    var = gd.Variable(np.array([5.0], np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0, clipnorm=2.0),
                                           initial_scale=2, dynamic_growth_steps=1)
    step = _identity_step(var, opt, factor=4.0)   # gradient 4, clipped to 2
    step(np.float32(1))
    np.testing.assert_allclose(var.numpy(), [1.0])
    assert opt.loss_scale.numpy() == 4.0
    step(np.float32(np.inf))
    np.testing.assert_allclose(var.numpy(), [1.0])     # not clipped: skipped
    assert opt.loss_scale.numpy() == 2.0


def test_fixed_loss_scale():
    # TF testFixedLossScaleAppliedToLossWithMinimize: scale 10 fixed, lr 2: 5 -> 3
    var = gd.Variable(np.array([5.0], np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0), dynamic=False,
                                           initial_scale=10.0)
    step = _identity_step(var, opt)
    step(np.float32(1))
    np.testing.assert_allclose(var.numpy(), [3.0])
    assert opt.loss_scale.numpy() == 10.0


def test_float16_loss():
    # TF testDynamicLossScaleWithFloat16Loss
    var = gd.Variable(np.array([5.0], np.float32))
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(2.0), initial_scale=2,
                                           dynamic_growth_steps=1)

    @gd.function
    def step():
        with gd.GradientTape() as tape:
            scaled = opt.get_scaled_loss(gd.cast(gd.reduce_sum(var), "float16"))
        assert scaled.dtype == np.float16
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [var]))
        return opt.apply_gradients(zip(grads, [var]))

    step()
    np.testing.assert_allclose(var.numpy(), [3.0])


def test_only_one_replica_overflows_and_every_replica_skips():
    # TF testNanOnOneReplicaOnly, on two logical CPUs and with Adam's slots
    strategy = gd.MirroredStrategy(DEV2)
    with strategy.scope():
        w = gd.Variable(np.array([[1.0], [2.0]], np.float32), name="w")
        opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(0.1), initial_scale=2,
                                               dynamic_growth_steps=2)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                scaled = opt.get_scaled_loss(gd.reduce_sum(x @ w))
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, [w]))
            opt.apply_gradients(zip(grads, [w]))
            return scaled

        return strategy.run(replica_fn, args=(x,))

    def per_replica(rows):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: rows[ctx.replica_id_in_sync_group])

    good = [np.array([[1.0, 2.0]], np.float32), np.array([[3.0, 4.0]], np.float32)]
    step(per_replica(good))
    assert opt.iterations.numpy() == 1
    before = [np.array(c) for c in w.values]
    slots = {k: [np.array(c) for c in s.values] for k, s in opt.inner_optimizer.slots().items()}
    bad = [good[0], np.array([[np.inf, 1.0]], np.float32)]      # replica 1 only
    losses = step(per_replica(bad))
    assert np.isfinite(float(losses.values[0])) and not np.isfinite(float(losses.values[1]))
    for got, old in zip(w.values, before):
        np.testing.assert_array_equal(got, old)                 # unchanged on both replicas
    np.testing.assert_array_equal(w.values[0], w.values[1])     # and bit-identical
    for k, s in opt.inner_optimizer.slots().items():
        for got, old in zip(s.values, slots[k]):
            np.testing.assert_array_equal(got, old)
    assert opt.iterations.numpy() == 1 and opt.loss_scale.numpy() == 1.0
    assert [float(c) for c in opt.loss_scale.values] == [1.0, 1.0]
    text = str(step.graph)
    assert text.count("all_reduce") >= 2              # the gradients, and the finiteness flag
    assert "f32[] = all_reduce[op=sum]" in text
    step(per_replica(good))                           # and training goes on, in sync
    assert opt.iterations.numpy() == 2
    np.testing.assert_array_equal(w.values[0], w.values[1])
    assert not np.array_equal(w.values[0], before[0])


def test_sparse_gradients_are_skipped_and_applied_too():
    strategy = gd.MirroredStrategy(DEV2)
    with strategy.scope():
        emb, dense = gd.nn.Embedding(50, 4), gd.nn.Dense(1)
        opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(0.1), initial_scale=4)
    ids = np.array([[1, 2], [3, 3], [4, 5], [6, 7]])
    kinds = []

    @gd.function
    def step(ids, k):
        def replica_fn(ids):
            with gd.GradientTape() as tape:
                scaled = opt.get_scaled_loss(gd.reduce_sum(dense(emb(ids)) * k))
            variables = emb.trainable_variables + dense.trainable_variables
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
            kinds.append(type(grads[0]).__name__)
            opt.apply_gradients(zip(grads, variables))
            return scaled

        return strategy.run(replica_fn, args=(ids,))

    step(ids, np.float32(1))
    table = emb.embeddings.numpy()
    step(ids, np.float32(np.inf))
    np.testing.assert_array_equal(emb.embeddings.numpy(), table)
    assert opt.loss_scale.numpy() == 2.0 and opt.iterations.numpy() == 1
    step(ids, np.float32(1))
    assert opt.iterations.numpy() == 2 and kinds[0] == "IndexedSlices"
    changed = np.any(emb.embeddings.numpy() != table, axis=1)
    assert set(np.flatnonzero(changed)) == set(ids.ravel())     # only the rows looked up


def test_checkpoint_round_trip_of_the_loss_scale(tmp_path):
    var = gd.Variable(np.array([1.0, 2.0], np.float32), name="var")
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(0.1), initial_scale=8.0,
                                           dynamic_growth_steps=5)
    opt.apply_gradients([(np.array([1.0, 1.0], np.float32), var)])
    opt.apply_gradients([(np.array([np.nan, 1.0], np.float32), var)])
    opt.apply_gradients([(np.array([1.0, 2.0], np.float32), var)])
    saved = {"scale": opt.loss_scale.numpy(), "count": opt.dynamic_counter.numpy(),
             "var": var.numpy(), "it": opt.iterations.numpy(),
             "m": opt.inner_optimizer.slots()["var/m"].numpy()}
    assert (saved["scale"], saved["count"], saved["it"]) == (4.0, 1, 2)
    path = gd.Checkpoint(model={"var": var}, opt=opt).save(tmp_path / "ck.npz")
    var2 = gd.Variable(np.zeros(2, np.float32), name="var")
    opt2 = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(0.1), initial_scale=8.0,
                                            dynamic_growth_steps=5)
    gd.Checkpoint(model={"var": var2}, opt=opt2).restore(path)
    assert opt2.loss_scale.numpy() == 4.0 and opt2.dynamic_counter.numpy() == 1
    assert opt2.iterations.numpy() == 2
    np.testing.assert_array_equal(var2.numpy(), saved["var"])
    np.testing.assert_array_equal(opt2.inner_optimizer.slots()["var/m"].numpy(), saved["m"])
    with np.load(path) as f:
        assert {"opt/current_loss_scale", "opt/good_steps", "opt/inner_optimizer/iterations"} \
            <= set(f.files)


def test_mixed_float16_training_with_loss_scaling():
    gd.config.set_precision("mixed_float16")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = gd.nn.Sequential([gd.nn.Dense(16, activation="relu"), gd.nn.Dense(2)])
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.Adam(1e-2))

    @gd.function
    def step(x, y):
        with gd.GradientTape() as tape:
            logits = gd.cast(model(x, training=True), "float32")
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
            scaled = opt.get_scaled_loss(loss)
        variables = model.trainable_variables
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
        opt.apply_gradients(zip(grads, variables))
        return loss

    losses = [float(step(x, y)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0] and all(np.isfinite(losses))
    assert all(v.dtype == np.float32 for v in model.variables)
    assert all(s.dtype == np.float32 for s in opt.inner_optimizer.slots().values())
    assert "f16[64,16] = matmul" in str(step.graph)
    assert opt.iterations.numpy() == 15                # 2**15 does not overflow this model


def test_wrong_arguments():
    with pytest.raises(TypeError):
        gd.optimizers.LossScaleOptimizer("sgd")
    with pytest.raises(ValueError):
        gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(), initial_scale=0.5)
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD())
    var = gd.Variable(np.ones(2, np.float32))
    with pytest.raises(TypeError, match="float32 master weights"):
        opt.apply_gradients([(np.ones(2, np.float16), var)])
