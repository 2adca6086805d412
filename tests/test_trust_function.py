"""gd.function that can be trusted (issue 21): variables made inside a function are never
silently made again by a retrace, concurrent calls lose no update, retrace storms warn and
stay bounded, every TraceError names the user's line, and a profile right after a first
call does not time the kernels still loading."""

from __future__ import annotations

import importlib
import logging
import sys
import threading

import numpy as np
import pytest

import graphdist as gd
from graphdist.runtime import warmup

function_module = importlib.import_module("graphdist.function")   # gd.function is the decorator

HERE = "test_trust_function.py:"


# ---------------------------------------------------------------- variables made in a trace

def test_a_variable_made_in_the_function_is_not_made_again_by_a_retrace():
    """The issue's running total: batches of 4, 4, 3, 4 rows read 4, 8, 3, 12 when the
    retrace for the 3-row batch silently made a fresh variable. Now that retrace raises,
    naming the variable and the line, and changes nothing; the first signature keeps
    running on the variable of the first trace."""
    @gd.function
    def running_total(x):
        total = gd.Variable(np.zeros((), np.float32), name="total")   # every trace
        total.assign_add(gd.reduce_sum(x))
        return total.read_value()

    batches = [np.ones((n,), np.float32) for n in (4, 4, 3, 4)]
    expected = np.cumsum([b.sum() for b in batches])
    assert running_total(batches[0]) == expected[0]
    assert running_total(batches[1]) == expected[1]
    with pytest.raises(gd.TraceError) as info:
        running_total(batches[2])
    text = str(info.value)
    assert "gd.Variable 'total'" in text and "running_total" in text
    assert "retraces for a new signature (trace 2)" in text and "first trace" in text
    assert HERE in text and 'total = gd.Variable(np.zeros((), np.float32), name="total")' in text
    assert running_total.trace_count == 1 and len(running_total._cache) == 1
    # the 4-row signature still runs on the first trace's variable: 4 + 4 + 4
    assert running_total(batches[3]) == expected[1] + batches[3].sum()


def test_a_variable_made_once_on_the_first_trace_is_reused_by_every_retrace():
    """The supported pattern (Keras layers build this way): create on the first trace only.
    Retraces, and a signature that was dropped from the cache and traced again, reuse it."""
    made = {}

    @gd.function
    def running_total(x):
        if "total" not in made:
            made["total"] = gd.Variable(np.zeros((), np.float32), name="total")
        made["total"].assign_add(gd.reduce_sum(x))
        return made["total"].read_value()

    rows = [4, 4, 3, 4, 5, 3, 4]
    got = [float(running_total(np.ones((n,), np.float32))) for n in rows]
    np.testing.assert_array_equal(got, np.cumsum(rows))
    assert running_total.trace_count == 3


def test_creating_a_variable_on_the_first_trace_still_works():
    @gd.function
    def counter(x):
        c = gd.Variable(np.zeros((), np.int64), name="c")
        c.assign_add(1)
        return c.read_value() + gd.cast(gd.reduce_sum(x), "int64")

    x = np.arange(3, dtype=np.int64)
    assert [int(counter(x)) for _ in range(3)] == [k + int(x.sum()) for k in (1, 2, 3)]


def test_uneven_shards_trace_again_without_making_the_variable_again():
    """Uneven shards trace the body once per shard shape on the first call. A variable made
    unconditionally would be made by each of those traces (a GraphError 'replicas captured
    different variables' before); it is a TraceError naming the variable and the line. Made
    once, every replica's trace shares it."""
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    shards = gd.PerReplica((np.ones((3, 2), np.float32), np.ones((2, 2), np.float32)))

    def replica_fn_making(holder):
        def replica_fn(x):
            if "acc" not in holder:
                holder["acc"] = gd.Variable(np.zeros((), np.float32), name="acc",
                                            aggregation=gd.VariableAggregation.SUM)
            holder["acc"].assign_add(gd.reduce_sum(x))
            return holder["acc"].read_value()
        return replica_fn

    @gd.function
    def every_trace(x):
        return strategy.run(replica_fn_making({}), args=(x,))

    with strategy.scope():
        with pytest.raises(gd.TraceError) as info:
            every_trace(shards)
    text = str(info.value)
    assert "gd.Variable 'acc'" in text and "another replica's shard shapes" in text
    assert HERE in text and "holder[\"acc\"] = gd.Variable(" in text

    made: dict = {}

    @gd.function
    def once(x):
        return strategy.run(replica_fn_making(made), args=(x,))

    with strategy.scope():
        once(shards)
        once(shards)
    assert once.trace_count == 1
    assert made["acc"].numpy() == 2 * sum(v.sum() for v in shards.values)


# ---------------------------------------------------------------- concurrent calls

