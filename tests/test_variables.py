"""Tests for gd.Variable: creation and dtype inference, eager reads and writes, and read/assign
semantics inside gd.function (program order per variable, swaps, failed traces)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

# 3 elements stay in plain temporaries; 5000 float32 (20 KiB) go through the lowering's arena
# buffers and may be computed straight into the variable's storage.
SIZES = [3, 5000]


# ---------------------------------------------------------------- creation


@pytest.mark.parametrize("initial, dtype", [
    (1.0, np.float32),
    (1, np.int32),
    (True, np.bool_),
    (-7, np.int32),
    ([1.0, 2.0], np.float32),
    ([[1, 2], [3, 4]], np.int32),
    (np.float64(1.5), np.float64),
    (np.float32(1.5), np.float32),
    (np.int64(3), np.int64),
    (np.int32(3), np.int32),
    (np.ones(3), np.float64),
    (np.ones((2, 2), np.float32), np.float32),
    (np.arange(4, dtype=np.int64), np.int64),
    (np.array([True, False]), np.bool_),
], ids=repr)
def test_dtype_inference(initial, dtype):
    v = gd.Variable(initial)
    assert v.dtype == np.dtype(dtype)
    assert isinstance(v.dtype, np.dtype)
    assert v.shape == np.shape(initial)
    np.testing.assert_array_equal(v.numpy(), np.asarray(initial))


@pytest.mark.parametrize("initial, dtype", [
    (1, "float32"), (1.0, np.float64), (np.ones(2), np.float32), ([1, 2], "int64"),
    (np.float64(2.0), "float32"), (0, np.bool_),
])
def test_explicit_dtype(initial, dtype):
    v = gd.Variable(initial, dtype=dtype)
    assert v.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v.numpy(), np.asarray(initial).astype(dtype))


def test_unsupported_dtype_raises():
    with pytest.raises(TypeError):
        gd.Variable(np.ones(2, np.uint8))   # float16 and bfloat16 are supported
    with pytest.raises(TypeError):
        gd.Variable(1.0, dtype="complex64")


def test_callable_and_variable_initial_values():
    v = gd.Variable(lambda: np.full(2, 4.0, np.float32))
    assert v.dtype == np.float32 and v.numpy().tolist() == [4.0, 4.0]
    u = gd.Variable(v, name="copy")
    v.assign(np.zeros(2, np.float32))
    assert u.numpy().tolist() == [4.0, 4.0], "a variable made from another copies its value"


def test_name_and_trainable():
    v = gd.Variable(1.0, name="my_var")
    assert v.name == "my_var" and v.trainable is True
    assert gd.Variable(1.0, trainable=False).trainable is False
    a, b = gd.Variable(1.0), gd.Variable(1.0)
    assert a.name == b.name == "Variable"   # as TF 2 ("Variable:0"): names need not be unique
    assert a.synchronization is gd.VariableSynchronization.AUTO
    assert a.aggregation is gd.VariableAggregation.NONE


def test_values_outside_strategy():
    v = gd.Variable(np.arange(3, dtype=np.float32))
    assert isinstance(v.values, tuple) and len(v.values) == 1
    np.testing.assert_array_equal(v.values[0], np.arange(3))
    assert v.ndim == 1 and len(v) == 3


def test_numpy_and_read_value_return_copies():
    v = gd.Variable(np.arange(3, dtype=np.float32))
    a = v.numpy()
    a[0] = 100.0
    r = v.read_value()
    r[1] = 100.0
    np.testing.assert_array_equal(v.numpy(), np.arange(3))
    assert not np.shares_memory(v.numpy(), v.values[0])
    np.testing.assert_array_equal(v.value(), np.arange(3))
    np.testing.assert_array_equal(np.asarray(v), np.arange(3))


def test_on_read_is_not_trainable_and_bad_enums():
    v = gd.Variable(0.0, trainable=True, synchronization=gd.VariableSynchronization.ON_READ,
                    aggregation=gd.VariableAggregation.SUM)
    assert v.trainable is False
    assert v.synchronization is gd.VariableSynchronization.ON_READ
    w = gd.Variable(0.0, synchronization=gd.VariableSynchronization.ON_WRITE)
    assert w.trainable is True
    with pytest.raises(ValueError, match="aggregation"):
        gd.Variable(0.0, aggregation="median")
    with pytest.raises(ValueError, match="aggregation"):
        gd.Variable(0.0, aggregation=7)
    with pytest.raises(ValueError, match="synchronization"):
        gd.Variable(0.0, synchronization="sometimes")


# ---------------------------------------------------------------- eager writes


def test_eager_assign_family():
    v = gd.Variable(np.arange(3, dtype=np.float32))
    storage = v.values[0]
    assert v.assign(np.full(3, 2.0, np.float32)) is v
    assert v.assign_add(np.ones(3, np.float32)) is v
    np.testing.assert_array_equal(v.numpy(), [3, 3, 3])
    v.assign_sub(np.array([1.0, 2.0, 3.0], np.float32))
    np.testing.assert_array_equal(v.numpy(), [2, 1, 0])
    v.assign_add(0.5)                      # Python numbers are weakly typed
    v.assign_sub(1)
    np.testing.assert_array_equal(v.numpy(), [1.5, 0.5, -0.5])
    assert v.dtype == np.float32 and v.numpy().dtype == np.float32
    assert v.values[0] is storage, "eager writes must update the storage in place"
    s = gd.Variable(0)
    s.assign(5)
    s.assign_add(2)
    assert s.numpy() == 7 and s.dtype == np.int32
    u = gd.Variable(np.zeros(3, np.float32))
    u.assign(v)                             # from another variable
    np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_eager_assign_is_seen_by_compiled_functions():
    v = gd.Variable(np.ones(2, np.float32))
    f = gd.function(lambda: v * 2)
    np.testing.assert_array_equal(f(), [2, 2])
    v.assign(np.array([5.0, 6.0], np.float32))
    np.testing.assert_array_equal(f(), [10, 12])
    assert f.trace_count == 1


@pytest.mark.parametrize("write, value, error", [
    ("assign", np.ones(4, np.float32), ValueError),
    ("assign", np.ones((3, 1), np.float32), ValueError),
    ("assign", np.ones(3, np.float64), TypeError),
    ("assign", np.ones(3, np.int32), TypeError),
    ("assign_add", np.ones(4, np.float32), ValueError),
    ("assign_add", np.ones((2, 3), np.float32), ValueError),
    ("assign_add", np.ones(3, np.float64), TypeError),
    ("assign_sub", np.ones(3, np.float64), TypeError),
    ("assign_sub", np.ones(2, np.float32), ValueError),
], ids=lambda x: x if isinstance(x, str) else None)
def test_eager_mismatch_raises_and_leaves_value(write, value, error):
    v = gd.Variable(np.arange(3, dtype=np.float32), name="target")
    with pytest.raises(error):
        getattr(v, write)(value)
    np.testing.assert_array_equal(v.numpy(), np.arange(3, dtype=np.float32))
    assert v.dtype == np.float32


def test_eager_int_variable_rejects_float_delta():
    v = gd.Variable(np.arange(3, dtype=np.int32))
    with pytest.raises(TypeError):
        v.assign_add(1.5)
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])


def test_shape_mismatch_error_names_variable():
    v = gd.Variable(np.zeros((2, 2), np.float32), name="kernel")
    with pytest.raises(ValueError, match="kernel"):
        v.assign(np.zeros(3, np.float32))


# ---------------------------------------------------------------- in-trace semantics


@pytest.mark.parametrize("n", SIZES)
def test_read_after_assign_sees_new_value(n):
    a0 = np.arange(n, dtype=np.float32)
    a = gd.Variable(a0)

    @gd.function
    def f(x):
        a.assign(x)
        first = a * 2
        a.assign_add(1.0)
        return first, a.read_value() + 0, a * 1

    first, second, third = f(np.full(n, 3.0, np.float32))
    np.testing.assert_array_equal(first, np.full(n, 6.0))
    np.testing.assert_array_equal(second, np.full(n, 4.0))
    np.testing.assert_array_equal(third, np.full(n, 4.0))
    np.testing.assert_array_equal(a.numpy(), np.full(n, 4.0))


@pytest.mark.parametrize("n", SIZES)
def test_read_before_assign_keeps_old_value_in_computations(n):
    a0 = np.arange(n, dtype=np.float32)
    a, b = gd.Variable(a0), gd.Variable(np.zeros(n, np.float32))

    @gd.function
    def f():
        old = a.read_value()
        a.assign(old * 2)
        a.assign(a * 3)
        b.assign(old + a)              # old is still a0 here, a is 6 * a0
        return old * 1, old + a

    r1, r2 = f()
    np.testing.assert_array_equal(r1, a0)
    np.testing.assert_array_equal(r2, 7 * a0)
    np.testing.assert_array_equal(a.numpy(), 6 * a0)
    np.testing.assert_array_equal(b.numpy(), 7 * a0)


@pytest.mark.parametrize("n", SIZES)
def test_returned_read_before_assign_keeps_old_value(n):
    a0 = np.arange(n, dtype=np.float32)
    a = gd.Variable(a0)

    @gd.function
    def f():
        old = a.read_value()
        a.assign(old + 1)
        return old

    np.testing.assert_array_equal(f(), a0)
    np.testing.assert_array_equal(a.numpy(), a0 + 1)


@pytest.mark.parametrize("n", SIZES)
def test_swap_inside_one_function(n):
    a0 = np.arange(n, dtype=np.float32)
    b0 = -np.arange(n, dtype=np.float32) - 1
    a, b = gd.Variable(a0), gd.Variable(b0)

    @gd.function
    def swap():
        a_old = a.read_value()
        a.assign(b)
        b.assign(a_old)

    swap()
    np.testing.assert_array_equal(a.numpy(), b0)
    np.testing.assert_array_equal(b.numpy(), a0)
    swap()
    np.testing.assert_array_equal(a.numpy(), a0)
    np.testing.assert_array_equal(b.numpy(), b0)

    @gd.function
    def swap_scaled():
        a_old = a.read_value()
        a.assign(b * 2)
        b.assign(a_old * 3)

    swap_scaled()
    np.testing.assert_array_equal(a.numpy(), 2 * b0)
    np.testing.assert_array_equal(b.numpy(), 3 * a0)


def test_assign_in_trace_returns_variable_and_chains():
    v = gd.Variable(np.zeros(2, np.float32))

    @gd.function
    def f(x):
        return v.assign(x).assign_add(x).read_value() * 1

    np.testing.assert_array_equal(f(np.array([1.0, 2.0], np.float32)), [2, 4])
    np.testing.assert_array_equal(v.numpy(), [2, 4])


@pytest.mark.parametrize("value, error", [
    (np.ones(4, np.float32), ValueError), (np.ones(3, np.float64), TypeError)])
def test_in_trace_mismatch_raises(value, error):
    v = gd.Variable(np.zeros(3, np.float32), name="state_var")

    @gd.function
    def f(x):
        v.assign(x)

    with pytest.raises(error, match="state_var"):
        f(value)
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))


@pytest.mark.parametrize("n", SIZES)
def test_failed_trace_changes_no_variable(n):
    a0 = np.arange(n, dtype=np.float32)
    a, b = gd.Variable(a0), gd.Variable(-a0)
    opt = gd.optimizers.SGD(0.1, momentum=0.9)

    @gd.function
    def step(x):
        a.assign(a * 5)
        opt.apply_gradients([(x, a)])
        b.assign(b + np.ones(n + 1, np.float32))   # shape error, after the other writes

    with pytest.raises(ValueError, match=rf"f32\[{n + 1}\]"):
        step(np.ones(n, np.float32))
    np.testing.assert_array_equal(a.numpy(), a0)
    np.testing.assert_array_equal(b.numpy(), -a0)
    assert opt.iterations.numpy() == 0
    assert all(not s.numpy().any() for s in opt.slots().values())
    assert step.trace_count == 0


def test_variable_created_inside_function_from_concrete_value():
    made = []

    @gd.function
    def f(x):
        if not made:
            made.append(gd.Variable(np.full(3, 2.0, np.float32), name="inner"))
        v = made[0]
        v.assign_add(x)
        return v * 1

    np.testing.assert_array_equal(f(np.ones(3, np.float32)), [3, 3, 3])
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), [4, 4, 4])
    assert len(made) == 1 and made[0].name == "inner"
    np.testing.assert_array_equal(made[0].numpy(), [4, 4, 4])


def test_variable_from_symbolic_value_raises_trace_error():
    @gd.function
    def f(x):
        return gd.Variable(x * 2)

    with pytest.raises(gd.TraceError):
        f(np.ones(2, np.float32))

    @gd.function
    def g(x):
        return gd.Variable(lambda: x)

    with pytest.raises(gd.TraceError):
        g(np.ones(2, np.float32))


def test_variable_is_not_a_numpy_array_inside_trace():
    v = gd.Variable(np.ones(2, np.float32), name="vv")

    @gd.function
    def f():
        return np.asarray(v)

    with pytest.raises(gd.TraceError, match="vv"):
        f()


def test_len_and_iteration():
    v = gd.Variable(np.arange(6.0).reshape(3, 2))
    assert len(v) == 3
    rows = list(v)
    assert len(rows) == 3
    np.testing.assert_array_equal(rows[2], [4.0, 5.0])
    with pytest.raises(TypeError):
        len(gd.Variable(1.0))

    @gd.function
    def f():
        return [r * 2 for r in v]

    np.testing.assert_array_equal(np.stack(f()), 2 * np.arange(6.0).reshape(3, 2))
