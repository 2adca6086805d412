"""Issue 21, ops: out-of-range sparse indices raise the same error on every path and change
nothing; errors name the function the user called (softmax, stack, embedding_lookup,
cast), with the user's line; 0-d gather indices, huge indices and one_hot's depth; `//`
and `%` (floor_divide, mod) on traced tensors as numpy computes them."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir.types import as_dtype
from graphdist.runtime import warmup

HERE = os.path.basename(__file__)


def _names_line(message: str, how: str, code: str) -> bool:
    """Does the error name the user's line, `how` ('traced at', 'while tracing') then
    'test_trust_ops.py:<n>  <code...>', with n the line of this file that holds `code`?"""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    found = re.search(rf"{how}  {re.escape(HERE)}:(\d+)  (.*)", message)
    return found is not None and code in found.group(2) and \
        code in lines[int(found.group(1)) - 1]


# ---------------------------------------------------------------- sparse indices, every path

MODES = ["numpy forms", "kernels", "unfused"]


@contextlib.contextmanager
def _mode(mode: str, monkeypatch):
    """Run a step's first calls on the numpy forms of its kernels (their warm-up held back,
    as while they load in the background), on the kernels, or unfused (no fused kernel)."""
    old_bg, old_fused = gd.config.background_compile(), gd.config.fused_kernels()
    if mode == "numpy forms":
        monkeypatch.setattr(warmup, "_loaded", set())       # as in a fresh process
    gd.config.set_background_compile(mode == "numpy forms")
    gd.config.set_fused_kernels(mode != "unfused")
    try:
        with warmup.paused() if mode == "numpy forms" else contextlib.nullcontext():
            yield
    finally:
        gd.config.set_background_compile(old_bg)
        gd.config.set_fused_kernels(old_fused)
        warmup.wait()


def _assert_ran_on(mode: str, step) -> None:
    """The step's programs really ran the numpy forms (their kernels deferred) or not."""
    programs = [p for c in step._cache.values() for p in c.executable.programs]
    assert any(getattr(p, "warming", False) for p in programs) == (mode == "numpy forms")


def _state(variables) -> list:
    """Every replica's copy of every variable, as arrays."""
    return [np.array(c) for v in variables for c in getattr(v, "values", [v.numpy()])]


def _assert_unchanged(before, variables):
    for a, b in zip(before, _state(variables)):
        np.testing.assert_array_equal(a, b)


