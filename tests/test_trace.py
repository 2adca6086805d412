"""gd.function: signature cache, pytrees, static Python scalars, retrace explanations, errors
that name the op, the shapes and the user's line, and name scopes."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import graphdist as gd


def test_traces_once_per_signature():
    calls = []

    @gd.function
    def f(x, scale):
        calls.append(1)
        return x * scale

    a = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(f(a, 2.0), a * 2)
    np.testing.assert_array_equal(f(a + 1, 2.0), (a + 1) * 2)
    assert f.trace_count == 1 and len(calls) == 1
    f(a, 3.0)                                   # Python scalars are static: retrace
    f(np.ones((4, 3), np.float32), 2.0)         # new shape: retrace
    f(np.ones((2, 3), np.float64), 2.0)         # new dtype: retrace
    assert f.trace_count == 4
    f(a, 3.0)
    assert f.trace_count == 4


def test_pytrees_in_and_out():
    @gd.function
    def f(batch, extra):
        x, y = batch
        return {"sum": x + y, "parts": [x * extra["k"], y]}

    x, y = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    out = f((x, y), {"k": np.float32(2)})
    np.testing.assert_array_equal(out["sum"], x + y)
    np.testing.assert_array_equal(out["parts"][0], x * 2)
    assert isinstance(out["parts"], list)
    assert f.graph.inputs[0].hint == "batch[0]"


def test_scalar_results_are_numpy_scalars():
    f = gd.function(lambda x: gd.reduce_sum(x))
    out = f(np.ones(4, np.float32))
    assert isinstance(out, np.float32) and out == 4


def test_python_control_flow_unrolls_and_bool_of_tensor_is_an_error():
    @gd.function
    def f(x, n):
        for _ in range(n):
            x = x + 1.0
        return x

    np.testing.assert_array_equal(f(np.zeros(2, np.float32), 3), [3, 3])
    assert sum(1 for e in f.graph.eqns if e.op.name == "add") == 3

    @gd.function
    def g(x):
        return x if x > 0 else -x

    with pytest.raises(gd.TraceError, match="truth value"):
        g(np.ones(2, np.float32))


def test_shape_error_names_op_shapes_and_source_line():
    f = gd.function(lambda x, w: x @ w)
    with pytest.raises(gd.ShapeError) as info:
        f(np.ones((32, 4), np.float32), np.ones((3, 4), np.float32))
    message = str(info.value)
    assert "matmul" in message and "f32[32,4]" in message and "f32[3,4]" in message
    assert "test_trace.py:" in message and "x @ w" in message
    assert isinstance(info.value, ValueError)


def test_mixed_float_dtypes_are_a_type_error():
    f = gd.function(lambda x, y: x + y)
    with pytest.raises(TypeError, match="float32.*float64|f32.*f64"):
        f(np.ones(2, np.float32), np.ones(2, np.float64))


def test_unsupported_dtype_argument_names_it():
    f = gd.function(lambda x: x)
    with pytest.raises(TypeError, match="x"):
        f(np.ones(2, np.complex64))     # float16 and bfloat16 are supported (mixed precision)


def test_failed_trace_changes_no_variable_and_leaves_no_cache_entry():
    w = gd.Variable(np.ones((4, 3), np.float32), name="w")

    @gd.function
    def step(x):
        w.assign_add(np.ones((4, 3), np.float32))
        return x @ w                            # fails for the wrong x

    with pytest.raises(gd.ShapeError):
        step(np.ones((2, 5), np.float32))
    np.testing.assert_array_equal(w.numpy(), np.ones((4, 3)))
    assert step.trace_count == 0
    step(np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(w.numpy(), 2 * np.ones((4, 3)))


def test_explain_retraces_logs_what_changed(caplog):
    gd.config.explain_retraces(True)
    try:
        f = gd.function(lambda x, n: x * n)
        f(np.ones((2, 3), np.float32), 2)
        with caplog.at_level(logging.WARNING, logger="graphdist"):
            f(np.ones((5, 3), np.float32), 2)
            f(np.ones((5, 3), np.float32), 4)
        text = caplog.text
        assert "f32[2,3] -> f32[5,3]" in text
        assert "2 -> 4" in text
    finally:
        gd.config.explain_retraces(False)


def test_name_scopes_prefix_nodes_and_nest():
    @gd.function
    def f(x):
        with gd.name_scope("outer"):
            with gd.name_scope("inner"):
                y = gd.tanh(x)
            z = y * 2.0
        return z + 1.0

    f(np.ones(2, np.float32))
    scopes = [e.scope for e in f.graph.eqns]
    assert scopes == ["outer/inner", "outer", ""]
    assert "# outer/inner" in str(f.graph)


def test_nested_functions_inline_into_one_trace():
    inner = gd.function(lambda x: x * 2.0)
    outer = gd.function(lambda x: inner(x) + 1.0)
    np.testing.assert_array_equal(outer(np.ones(2, np.float32)), [3, 3])
    assert inner.trace_count == 0 and len(outer.graph) == 2


def test_leaked_tensor_is_an_error():
    leaked = []

    @gd.function
    def f(x):
        leaked.append(x * 1.0)
        return x

    f(np.ones(2, np.float32))
    g = gd.function(lambda x: x + leaked[0])
    with pytest.raises(gd.TraceError, match="another trace"):
        g(np.ones(2, np.float32))


def test_graph_accessors():
    f = gd.function(lambda x: gd.exp(x))
    with pytest.raises(ValueError, match="not been traced"):
        _ = f.graph
    x = np.ones(3, np.float32)
    g = f.get_graph(x)
    assert [e.op.name for e in g.eqns] == ["exp"] and len(g) == 1
    assert f.get_replicated_graph(x).devices == ("cpu:0",)
    assert f.trace_count == 1


def test_numpy_arrays_and_variables_as_constants():
    w = gd.Variable(np.full(3, 2.0, np.float32))
    c = np.arange(3, dtype=np.float32)
    f = gd.function(lambda x: x * w + c)
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), 2 + c)
    w.assign(np.full(3, 5.0, np.float32))             # the program reads live storage
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), 5 + c)
    assert f.trace_count == 1


def test_trace_errors_raised_before_any_eqn_name_the_source_line():
    @gd.function
    def f(x):
        return gd.squeeze(x, axis=0)

    with pytest.raises(ValueError, match=r"squeeze.*\n  while tracing  test_trace.py:\d+"):
        f(np.ones((2, 3), np.float32))


def test_a_trace_in_one_thread_does_not_capture_another_threads_ops():
    """The trace context is thread-local: eager ops in a second thread run eagerly while
    the first thread is tracing."""
    import threading

    started, release = threading.Event(), threading.Event()
    seen = {}

    @gd.function
    def f(x):
        started.set()
        release.wait(10)
        return x * 2.0

    def other():
        started.wait(10)
        seen["eager"] = gd.add(np.ones(2, np.float32), 1.0)     # not a gd.Tensor
        release.set()

    t = threading.Thread(target=other)
    t.start()
    out = f(np.ones(2, np.float32))
    t.join()
    np.testing.assert_array_equal(out, [2.0, 2.0])
    assert isinstance(seen["eager"], np.ndarray)
    np.testing.assert_array_equal(seen["eager"], [2.0, 2.0])


def test_a_slow_first_call_says_what_it_is_doing(monkeypatch, capsys):
    """A compile past progress.SLOW_SECONDS tells the user, while it runs, and how long it
    took; a quick one says nothing."""
    import time

    from graphdist import progress

    quick = gd.function(lambda x: x * 2.0)
    quick(np.ones(2, np.float32))
    assert "graphdist:" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "SLOW_SECONDS", 0.05)

    @gd.function
    def slow_to_trace(x):
        time.sleep(0.3)               # tracing runs the Python function once
        return x * 2.0

    slow_to_trace(np.ones(2, np.float32))
    err = capsys.readouterr().err
    assert "compiling gd.function slow_to_trace" in err and "done in" in err
    slow_to_trace(np.ones(2, np.float32))           # cached: no notice
    assert "graphdist:" not in capsys.readouterr().err
