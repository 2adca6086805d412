"""strategy.experimental_run_steps and gd.MultiStepContext: K steps in one call against K
single calls and K plain gd.function steps (bit for bit), last-step outputs, an input that
ends early, loop-carried values, one trace, and the profile's steps."""

import numpy as np
import pytest

import graphdist as gd

DEVICES = [f"cpu:{i}" for i in range(4)]


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    y = rng.integers(0, 3, 96).astype(np.int32)
    w0 = rng.standard_normal((8, 3)).astype(np.float32)
    return x, y, w0


def _setup(devices=DEVICES, seed=0):
    x, y, w0 = _problem(seed)
    strategy = gd.MirroredStrategy(devices)
    with strategy.scope():
        w = gd.Variable(w0)
        b = gd.Variable(np.zeros(3, np.float32))
        opt = gd.optimizers.Adam(0.05)

    def replica_step(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, x @ w + b))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        return loss

    data = strategy.experimental_distribute_dataset(gd.data.batches((x, y), 16))
    return strategy, replica_step, data, (w, b, opt)


def test_k_steps_in_one_call_equal_k_single_calls_and_k_plain_steps_bit_for_bit():
    strategy, replica_step, data, (w, b, opt) = _setup()
    calls = []

    def fn(ctx, x, y):
        calls.append(1)
        ctx.set_last_step_output("loss", strategy.run(replica_step, args=(x, y)),
                                 gd.ReduceOp.MEAN)

    ctx = strategy.experimental_run_steps(fn, iter(data), steps=6)
    assert ctx.steps_run == 6 and int(opt.iterations.numpy()) == 6
    looped = [w.numpy(), b.numpy(), *(s.numpy() for s in opt.slots().values())]

    strategy2, replica_step2, data2, (w2, b2, opt2) = _setup()

    def fn2(ctx, x, y):
        strategy2.run(replica_step2, args=(x, y))

    for batch in data2:                           # 6 calls of one step each
        strategy2.experimental_run_steps(fn2, iter([batch]), steps=1)
    single = [w2.numpy(), b2.numpy(), *(s.numpy() for s in opt2.slots().values())]

    strategy3, replica_step3, data3, (w3, b3, opt3) = _setup()
    step = gd.function(lambda x, y: strategy3.run(replica_step3, args=(x, y)))
    for batch in data3:
        step(*batch)
    plain = [w3.numpy(), b3.numpy(), *(s.numpy() for s in opt3.slots().values())]
    for a, s, p in zip(looped, single, plain):
        np.testing.assert_array_equal(a, s)
        np.testing.assert_array_equal(a, p)
    assert len(calls) == 1                       # fn's Python body ran once: one trace
    assert ctx.step_function.trace_count == 1


def test_last_step_outputs_reduced_or_per_replica_in_either_context():
    strategy, _, data, _ = _setup()
    outer = {}

    def replica_fn(x, y):
        value = gd.reduce_sum(x)
        outer["ctx"].set_last_step_output("inside_sum", value, "sum")   # in a replica
        outer["ctx"].set_last_step_output("inside_each", value)
        return value

    def fn(ctx, x, y):
        outer["ctx"] = ctx
        per = strategy.run(replica_fn, args=(x, y))
        ctx.set_last_step_output("mean", per, gd.ReduceOp.MEAN)
        ctx.set_last_step_output("each", per)

    batches = list(data)
    ctx = strategy.experimental_run_steps(fn, iter(batches), steps=3)
    last_x = batches[2][0]
    sums = [float(np.sum(v)) for v in last_x.values]
    out = ctx.last_step_outputs
    assert isinstance(out["each"], gd.PerReplica) and len(out["each"].values) == 4
    np.testing.assert_allclose([float(v) for v in out["each"].values], sums, rtol=1e-6)
    np.testing.assert_allclose(float(out["mean"]), np.mean(sums), rtol=1e-6)
    np.testing.assert_allclose(float(out["inside_sum"]), np.sum(sums), rtol=1e-6)
    np.testing.assert_allclose([float(v) for v in out["inside_each"].values], sums, rtol=1e-6)