@pytest.fixture
def _frequent_thread_switches():
    """Switch threads every microsecond: a race shows in every run instead of some."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _hammer(calls_of, threads: int = 8, calls: int = 500) -> None:
    errors = []

    def worker(k):
        try:
            for i in range(calls):
                calls_of(k, i)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors


def test_threads_calling_one_stateful_function_lose_no_update_when_it_retraces(
        _frequent_thread_switches):
    """8 threads x 500 calls with 7 batch shapes (so calls retrace while others run): the
    count is exactly 4,000 (it kept 3,380 when two signatures' programs overlapped) and the
    row total is the sum of every batch's rows."""
    count = gd.Variable(np.zeros((), np.float32), name="count")
    rows = gd.Variable(np.zeros((), np.float64), name="rows")

    @gd.function
    def step(x):
        count.assign_add(1.0)
        rows.assign_add(gd.cast(gd.reduce_sum(gd.ones_like(x[:, 0])), "float64"))
        return gd.reduce_sum(gd.tanh(x @ gd.transpose(x)))

    def shape(k, i):
        return (k * 500 + i) % 7 + 1

    _hammer(lambda k, i: step(np.ones((shape(k, i), 64), np.float32)))
    assert step.trace_count == 7
    assert count.numpy() == 8 * 500
    assert rows.numpy() == sum(shape(k, i) for k in range(8) for i in range(500))


def test_two_functions_updating_one_variable_from_two_threads_lose_no_update(
        _frequent_thread_switches):
    v = gd.Variable(np.zeros((), np.float32), name="v")

    @gd.function
    def add_one(x):
        v.assign_add(1.0)
        return gd.reduce_sum(gd.tanh(x @ gd.transpose(x)))

    @gd.function
    def add_two(x):
        v.assign_add(2.0)
        return gd.reduce_sum(gd.tanh(x @ gd.transpose(x)))

    x = np.ones((8, 64), np.float32)
    _hammer(lambda k, i: (add_one if k % 2 else add_two)(x), threads=4, calls=500)
    assert v.numpy() == 2 * 500 * 1.0 + 2 * 500 * 2.0


def test_threads_calling_a_stateless_threaded_all_reduce_get_their_own_sums(
        _frequent_thread_switches):
    """With device_concurrency("threads") one call runs a program per device, passing values
    through per-run channels; two threads' calls shared them (963 of 1,200 sums wrong)."""
    old = gd.config.device_concurrency()
    gd.config.set_device_concurrency("threads")
    try:
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

        @gd.function
        def total(x):
            doubled = strategy.run(lambda x: x * 2, args=(x,))
            return strategy.reduce(gd.ReduceOp.SUM, doubled, axis=None)

        got = {}

        def call(k, i):
            x = gd.PerReplica((np.full(16, k, np.float32), np.full(16, k + 100, np.float32)))
            got[(k, i)] = float(np.sum(total(x)))

        _hammer(call, threads=4, calls=150)
    finally:
        gd.config.set_device_concurrency(old)
    wrong = {key: value for key, value in got.items()
             if value != 16 * 2 * (key[0] + key[0] + 100)}
    assert len(got) == 600 and not wrong


# ---------------------------------------------------------------- retrace storms

def _retrace_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "graphdist" and r.levelno == logging.WARNING and "retraced" in
            r.getMessage()]


@pytest.mark.parametrize("quiet", [False, True])
def test_graphdists_own_per_shape_helpers_retrace_without_warning(caplog, quiet):
    """The eager reduce across workers compiles one function per (op, axis) that retraces
    for every new shape by design: the user did nothing to cause it, so no warning; a
    user's eager strategy.run (quiet=False) still warns."""
    from graphdist import eager

    cache = {}
    with caplog.at_level(logging.WARNING, logger="graphdist"):
        for n in range(1, 9):
            eager.compiled(cache, "reduce", lambda v: gd.reduce_sum(v), quiet=quiet)(
                np.ones(n, np.float32))
    assert cache["reduce"].trace_count == 8
    assert len(_retrace_warnings(caplog)) == (0 if quiet else 3)


def test_the_sixth_trace_and_later_ones_warn_naming_what_changed(caplog):
    @gd.function
    def f(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="graphdist"):
        for n in range(1, 6):
            f(np.ones((n,), np.float32))
        assert _retrace_warnings(caplog) == []          # five traces: quiet
        f(np.ones((6,), np.float32))
        f(np.ones((7,), np.float32))
        f(np.ones((7,), np.float32))                    # cached: no trace, no warning
    warnings = _retrace_warnings(caplog)
    assert len(warnings) == 2
    assert "gd.function f retraced (trace 6): x: f32[5] -> f32[6]" in warnings[0]
    assert "(trace 7): x: f32[6] -> f32[7]" in warnings[1]


