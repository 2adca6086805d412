"""The strategy API of docs/api.md "Strategies and contexts" and "Variables": devices, contexts,
run/reduce/merge_call, input distribution, and mirrored and sync-on-read variable rules,
on MirroredStrategy over four logical CPU devices, OneDeviceStrategy and the default one."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

DEVICES = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
N = len(DEVICES)
Agg = gd.VariableAggregation
Sync = gd.VariableSynchronization


@pytest.fixture
def strategy():
    return gd.MirroredStrategy(list(DEVICES))


def _per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: fn(ctx.replica_id_in_sync_group))


def _rid_f32():
    return gd.cast(gd.get_replica_context().replica_id_in_sync_group, "float32")


# ---------------------------------------------------------------- devices


def test_devices_are_canonicalized(strategy):
    s = gd.MirroredStrategy(["CPU:0", "/device:cpu:1", " cpu:2", "/cpu:3"])
    assert s.devices == DEVICES and isinstance(s.devices, tuple)
    assert s.num_replicas_in_sync == 4
    assert strategy.devices == DEVICES
    assert gd.MirroredStrategy(["cpu:3", "cpu:1"]).devices == ("cpu:3", "cpu:1")


@pytest.mark.parametrize("devices", [[], ["cpu:0", "cpu:0"], ["cpu:0", "CPU:0"],
                                     ["cpu:1", "/device:cpu:1", "cpu:2"]])
def test_empty_or_duplicate_devices_raise(devices):
    with pytest.raises(ValueError):
        gd.MirroredStrategy(devices)


@pytest.mark.parametrize("device", ["tpu:0", "cpu:x", "gpu:17", "quantum"])
def test_unknown_device_raises_naming_it(device):
    with pytest.raises(ValueError, match=device) as info:
        gd.MirroredStrategy(["cpu:0", device])
    assert "cpu:0" in str(info.value), "the message lists the devices that exist"
    with pytest.raises(ValueError, match=device):
        gd.OneDeviceStrategy(device)


def test_default_devices():
    s = gd.MirroredStrategy()
    assert s.devices == (tuple(gd.devices("gpu")) or ("cpu:0",))


# ---------------------------------------------------------------- contexts


def test_contexts_outside_scope_and_run(strategy):
    ctx = gd.get_replica_context()
    assert isinstance(ctx, gd.ReplicaContext)
    assert ctx.num_replicas_in_sync == 1 and ctx.replica_id_in_sync_group == 0
    assert ctx.strategy is gd.get_strategy()
    assert not gd.in_cross_replica_context() and not gd.has_strategy()
    with strategy.scope():
        assert gd.get_replica_context() is None
        assert gd.in_cross_replica_context() and gd.has_strategy()
        assert gd.get_strategy() is strategy
    assert gd.get_strategy() is not strategy and not gd.has_strategy()
    assert isinstance(gd.get_replica_context(), gd.ReplicaContext)


@pytest.mark.parametrize("in_scope", [False, True])
def test_contexts_inside_run_and_merge_fn(strategy, in_scope):
    seen = {}

    def merge_fn(s, value):
        seen["merge"] = (s, gd.get_replica_context(), gd.in_cross_replica_context(),
                         gd.has_strategy(), gd.get_strategy())
        return value

    def replica_fn(x):
        ctx = gd.get_replica_context()
        seen["run"] = (ctx, gd.in_cross_replica_context(), gd.has_strategy(), gd.get_strategy())
        y = ctx.merge_call(merge_fn, args=(x * 2.0,))
        seen["after merge"] = gd.get_replica_context()
        return y

    x = _per_replica(strategy, lambda r: np.float32(r))
    if in_scope:
        with strategy.scope():
            out = strategy.run(replica_fn, args=(x,))
            assert gd.in_cross_replica_context()
    else:
        out = strategy.run(replica_fn, args=(x,))
    assert [float(v) for v in out.values] == [0.0, 2.0, 4.0, 6.0]
    ctx, cross, has, current = seen["run"]
    assert isinstance(ctx, gd.ReplicaContext) and ctx.strategy is strategy
    assert ctx.num_replicas_in_sync == 4
    assert not cross and has and current is strategy
    s, ctx, cross, has, current = seen["merge"]
    assert s is strategy and ctx is None and cross and has and current is strategy
    assert seen["after merge"] is seen["run"][0]
    assert not gd.has_strategy()


def test_contexts_restored_after_failing_run(strategy):
    def replica_fn(x):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        strategy.run(replica_fn, args=(np.ones(2, np.float32),))
    assert not gd.has_strategy() and isinstance(gd.get_replica_context(), gd.ReplicaContext)


@pytest.mark.parametrize("traced", [False, True])
def test_reduce_and_run_inside_a_replica_function_raise(strategy, traced):
    # as in TF: both need cross-replica context; a replica uses all_reduce or merge_call
    x = _per_replica(strategy, lambda r: np.float32(r))
    misuses = {"reduce": lambda x: strategy.reduce("sum", x * 2.0),
               "run": lambda x: strategy.run(lambda y: y * 2.0, args=(x,)),
               "default": lambda x: gd.get_strategy().reduce("mean", x * 2.0)}
    for name, misuse in misuses.items():
        call = (lambda: strategy.run(misuse, args=(x,))) if not traced else (
            lambda: gd.function(lambda x: strategy.run(misuse, args=(x,)))(x))
        method = "run" if name == "run" else "reduce"
        hint = "call fn directly" if name == "run" else r"all_reduce\(op, value\).*merge_call"
        with pytest.raises(RuntimeError, match=rf"(?s)strategy\.{method}\(\) was called inside "
                                               rf"a replica function.*{hint}.*test_strategy.py"):
            call()
        assert not gd.has_strategy()
    # the allowed places: outside run, inside scope(), and in merge_fn
    with strategy.scope():
        assert float(strategy.reduce("sum", x)) == 6.0
    out = strategy.run(lambda x: gd.get_replica_context().merge_call(
        lambda s, v: s.reduce("sum", v), args=(x * 2.0,)), args=(x,))
    assert float(out) == 12.0


# ---------------------------------------------------------------- run and replica ids


def test_replica_id_in_sync_group_per_replica(strategy):
    def replica_fn():
        return gd.get_replica_context().replica_id_in_sync_group

    out = strategy.run(replica_fn)
    assert isinstance(out, gd.PerReplica)
    assert [int(v) for v in out.values] == [0, 1, 2, 3]

    @gd.function
    def step(x):
        def fn(x):
            rid = gd.get_replica_context().replica_id_in_sync_group
            return rid, x * gd.cast(rid, "float32") + 1.0

        return strategy.run(fn, args=(x,))

    rid, y = step(np.arange(3, dtype=np.float32))
    assert [int(v) for v in rid.values] == [0, 1, 2, 3]
    assert rid.values[0].dtype == np.int32
    for r, v in enumerate(y.values):
        np.testing.assert_array_equal(v, np.arange(3, dtype=np.float32) * r + 1)


def test_run_returns_per_replica_or_plain_values(strategy):
    x = _per_replica(strategy, lambda r: np.full((2, 3), r + 1, np.float32))
    with strategy.scope():
        w = gd.Variable(np.full(3, 0.5, np.float32), name="w")

    def replica_fn(x):
        ctx = gd.get_replica_context()
        local = gd.reduce_sum(x * w, axis=0)
        return {"local": local, "summed": ctx.all_reduce("sum", local),
                "weights": w.read_value(), "static": 7, "pair": (local, 1.5)}

    out = strategy.run(replica_fn, args=(x,))
    assert set(out) == {"local", "summed", "weights", "static", "pair"}
    assert isinstance(out["local"], gd.PerReplica) and len(out["local"].values) == 4
    for r, v in enumerate(out["local"].values):
        np.testing.assert_array_equal(v, np.full(3, (r + 1) * 2 * 0.5, np.float32))
    assert not isinstance(out["summed"], gd.PerReplica)
    np.testing.assert_array_equal(out["summed"], np.full(3, 10.0, np.float32))
    assert not isinstance(out["weights"], gd.PerReplica)
    np.testing.assert_array_equal(out["weights"], w.numpy())
    assert out["static"] == 7
    assert isinstance(out["pair"], tuple) and out["pair"][1] == 1.5
    assert isinstance(out["pair"][0], gd.PerReplica)


def test_plain_arguments_go_to_every_replica_and_kwargs(strategy):
    def replica_fn(x, scale=1.0, offset=None):
        return x * scale + offset + _rid_f32()

    out = strategy.run(replica_fn, args=(np.ones(2, np.float32),),
                       kwargs={"scale": 3.0, "offset": np.full(2, 10, np.float32)})
    for r, v in enumerate(out.values):
        np.testing.assert_array_equal(v, np.full(2, 13.0 + r, np.float32))


def test_run_on_its_own_traces_once_per_shard_signature(strategy):
    calls = []

    def replica_fn(x):
        calls.append(x.shape)
        return gd.reduce_sum(x)

    batches = list(strategy.experimental_distribute_dataset(
        [np.arange(8, dtype=np.float32), np.arange(8, 16).astype(np.float32),
         np.arange(10, dtype=np.float32)]))
    outs, traces = [], []
    for b in batches:
        outs.append(strategy.run(replica_fn, args=(b,)))
        traces.append(len(calls))
    assert [float(v) for v in outs[0].values] == [1.0, 5.0, 9.0, 13.0]
    assert [float(v) for v in outs[1].values] == [17.0, 21.0, 25.0, 29.0]
    assert [float(v) for v in outs[2].values] == [3.0, 12.0, 13.0, 17.0]
    assert traces[0] == 1 and traces[1] == 1, calls     # the second batch reused the trace
    assert traces[2] > 1 and (3,) in calls and (2,) in calls[1:]   # 3,3,2,2: both traced
    again = strategy.run(replica_fn, args=(batches[0],))
    assert len(calls) == traces[2]
    assert [float(v) for v in again.values] == [1.0, 5.0, 9.0, 13.0]


def test_replica_context_all_reduce(strategy):
    x = _per_replica(strategy, lambda r: np.array([r, 2 * r + 1], np.float32))

    def replica_fn(x):
        ctx = gd.get_replica_context()
        y = x * 1.0
        return (ctx.all_reduce(gd.ReduceOp.SUM, y), ctx.all_reduce("mean", y),
                ctx.all_reduce("sum", {"a": y, "b": (y * 2.0,)}))

    total, mean, nested = strategy.run(replica_fn, args=(x,))
    np.testing.assert_array_equal(total, [6.0, 16.0])
    np.testing.assert_array_equal(mean, [1.5, 4.0])
    np.testing.assert_array_equal(nested["a"], [6.0, 16.0])
    np.testing.assert_array_equal(nested["b"][0], [12.0, 32.0])
    with pytest.raises(ValueError):
        strategy.run(lambda x: gd.get_replica_context().all_reduce("max", x * 1.0), args=(x,))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_constants_entering_collectives_are_values_on_every_replica(n):
    # a Python or numpy constant is the same value on every replica: SUM gives n times it
    s = gd.MirroredStrategy([f"cpu:{d}" for d in range(n)])
    ones = np.ones(3, np.float32)

    def replica_fn():
        ctx = gd.get_replica_context()
        merged = ctx.merge_call(lambda st, v: st.reduce("sum", v), args=(1.0,))
        return (ctx.all_reduce(gd.ReduceOp.SUM, 1.0), ctx.all_reduce("sum", np.float32(3.0)),
                ctx.all_reduce("sum", {"a": ones}), ctx.all_reduce("mean", 2.0),
                ctx.all_reduce("sum", 2), merged,
                ctx.merge_call(lambda st: st.reduce("sum", np.float32(1.0))))

    total, three, nested, mean, integer, merged, merged_result = s.run(replica_fn)
    assert float(total) == n and float(three) == 3.0 * n and float(mean) == 2.0
    np.testing.assert_array_equal(nested["a"], np.full(3, n, np.float32))
    assert int(integer) == 2 * n and np.asarray(integer).dtype == np.int32
    assert float(merged) == n and float(merged_result) == n

    per = gd.PerReplica([np.float32(1.0)] * n)
    rows = gd.PerReplica([ones] * n)

    @gd.function
    def f():
        return (s.reduce(gd.ReduceOp.SUM, per), s.reduce("mean", per), s.reduce("sum", 1.0),
                s.reduce("sum", rows, axis=0), s.reduce("mean", rows, axis=0))

    t_sum, t_mean, t_plain, t_rows, t_row_mean = f()
    assert float(t_sum) == n and float(t_mean) == 1.0 and float(t_plain) == n
    assert float(t_rows) == 3.0 * n and float(t_row_mean) == 1.0
    # eagerly: the same answers, in the same dtype
    assert s.reduce("sum", per) == n and s.reduce("sum", 1.0) == n
    assert np.asarray(s.reduce("sum", 1.0)).dtype == np.float32
    # MEAN of an int constant, as of an int tensor: the sum divided as TF's cross-device ops
    # divide it, a true division into float64
    mean = s.run(lambda: gd.get_replica_context().all_reduce("mean", 2))
    for part in (mean.values if isinstance(mean, gd.PerReplica) else (mean,)):
        assert np.asarray(part).dtype == np.float64 and float(part) == 2.0


def test_all_reduce_of_an_argument_directly(strategy):
    # the all-reduce reads the replicas' input buffers themselves (no op in between)
    x = _per_replica(strategy, lambda r: np.array([r, 1.0], np.float32))
    out = strategy.run(lambda x: gd.get_replica_context().all_reduce("sum", x), args=(x,))
    np.testing.assert_array_equal(out, [6.0, 4.0])


def test_only_first_replica_assign_of_an_argument_directly(strategy):
    # the broadcast from replica 0 reads replica 0's input buffer itself
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), aggregation=Agg.ONLY_FIRST_REPLICA)
    x = _per_replica(strategy, lambda r: np.array([r + 5, 1.0], np.float32))
    strategy.run(lambda x: v.assign(x), args=(x,))
    assert [c.tolist() for c in v.values] == [[5.0, 1.0]] * 4


def test_merge_call_regroups_and_splits(strategy):
    x = _per_replica(strategy, lambda r: np.float32(r + 1))
    got = {}

    def merge_fn(s, value, *, extra):
        got["value"], got["extra"] = value, extra
        return {"total": s.reduce("sum", value), "own": value, "plain": np.float32(100.0),
                "extra": extra}

    def replica_fn(x):
        y = x * 10.0
        return gd.get_replica_context().merge_call(merge_fn, args=(y,), kwargs={"extra": 3})

    out = strategy.run(replica_fn, args=(x,))
    assert isinstance(got["value"], gd.PerReplica) and got["extra"] == 3
    assert not isinstance(out["total"], gd.PerReplica)
    assert float(out["total"]) == 100.0
    assert isinstance(out["own"], gd.PerReplica)
    assert [float(v) for v in out["own"].values] == [10.0, 20.0, 30.0, 40.0]
    assert float(out["plain"]) == 100.0 and out["extra"] == 3

    def use_result(x):   # each replica computes with its part of the merge result
        part = gd.get_replica_context().merge_call(lambda s, v: v, args=(x * 2.0,))
        plain = gd.get_replica_context().merge_call(lambda s: np.float32(0.5))
        return part + plain

    out = strategy.run(use_result, args=(x,))
    assert [float(v) for v in out.values] == [2.5, 4.5, 6.5, 8.5]


def test_merge_call_passes_variables_and_splits_constant_per_replica_results(strategy):
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32), name="v")
    got = {}

    def merge_fn(s, var, value):
        got["var"] = var
        var.assign(s.reduce("sum", value))
        return var.read_value(), gd.PerReplica([np.float32(10 * r) for r in range(4)])

    def replica_fn(x):
        total, constant = gd.get_replica_context().merge_call(merge_fn, args=(v, x * 1.0))
        return total, x + constant

    x = _per_replica(strategy, lambda r: np.full(2, r + 1, np.float32))
    total, mixed = strategy.run(replica_fn, args=(x,))
    assert got["var"] is v, "a mirrored variable reaches merge_fn as itself"
    np.testing.assert_array_equal(total, [10.0, 10.0])
    assert [c.tolist() for c in v.values] == [[10.0, 10.0]] * 4
    assert [v.tolist() for v in mixed.values] == [[1.0, 1.0], [12.0, 12.0], [23.0, 23.0],
                                                  [34.0, 34.0]]


def test_per_replica_constants_made_inside_a_function(strategy):
    @gd.function
    def f(x):
        per = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.float32))
        same = gd.PerReplica([np.float32(2.0)] * 4)
        return strategy.run(lambda a, b: x * b + a, args=(per, same))

    out = f(np.ones(2, np.float32))
    assert [v.tolist() for v in out.values] == [[2.0, 2.0], [3.0, 3.0], [4.0, 4.0],
                                                [5.0, 5.0]]


def test_merge_call_on_default_and_one_device_context():
    ctx = gd.get_replica_context()
    assert ctx.merge_call(lambda s, a, b=0: (s is gd.get_strategy(), a * 2 + b), args=(3,),
                          kwargs={"b": 1}) == (True, 7)
    s = gd.OneDeviceStrategy("cpu:0")
    out = s.run(lambda x: gd.get_replica_context().merge_call(
        lambda st, v: st.reduce("sum", v) + 1.0, args=(x * 2.0,)), args=(np.float32(3),))
    assert float(out) == 7.0


# ---------------------------------------------------------------- reduce


UNEVEN = np.arange(20, dtype=np.float64).reshape(10, 2) ** 1.5


def test_reduce_inside_function(strategy):
    batch = next(iter(strategy.experimental_distribute_dataset([UNEVEN])))

    @gd.function
    def step(x):
        per = strategy.run(lambda x: x * 2.0, args=(x,))
        rows = strategy.run(lambda x: gd.reduce_sum(x, axis=0), args=(x,))
        return {("sum", None): strategy.reduce("sum", rows, axis=None),
                ("mean", None): strategy.reduce(gd.ReduceOp.MEAN, rows, axis=None),
                ("sum", 0): strategy.reduce(gd.ReduceOp.SUM, per, axis=0),
                ("mean", 0): strategy.reduce("mean", per, axis=0),
                ("mean", 1): strategy.reduce("mean", rows, axis=0)}

    out = step(batch)
    shards = np.split(UNEVEN, [3, 6, 8])
    rows = [s.sum(0) for s in shards]
    np.testing.assert_allclose(out[("sum", None)], np.sum(rows, 0), rtol=1e-14)
    np.testing.assert_allclose(out[("mean", None)], np.mean(rows, 0), rtol=1e-14)
    np.testing.assert_allclose(out[("sum", 0)], 2 * UNEVEN.sum(0), rtol=1e-14)
    np.testing.assert_allclose(out[("mean", 0)], 2 * UNEVEN.mean(0), rtol=1e-14)
    np.testing.assert_allclose(out[("mean", 1)], UNEVEN.sum() / 8, rtol=1e-14)
    for v in out.values():
        assert not isinstance(v, gd.PerReplica)


def test_reduce_eagerly_on_per_replica_numpy_values(strategy):
    shards = np.split(UNEVEN, [3, 6, 8])
    per = gd.PerReplica(shards)
    np.testing.assert_allclose(strategy.reduce("sum", per, axis=0), UNEVEN.sum(0))
    np.testing.assert_allclose(strategy.reduce("mean", per, axis=0), UNEVEN.mean(0))
    even = gd.PerReplica([np.full(3, r, np.float32) for r in range(4)])
    np.testing.assert_array_equal(strategy.reduce(gd.ReduceOp.SUM, even), np.full(3, 6.0))
    np.testing.assert_array_equal(strategy.reduce(gd.ReduceOp.MEAN, even), np.full(3, 1.5))
    assert strategy.reduce("mean", even).dtype == np.float32
    np.testing.assert_allclose(strategy.reduce("mean", even, axis=0), 1.5)
    with pytest.raises(ValueError):
        strategy.reduce("max", even)


def test_reduce_structures_leaf_by_leaf(strategy):
    per = gd.PerReplica([np.float32(r) for r in range(4)])
    out = strategy.reduce("sum", (per, {"a": per, "b": [per]}))
    assert float(out[0]) == 6.0 and float(out[1]["a"]) == 6.0 and float(out[1]["b"][0]) == 6.0

    @gd.function
    def f(x):
        pair = strategy.run(lambda x: (gd.reduce_sum(x), {"twice": gd.reduce_sum(x) * 2.0}),
                            args=(x,))
        return strategy.reduce("mean", pair), strategy.reduce("sum", pair[0])

    (batch,) = strategy.experimental_distribute_dataset([np.arange(8, dtype=np.float32)])
    (mean, twice), total = f(batch)
    assert float(mean) == 7.0 and float(twice["twice"]) == 14.0 and float(total) == 28.0


def test_batch_smaller_than_replica_count(strategy):
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    (batch,) = strategy.experimental_distribute_dataset([x])
    assert [v.shape for v in batch.values] == [(1, 2), (1, 2), (1, 2), (0, 2)]

    @gd.function
    def f(b):
        per = strategy.run(lambda x: x * 2.0, args=(b,))
        return strategy.reduce("mean", per, axis=0), strategy.reduce("sum", per, axis=0), per

    mean, total, per = f(batch)
    np.testing.assert_array_equal(mean, 2 * x.mean(0))
    np.testing.assert_array_equal(total, 2 * x.sum(0))
    assert per.values[3].shape == (0, 2)


def test_gather(strategy):
    shards = np.split(UNEVEN, [3, 6, 8])
    np.testing.assert_array_equal(strategy.gather(gd.PerReplica(shards), axis=0), UNEVEN)


# ---------------------------------------------------------------- input distribution


def test_distribute_dataset_tuple_dict_and_uneven(strategy):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    y = np.arange(8, dtype=np.int32)
    batches = [(x, y), {"x": x[:6], "y": y[:6]}, x[:5]]
    dist = strategy.experimental_distribute_dataset(batches)
    assert len(dist) == 3
    tup, dic, uneven = list(dist)
    assert isinstance(tup, tuple) and len(tup) == 2
    assert all(isinstance(t, gd.PerReplica) and len(t.values) == 4 for t in tup)
    for r in range(4):
        np.testing.assert_array_equal(tup[0].values[r], x[2 * r:2 * r + 2])
        np.testing.assert_array_equal(tup[1].values[r], y[2 * r:2 * r + 2])
    assert set(dic) == {"x", "y"}
    assert [len(v) for v in dic["x"].values] == [2, 2, 1, 1]
    np.testing.assert_array_equal(np.concatenate(dic["y"].values), y[:6])
    assert [v.shape for v in uneven.values] == [(2, 3), (1, 3), (1, 3), (1, 3)]
    np.testing.assert_array_equal(np.concatenate(uneven.values), x[:5])
    # a generator works too, and is consumed lazily
    gen = strategy.experimental_distribute_dataset(np.ones((4, 2)) * i for i in range(3))
    assert [float(b.values[3][0, 0]) for b in gen] == [0.0, 1.0, 2.0]


def test_distributed_batches_feed_a_function(strategy):
    @gd.function
    def step(batch):
        return strategy.run(lambda x, y: gd.reduce_sum(x) + gd.cast(gd.reduce_sum(y),
                                                                     "float32"), args=batch)

    x = np.arange(10, dtype=np.float32)
    y = np.arange(10, dtype=np.int32)
    (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    out = step(batch)
    assert [float(v) for v in out.values] == [6.0, 24.0, 26.0, 34.0]


def test_distribute_values_from_function(strategy):
    seen = []

    def fn(ctx):
        assert isinstance(ctx, gd.ValueContext)
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return np.full(2, ctx.replica_id_in_sync_group * 10, np.float32)

    per = strategy.experimental_distribute_values_from_function(fn)
    assert isinstance(per, gd.PerReplica)
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [v[0] for v in per.values] == [0, 10, 20, 30]
    out = strategy.run(lambda v: v + 1.0, args=(per,))
    assert [float(v[1]) for v in out.values] == [1.0, 11.0, 21.0, 31.0]


def test_per_replica_arguments_must_match_replica_count(strategy):
    with pytest.raises(ValueError):
        strategy.run(lambda x: x + 1.0, args=(gd.PerReplica([np.ones(2, np.float32)] * 3),))


# ---------------------------------------------------------------- sync-on-read variables


def _on_read(strategy, aggregation, initial=1.0, name="v"):
    with strategy.scope():
        return gd.Variable(initial, name=name, synchronization=Sync.ON_READ,
                           aggregation=aggregation)


@pytest.mark.parametrize("aggregation, initial_read", [
    (Agg.SUM, 4.0), (Agg.MEAN, 1.0), (Agg.ONLY_FIRST_REPLICA, 1.0)])
def test_sync_on_read_initial_value(strategy, aggregation, initial_read):
    v = _on_read(strategy, aggregation)
    assert not v.trainable and v.synchronization is Sync.ON_READ
    assert len(v.values) == 4 and all(c == 1.0 for c in v.values)
    assert v.numpy() == initial_read
    assert float(np.asarray(v)) == initial_read


@pytest.mark.parametrize("aggregation, expected", [
    (Agg.SUM, 2 + 3 + 4 + 5), (Agg.MEAN, 3.5), (Agg.ONLY_FIRST_REPLICA, 2.0)])
def test_sync_on_read_each_replica_updates_its_component(strategy, aggregation, expected):
    v = _on_read(strategy, aggregation)

    @gd.function
    def step():
        local = strategy.run(lambda: v.assign_add(_rid_f32() + 1.0).read_value())
        return local, v.read_value(), v + 0.0

    local, aggregate, arithmetic = step()
    assert [float(c) for c in v.values] == [2.0, 3.0, 4.0, 5.0]
    assert isinstance(local, gd.PerReplica)
    assert [float(c) for c in local.values] == [2.0, 3.0, 4.0, 5.0]
    assert not isinstance(aggregate, gd.PerReplica)
    assert float(aggregate) == expected and float(arithmetic) == expected
    assert v.numpy() == expected
    step()
    assert [float(c) for c in v.values] == [3.0, 5.0, 7.0, 9.0]


def test_sync_on_read_counts_examples(strategy):
    seen = _on_read(strategy, Agg.SUM, initial=0.0, name="seen")

    @gd.function
    def step(x):
        strategy.run(lambda x: seen.assign_add(gd.cast(gd.shape(x)[0], "float32")), args=(x,))

    for batch in strategy.experimental_distribute_dataset([np.ones((10, 2))] * 2):
        step(batch)
    assert [float(c) for c in seen.values] == [6.0, 6.0, 4.0, 4.0]
    assert seen.numpy() == 20.0


@pytest.mark.parametrize("aggregation, expected", [
    (Agg.SUM, 8.0), (Agg.MEAN, 2.0), (Agg.ONLY_FIRST_REPLICA, 0.0)])
def test_sync_on_read_read_in_a_function_without_run(strategy, aggregation, expected):
    v = _on_read(strategy, aggregation)
    for c, value in zip(v.values, [0.0, 1.0, 3.0, 4.0]):
        c[...] = value
    out = gd.function(lambda: v.read_value() * 1.0)()
    assert not isinstance(out, gd.PerReplica)
    assert float(out) == expected and v.numpy() == expected


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("aggregation, stored", [
    (Agg.SUM, [8.0, 0.0, 0.0, 0.0]), (Agg.MEAN, [8.0] * 4), (Agg.ONLY_FIRST_REPLICA, [8.0] * 4)])
def test_sync_on_read_cross_replica_assign(strategy, aggregation, stored, traced):
    v = _on_read(strategy, aggregation)
    if traced:
        gd.function(lambda: v.assign(8.0))()
    else:
        v.assign(8.0)
    assert [float(c) for c in v.values] == stored      # SUM: the first holds it, exactly
    assert v.numpy() == 8.0


# ---------------------------------------------------------------- mirrored variables


def _mirrored(strategy, aggregation, initial=None):
    with strategy.scope():
        return gd.Variable(np.full(2, 1.0, np.float32) if initial is None else initial,
                           name=f"m_{aggregation.name.lower()}", aggregation=aggregation)


def test_mirrored_components_start_equal_and_separate(strategy):
    v = _mirrored(strategy, Agg.NONE, initial=np.arange(3, dtype=np.float32))
    assert v.synchronization is Sync.AUTO and v.trainable
    assert len(v.values) == 4
    for c in v.values:
        np.testing.assert_array_equal(c, np.arange(3))
    assert len({id(c) for c in v.values}) == 4, "each device has its own buffer"


def test_mirrored_assign_in_replica_needs_aggregation(strategy):
    v = _mirrored(strategy, Agg.NONE)
    for write in ("assign", "assign_add", "assign_sub"):
        with pytest.raises(ValueError, match="aggregation"):
            strategy.run(lambda write=write: getattr(v, write)(gd.ones_like(v) * _rid_f32()))
    for c in v.values:
        np.testing.assert_array_equal(c, [1.0, 1.0])


@pytest.mark.parametrize("aggregation, write, expected", [
    (Agg.SUM, "assign", 0 + 1 + 2 + 3),
    (Agg.SUM, "assign_add", 1 + 6),
    (Agg.SUM, "assign_sub", 1 - 6),
    (Agg.MEAN, "assign", 1.5),
    (Agg.MEAN, "assign_add", 2.5),
    (Agg.ONLY_FIRST_REPLICA, "assign", 0.0),
    (Agg.ONLY_FIRST_REPLICA, "assign_add", 1.0),
])
def test_mirrored_assign_in_replica_aggregates(strategy, aggregation, write, expected):
    v = _mirrored(strategy, aggregation)

    def replica_fn():
        getattr(v, write)(gd.ones_like(v) * _rid_f32())
        return v.read_value()

    out = strategy.run(replica_fn)
    assert not isinstance(out, gd.PerReplica)
    np.testing.assert_array_equal(out, [expected] * 2)
    for c in v.values:
        np.testing.assert_array_equal(c, [expected] * 2)


def test_mirrored_assign_of_constants_in_replica(strategy):
    s = _mirrored(strategy, Agg.SUM)
    for constant in (5.0, np.full(2, 5.0, np.float32)):
        with pytest.raises(ValueError):
            strategy.run(lambda constant=constant: s.assign(constant))
        with pytest.raises(ValueError):
            strategy.run(lambda constant=constant: s.assign_add(constant))
    for c in s.values:
        np.testing.assert_array_equal(c, [1.0, 1.0])
    m = _mirrored(strategy, Agg.MEAN)
    strategy.run(lambda: m.assign(5.0))
    assert [c.tolist() for c in m.values] == [[5.0, 5.0]] * 4
    first = _mirrored(strategy, Agg.ONLY_FIRST_REPLICA)
    strategy.run(lambda: first.assign_add(np.full(2, 2.0, np.float32)))
    assert [c.tolist() for c in first.values] == [[3.0, 3.0]] * 4


@pytest.mark.parametrize("aggregation", [Agg.NONE, Agg.SUM, Agg.MEAN])
def test_mirrored_assign_outside_run_sets_every_component(strategy, aggregation):
    v = _mirrored(strategy, aggregation)
    v.assign(np.array([3.0, 4.0], np.float32))
    assert [c.tolist() for c in v.values] == [[3.0, 4.0]] * 4
    with strategy.scope():
        v.assign_add(np.ones(2, np.float32))
    assert [c.tolist() for c in v.values] == [[4.0, 5.0]] * 4
    gd.function(lambda d: v.assign_sub(d))(np.full(2, 2.0, np.float32))
    assert [c.tolist() for c in v.values] == [[2.0, 3.0]] * 4
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])


def test_variable_synchronization_and_aggregation_validation(strategy):
    with strategy.scope():
        with pytest.raises(ValueError):
            gd.Variable(1.0, synchronization=Sync.NONE)
        with pytest.raises(ValueError):
            gd.Variable(1.0, aggregation="median")
        with pytest.raises(ValueError):
            gd.Variable(1.0, synchronization="sometimes")
        on_write = gd.Variable(1.0, synchronization=Sync.ON_WRITE)
    assert len(on_write.values) == 4
    single = gd.Variable(1.0, synchronization=Sync.NONE)    # one device: allowed
    assert len(single.values) == 1


# ---------------------------------------------------------------- one-replica strategies


@pytest.mark.parametrize("make", [lambda: gd.OneDeviceStrategy("cpu:0"), gd.get_strategy],
                         ids=["one_device", "default"])
def test_one_replica_strategies(make):
    s = make()
    assert s.num_replicas_in_sync == 1 and len(s.devices) == 1
    assert s.devices == ("cpu:0",) or s.devices == ("gpu:0",)
    with s.scope():
        v = gd.Variable(np.ones(2, np.float32), name="w")
        total = gd.Variable(1.0, synchronization=Sync.ON_READ, aggregation=Agg.SUM)
    assert len(v.values) == 1 and total.numpy() == 1.0

    def replica_fn(x):
        ctx = gd.get_replica_context()
        assert ctx is not None and ctx.num_replicas_in_sync == 1
        total.assign_add(1.0)
        return ctx.all_reduce("sum", x * v), ctx.replica_id_in_sync_group

    x = np.array([2.0, 3.0], np.float32)
    out, rid = s.run(replica_fn, args=(x,))
    assert not isinstance(out, gd.PerReplica)
    np.testing.assert_array_equal(out, x)
    assert int(rid) == 0
    assert total.numpy() == 2.0
    assert s.reduce("sum", np.float32(3.0)) == 3.0
    assert s.reduce("mean", x, axis=0) == 2.5
    batches = [np.arange(4.0)]
    assert np.array_equal(next(iter(s.experimental_distribute_dataset(batches))), batches[0])
    got = s.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    assert got == (0, 1) or (isinstance(got, gd.PerReplica) and got.values == ((0, 1),))


def test_one_device_strategy_places_variables():
    s = gd.OneDeviceStrategy("CPU:0")
    assert s.devices == ("cpu:0",)
    with s.scope():
        v = gd.Variable(np.zeros(3, np.float32))
        assert gd.get_strategy() is s and gd.get_replica_context() is None
    assert v.devices == ("cpu:0",)
    assert gd.get_strategy() is not s