def _embedding_step(optimizer: str, replicas: int, sparse_gradient_by_hand: bool):
    """A step that only applies a table's gradient: the forward lookup is dead code, so only
    the gradient's path can check the ids. Returns (step, table, optimizer)."""
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)]) \
        if replicas > 1 else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        table = gd.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
        opt = {"sgd": lambda: gd.optimizers.SGD(0.1),
               "momentum": lambda: gd.optimizers.SGD(0.1, momentum=0.9),
               "adam": lambda: gd.optimizers.Adam(0.1)}[optimizer]()

    def replica_fn(ids):
        if sparse_gradient_by_hand:
            grad = gd.IndexedSlices(ids, gd.ones_like(gd.cast(ids, "float32"))[:, None]
                                    * np.ones(3, np.float32), (4, 3))
        else:
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(gd.nn.embedding_lookup(table, ids))
            grad = tape.gradient(loss, table)
        opt.apply_gradients([(grad, table)])

    @gd.function
    def step(ids):
        if strategy is None:
            return replica_fn(ids)
        return strategy.run(replica_fn, args=(ids,))
    return step, table, opt


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("mode", MODES)
def test_a_negative_id_in_a_sparse_gradient_raises_the_same_error_and_changes_nothing(
        mode, optimizer, replicas, monkeypatch):
    """Before: SGD's numpy form (the first calls, and fused=False on every call) added the
    row of id -1 into the table's last row, and the kernel raised naming sum_duplicates and
    2**63-1 rows."""
    with _mode(mode, monkeypatch):
        step, table, opt = _embedding_step(optimizer, replicas, sparse_gradient_by_hand=False)
        step(np.array([0, 1]))                 # a good step first: slots exist, kernels load
        _assert_ran_on(mode, step)
        variables = [table, *opt.variables()]
        before = _state(variables)
        for _ in range(3):                     # the same error on every call
            with pytest.raises(IndexError) as info:
                step(np.array([0, -1]))
            message = str(info.value)
            assert message.startswith("embedding_lookup: index -1 at 1 of the indices (2,) is "
                                      "out of range for 4 rows"), message
            assert _names_line(message, "traced at", "gd.nn.embedding_lookup(table, ids)")
            _assert_unchanged(before, variables)
        step(np.array([3, 3]))                 # and the step still works
        assert opt.iterations.numpy() == 2


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("mode", MODES)
def test_a_user_built_indexed_slices_out_of_range_raises_with_the_table_s_rows(
        mode, optimizer, replicas, monkeypatch):
    """Its indices are checked where it is merged, densified or applied: the message shows
    the table's 4 rows (not 2**63-1), on every path, before anything changes."""
    with _mode(mode, monkeypatch):
        step, table, opt = _embedding_step(optimizer, replicas, sparse_gradient_by_hand=True)
        step(np.array([0, 1]))
        _assert_ran_on(mode, step)
        variables = [table, *opt.variables()]
        before = _state(variables)
        for bad in ([0, -1], [9, 1]):
            with pytest.raises(IndexError) as info:
                step(np.array(bad))
            message = str(info.value)
            value = min(bad) if min(bad) < 0 else max(bad)
            assert message.startswith(f"IndexedSlices: index {value} at ") and \
                "is out of range for 4 rows (expected 0 <= index < 4" in message, message
            assert str(2**63 - 1) not in message
            _assert_unchanged(before, variables)


def test_merged_replicas_check_embedding_ids_too():
    """The check has a batching rule: merged replicas check the stacked ids."""
    gd.config.set_device_concurrency("merged")
    try:
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        table = np.arange(12, dtype=np.float32).reshape(4, 3)
        step = gd.function(lambda ids: strategy.run(
            lambda i: gd.nn.embedding_lookup(table, i) * 2.0, args=(ids,)))
        out = step(gd.PerReplica((np.array([0, 3]), np.array([1, 2]))))
        assert step.replicated_graph.merged
        for k, ids in enumerate(([0, 3], [1, 2])):
            np.testing.assert_array_equal(out.values[k], table[ids] * 2)
        with pytest.raises(IndexError, match=r"^embedding_lookup: index -2 .* for 4 rows"):
            step(gd.PerReplica((np.array([0, 3]), np.array([1, -2]))))
    finally:
        gd.config.set_device_concurrency("auto")


def test_an_indexed_slices_built_eagerly_checks_its_indices():
    with pytest.raises(IndexError, match=r"IndexedSlices: index -1 at 0 .* for 4 rows"):
        gd.IndexedSlices(np.array([-1]), np.ones((1, 2)), (4, 2))
    s = gd.IndexedSlices(np.array([3, 0]), np.ones((2, 2)), (4, 2))
    np.testing.assert_array_equal(np.asarray(s), [[1, 1], [0, 0], [0, 0], [1, 1]])


def test_the_row_kernels_refuse_a_negative_index_and_write_nothing():
    """kernels/sparse.py called directly: Numba would wrap -1 into the last row."""
    from graphdist.kernels.sparse import add_scaled_rows_cpu, sum_duplicates_cpu

    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="index -1 is negative"):
        add_scaled_rows_cpu(table, np.array([0, -1]), np.ones((2, 2), np.float32))
    with pytest.raises(IndexError, match="index 4 is out of range for 4 rows"):
        add_scaled_rows_cpu(table, np.array([4]), np.ones((1, 2), np.float32))
    assert not table.any()
    outs = (np.zeros(2, np.int64), np.zeros((2, 2), np.float32))
    with pytest.raises(IndexError, match="index -3 is negative"):
        sum_duplicates_cpu(outs, np.array([1, -3]), np.ones((2, 2), np.float32))


