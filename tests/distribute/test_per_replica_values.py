"""What cross-replica code sees of per-replica values, as a TF MirroredStrategy user expects:
merge_fn and the code around strategy.run get every replica's component (`.values[k]`),
gather works in traced code, Python numbers in a PerReplica reach their own replica, and the
eager reduce/gather and variable paths reject what the traced ones reject."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.device import names as devices_module

VS, VA = gd.VariableSynchronization, gd.VariableAggregation


def _strategy(n):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def _numbered(n):
    """PerReplica(1, 2, ..., n) as float32 scalars."""
    return gd.PerReplica([np.float32(i + 1) for i in range(n)])


def _each(value):
    return [float(v) for v in value.values] if isinstance(value, gd.PerReplica) else value


# ------------------------------------------------------------------ merge_call
@pytest.mark.parametrize("n", [2, 3, 4])
def test_merge_fn_sees_every_replica_component(n):
    s = _strategy(n)
    seen = []

    def replica_fn(x):
        def merge_fn(strategy, v):
            seen.append(len(v.values))
            return sum(v.values[1:], v.values[0]), v.values[0], v.values[-1], v
        return gd.get_replica_context().merge_call(merge_fn, args=(x,))

    total, first, last, own = s.run(replica_fn, args=(_numbered(n),))
    assert seen == [n]
    assert _each(total) == [n * (n + 1) / 2] * n       # every replica: the same sum
    assert float(first) == 1.0 and float(last) == float(n)   # broadcasts: mirrored values
    assert _each(own) == [float(i + 1) for i in range(n)]


def test_merge_fn_assigns_one_replicas_value_to_every_component():
    s = _strategy(3)
    with s.scope():
        v = gd.Variable(0.0, name="v")

    def replica_fn(x):
        def merge_fn(strategy, val):
            v.assign(val.values[1])
        gd.get_replica_context().merge_call(merge_fn, args=(x,))

    s.run(replica_fn, args=(_numbered(3),))
    assert [float(c) for c in v.values] == [2.0, 2.0, 2.0]   # mirrored stays bit-identical


def test_cross_replica_code_in_a_function_indexes_the_per_replica_result():
    s = _strategy(3)
    with s.scope():
        w = gd.Variable(0.0, name="w")

    @gd.function
    def step(x):
        pr = s.run(lambda a: a * 2.0, args=(x,))
        w.assign(pr.values[-1])
        return len(pr.values), pr.values[0]

    count, first = step(_numbered(3))
    assert count == 3 and float(first) == 2.0
    assert [float(c) for c in w.values] == [6.0, 6.0, 6.0]


def test_assigning_a_per_replica_value_in_cross_replica_context_is_refused():
    s = _strategy(2)
    with s.scope():
        w = gd.Variable(1.0, name="w")

    @gd.function
    def step(x):
        w.assign(s.run(lambda a: a * 2.0, args=(x,)))

    with pytest.raises(TypeError, match="'w'.*cross-replica context"):
        step(_numbered(2))
    with pytest.raises(TypeError, match="'w'.*PerReplica"):
        w.assign(_numbered(2))
    assert [float(c) for c in w.values] == [1.0, 1.0]


# ------------------------------------------------------------------ gather
@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_in_traced_code_equals_eager_gather(n):
    s = _strategy(n)
    x = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
    shards = next(iter(s.experimental_distribute_dataset([x])))

    @gd.function
    def step(batch):
        out = s.run(lambda a: a + 1.0, args=(batch,))
        return s.gather(out, axis=0), s.gather(out, axis=1)

    rows, cols = step(shards)
    np.testing.assert_array_equal(rows, x + 1.0)
    eager = s.run(lambda a: a + 1.0, args=(shards,))
    np.testing.assert_array_equal(cols, s.gather(eager, axis=1))
    assert cols.shape == (2, 3 * n) if n > 1 else cols.shape == (2, 3)


def test_gather_maps_over_structures():
    s = _strategy(2)
    pr = gd.PerReplica([np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32)])
    out = s.gather({"a": pr, "b": (pr,)}, axis=0)
    np.testing.assert_array_equal(out["a"], [[1, 1], [0, 0]])
    np.testing.assert_array_equal(out["b"][0], [[1, 1], [0, 0]])


# ------------------------------------------------------------------ Python numbers
def test_python_numbers_in_a_per_replica_reach_their_own_replica():
    s = _strategy(4)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: float(ctx.replica_id_in_sync_group))
    assert all(v.dtype == np.float32 for v in pr.values)    # as TF converts them
    doubled = s.run(lambda a: a * 2.0, args=(pr,))
    assert _each(doubled) == [0.0, 2.0, 4.0, 6.0]
    assert float(s.reduce("sum", doubled)) == 12.0
    assert gd.PerReplica([1, True]).values[0].dtype == np.int32
    assert gd.PerReplica([np.float64(0.5)]).values[0].dtype == np.float64


# ------------------------------------------------------------------ eager reduce
def test_eager_reduce_and_gather_check_the_replica_count():
    s = _strategy(3)
    for call in (lambda: s.reduce("mean", gd.PerReplica([1.0, 2.0])),
                 lambda: s.gather(gd.PerReplica([np.ones(1), np.ones(1)]))):
        with pytest.raises(ValueError, match="2 values.*3 replicas"):
            call()


def test_misusing_a_per_replica_as_one_array_says_what_it_is_and_what_to_do():
    s = _strategy(2)
    made = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    (batch,) = s.experimental_distribute_dataset([np.ones((4, 2), np.float32)])
    ran = s.run(lambda x: x * 2.0, args=(batch,))
    remedy = r"strategy\.reduce.*strategy\.gather.*\.values\[k\].*strategy\.run"
    for per in (made, batch, ran):
        assert per.devices == ("cpu:0", "cpu:1")
        what = r"a gd\.PerReplica of 2 values \(on cpu:0, cpu:1\)"
        for misuse, where in [(lambda: np.asarray(per), "used as an array"),
                              (lambda: per + 1, r"'\+' applied to a PerReplica"),
                              (lambda: np.float32(2) * per, r"'\*' applied to a PerReplica"),
                              (lambda: -per, "unary"),
                              (lambda: gd.reduce_sum(per), "reduce_sum: .*used as an array")]:
            with pytest.raises(TypeError, match=rf"(?s){where}.*{what}.*{remedy}"):
                misuse()
    # a PerReplica made by hand does not know its devices; in traced code the op is named too
    with pytest.raises(TypeError, match=r"a gd\.PerReplica of 2 values \(one per replica\)"):
        np.asarray(_numbered(2))
    with pytest.raises(TypeError, match=rf"(?s)exp: .*PerReplica.*{remedy}.*while tracing  "
                                        r"test_per_replica_values\.py"):
        gd.function(lambda: gd.exp(made))()
    with pytest.raises(TypeError, match=rf"(?s)add: .*PerReplica.*{remedy}.*while tracing"):
        gd.function(lambda x, y: gd.exp(x) + y)(np.ones(2, np.float32), batch)


def test_eager_reduce_errors_name_the_shapes():
    s = _strategy(3)
    uneven = gd.PerReplica([np.ones(2, np.float32), np.ones(3, np.float32),
                            np.ones(2, np.float32)])
    with pytest.raises(ValueError, match=r"\[\(2,\), \(3,\), \(2,\)\].*axis=0"):
        s.reduce("sum", uneven)
    assert float(s.reduce("sum", uneven, axis=0)) == 7.0
    with pytest.raises(ValueError, match=r"axis 5 .* shape \(3,\)"):
        s.reduce("sum", gd.PerReplica([np.ones(3, np.float32)] * 3), axis=5)
    with pytest.raises(TypeError, match="MEAN.* bool"):        # integers divide as TF's
        s.reduce("mean", gd.PerReplica([np.bool_(True)] * 3))   # (test_trust_distribute)


# ------------------------------------------------------------------ integer variables
def test_integer_sum_sync_on_read_keeps_cross_replica_writes_exact():
    s = _strategy(3)
    with s.scope():
        count = gd.Variable(0, name="count", synchronization=VS.ON_READ, aggregation=VA.SUM)
    count.assign(5)                   # 5/3 per replica would read 3
    assert int(count.numpy()) == 5

    @gd.function
    def bump():
        count.assign_add(4)
        return count.read_value()

    with s.scope():
        assert int(bump()) == 9
    assert sum(int(c) for c in count.values) == 9

    @gd.function
    def reset():
        count.assign(7)

    with s.scope():
        reset()
    assert int(count.numpy()) == 7


def test_mean_aggregation_needs_a_float_variable():
    with _strategy(2).scope(), pytest.raises(TypeError, match="'m'.*MEAN.*int32"):
        gd.Variable(0, name="m", synchronization=VS.ON_READ, aggregation=VA.MEAN)


def test_assigning_python_lists_converts_to_the_variable_dtype():
    w = gd.Variable(np.zeros((2, 2), np.float32), name="w")
    w.assign([[1, 2], [3, 4]])
    assert w.numpy().dtype == np.float32
    np.testing.assert_array_equal(w.numpy(), [[1, 2], [3, 4]])


def test_traced_assign_errors_name_the_variable():
    s = _strategy(2)
    with s.scope():
        m = gd.Variable(np.zeros(3, np.float32), name="m", aggregation=VA.MEAN)
    with pytest.raises(ValueError, match="variable 'm' is f32"):
        s.run(lambda: m.assign(np.ones(4, np.float32)))


# ------------------------------------------------------------------ devices and ops
def test_strategy_arguments_are_checked_when_constructed():
    assert gd.MirroredStrategy("cpu:0").devices == ("cpu:0",)
    with pytest.raises(TypeError, match="cross_device_ops.*'ring'"):
        gd.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops="ring")
    assert isinstance(gd.choose_cross_device_ops(["CPU:0", "/device:cpu:1"]), gd.HostAllReduce)


def test_logical_cpu_count_lists_the_cpu_devices(monkeypatch):
    monkeypatch.setitem(gd.config._state["logical_devices"], "cpu", 3)
    monkeypatch.setattr(devices_module, "physical_gpu_count", lambda: 0)
    assert gd.devices("cpu") == ["cpu:0", "cpu:1", "cpu:2"]