def test_explain_retraces_logs_each_retrace_once_also_past_the_sixth(caplog):
    @gd.function
    def f(x):
        return x + 1

    gd.config.explain_retraces(True)
    try:
        with caplog.at_level(logging.WARNING, logger="graphdist"):
            for n in range(1, 8):
                f(np.ones((n,), np.float32))
    finally:
        gd.config.explain_retraces(False)
    warnings = _retrace_warnings(caplog)
    assert [w.split(":")[0] for w in warnings] == [
        f"gd.function f retraced (trace {t})" for t in range(2, 8)]


def test_the_signature_cache_drops_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(function_module, "MAX_SIGNATURES", 3)

    @gd.function
    def f(x):
        return x * 3

    def call(n):
        np.testing.assert_array_equal(f(np.ones((n,), np.float32)), np.full(n, 3.0))

    for n in (1, 2, 3):
        call(n)
    call(1)                                   # used again: 2 is now the oldest
    call(4)                                   # a fourth signature drops 2
    assert len(f._cache) == 3 and f.trace_count == 4
    call(1)
    call(3)
    assert f.trace_count == 4                 # still cached
    call(2)                                   # dropped: traced again
    assert f.trace_count == 5 and len(f._cache) == 3
    assert f.graph.inputs[0].ty.shape == (2,)


def test_a_dropped_signature_traces_again_and_reuses_the_first_traces_variable(
        monkeypatch):
    """Dropping the first signature's trace must not make its retrace look like a new
    variable (the variable check) nor lose the state the variable holds."""
    monkeypatch.setattr(function_module, "MAX_SIGNATURES", 2)
    made = []

    @gd.function
    def total(x):
        if not made:
            made.append(gd.Variable(np.zeros((), np.float32), name="total"))
        made[0].assign_add(gd.reduce_sum(x))
        return made[0].read_value()

    rows = [4, 3, 2, 4, 3, 4]                 # 4 is dropped by 2, then comes back
    got = [float(total(np.ones((n,), np.float32))) for n in rows]
    np.testing.assert_array_equal(got, np.cumsum(rows))
    assert len(made) == 1 and total.trace_count == 5


# ---------------------------------------------------------------- errors name the line

def _trace_error(fn, *args) -> str:
    with pytest.raises(gd.TraceError) as info:
        fn(*args)
    return str(info.value)


def test_if_on_a_tensor_names_the_action_and_the_line():
    @gd.function
    def f(x):
        if x > 0:
            return x
        return -x

    text = _trace_error(f, np.float32(1.0))
    assert text.startswith("bool() of <gd.Tensor bool[]>")
    assert HERE in text and "if x > 0:" in text


def test_np_asarray_of_a_tensor_names_the_action_and_the_line():
    @gd.function
    def f(x):
        return np.asarray(x) * 2

    text = _trace_error(f, np.ones(3, np.float32))
    assert text.startswith("np.asarray() of <gd.Tensor f32[3] x>")
    assert HERE in text and "return np.asarray(x) * 2" in text


def test_checkpoint_save_in_a_step_names_the_line(tmp_path):
    w = gd.Variable(np.ones(2, np.float32), name="w")
    ckpt = gd.Checkpoint(w=w)

    @gd.function
    def f(x):
        ckpt.save(tmp_path / "in_step.ckpt")
        return x * w

    text = _trace_error(f, np.ones(2, np.float32))
    assert "Checkpoint.save" in text
    assert HERE in text and 'ckpt.save(tmp_path / "in_step.ckpt")' in text
    assert not (tmp_path / "in_step.ckpt").exists()


def test_a_variable_made_outside_the_scope_names_the_line_that_uses_it():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    w = gd.Variable(np.ones(4, np.float32), name="w_outside")

    @gd.function
    def step(x):
        def replica_fn(x):
            return gd.reduce_sum(x * w_outside_use(w))
        return strategy.run(replica_fn, args=(x,))

    text = _trace_error(step, np.ones(4, np.float32))
    assert "variable 'w_outside'" in text and "strategy.scope()" in text
    assert HERE in text and "return gd.reduce_sum(x * w_outside_use(w))" in text


def w_outside_use(w):
    return w


def test_every_trace_error_ends_with_the_users_line():
    """TraceError itself adds the line: each raise site need not remember to."""
    with pytest.raises(gd.TraceError) as info:
        raise gd.TraceError("something tracing cannot capture")
    assert str(info.value).endswith(
        f'while tracing  {HERE}{info.tb.tb_lineno}  raise gd.TraceError("something tracing '
        'cannot capture")')
    kept = gd.TraceError("already placed\n  while tracing  user.py:3  y = f(x)")
    assert str(kept).count("while tracing") == 1
    assert str(gd.TraceError("named", where="model.py:7  h = layer(x)")).endswith(
        "\n  while tracing  model.py:7  h = layer(x)")


