"""Merged replicas (passes/merge.py): N replicas on logical CPU devices as one program over
stacked values. Every result is checked against the replica function run eagerly on numpy,
shard by shard, and the merged graph's shape against what the merge promises (one GEMM per
weight gradient, one optimizer update for all replicas)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.core import OPS, Op, bind

DEVICES = [f"cpu:{i}" for i in range(4)]


@pytest.fixture
def merged():
    gd.config.set_device_concurrency("merged")
    yield
    gd.config.set_device_concurrency("auto")


def _shards(x, n=4):
    return gd.PerReplica(tuple(np.array_split(x, n)))


@pytest.fixture
def no_rule():
    """An op without a batching rule: the merge runs it once per replica on slices."""
    op = Op("test_merge_cumulative")
    op.def_shape(lambda x: x)
    op.def_impl(lambda xp, x: xp.cumsum(x, axis=-1).astype(x.dtype))
    yield op
    del OPS[op.name]


def body(x, w, rid, no_rule):
    """Touches every batching rule, on a (rows, 3) shard x and a shared (3, 3) w."""
    h = gd.matmul(x, w) + gd.cast(rid, "float32")                   # batched @ shared
    t = gd.matmul(w, gd.transpose(h))                                # shared @ batched
    g = gd.matmul(gd.transpose(x), h)                                # batched @ batched
    row = gd.reduce_sum(h, axis=0, keepdims=True)                    # (1, 3)
    e = gd.exp(-gd.abs(h)) * row + gd.reshape(gd.reduce_max(h, axis=-1), (-1, 1))
    parts = gd.split(gd.concat([e, x], axis=1), [2, 4], axis=1)      # shared-free concat
    both = gd.concat([gd.reshape(w, (1, 9)), gd.reshape(parts[0][:1], (1, -1))[:, :2]],
                     axis=1)                                         # shared with batched
    hot = gd.one_hot(gd.minimum(gd.cast(gd.relu(x[:, 0]) * 2.0, "int32"), 2), 3)
    picked = gd.where(gd.greater(hot, 0.5), e, gd.zeros_like(e))
    wide = gd.broadcast_to(gd.reshape(gd.reduce_mean(picked, axis=1), (-1, 1, 1)),
                           (h.shape[0], 2, 3))
    cum = bind(no_rule, parts[1])
    return (gd.reduce_sum(t, axis=None), g, both, wide, cum,
            gd.stop_gradient(gd.sqrt(gd.square(e) + 1.0)))


def test_every_batching_rule_matches_the_replica_function_run_eagerly(merged, no_rule):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 3)).astype(np.float32)
    w = rng.standard_normal((3, 3)).astype(np.float32)
    strategy = gd.MirroredStrategy(DEVICES)

    @gd.function
    def step(xs, w):
        def replica_fn(x, w):
            return body(x, w, gd.get_replica_context().replica_id_in_sync_group, no_rule)
        return strategy.run(replica_fn, args=(xs, w))

    got = step(_shards(x), w)
    placed = step.replicated_graph
    assert placed.merged, "the step should have merged"
    assert step._latest().executable.diagnosis is None, "the merged program itself ran"
    # the shared argument w enters once; x's four shards are stacked
    assert sum(v.hint == "w" for v in placed.inputs[:placed.num_args]) == 4
    want = [body(xs, w, np.int32(k), no_rule) for k, xs in enumerate(np.array_split(x, 4))]
    for k in range(4):
        for out, ref in zip(got, want[k]):
            np.testing.assert_allclose(out.values[k], ref, rtol=1e-5, atol=1e-6)


def test_a_training_step_merges_into_one_gemm_per_matmul_and_one_update(merged):
    rng = np.random.default_rng(1)
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        w1 = gd.Variable(rng.standard_normal((6, 8)).astype(np.float32) * 0.3, name="w1")
        w2 = gd.Variable(rng.standard_normal((8, 3)).astype(np.float32) * 0.3, name="w2")
        opt = gd.optimizers.Adam(0.01)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                logits = gd.relu(x @ w1) @ w2
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
            opt.apply_gradients(zip(tape.gradient(loss, [w1, w2]), [w1, w2]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = rng.integers(0, 3, 16).astype(np.int32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(step(batch)) for _ in range(3)]
    placed, logical = step.replicated_graph, step.graph
    ops = [e.op.name for e in placed.eqns]
    # as many GEMMs as the logical graph has matmuls: the weight gradients summed over
    # replicas are one GEMM over all 16 rows each, never 4 and a sum
    # (relu(x @ w1) runs as one matmul_bias_act: passes/epilogue.py)
    assert ops.count("matmul") + ops.count("matmul_bias_act") == \
        [e.op.name for e in logical.eqns].count("matmul")
    assert max(e.inputs[0].ty.shape[0] for e in placed.eqns if e.op.name == "matmul") == 16
    assert ops.count("adam_multi_update") == 1
    assert step._latest().executable.diagnosis is None
    # the same three steps on one device over the global batch: the same training
    ref = [v.numpy() for v in (w1, w2)]
    one = gd.OneDeviceStrategy("cpu:0")
    with one.scope():
        v1 = gd.Variable(np.zeros((6, 8), np.float32))
        v2 = gd.Variable(np.zeros((8, 3), np.float32))
        opt1 = gd.optimizers.Adam(0.01)
    rng = np.random.default_rng(1)
    v1.assign(rng.standard_normal((6, 8)).astype(np.float32) * 0.3)
    v2.assign(rng.standard_normal((8, 3)).astype(np.float32) * 0.3)

    @gd.function
    def step1(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, gd.relu(x @ v1) @ v2))
        opt1.apply_gradients(zip(tape.gradient(loss, [v1, v2]), [v1, v2]))
        return loss

    one_losses = [float(step1(x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    for a, b in zip(ref, (v1.numpy(), v2.numpy())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _counter_step(strategy, v):
    @gd.function
    def step(x):
        def replica_fn(x):
            v.assign_add(gd.reduce_sum(x, axis=0))
            return v.read_value()
        return strategy.run(replica_fn, args=(x,))
    return step


def test_lagging_components_catch_up_when_read_and_before_per_device_steps(merged):
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), name="v", aggregation="sum")
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    merged_step = _counter_step(strategy, v)
    merged_step(_shards(x))
    assert merged_step.replicated_graph.merged
    total = x.sum(axis=0)
    # only component 0 was written; the others are brought up to date when looked at
    assert v._lagging and not np.array_equal(v._values[1], total)
    assert all(np.array_equal(c, total) for c in v.values) and not v._lagging
    merged_step(_shards(x))
    gd.config.set_device_concurrency("sequential")
    try:
        per_device = _counter_step(strategy, v)
        per_device(_shards(x))            # reads every component: they must be current
        assert not per_device.replicated_graph.merged
    finally:
        gd.config.set_device_concurrency("merged")
    assert all(np.array_equal(c, 3 * total) for c in v.values)
    assert np.array_equal(v.numpy(), 3 * total)


def test_checkpoint_after_merged_steps_restores_onto_two_replicas(tmp_path, merged):
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), name="v", aggregation="sum")
    x = np.ones((8, 2), np.float32)
    _counter_step(strategy, v)(_shards(x))
    path = gd.Checkpoint(v=v).save(tmp_path / "ckpt")
    two = gd.MirroredStrategy(DEVICES[:2])
    with two.scope():
        w = gd.Variable(np.zeros(2, np.float32), name="v")
    gd.Checkpoint(v=w).restore(path)
    assert all(np.array_equal(c, [8.0, 8.0]) for c in w.values)


def test_sync_on_read_variables_merge_with_one_component_per_replica(merged):
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        seen = gd.Variable(0.0, name="seen", synchronization="on_read", aggregation="sum")
        last = gd.Variable(0.0, name="last", synchronization="on_read",
                           aggregation="only_first_replica")

    @gd.function
    def step(x):
        def replica_fn(x):
            seen.assign_add(gd.cast(gd.shape(x)[0], "float32"))
            last.assign(gd.reduce_max(x))
            return seen.read_value()
        return strategy.run(replica_fn, args=(x,))

    x = np.arange(8, dtype=np.float32)
    out = step(_shards(x))
    step(_shards(x))
    assert step.replicated_graph.merged
    assert [float(c) for c in seen.values] == [4.0] * 4      # 2 rows a step, per replica
    assert float(seen.numpy()) == 16.0
    assert [float(c) for c in last.values] == [1.0, 3.0, 5.0, 7.0]
    assert float(last.numpy()) == 1.0
    assert [float(v) for v in out.values] == [2.0] * 4


def test_uneven_shards_run_per_device_and_nothing_merges_by_default(merged):
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), name="v", aggregation="sum")
    step = _counter_step(strategy, v)
    x = np.ones((10, 2), np.float32)                   # 3, 3, 2, 2 rows
    step(_shards(x))
    assert not step.replicated_graph.merged
    assert np.array_equal(v.numpy(), [10.0, 10.0])
    gd.config.set_device_concurrency("auto")           # the default: per-device copies
    with strategy.scope():
        u = gd.Variable(np.zeros(2, np.float32), name="u", aggregation="sum")
    auto_step = _counter_step(strategy, u)
    auto_step(_shards(np.ones((8, 2), np.float32)))
    assert not auto_step.replicated_graph.merged
    assert {e.device for e in auto_step.replicated_graph.eqns} == set(DEVICES)
    assert np.array_equal(u.numpy(), [8.0, 8.0])


def test_merged_mode_applies_to_explicit_cross_device_ops_too(merged):
    ring = gd.MirroredStrategy(DEVICES, cross_device_ops=gd.RingAllReduce())
    with ring.scope():
        u = gd.Variable(np.zeros(2, np.float32), name="u", aggregation="mean")
    step = _counter_step(ring, u)
    out = step(_shards(np.arange(16, dtype=np.float32).reshape(8, 2)))
    assert step.replicated_graph.merged
    # MEAN of the replicas' column sums of their 2-row shards
    want = np.arange(16, dtype=np.float32).reshape(4, 2, 2).sum(axis=1).mean(axis=0)
    assert np.array_equal(u.numpy(), want)
    assert np.array_equal(out, want)          # the same mirrored value from every replica


def test_merge_refuses_a_per_replica_value_assigned_to_a_mirrored_variable():
    from graphdist.passes.merge import CannotMerge, merge_replicas

    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), name="v")

    def replica_fn(x):    # assign_synced skips the all-reduce: each replica writes its own
        v.assign_synced(gd.reduce_sum(x, axis=0))

    @gd.function
    def step(x):
        return strategy.run(replica_fn, args=(x,))

    step(_shards(np.ones((8, 2), np.float32)))
    with pytest.raises(CannotMerge, match="'v'"):
        merge_replicas(step.graph, tuple(DEVICES))