def test_the_forward_gather_and_its_gradient_agree_on_a_negative_index():
    """numpy's take wraps -1 to the last row; gather raises (TF's CPU kernel does), eagerly
    and when the step runs, and so does the gradient path (above)."""
    table = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    with pytest.raises(IndexError, match=r"^gather: index -1 at 0 of the indices \(1,\)"):
        gd.gather(table, np.array([-1]))
    step = gd.function(lambda t, i: gd.gather(t, i))
    with pytest.raises(IndexError, match=r"^gather: index -1 at 0 of the indices"):
        step(table, np.array([-1]))


# ---------------------------------------------------------------- 0-d and huge indices


def test_a_0d_out_of_range_gather_index_raises_index_error_naming_gather():
    """Before: a ValueError from numpy ("Calling nonzero on 0d arrays")."""
    table = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(gd.gather(table, np.array(3)), table[3])
    for index in (np.array(9), np.array(-1), 9, -1):
        with pytest.raises(IndexError, match=rf"^gather: index {int(index)} is out of range "
                                             r"for 4 rows \(expected 0 <= index < 4\)$"):
            gd.gather(table, index)
    step = gd.function(lambda t, i: gd.gather(t, i))
    np.testing.assert_array_equal(step(table, np.array(2)), table[2])
    with pytest.raises(IndexError) as info:
        step(table, np.array(4))
    assert str(info.value).startswith("gather: index 4 is out of range for 4 rows")
    assert _names_line(str(info.value), "traced at", "gd.function(lambda t, i: gd.gather(")


HUGE_INDEX_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import graphdist as gd

    gd.config.set_background_compile(False)          # the kernels from the first call
    table = gd.Variable(np.zeros((4, 3), np.float32))
    opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(ids):                        # the forward gather is dead code: only the
        with gd.GradientTape() as tape:   # gradient's path sees the ids
            loss = gd.reduce_sum(gd.gather(table, ids))
        opt.apply_gradients([(tape.gradient(loss, table), table)])

    step(np.array([1, 2]))                # compile and load everything first
    gd.gather(table.numpy(), np.array([1]))
    before = table.numpy().copy()

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    baseline = vm_bytes()
    room = 1 << 30                        # 1 GiB above what the process holds now
    resource.setrlimit(resource.RLIMIT_AS, (baseline + room, baseline + room))
    print("baseline", baseline, flush=True)
    for name, call in [("eager", lambda: gd.gather(table.numpy(), np.array([2**31]))),
                       ("step", lambda: step(np.array([0, 2**31])))]:
        try:
            call()
            print(name, "no error")
        except IndexError as e:
            print(name, "IndexError", str(e).splitlines()[0])
        except MemoryError as e:
            print(name, "MemoryError", e)
    print("table unchanged", bool((table.numpy() == before).all()))