# ---------------------------------------------------------------- profiles after a first call

@pytest.fixture
def _background_compile(monkeypatch):
    monkeypatch.setattr(warmup, "_loaded", set())     # as a fresh process: kernels to load
    old = gd.config.background_compile()
    gd.config.set_background_compile(True)
    yield
    gd.config.set_background_compile(old)
    warmup.wait()


def _sgd_step():
    w = gd.Variable(np.full((16, 4), 0.5, np.float32), name="w")
    opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.relu(x @ w))
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    return step, np.ones((8, 16), np.float32)


@pytest.mark.parametrize("how", ["profile", "call_many"])
def test_a_profile_right_after_the_first_call_waits_for_the_kernels(_background_compile,
                                                                    how):
    """The first call runs the numpy forms and leaves the kernels loading in the background;
    the profile must time the step on its kernels, after that loading, not during it. A
    slow extra warm-up job stands for a slow kernel load."""
    step, x = _sgd_step()
    order, gate = [], threading.Event()
    # queued ahead of the step's own warm-up, so that one cannot finish (kernels another
    # test already compiled in this process load in microseconds) before it is looked at
    warmup._submit([], lambda: (gate.wait(60), order.append("kernels loaded")))
    step(x)
    (program,) = step._cache[step._last].executable.programs
    assert program.warming                       # the kernels are still loading
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    try:
        if how == "profile":
            trace = step.profile(x)
        else:
            trace = step.call_many(lambda _: (x,), 2, profile=True)[2]
        order.append("profiled")
    finally:
        gate.set()
        timer.cancel()
    assert order == ["kernels loaded", "profiled"]
    assert not program.warming
    assert any(e.get("cat") == "compute" for e in trace["traceEvents"])


# ---------------------------------------------------------------- plain vs PerReplica

def _replica_step(strategy, w):
    @gd.function
    def step(x):
        return strategy.run(lambda x: gd.reduce_sum(x * w), args=(x,))
    return step


def test_switching_between_a_plain_array_and_a_per_replica_traces_once_per_kind(caplog):
    """A plain array reaches every replica whole, a gd.PerReplica gives each its own
    component: two signatures, as tf.function's TensorSpec and PerReplicaSpec are (the body
    sees a tensor in one case and per-replica values in the other, so the two traces may
    differ: see the next test). Each is traced once, switching back and forth retraces
    nothing more, and the retrace says what changed."""
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        w = gd.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32), name="w")
    step = _replica_step(strategy, w)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    shards = gd.PerReplica((x, x + 1))
    plain_sum = float((x * w.numpy()).sum())
    gd.config.explain_retraces(True)
    try:
        with caplog.at_level(logging.WARNING, logger="graphdist"):
            for _ in range(3):
                assert [float(v) for v in step(x).values] == [plain_sum, plain_sum]
                assert [float(v) for v in step(shards).values] == [
                    float((s * w.numpy()).sum()) for s in shards.values]
    finally:
        gd.config.explain_retraces(False)
    assert step.trace_count == 2
    (warning,) = _retrace_warnings(caplog)
    assert "x: f32[2,4] -> PerReplica(f32[2,4], f32[2,4])" in warning


def test_a_per_replica_never_runs_on_a_trace_made_for_a_plain_array():
    """Why the signatures differ: outside strategy.run a plain array is one tensor and a
    PerReplica is not, so the same body may be valid for one and wrong for the other. A
    shared signature would have run this body's plain-array trace on replica 0's
    component alone."""
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

    @gd.function
    def double(x):
        return x * 2

    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(double(x), x * 2)
    with pytest.raises(TypeError, match="PerReplica"):
        double(strategy.experimental_distribute_values_from_function(lambda ctx: x))


def test_a_profile_as_the_first_call_loads_its_kernels_before_it_times(_background_compile,
                                                                       monkeypatch):
    """No call ran before, so nothing was loading: the profiled program itself loads its
    kernels before its run (a first profile charged 310 ms of loading to one update node)."""
    step, x = _sgd_step()
    loaded_when_run = []
    run = function_module.Compiled.run

    def recording_run(self, arrays, executable=None):
        loaded_when_run.append(set(warmup._loaded))
        return run(self, arrays, executable)

    monkeypatch.setattr(function_module.Compiled, "run", recording_run)
    trace = step.profile(x)
    (loaded,) = loaded_when_run
    assert any(key[1].startswith("sgd") for key in loaded), loaded
    assert any(e.get("name") == "sgd_update" for e in trace["traceEvents"])
