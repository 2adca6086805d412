"""gradient_accumulation_steps=k: k-1 local micro-steps (no collective), then one all-reduce
and one update, equal to one step on the k micro-batches together. Every case is checked
against a numpy reference of the big-batch step (float64 formulas, independent of the
optimizer kernels)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

RNG = np.random.default_rng(7)
W0 = RNG.standard_normal((4, 3)).astype(np.float32)
B0 = RNG.standard_normal(3).astype(np.float32) * 0.1
LR = 0.05


def _devices(n):
    return [f"cpu:{i}" for i in range(n)]


def _batches(count, rows):
    return [(RNG.standard_normal((rows, 4)).astype(np.float32),
             RNG.standard_normal((rows, 3)).astype(np.float32)) for _ in range(count)]


def _grads(w, b, x, y):
    """d/d(w, b) of mean((tanh(x w + b) - y)^2) over every entry, in float64."""
    a = np.tanh(x @ w + b)
    dz = 2 * (a - y) / a.size * (1 - a * a)
    return [x.T @ dz, dz.sum(axis=0)]


def _reference(kind, windows, clip=None):
    """The parameters after one big-batch step per window (all its micro-batches together)."""
    params = [W0.astype(np.float64), B0.astype(np.float64)]
    slots = [[np.zeros_like(p) for p in params] for _ in range(2)]
    for t, window in enumerate(windows, start=1):
        x = np.concatenate([x for x, _ in window]).astype(np.float64)
        y = np.concatenate([y for _, y in window]).astype(np.float64)
        grads = _grads(*params, x, y)
        if clip is not None:
            norm = np.sqrt(sum((g * g).sum() for g in grads))
            grads = [g * clip / max(norm, clip) for g in grads]
        for i, g in enumerate(grads):
            if kind == "sgd":
                slots[0][i] = 0.9 * slots[0][i] + g
                params[i] = params[i] - LR * slots[0][i]
            else:
                m = slots[0][i] = 0.9 * slots[0][i] + 0.1 * g
                v = slots[1][i] = 0.999 * slots[1][i] + 0.001 * g * g
                lr_t = LR * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
                params[i] = params[i] - lr_t * m / (np.sqrt(v) + 1e-7)
    return params


def _optimizer(kind, k, **kw):
    if kind == "sgd":
        return gd.optimizers.SGD(LR, momentum=0.9, gradient_accumulation_steps=k, **kw)
    return gd.optimizers.Adam(LR, gradient_accumulation_steps=k, **kw)


def _setup(kind, n, k, **kw):
    strategy = gd.MirroredStrategy(_devices(n)) if n > 1 else gd.get_strategy()
    with strategy.scope():
        w = gd.Variable(W0, name="w")
        b = gd.Variable(B0, name="b")
        opt = _optimizer(kind, k, **kw)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(gd.tanh(x @ w + b) - y))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        return loss

    if n == 1:
        return strategy, w, b, opt, gd.function(replica_fn)
    return strategy, w, b, opt, gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))


def _split(strategy, n, x, y):
    """Replica r gets rows r*B/n..: the global micro-batch split as the data split cuts it."""
    if n == 1:
        return x, y
    xs, ys = np.array_split(x, n), np.array_split(y, n)
    per = strategy.experimental_distribute_values_from_function
    return (per(lambda ctx: xs[ctx.replica_id_in_sync_group]),
            per(lambda ctx: ys[ctx.replica_id_in_sync_group]))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("n,k", [(1, 2), (2, 2), (2, 4), (4, 2)])
def test_accumulated_step_equals_the_big_batch_step(kind, n, k):
    strategy, w, b, opt, step = _setup(kind, n, k)
    windows = [_batches(k, 4 * n) for _ in range(2)]
    for w_i, window in enumerate(windows):
        for i, (x, y) in enumerate(window):
            step(*_split(strategy, n, x, y))
            # iterations counts applied updates only
            assert int(opt.iterations.numpy()) == w_i + (i == k - 1)
            assert int(opt.accumulation_step.numpy()) == (i + 1) % k
    ref = _reference(kind, windows)
    np.testing.assert_allclose(w.numpy(), ref[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(b.numpy(), ref[1], rtol=2e-5, atol=2e-6)
    for var in (w, b):                     # every replica holds the same parameters
        for component in var.values[1:]:
            np.testing.assert_array_equal(component, var.values[0])
    # the window's first micro-step (writes the accumulators), the others (add), the
    # applying call: k = 2 has no "others"
    assert step.trace_count == (2 if k == 2 else 3)


def test_k_1_is_the_plain_optimizer():
    strategy, w, b, opt, step = _setup("sgd", 2, 1)
    window = _batches(1, 8)
    step(*_split(strategy, 2, *window[0]))
    assert opt.accumulation_step is None and int(opt.iterations.numpy()) == 1
    np.testing.assert_allclose(w.numpy(), _reference("sgd", [window])[0], rtol=2e-5, atol=2e-6)


def test_micro_steps_communicate_nothing_and_the_applying_call_all_reduces_once():
    strategy, w, b, opt, step = _setup("sgd", 2, 3)
    window = _batches(3, 8)

    def collectives(trace):
        return [e for e in trace["traceEvents"]
                if e.get("ph") == "X" and e.get("cat") == "collective"]

    micro = step.profile(*_split(strategy, 2, *window[0]))
    assert collectives(micro) == []
    assert "all_reduce" not in str(step.replicated_graph)
    assert "# gradient_accumulation/accumulate (calls 1-2 of every 3: no collective)" \
        in str(step.graph)
    step(*_split(strategy, 2, *window[1]))
    applying = step.profile(*_split(strategy, 2, *window[2]))
    assert collectives(applying)
    assert int(opt.iterations.numpy()) == 1
    graph = str(step.graph)
    assert graph.count("all_reduce") == 1       # w and b in one bucket
    # the all-reduce under its condition: in the applying program's scope
    applying = graph.split("# gradient_accumulation/apply (call 3 of every 3)")[1]
    assert "all_reduce" in applying.split("  #\n")[0]
    np.testing.assert_allclose(w.numpy(), _reference("sgd", [window])[0], rtol=2e-5,
                               atol=2e-6)


def test_global_clipnorm_clips_the_window_gradient():
    strategy, w, b, opt, step = _setup("sgd", 2, 2, global_clipnorm=0.05)
    windows = [_batches(2, 8) for _ in range(2)]
    for window in windows:
        for x, y in window:
            step(*_split(strategy, 2, x, y))
    ref = _reference("sgd", windows, clip=0.05)
    np.testing.assert_allclose(w.numpy(), ref[0], rtol=2e-5, atol=2e-6)
    unclipped = _reference("sgd", windows)
    assert not np.allclose(ref[0], unclipped[0], rtol=1e-3)     # the clip mattered


def test_sum_reduction_sums_the_window():
    # gradient_reduction="sum": the update takes the sum over replicas and micro-steps
    strategy = gd.MirroredStrategy(_devices(2))
    with strategy.scope():
        v = gd.Variable(np.zeros(3, np.float32), name="v")
        opt = gd.optimizers.SGD(1.0, gradient_reduction="sum", gradient_accumulation_steps=3)

    @gd.function
    def step(g):
        return strategy.run(lambda g: opt.apply_gradients([(g, v)]), args=(g,))

    grads = [RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(3)]
    for g in grads:
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: g[ctx.replica_id_in_sync_group]))
    np.testing.assert_allclose(v.numpy(), -np.sum(grads, axis=(0, 1), dtype=np.float64),
                               rtol=1e-6)


def test_sparse_gradients_accumulate():
    strategy = gd.MirroredStrategy(_devices(2))
    table0 = RNG.standard_normal((6, 2)).astype(np.float32)
    with strategy.scope():
        table = gd.Variable(table0, name="table")
        opt = gd.optimizers.SGD(0.5, gradient_accumulation_steps=2)

    @gd.function
    def step(ids):
        def replica_fn(ids):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(gd.gather(table, ids))
            (g,) = tape.gradient(loss, [table])
            assert isinstance(g, gd.IndexedSlices)
            opt.apply_gradients([(g, table)])
            return loss

        return strategy.run(replica_fn, args=(ids,))

    ids = [np.array([[0, 1], [1, 5]], np.int32), np.array([[2, 2], [0, 3]], np.int32)]
    for batch in ids:
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx, batch=batch: batch[ctx.replica_id_in_sync_group]))
    counts = np.zeros(6)
    for batch in ids:
        np.add.at(counts, batch.reshape(-1), 1.0)
    # mean over 2 replicas and over 2 micro-steps: each lookup's gradient is 1 / 4
    expected = table0 - 0.5 * (counts / 4)[:, None]
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)


def test_a_non_finite_micro_step_skips_only_its_window():
    strategy = gd.MirroredStrategy(_devices(2))
    with strategy.scope():
        w = gd.Variable(W0, name="w")
        b = gd.Variable(B0, name="b")
        opt = gd.optimizers.LossScaleOptimizer(_optimizer("sgd", 2), initial_scale=4.0)

    @gd.function
    def step(x, y):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.square(gd.tanh(x @ w + b) - y))
                scaled = opt.get_scaled_loss(loss)
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, [w, b]))
            opt.apply_gradients(zip(grads, [w, b]))
            return loss

        return strategy.run(replica_fn, args=(x, y))

    poisoned = _batches(2, 8)
    x_bad = poisoned[0][0].copy()
    x_bad[5, 1] = np.inf                               # a row of replica 1's shard only
    poisoned[0] = (x_bad, poisoned[0][1])
    for x, y in poisoned:
        step(*_split(strategy, 2, x, y))
    np.testing.assert_array_equal(w.numpy(), W0)       # the window was skipped everywhere
    assert int(opt.iterations.numpy()) == 0 and float(opt.loss_scale.numpy()) == 2.0
    for component in w.values[1:]:
        np.testing.assert_array_equal(component, w.values[0])
    good = _batches(2, 8)                              # the next window is whole again
    for x, y in good:
        step(*_split(strategy, 2, x, y))
    assert int(opt.iterations.numpy()) == 1
    np.testing.assert_allclose(w.numpy(), _reference("sgd", [good])[0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("k", [2, 3])      # k = 3: first, adding and applying programs
def test_experimental_run_steps_switches_programs_inside_the_loop(k):
    strategy, w, b, opt, _ = _setup("adam", 2, k)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(gd.tanh(x @ w + b) - y))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        return loss

    def fn(ctx, x, y):
        ctx.set_last_step_output("loss", strategy.run(replica_fn, args=(x, y)), "mean")

    windows = [_batches(k, 8) for _ in range(2)]
    batches = [_split(strategy, 2, x, y) for window in windows for x, y in window]
    ctx = strategy.experimental_run_steps(fn, iter(batches), steps=2 * k)
    assert ctx.steps_run == 2 * k and int(opt.iterations.numpy()) == 2
    ref = _reference("adam", windows)
    np.testing.assert_allclose(w.numpy(), ref[0], rtol=2e-5, atol=2e-6)


def test_eager_apply_gradients_accumulates():
    v = gd.Variable(np.ones(2, np.float32), name="v")
    opt = gd.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    opt.apply_gradients([(np.array([1.0, 2.0], np.float32), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    opt.apply_gradients([(np.array([3.0, 0.0], np.float32), v)])
    np.testing.assert_allclose(v.numpy(), [1.0 - 2.0, 1.0 - 1.0])
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_accumulation_steps_are_refused(bad):
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int"):
        gd.optimizers.Adam(gradient_accumulation_steps=bad)


def test_changing_k_after_tracing_traces_again():
    v = gd.Variable(np.zeros(2, np.float32), name="v")
    opt = gd.optimizers.SGD(1.0)

    @gd.function
    def step(g):
        return opt.apply_gradients([(g, v)])

    one = np.ones(2, np.float32)
    step(one)                                           # k = 1: applies
    np.testing.assert_array_equal(v.numpy(), [-1.0, -1.0])
    opt.gradient_accumulation_steps = 2
    step(one)                                           # now a micro-step
    np.testing.assert_array_equal(v.numpy(), [-1.0, -1.0])
    step(3 * one)                                       # applies the mean, 2
    np.testing.assert_array_equal(v.numpy(), [-3.0, -3.0])
    assert int(opt.iterations.numpy()) == 2 and step.trace_count == 3


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1), (2, 2)])
def test_a_checkpoint_mid_window_resumes_on_any_replica_count(tmp_path, before, after):
    window = _batches(2, 8)
    first = _setup("adam", before, 2)
    first[4](*_split(first[0], before, *window[0]))           # one micro-step of two
    path = gd.Checkpoint(w=first[1], b=first[2], opt=first[3]).save(tmp_path / "c.npz")
    strategy, w, b, opt, step = _setup("adam", after, 2)
    gd.Checkpoint(w=w, b=b, opt=opt).restore(path).assert_consumed()
    assert int(opt.accumulation_step.numpy()) == 1 and int(opt.iterations.numpy()) == 0
    step(*_split(strategy, after, *window[1]))                # completes the window
    assert int(opt.iterations.numpy()) == 1
    ref = _reference("adam", [window])
    np.testing.assert_allclose(w.numpy(), ref[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(b.numpy(), ref[1], rtol=2e-5, atol=2e-6)


def test_a_file_without_a_window_starts_an_empty_one(tmp_path):
    plain = _setup("sgd", 2, 1)
    plain[4](*_split(plain[0], 2, *_batches(1, 8)[0]))
    path = gd.Checkpoint(w=plain[1], b=plain[2], opt=plain[3]).save(tmp_path / "c.npz")
    strategy, w, b, opt, step = _setup("sgd", 2, 2)
    step(*_split(strategy, 2, *_batches(1, 8)[0]))            # a micro-step: window 1 of 2
    status = gd.Checkpoint(w=w, b=b, opt=opt).restore(path)
    assert set(status.unrestored) == {"opt/accumulation/step", "opt/accumulation/w",
                                      "opt/accumulation/b"}
    status.expect_partial()
    assert int(opt.accumulation_step.numpy()) == 0
    for component in opt._accumulators[w].values:
        np.testing.assert_array_equal(component, 0)
    with pytest.raises(gd.CheckpointError, match="accumulation"):
        status.assert_consumed()


# ---------------------------------------------------------------- the fused accumulate
# A weight gradient x^T @ dy is added to its accumulator inside the GEMM (BLAS beta=1,
# passes/accumulate.py): one matmul_accumulate node in place of a matmul and an add.


def _mlp_setup(n, k, dtype=np.float32, width=16):
    """A 2-layer MLP (Dense-style x @ w + b) with SGD: two weight gradients to fuse."""
    rng = np.random.default_rng(3)
    init = [rng.standard_normal((4, width)) * 0.5, rng.standard_normal(width) * 0.1,
            rng.standard_normal((width, 3)) * 0.5, rng.standard_normal(3) * 0.1]
    init = [p.astype(dtype) for p in init]
    strategy = gd.MirroredStrategy(_devices(n)) if n > 1 else gd.get_strategy()
    with strategy.scope():
        params = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(init)]
        opt = gd.optimizers.SGD(LR, gradient_accumulation_steps=k)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            h = gd.tanh(x @ params[0] + params[1])
            loss = gd.reduce_mean(gd.square(h @ params[2] + params[3] - y))
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    step = gd.function(replica_fn if n == 1 else
                       lambda x, y: strategy.run(replica_fn, args=(x, y)))
    return strategy, init, params, opt, step


def _mlp_reference(init, windows):
    """Plain SGD on the float64 big-batch gradient of each window."""
    w0, b0, w1, b1 = [p.astype(np.float64) for p in init]
    for window in windows:
        x = np.concatenate([x for x, _ in window]).astype(np.float64)
        y = np.concatenate([y for _, y in window]).astype(np.float64)
        h = np.tanh(x @ w0 + b0)
        dz = 2 * (h @ w1 + b1 - y) / y.size
        dh = dz @ w1.T * (1 - h * h)
        grads = [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]
        w0, b0, w1, b1 = [p - LR * g for p, g in zip((w0, b0, w1, b1), grads)]
    return [w0, b0, w1, b1]


def _fused_nodes(graph) -> list:
    return [line for line in str(graph).splitlines() if "matmul_accumulate" in line]


def test_a_weight_gradient_is_accumulated_inside_its_gemm():
    strategy, _, params, opt, step = _mlp_setup(2, 3)
    batches = _batches(3, 8)
    step(*_split(strategy, 2, *batches[0]))             # the window's first: writes
    assert _fused_nodes(step.graph) == []
    step(*_split(strategy, 2, *batches[1]))             # the second: adds inside the GEMM
    text = str(step.graph)
    fused = _fused_nodes(text)
    assert len(fused) == 2                              # both weights; the biases keep an add
    # no separate matmul writes a weight gradient: the remaining matmuls are the forward
    # pass's two and the backward pass's one input gradient (dh = dz @ w1^T)
    assert sum(" = matmul " in line for line in text.splitlines()) == 3
    scope = "# gradient_accumulation/accumulate (calls 1-2 of every 3: no collective)"
    for node in fused:                                   # each under the accumulate scope
        assert text.rfind(scope, 0, text.index(node)) > text.rfind("  #\n", 0, text.index(node))
    placed = [e.device for e in step.replicated_graph.eqns if e.op.name == "matmul_accumulate"]
    assert sorted(placed) == ["cpu:0", "cpu:0", "cpu:1", "cpu:1"]    # 2 weights x 2 replicas
    step(*_split(strategy, 2, *batches[2]))             # the applying call adds the same way
    assert len(_fused_nodes(step.graph)) == 2
    assert "all_reduce" in str(step.graph)


@pytest.mark.parametrize("n", [1, 2])
def test_fused_accumulation_equals_the_float64_big_batch_step(n):
    strategy, init, params, _, step = _mlp_setup(n, 3)
    windows = [_batches(3, 4 * n) for _ in range(2)]
    for window in windows:
        for x, y in window:
            step(*_split(strategy, n, x, y))
    # the GEMM adds c to its blocks as it writes them (not numpy's product-then-add): the
    # same up to float32 rounding
    for p, ref in zip(params, _mlp_reference(init, windows)):
        np.testing.assert_allclose(p.numpy(), ref, rtol=2e-5, atol=2e-6)


def test_float64_accumulation_matches_numpy_to_float64_rounding():
    strategy, init, params, _, step = _mlp_setup(1, 4, dtype=np.float64)
    rng = np.random.default_rng(11)
    window = [(rng.standard_normal((5, 4)), rng.standard_normal((5, 3))) for _ in range(4)]
    for x, y in window:
        step(x, y)
    assert len(_fused_nodes(step.graph)) == 2
    for p, ref in zip(params, _mlp_reference(init, [window])):
        np.testing.assert_allclose(p.numpy(), ref, rtol=1e-13, atol=1e-15)


def test_the_first_micro_step_writes_the_accumulators():
    strategy, _, params, opt, step = _mlp_setup(2, 2)
    for x, y in _batches(2, 8):                         # a whole window: applied
        step(*_split(strategy, 2, x, y))
    assert int(opt.accumulation_step.numpy()) == 0
    stale = [opt._accumulators[p].values[0].copy() for p in params]
    assert any(np.any(s != 0) for s in stale)           # the last window's sum, not zeroed
    x, y = _batches(1, 8)[0]
    first = str(step.get_graph(*_split(strategy, 2, x, y)))    # the program the window
    assert "assign_var[var=p0/SGD/accumulator]" in first      # position picks: it writes
    assert "read_var[var=p0/SGD/accumulator]" not in first    # the accumulator unread
    step(*_split(strategy, 2, x, y))                    # the next window's first micro-step
    # the accumulator is this micro-batch's gradient alone, bit for bit the one the same
    # graph computes without accumulation (the old sum was overwritten, not added to)
    compute = gd.function(lambda x, y: strategy.run(_gradients_of(params), args=(x, y)))
    grads = compute(*_split(strategy, 2, x, y))
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(opt._accumulators[p].values[0], g.values[0])


def _gradients_of(params):
    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            h = gd.tanh(x @ params[0] + params[1])
            loss = gd.reduce_mean(gd.square(h @ params[2] + params[3] - y))
        return tape.gradient(loss, params)
    return replica_fn


def test_a_checkpoint_between_windows_saves_empty_accumulators(tmp_path):
    strategy, _, params, opt, step = _mlp_setup(2, 2)
    for x, y in _batches(2, 8):
        step(*_split(strategy, 2, x, y))
    path = gd.Checkpoint(opt=opt, params=params).save(tmp_path / "c.npz")
    with np.load(path) as saved:
        accumulators = [k for k in saved.files if "/accumulation/" in k and "step" not in k]
        assert len(accumulators) == 4
        for key in accumulators:
            np.testing.assert_array_equal(saved[key], 0)


def test_with_fused_kernels_off_the_accumulate_stays_an_add():
    old = gd.config.fused_kernels()
    gd.config.set_fused_kernels(False)
    try:
        strategy, init, params, _, step = _mlp_setup(1, 3)
        window = _batches(3, 4)
        for x, y in window:
            step(x, y)
        assert _fused_nodes(step.graph) == []
    finally:
        gd.config.set_fused_kernels(old)
    for p, ref in zip(params, _mlp_reference(init, [window])):
        np.testing.assert_allclose(p.numpy(), ref, rtol=2e-5, atol=2e-6)