""")


def test_a_huge_index_raises_at_once_instead_of_allocating(tmp_path):
    """Index 2**31 into a 4-row table: the gradient's duplicate-merging kernel sized a slot
    table by the largest index (16 GiB of int64). Run in a child limited to 1 GiB above its
    own baseline address space, measured after it has compiled everything."""
    script = tmp_path / "huge_index.py"
    script.write_text(HUGE_INDEX_CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert int(lines["baseline"]) > 0
    for name in ("eager", "step"):
        assert lines[name].startswith(f"IndexError gather: index {2**31} at "), lines[name]
        assert "out of range for 4 rows" in lines[name]
    assert lines["table"] == "unchanged True"


def test_one_hot_depth_must_not_be_negative_and_zero_is_an_empty_axis():
    with pytest.raises(ValueError, match=r"^one_hot: depth must be >= 0, got -1"):
        gd.one_hot(np.array([0, 1]), depth=-1)
    with pytest.raises(ValueError) as info:
        gd.function(lambda i: gd.one_hot(i, -1))(np.array([0, 1]))
    assert str(info.value).startswith("one_hot: depth must be >= 0, got -1")
    assert _names_line(str(info.value), "while tracing", "gd.one_hot(i, -1)")
    for call in (lambda i: gd.one_hot(i, 0), gd.function(lambda i: gd.one_hot(i, 0))):
        out = call(np.array([[0, 1, 2]]))
        assert out.shape == (1, 3, 0) and out.dtype == np.float32    # as TF


# ---------------------------------------------------------------- errors name the user's op


def _traced(fn, *args):
    return gd.function(fn)(*args)


def _eager(fn, *args):
    return fn(*args)


F32 = np.ones((2, 3), np.float32)
BAD_CALLS = [
    # (user's function, call, args, error, message start)
    ("softmax", lambda x: gd.nn.softmax(x), (np.float32(1),), gd.ShapeError,
     "softmax: logits need at least one axis, got shape ()"),
    ("softmax", lambda x: gd.nn.softmax(x, axis=2), (F32,), gd.ShapeError,
     "softmax: axis 2 is out of range for the operand of shape (2, 3)"),
    ("log_softmax", lambda x: gd.nn.log_softmax(x), (np.array([1, 2]),), TypeError,
     "log_softmax: expected a float tensor, got i64[2]"),
    ("stack", lambda a, b: gd.stack([a, b]), (F32, F32.astype(np.float64)), TypeError,
     "stack: every value must have one dtype, got float32, float64"),
    ("embedding_lookup", lambda t, i: gd.nn.embedding_lookup(t, i), (F32, np.array([0.5])),
     TypeError, "embedding_lookup: indices must be integers, got f64[1]"),
    ("embedding_lookup", lambda t, i: gd.nn.embedding_lookup(t, i),
     (np.float32(1), np.array([0])), gd.ShapeError,
     "embedding_lookup: params must have rank >= 1, got shape () (in gather, inside "
     "embedding_lookup)"),
    ("cast", lambda x: gd.cast(x, "complex64"), (F32,), TypeError,
     "cast: unsupported dtype complex64; use one of"),
    ("cast", lambda x: gd.cast(x, "no such type"), (F32,), TypeError,
     "cast: unknown dtype 'no such type'"),
]


@pytest.mark.parametrize("run", [_eager, _traced], ids=["eager", "traced"])
@pytest.mark.parametrize("name,fn,args,error,start", BAD_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_errors_name_the_function_the_user_called_and_the_line(run, name, fn, args, error,
                                                                 start):
    """Before: reduce_max (softmax of a scalar or a bad axis), exp (log_softmax of ints),
    concat (stack's dtypes), gather (embedding ids) and no name at all (cast)."""
    with pytest.raises(error) as info:
        run(fn, *args)
    message = str(info.value)
    assert message.startswith(start), message
    if run is _traced:                     # the lambda's line, where the user called it
        assert _names_line(message, "while tracing", f"{name}("), message


def test_cast_to_float64_casts_what_has_no_dtype_and_names_itself():
    """`getattr(x, 'dtype', None) == float64` was True for None (np.dtype(None) is
    float64): a list, a Python int or a PerReplica came back unchanged, uncast."""
    out = gd.cast([1, 2], "float64")
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    assert np.asarray(gd.cast(3, "float64")).dtype == np.float64
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2, np.float32))
    with pytest.raises(TypeError, match="^cast: a PerReplica used as an array"):
        gd.cast(values, "float64")
    with pytest.raises(TypeError, match="^cast: dtype must be given, got None"):
        gd.cast(np.ones(2), None)


def test_an_out_of_range_embedding_id_names_embedding_lookup_when_the_step_runs():
    table = np.ones((4, 2), np.float32)
    step = gd.function(lambda t, i: gd.nn.embedding_lookup(t, i))
    with pytest.raises(IndexError) as info:
        step(table, np.array([[1, 7]]))
    assert str(info.value).startswith("embedding_lookup: index 7 at (0, 1) of the indices "
                                      "(1, 2) is out of range for 4 rows"), str(info.value)
    with pytest.raises(IndexError, match="^embedding_lookup: index 7 "):
        gd.nn.embedding_lookup(table, np.array([7]))


