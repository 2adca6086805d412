"""The generated program must compute what eager numpy computes, whatever buffers the static
plan shares: arrays here are above the arena threshold so donation, pooling and writing
into variable storage are all exercised."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

N = 128 * 128  # float32 elements, 64 KiB: every (N,) array gets an arena buffer


def _rng(seed=0):
    return np.random.default_rng(seed)


PROGRAMS = {
    "where_donates_its_input": lambda x, y: gd.where(x > 0, x * 3.0, 0.0),
    "relu_grad_chain": lambda x, y: gd.relu(gd.relu(x) - y) * 2.0 + gd.sigmoid(y),
    "self_transpose": lambda x, y: (gd.reshape(x, (128, -1))
                                    + gd.transpose(gd.reshape(x, (128, -1)))),
    "broadcast_and_reduce": lambda x, y: gd.reduce_sum(gd.reshape(x, (128, -1)), axis=0,
                                                       keepdims=True) * gd.reshape(y, (128, -1)),
    "cast_roundtrip": lambda x, y: gd.cast(gd.cast(x * 100.0, "int32"), "float32") - y,
    "pool_reuse": lambda x, y: ((x + y) * (x - y)) / (gd.exp(y) + 1.0) + gd.tanh(x) * y,
    "matmul_views": lambda x, y: gd.reshape(x, (128, -1)) @ gd.transpose(gd.reshape(y, (128, -1))),
    "mean_max": lambda x, y: gd.reduce_max(gd.reshape(x, (128, -1)), axis=1)
    + gd.reduce_mean(gd.reshape(y, (128, -1)), axis=1),
    "sqrt_log_pow": lambda x, y: gd.sqrt(gd.abs(x) + 1.0) * gd.log(gd.abs(y) + 1.0) + x ** 2.0,
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_compiled_matches_eager(name):
    fn = PROGRAMS[name]
    rng = _rng()
    x = rng.standard_normal(N).astype(np.float32)
    y = rng.standard_normal(N).astype(np.float32)
    expected = fn(x, y)                      # eager: numpy in, numpy out
    compiled = gd.function(fn)
    for _ in range(3):                       # buffers are reused across calls
        np.testing.assert_allclose(compiled(x, y), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"cast_roundtrip"}))  # int: no grad
def test_gradients_match_finite_differences(name):
    fn = PROGRAMS[name]
    rng = _rng(1)
    x = rng.standard_normal(N).astype(np.float64)
    y = rng.standard_normal(N).astype(np.float64)
    vg = gd.value_and_grad(lambda x, y: gd.reduce_sum(fn(x, y)), argnums=(0, 1))
    _, (gx, gy) = vg(x, y)
    eps = 1e-6
    t = rng.standard_normal(N)
    f = lambda a, b: float(np.sum(fn(a, b)))  # noqa: E731
    fd_x = (f(x + eps * t, y) - f(x - eps * t, y)) / (2 * eps)
    fd_y = (f(x, y + eps * t) - f(x, y - eps * t)) / (2 * eps)
    assert np.isclose(fd_x, float(np.dot(gx, t)), rtol=1e-4, atol=1e-6)
    if gy is None:   # fn does not read y
        assert fd_y == 0
    else:
        assert np.isclose(fd_y, float(np.dot(gy, t)), rtol=1e-4, atol=1e-6)


def test_final_state_written_into_storage_and_old_reads_kept():
    w = gd.Variable(np.ones(N, np.float32), name="w")
    storage = w.values[0]

    @gd.function
    def step(x):
        old = w.read_value()
        w.assign(w * 2.0 + x)       # elementwise: may write straight into w's storage
        return old * 1.0            # the old value must survive the in-place write

    x = np.full(N, 0.5, np.float32)
    old = step(x)
    np.testing.assert_array_equal(old, np.ones(N))
    np.testing.assert_array_equal(w.numpy(), np.full(N, 2.5))
    assert w.values[0] is storage   # updated in place, never replaced
    step(x)
    np.testing.assert_array_equal(w.numpy(), np.full(N, 5.5))


def test_swap_two_variables_in_one_step():
    a = gd.Variable(np.full(N, 1.0, np.float32), name="a")
    b = gd.Variable(np.full(N, 2.0, np.float32), name="b")

    @gd.function
    def swap():
        old_a = a.read_value()
        a.assign(b.read_value())
        b.assign(old_a)
        return 0

    swap()
    np.testing.assert_array_equal(a.numpy(), np.full(N, 2.0))
    np.testing.assert_array_equal(b.numpy(), np.full(N, 1.0))


def test_results_do_not_alias_reused_buffers():
    f = gd.function(lambda x: gd.tanh(x) * 2.0)
    x1 = np.full(N, 0.1, np.float32)
    r1 = f(x1)
    r2 = f(np.full(N, 0.9, np.float32))
    assert not np.shares_memory(r1, r2)
    np.testing.assert_allclose(r1, np.tanh(x1) * 2, rtol=1e-6)


def test_every_placed_node_has_a_device():
    f = gd.function(lambda x, y: gd.nn.sparse_softmax_cross_entropy(y, x))
    x = np.zeros((2, 3), np.float32)
    y = np.array([0, 1], np.int32)
    f(x, y)
    placed = f.get_replicated_graph(x, y)
    assert placed.devices == ("cpu:0",)
    assert all(eqn.device == "cpu:0" for eqn in placed.eqns)
    assert all(v.device == "cpu:0" for eqn in placed.eqns for v in eqn.outputs)


@pytest.fixture
def failing_op():
    from graphdist.ops.core import OPS, Op, bind

    op = Op("test_fails_at_run_time")
    op.def_shape(lambda x: x)

    @op.def_impl
    def _impl(xp, x):
        raise FloatingPointError("boom")

    yield lambda x: bind(op, x)
    del OPS[op.name]


def test_runtime_error_names_node_device_and_source_and_keeps_variables(failing_op):
    w = gd.Variable(np.ones(3, np.float32), name="w")

    @gd.function
    def step(x):
        w.assign(w + 1.0)
        return failing_op(x * 2.0)

    with pytest.raises(FloatingPointError) as info:
        step(np.ones(3, np.float32))
    message = str(info.value)
    assert "boom" in message and "test_fails_at_run_time" in message
    assert "cpu:0" in message and "test_lower.py" in message
    np.testing.assert_array_equal(w.numpy(), np.ones(3))   # the failed step changed nothing


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_long_programs_split_into_chunks_compute_the_same(name, monkeypatch):
    import graphdist.runtime.program as lower_module

    monkeypatch.setattr(lower_module, "CHUNK_LINES", 3)
    fn = PROGRAMS[name]
    rng = _rng(2)
    x = rng.standard_normal(N).astype(np.float32)
    y = rng.standard_normal(N).astype(np.float32)
    compiled = gd.function(gd.value_and_grad(lambda x, y: gd.reduce_sum(fn(x, y))))
    value, grad = compiled(x, y)
    assert "def chunk1(" in compiled.program_source()
    monkeypatch.setattr(lower_module, "CHUNK_LINES", 10**6)
    ref_value, ref_grad = gd.function(gd.value_and_grad(lambda x, y: gd.reduce_sum(fn(x, y))))(
        x, y)
    np.testing.assert_array_equal(value, ref_value)
    np.testing.assert_array_equal(grad, ref_grad)


def test_values_flattened_into_a_concat_are_computed_in_place():
    """Gradient buckets: big values that only feed a 1-D concat are written straight into
    their slice of its buffer; small ones are copied in."""
    rng = _rng(3)
    a = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal((96, 80)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)

    def pack(a, b, bias):
        big1 = a @ b                               # (64, 80): 20 KiB
        big2 = gd.tanh(a) * 2.0                    # (64, 96): 24 KiB
        return gd.concat([gd.reshape(big1, (-1,)), gd.reshape(bias * 3.0, (-1,)),
                          gd.reshape(big2, (-1,))]) * 1.0

    f = gd.function(pack)
    expected = np.concatenate([(a @ b).ravel(), bias * 3, (np.tanh(a) * 2).ravel()])
    for _ in range(2):
        np.testing.assert_allclose(f(a, b, bias), expected, rtol=1e-5, atol=1e-5)
    source = f.program_source()
    copies = [line for line in source.splitlines() if "] = " in line and ".reshape(-1)" in line]
    assert len(copies) == 1                        # only the small bias is copied in


def test_a_profiled_program_in_chunks_runs(monkeypatch):
    """The profiler writes its timer before every node: each chunk takes it once."""
    import graphdist.runtime.program as lower_module

    monkeypatch.setattr(lower_module, "CHUNK_LINES", 5)
    step = gd.function(lambda x: gd.reduce_sum(gd.tanh(gd.exp(x * 2.0) + 1.0) * x))
    x = np.linspace(-1, 1, 8).astype(np.float32)
    trace = step.profile(x)
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {"exp", "tanh", "reduce_sum"} <= set(names)
    np.testing.assert_allclose(step(x), np.sum(np.tanh(np.exp(2 * x) + 1) * x), rtol=1e-6)
