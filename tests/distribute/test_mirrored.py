"""MirroredStrategy end to end: data-parallel equivalence with one device and with a numpy
reference, bit-identical mirrored components, determinism, gradient_reduction="sum",
uneven shards, gradient bucketing, failures inside one replica, and the bundled demo."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.core import OPS, Op, bind

DEVICES = [f"cpu:{i}" for i in range(4)]
SIZES = (16, 32, 4)
GLOBAL_BATCH = 32
STEPS = 5


# ---------------------------------------------------------------- numpy reference


def _init(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((16, 32)) * 0.5).astype(dtype),
            (rng.standard_normal(32) * 0.1).astype(dtype),
            (rng.standard_normal((32, 4)) * 0.5).astype(dtype),
            (rng.standard_normal(4) * 0.1).astype(dtype)]


def _batches(n_batches=STEPS, batch=GLOBAL_BATCH, seed=1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 16)).astype(dtype),
             rng.integers(0, 4, batch).astype(np.int32)) for _ in range(n_batches)]


def _np_per_example(params, x, y):
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    logits = np.tanh(x @ w1 + b1) @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(y)), y]


def _np_loss_and_grads(params, x, y):
    """Mean sparse softmax cross entropy of the tanh MLP and its gradients, in float64."""
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    x = x.astype(np.float64)
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.mean(np.log(p[np.arange(n), y]))
    dlogits = p.copy()
    dlogits[np.arange(n), y] -= 1
    dlogits /= n
    dh = dlogits @ w2.T * (1 - h * h)
    return loss, [x.T @ dh, dh.sum(0), h.T @ dlogits, dlogits.sum(0)]


def _np_train(params, batches, optimizer):
    params = [p.astype(np.float64) for p in params]
    slots = [[np.zeros_like(p), np.zeros_like(p)] for p in params]
    losses = []
    for t, (x, y) in enumerate(batches, start=1):
        loss, grads = _np_loss_and_grads(params, x, y)
        losses.append(loss)
        for p, g, (m, v) in zip(params, grads, slots):
            if optimizer == "sgd":           # torch.optim.SGD momentum
                m *= 0.9
                m += g
                p -= 0.1 * m
            else:                            # Adam, TF epsilon placement
                m *= 0.9
                m += 0.1 * g
                v *= 0.999
                v += 0.001 * g * g
                lr_t = 0.01 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
                p -= lr_t * m / (np.sqrt(v) + 1e-7)
    return params, losses


# ---------------------------------------------------------------- graphdist training


def _make_optimizer(kind, reduction="mean"):
    if kind == "sgd":
        return gd.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_reduction=reduction)
    return gd.optimizers.Adam(learning_rate=0.01, gradient_reduction=reduction)


def _forward(params, x):
    w1, b1, w2, b2 = params
    return gd.tanh(x @ w1 + b1) @ w2 + b2


def _setup(strategy, kind, dtype, reduction="mean", loss="mean", global_batch_size=None):
    with strategy.scope():
        params = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(_init(dtype=dtype))]
        opt = _make_optimizer(kind, reduction)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                per_example = gd.nn.sparse_softmax_cross_entropy(y, _forward(params, x))
                if loss == "mean":
                    value = gd.reduce_mean(per_example)
                else:
                    value = gd.nn.compute_average_loss(per_example, global_batch_size)
            grads = tape.gradient(value, params)
            opt.apply_gradients(zip(grads, params))
            return per_example

        per_example = strategy.run(replica_fn, args=batch)
        return strategy.reduce(gd.ReduceOp.MEAN, per_example, axis=0), per_example

    return params, opt, step


def _assert_mirrored(variables):
    for v in variables:
        first = v.values[0]
        for d, component in enumerate(v.values[1:], start=1):
            assert np.array_equal(first, component), \
                f"{v.name}: component {d} differs from component 0"


def _train(strategy, kind, batches, dtype=np.float32, **kw):
    params, opt, step = _setup(strategy, kind, dtype, **kw)
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        loss, _ = step(batch)
        losses.append(loss)
        _assert_mirrored(params + opt.variables())
    assert step.trace_count == 1
    assert int(opt.iterations.numpy()) == len(batches)
    return [p.numpy() for p in params], losses, step


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_device_matches_numpy_reference_float64(kind):
    batches = _batches(dtype=np.float64)
    got, losses, _ = _train(gd.OneDeviceStrategy("cpu:0"), kind, batches, np.float64)
    want, want_losses = _np_train(_init(dtype=np.float64), batches, kind)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)


@pytest.fixture(params=["merged", "sequential"])
def mode(request):
    gd.config.set_device_concurrency(request.param)
    yield request.param
    gd.config.set_device_concurrency("auto")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_four_replicas_match_one_device_float32(kind, mode):
    batches = _batches()
    one, one_losses, _ = _train(gd.OneDeviceStrategy("cpu:0"), kind, batches)
    four, four_losses, step = _train(gd.MirroredStrategy(DEVICES), kind, batches)
    assert all(p.dtype == np.float32 for p in four)
    for a, b in zip(four, one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(four_losses, one_losses, rtol=1e-5)
    want, _ = _np_train(_init(), batches, kind)   # and both are the right training
    for a, w in zip(four, want):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5)
    # the step really ran over four devices, with the shards' shapes: merged, as one
    # program over the four shards stacked; else one copy per device
    rg = step.replicated_graph
    assert set(rg.devices) == set(DEVICES)
    assert all(v.shape == (8, 16) for v in rg.inputs[: rg.num_args] if v.ty.shape[-1:] == (16,))
    if mode == "merged":
        assert rg.merged and {e.device for e in rg.eqns} == {DEVICES[0]}
        assert any(v.ty.shape == (4, 8, 16) for e in rg.eqns for v in e.outputs)
    else:
        assert {e.device for e in rg.eqns} == set(DEVICES)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_four_replicas_match_one_device_float64(kind):
    batches = _batches(dtype=np.float64)
    one, one_losses, _ = _train(gd.OneDeviceStrategy("cpu:0"), kind, batches, np.float64)
    four, four_losses, _ = _train(gd.MirroredStrategy(DEVICES), kind, batches, np.float64)
    for a, b in zip(four, one):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(four_losses, one_losses, rtol=1e-12)
    want, _ = _np_train(_init(dtype=np.float64), batches, kind)
    for a, w in zip(four, want):
        np.testing.assert_allclose(a, w, rtol=1e-10, atol=1e-12)


def test_two_fresh_runs_give_identical_bits():
    batches = _batches()
    runs = [_train(gd.MirroredStrategy(DEVICES), "adam", batches) for _ in range(2)]
    for a, b in zip(runs[0][0], runs[1][0]):
        assert np.array_equal(a, b)
    assert [float(x) for x in runs[0][1]] == [float(x) for x in runs[1][1]]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sum_reduction_with_compute_average_loss_matches_one_device(kind):
    batches = _batches()
    one, _, _ = _train(gd.OneDeviceStrategy("cpu:0"), kind, batches)
    four, _, _ = _train(gd.MirroredStrategy(DEVICES), kind, batches, reduction="sum",
                        loss="average")
    for a, b in zip(four, one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mean_reduction_with_compute_average_loss_is_scaled_down():
    # the counter-check: averaging gradients of a loss already divided by the global batch
    # shrinks the step by the replica count, so the result must differ from one device
    batches = _batches(n_batches=2)
    one, _, _ = _train(gd.OneDeviceStrategy("cpu:0"), "sgd", batches)
    four, _, _ = _train(gd.MirroredStrategy(DEVICES), "sgd", batches, loss="average")
    assert not np.allclose(four[0], one[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- uneven shards


def test_uneven_shards_run_and_reduce_weighted_by_shard_size():
    strategy = gd.MirroredStrategy(DEVICES)
    batches = _batches(n_batches=2, batch=10)
    params, opt, step = _setup(strategy, "sgd", np.float32)
    init = _init()
    dist = list(strategy.experimental_distribute_dataset(batches))
    assert [len(s) for s in dist[0][0].values] == [3, 3, 2, 2]
    mean, per_example = step(dist[0])
    assert isinstance(per_example, gd.PerReplica)
    assert [v.shape for v in per_example.values] == [(3,), (3,), (2,), (2,)]
    want = _np_per_example(init, *batches[0])
    np.testing.assert_allclose(np.concatenate(per_example.values), want, rtol=1e-5)
    np.testing.assert_allclose(mean, want.mean(), rtol=1e-5)
    # mean over shards' means would weigh the 2-row shards more: make sure it is not that
    assert not np.isclose(np.mean([v.mean() for v in per_example.values]), want.mean(),
                          rtol=1e-6)
    # eagerly, on the returned PerReplica
    np.testing.assert_allclose(strategy.reduce("mean", per_example, axis=0), want.mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(strategy.reduce("sum", per_example, axis=0), want.sum(),
                               rtol=1e-5)
    _assert_mirrored(params + opt.variables())
    # gradients are the mean of the shard means (one step of SGD, momentum buffer = grad)
    grads = [np.mean([_np_loss_and_grads(init, x, y)[1][k] for x, y in
                      zip(dist[0][0].values, dist[0][1].values)], axis=0) for k in range(4)]
    for p, p0, g in zip(params, init, grads):
        np.testing.assert_allclose(p.numpy(), p0 - 0.1 * g, rtol=1e-5, atol=1e-6)
    step(dist[1])
    _assert_mirrored(params + opt.variables())
    assert step.trace_count == 1


def test_uneven_shards_with_sum_reduction_match_one_device():
    batches = _batches(n_batches=3, batch=10)
    one, _, _ = _train(gd.OneDeviceStrategy("cpu:0"), "sgd", batches)
    four, _, _ = _train(gd.MirroredStrategy(DEVICES), "sgd", batches, reduction="sum",
                        loss="average", global_batch_size=10)
    for a, b in zip(four, one):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bucketing


def test_bucket_size_does_not_change_results():
    batches = _batches(n_batches=3)
    results = {}
    for bucket_bytes in (64, 2**30):
        strategy = gd.MirroredStrategy(DEVICES, bucket_bytes=bucket_bytes)
        assert strategy.bucket_bytes == bucket_bytes
        params, losses, step = _train(strategy, "adam", batches)
        n_reduce = sum(e.op.name == "all_reduce" for e in step.graph.eqns)
        results[bucket_bytes] = params, losses, n_reduce
    tiny, huge = results[64], results[2**30]
    for a, b in zip(tiny[0], huge[0]):
        assert np.array_equal(a, b)
    assert [float(x) for x in tiny[1]] == [float(x) for x in huge[1]]
    # 4 gradients: one bucket each (every one is > 64 bytes but b2), or all in one bucket
    assert tiny[2] >= huge[2] + 2, (tiny[2], huge[2])


def test_bad_bucket_bytes_raise():
    with pytest.raises(ValueError):
        gd.MirroredStrategy(DEVICES, bucket_bytes=0)


# ---------------------------------------------------------------- failures


class ReplicaFailure(RuntimeError):
    pass


@pytest.fixture
def fail_if_negative():
    # a short timeout: a replica that waits forever for a failed peer fails the test fast
    timeout = gd.config.collective_timeout()
    gd.config.set_collective_timeout(5.0)
    op = Op("test_mirrored_fail_if_negative")
    op.def_shape(lambda x: x)
    op.def_vjp(lambda ct, x: (ct,))

    @op.def_impl
    def _impl(xp, x):
        if x.reshape(-1)[0] < 0:
            raise ReplicaFailure("negative input")
        return x.copy()

    yield lambda x: bind(op, x)
    del OPS["test_mirrored_fail_if_negative"]
    gd.config.set_collective_timeout(timeout)


def test_failure_in_one_replica_propagates_and_leaves_state(fail_if_negative):
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        params = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(_init())]
        opt = _make_optimizer("adam")
        counter = gd.Variable(0.0, name="counter",
                              synchronization=gd.VariableSynchronization.ON_READ,
                              aggregation=gd.VariableAggregation.SUM)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            x = fail_if_negative(x)
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, _forward(params, x)))
            opt.apply_gradients(zip(tape.gradient(loss, params), params))
            counter.assign_add(1.0)
            return loss

        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    x, y = _batches(n_batches=1)[0]
    x = np.abs(x)
    good = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    step(good)                                   # slots exist, one good step done
    state = [[c.copy() for c in v.values] for v in params + opt.variables() + [counter]]
    bad_x = x.copy()
    bad_x[16] = -1.0                             # row 16 is replica 2's first row
    bad = next(iter(strategy.experimental_distribute_dataset([(bad_x, y)])))
    for _ in range(2):                           # the same failure twice: no hang, same error
        with pytest.raises(ReplicaFailure) as info:
            step(bad)
        message = str(info.value)
        assert "negative input" in message
        assert "cpu:2" in message
        assert "test_mirrored_fail_if_negative" in message
        assert "cpu:0" not in message and "cpu:1" not in message
        for v, before in zip(params + opt.variables() + [counter], state):
            for d, (now, then) in enumerate(zip(v.values, before)):
                assert np.array_equal(now, then), f"{v.name} changed on replica {d}"
    assert step.trace_count == 1
    # still usable: the next good step is the same as a step on a fresh model would be
    step(good)
    assert int(opt.iterations.numpy()) == 2
    assert counter.numpy() == 8.0
    _assert_mirrored(params + opt.variables())
    ref, _, _ = _train(strategy, "adam", [(x, y), (x, y)])
    for p, r in zip(params, ref):
        assert np.array_equal(p.numpy(), r)


def test_failure_in_replica_zero_of_strategy_run(fail_if_negative):
    strategy = gd.MirroredStrategy(DEVICES)

    def replica_fn(x):
        return gd.reduce_sum(fail_if_negative(x))

    values = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    out = strategy.run(replica_fn, args=(strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group]),))
    assert [float(v) for v in out.values] == [3.0, 7.0, 11.0, 15.0]
    bad = strategy.experimental_distribute_values_from_function(
        lambda ctx: -values[ctx.replica_id_in_sync_group] if ctx.replica_id_in_sync_group == 0
        else values[ctx.replica_id_in_sync_group])
    with pytest.raises(ReplicaFailure, match="cpu:0"):
        strategy.run(replica_fn, args=(bad,))
    out = strategy.run(replica_fn, args=(strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group]),))
    assert [float(v) for v in out.values] == [3.0, 7.0, 11.0, 15.0]


# ---------------------------------------------------------------- the demo


def test_demo_model_on_four_devices_matches_one_device():
    from graphdist.examples.mlp_digits import train

    one = train(devices=1, steps=20)
    four = train(devices=4, steps=20)
    assert four["strategy"].num_replicas_in_sync == 4
    for a, b in zip(four["params"], one["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    assert four["losses"][-1] < four["losses"][0]