def test_user_op_names_errors_by_the_outermost_marked_function():
    from graphdist.ops.naming import called_as, user_op

    @user_op("inner")
    def inner(x):
        assert called_as("default") == "outer"
        raise ValueError("reshape: cannot reshape")

    @user_op("outer")
    def outer(x):
        return inner(x)

    with pytest.raises(ValueError, match=r"^outer: cannot reshape \(in reshape, inside outer\)$"):
        outer(1)
    assert called_as("default") == "default"           # nothing marked is running now

    @user_op("mine")
    def already_named():
        raise gd.ShapeError("mine: bad shape\n  while tracing  here")

    with pytest.raises(gd.ShapeError, match=r"^mine: bad shape\n  while tracing  here$"):
        already_named()


# ---------------------------------------------------------------- `//` and `%`

DIVISION_DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]


def _signed_operands(dtype: str):
    """x and y over every sign combination, y never 0; floats with fractions, exact in
    float16 and bfloat16 (multiples of 1/4 below 64)."""
    rng = np.random.default_rng(5)
    x = rng.integers(-40, 41, (6, 8)) / (4 if dtype.startswith(("float", "bfloat")) else 1)
    y = rng.choice([-7, -3, -2, -1, 1, 2, 3, 7], (8,)) * \
        (1.25 if dtype.startswith(("float", "bfloat")) else 1)
    return x.astype(as_dtype(dtype)), y.astype(as_dtype(dtype))