def test_an_iterator_that_ends_mid_loop_runs_the_steps_it_has():
    strategy, replica_step, data, (_, _, opt) = _setup()

    def fn(ctx, x, y):
        strategy.run(replica_step, args=(x, y))

    it = iter(data)                                 # 6 batches
    first = strategy.experimental_run_steps(fn, it, steps=4)
    second = strategy.experimental_run_steps(fn, it, steps=4)
    third = strategy.experimental_run_steps(fn, it, steps=4)
    assert (first.steps_run, second.steps_run, third.steps_run) == (4, 2, 0)
    assert int(opt.iterations.numpy()) == 6
    assert third.last_step_outputs == {}


def test_initial_loop_values_are_carried_from_step_to_step():
    strategy, replica_step, data, _ = _setup()

    def fn(ctx, x, y):
        previous = ctx.last_step_outputs["total"]
        loss = strategy.run(replica_step, args=(x, y))
        ctx.set_last_step_output("total", previous + strategy.reduce("sum", loss, axis=None))
        ctx.set_last_step_output("count", ctx.last_step_outputs["count"] + 1.0)

    start = {"total": np.float32(100.0), "count": np.float32(0.0)}
    ctx = strategy.experimental_run_steps(fn, iter(data), steps=6, initial_loop_values=start)
    assert float(ctx.last_step_outputs["count"]) == 6.0
    # the same losses, step by step
    strategy2, replica_step2, data2, _ = _setup()
    step = gd.function(lambda x, y: strategy2.reduce(
        "sum", strategy2.run(replica_step2, args=(x, y)), axis=None))
    want = 100.0 + sum(float(step(*batch)) for batch in data2)
    np.testing.assert_allclose(float(ctx.last_step_outputs["total"]), want, rtol=1e-6)


def test_the_profile_shows_every_step_on_every_lane():
    strategy, replica_step, data, _ = _setup()

    def fn(ctx, x, y):
        strategy.run(replica_step, args=(x, y))

    ctx = strategy.experimental_run_steps(fn, iter(data), steps=3, profile=True)
    events = [e for e in ctx.profile["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["cat"] == "step"]
    # 4 device lanes and their 4 collectives lanes
    assert sorted({(e["name"], e["tid"]) for e in steps}) == sorted(
        (f"step {k}", lane) for k in range(3) for lane in range(8))
    nodes = [e for e in events if e["cat"] != "step"]
    assert {0, 1, 2, 3} <= {e["tid"] for e in nodes} <= set(range(8))
    for e in nodes:                                # every node inside one of the steps
        assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                   for s in steps if s["tid"] == e["tid"])


def test_bad_arguments_and_contexts_raise():
    strategy, replica_step, data, _ = _setup()

    def fn(ctx, x, y):
        strategy.run(replica_step, args=(x, y))

    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        strategy.experimental_run_steps(fn, iter(data), steps=0)
    with pytest.raises(TypeError, match="expected an iterator"):
        strategy.experimental_run_steps(fn, data, steps=2)
    with pytest.raises(TypeError, match="initial_loop_values must be a dict"):
        strategy.experimental_run_steps(fn, iter(data), steps=2, initial_loop_values=[1.0])
    with pytest.raises(RuntimeError, match="experimental_run_steps"):
        gd.function(lambda: strategy.experimental_run_steps(fn, iter(data), 2))()


def test_a_failing_step_leaves_the_last_completed_steps_state():
    strategy, replica_step, data, (w, b, opt) = _setup()
    batches = list(data)
    bad = (batches[2][0], gd.PerReplica(tuple(np.full_like(v, 7) for v in batches[2][1].values)))

    def fn(ctx, x, y):
        strategy.run(replica_step, args=(x, y))

    with pytest.raises(ValueError, match="labels"):
        strategy.experimental_run_steps(fn, iter(batches[:2] + [bad] + batches[3:]), steps=6)
    assert int(opt.iterations.numpy()) == 2
    strategy2, replica_step2, data2, (w2, _, _) = _setup()
    step = gd.function(lambda x, y: strategy2.run(replica_step2, args=(x, y)))
    for batch in batches[:2]:
        step(*batch)
    np.testing.assert_array_equal(w.numpy(), w2.numpy())