def _assert_numpy_equal(got, want):
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("dtype", DIVISION_DTYPES)
def test_floor_divide_and_mod_match_numpy_eagerly_and_traced(dtype):
    x, y = _signed_operands(dtype)
    want = {"x // y": np.floor_divide(x, y), "x % y": np.remainder(x, y),
            "x // 3": np.floor_divide(x, x.dtype.type(3)),
            "7 % y": np.remainder(y.dtype.type(7), y)}

    def by_function(x, y):
        return {"x // y": gd.floor_divide(x, y), "x % y": gd.mod(x, y),
                "x // 3": gd.floor_divide(x, 3), "7 % y": gd.mod(7, y)}

    def by_operator(x, y):
        return {"x // y": x // y, "x % y": x % y, "x // 3": x // 3, "7 % y": 7 % y}
    for results in (by_function(x, y), gd.function(by_function)(x, y),
                    gd.function(by_operator)(x, y)):
        for key, value in want.items():
            _assert_numpy_equal(results[key], value)
    np.testing.assert_array_equal(                      # x == (x // y) * y + x % y
        (want["x // y"] * y + want["x % y"]).astype(np.float64), x.astype(np.float64))


def test_a_variable_takes_floor_divide_and_mod_eagerly():
    v = gd.Variable(np.array([-7, 7, 8], np.int64))
    np.testing.assert_array_equal(v // 2, [-4, 3, 4])
    np.testing.assert_array_equal(v % -3, [-1, -2, -1])
    np.testing.assert_array_equal(20 // v, [-3, 2, 2])


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_floor_divide_and_mod_under_a_2_replica_mirrored_strategy(dtype):
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    shards = [np.array([-7.5, 7.5, 3.0, -3.0]).astype(dtype),
              np.array([-1, 9, -10, 0]).astype(dtype)]
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: shards[ctx.replica_id_in_sync_group])
    y = np.array([2, -2, 3, -3] if dtype == "int32" else [2, -2, 2.5, -2.5], dtype)
    with strategy.scope():
        divisors = gd.Variable(y)             # a mirrored variable as the divisor

    @gd.function
    def step(x):
        return strategy.run(lambda x: (x // 2, x % -2, x // divisors, gd.mod(x, divisors)),
                            args=(x,))

    results = step(xs)
    two = np.asarray(2, dtype)
    for k, x in enumerate(shards):
        for got, want in zip(results, [np.floor_divide(x, two), np.remainder(x, -two),
                                       np.floor_divide(x, y), np.remainder(x, y)]):
            _assert_numpy_equal(got.values[k], want)


def _finite_difference(f, args, k, eps=1e-6):
    """d sum(f) / d args[k], central differences, element by element."""
    grad = np.zeros_like(args[k])
    for i in np.ndindex(args[k].shape):
        hi, lo = [a.copy() for a in args], [a.copy() for a in args]
        hi[k][i] += eps
        lo[k][i] -= eps
        grad[i] = (f(*hi).sum() - f(*lo).sum()) / (2 * eps)
    return grad


def test_mod_and_floor_divide_gradients_match_finite_differences():
    """mod: d/dx = 1, d/dy = -floor(x / y) (TF's FloorMod gradient); floor_divide: 0.
    Points away from the jumps (x / y never within 1e-3 of an integer)."""
    rng = np.random.default_rng(3)
    y = rng.uniform(0.5, 3.0, (3, 4)) * rng.choice([-1.0, 1.0], (3, 4))
    x = (rng.integers(-5, 6, (3, 4)) + rng.uniform(0.1, 0.9, (3, 4))) * y
    _, (gx, gy) = gd.value_and_grad(lambda x, y: gd.reduce_sum(x % y), (0, 1))(x, y)
    np.testing.assert_allclose(gx, _finite_difference(np.remainder, (x, y), 0), atol=1e-6)
    np.testing.assert_allclose(gy, _finite_difference(np.remainder, (x, y), 1), atol=1e-6)
    np.testing.assert_array_equal(gx, np.ones_like(x))
    np.testing.assert_array_equal(gy, -np.floor(x / y))
    _, (gx, gy) = gd.value_and_grad(lambda x, y: gd.reduce_sum(x // y), (0, 1))(x, y)
    np.testing.assert_array_equal(gx, _finite_difference(np.floor_divide, (x, y), 0))
    np.testing.assert_array_equal(gy, np.zeros_like(y))
    # a broadcast divisor sums its gradient: -sum over rows of floor(x / y)
    row = y[0]
    _, g_row = gd.value_and_grad(lambda y: gd.reduce_sum(x % y))(row)
    np.testing.assert_allclose(g_row, -np.floor(x / row).sum(axis=0))


@pytest.mark.parametrize("op", ["//", "%"])
def test_integer_division_by_zero_raises_instead_of_numpy_s_silent_zero(op):
    """numpy gives 0 (with a warning that a compiled step, run with warnings off, never
    shows); Python and TF's CPU kernels raise."""
    name = {"//": "floor_divide", "%": "mod"}[op]
    fn = {"//": lambda x, y: x // y, "%": lambda x, y: x % y}[op]
    x, y = np.array([5, -5, 6], np.int32), np.array([2, 0, 3], np.int32)
    with pytest.raises(ZeroDivisionError, match=rf"^{name}: integer division by zero at 1 of "
                                                r"the divisor \(3,\) \(1 of 3 are 0\)"):
        {"//": gd.floor_divide, "%": gd.mod}[op](x, y)
    step = gd.function(fn)
    step(x, y + 1)
    with pytest.raises(ZeroDivisionError) as info:
        step(x, y)
    assert str(info.value).startswith(f"{name}: integer division by zero at 1")
    assert _names_line(str(info.value), "traced at", "lambda x, y: x " + op)
    with pytest.raises(ZeroDivisionError, match=f"^{name}: integer division by zero;"):
        step(x, np.int32(0))


def test_float_division_by_zero_follows_numpy():
    x, y = np.array([1.0, -1.0, 0.0], np.float32), np.zeros(3, np.float32)
    quotient, remainder = gd.function(lambda x, y: (x // y, x % y))(x, y)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(quotient, np.floor_divide(x, y))
        np.testing.assert_array_equal(remainder, np.remainder(x, y))


def test_floor_divide_refuses_bool_and_mixed_dtypes():
    with pytest.raises(TypeError, match="^floor_divide: expected int or float tensors"):
        gd.floor_divide(np.array([True]), np.array([True]))
    with pytest.raises(TypeError, match="^mod: dtypes differ"):
        gd.function(lambda x, y: x % y)(np.ones(2, np.float32), np.ones(2, np.int32))
