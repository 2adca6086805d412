"""The fused elementwise kernel (kernels/fused_elementwise.py, runtime/adapters/fused.py):
the generated Numba loop against its numpy twin bit for bit, on values that find the edge
cases (NaN, infinities, signed zeros, huge and tiny numbers), for every member formula, in
float32 and float64; against the members' reference impls; broadcasts, literals, several
outputs, operands the loop does not take, and the compile cache."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import evaluate
from graphdist.kernels import fused_elementwise as fk
from graphdist.kernels.gelu import gelu_ref
from graphdist.ops.core import bind
from graphdist.ops.fused import fused_elementwise_p
from graphdist.ops.math import relu_grad
from graphdist.ops.special import gelu_grad_p
from graphdist.runtime.adapters.fused import fused_elementwise_cpu, fused_elementwise_numpy
from graphdist.runtime import warmup
from graphdist.runtime.adapters.registry import ENTRIES

M, N = 64, 96


@pytest.fixture(autouse=True)
def _small_values_fuse(monkeypatch):
    """These tests are about the kernels, on small values: the pass fuses them here (its
    size rule is tests/passes/test_fuse_elementwise.py's business)."""
    from graphdist.passes import fuse_elementwise

    monkeypatch.setattr(fuse_elementwise, "MIN_ELEMENTS", 4096)


def edge_values(shape, dtype, seed):
    """Normal numbers with NaN, +-inf, +-0, huge, tiny and subnormal values mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    info = np.finfo(dtype)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, info.max, -info.max, info.tiny,
                        info.tiny / 4, 1e30, -1e30, 5.0, -5.0, 4.84, -4.84], dtype)
    flat = x.reshape(-1)
    where = rng.choice(flat.size, size=flat.size // 8, replace=False)
    flat[where] = rng.choice(special, size=where.size)
    return x


def fused_node(fn, *args):
    """The one fused_elementwise node fn's program has, traced on args."""
    f = gd.function(fn)
    f(*args)
    (node,) = [e for e in f.replicated_graph.eqns if e.op is fused_elementwise_p]
    return node


def run_both(node, args):
    """The kernel's and the twin's outputs for `node` on `args`."""
    params = dict(node.params)
    outs = []
    for form in (fused_elementwise_cpu, fused_elementwise_numpy):
        out = tuple(np.full(v.ty.shape, 7, v.ty.dtype) for v in node.outputs)
        with np.errstate(all="ignore"):      # as a compiled program runs (edge values)
            form(out if len(out) > 1 else out[0], *args, **params)
        outs.append(out)
    return outs


def assert_same_bits(a, b):
    """Equal bit for bit (signed zeros included), except that a NaN matches any NaN: which
    operand's NaN an add of two NaNs passes on, and so its sign bit, is the compiler's
    choice (LLVM may swap the operands of a commutative op), in numpy's loops too."""
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        nan = np.isnan(x)
        np.testing.assert_array_equal(nan, np.isnan(y))
        np.testing.assert_array_equal(x[~nan].view(f"u{x.itemsize}"),
                                      y[~nan].view(f"u{y.itemsize}"))


CHAINS = {
    "add sub mul div neg": lambda x, y: (x + y) * (x - y) / y + (-x),
    "abs square sqrt": lambda x, y: gd.sqrt(gd.abs(x)) * gd.square(y) + x,
    "maximum minimum": lambda x, y: gd.maximum(x, y) * 2.0 + gd.minimum(y, x),
    "relu": lambda x, y: gd.relu(x) * y + gd.relu(-y),
    "where comparisons": lambda x, y: gd.where(x > y, x, y * 0.5) + gd.where(
        gd.logical_not(x <= 0.0), x, -y),
    "clip": lambda x, y: gd.clip_by_value(x, -1.5, 2.0) * y - x,
    "gelu erf": lambda x, y: gd.nn.gelu(x * y, approximate=False) + y,
    "gelu tanh": lambda x, y: gd.nn.gelu(x + y, approximate=True) * y,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_the_kernel_gives_the_twin_s_bits_on_edge_values(chain, dtype):
    x, y = edge_values((M, N), dtype, 1), edge_values((M, N), dtype, 2)
    node = fused_node(CHAINS[chain], x, y)
    with np.errstate(all="ignore"):
        kernel, twin = run_both(node, [x, y])
    assert_same_bits(kernel, twin)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_of_relu_and_gelu_give_the_twin_s_bits(dtype):
    """relu_grad and gelu_grad in both forms, as the tape emits them, with a scale after."""
    x, ct = edge_values((M, N), dtype, 3), edge_values((M, N), dtype, 4)
    for grad in (lambda c, x: bind(gelu_grad_p, c, x, approximate=True) * 0.5 + c,
                 lambda c, x: bind(gelu_grad_p, c, x, approximate=False) - x,
                 lambda c, x: relu_grad(c * 2.0, x) + x):
        node = fused_node(grad, ct, x)
        with np.errstate(all="ignore"):
            kernel, twin = run_both(node, [ct, x])
        assert_same_bits(kernel, twin)


def test_the_twin_is_the_members_reference_where_their_impls_are_their_kernels():
    """Arithmetic, relu and where: the twin's bits are the reference interpreter's (the
    members' numpy impls); gelu's kernel (Eigen's rational erf) is within 1.2e-6 of it."""
    x, y = edge_values((M, N), np.float32, 5), edge_values((M, N), np.float32, 6)
    node = fused_node(CHAINS["where comparisons"], x, y)
    with np.errstate(all="ignore"):
        kernel, _ = run_both(node, [x, y])
        (ref,) = evaluate(dict(node.params)["body"], x, y)
    np.testing.assert_array_equal(kernel[0], ref)
    x = np.linspace(-8, 8, M * N, dtype=np.float32).reshape(M, N)
    node = fused_node(lambda x, y: gd.nn.gelu(x, approximate=False) + y, x, x)
    kernel, _ = run_both(node, [x, x])
    ref = gelu_ref(x.astype(np.float64), False) + x         # the float64 spec (math.erfc)
    np.testing.assert_allclose(kernel[0], ref, rtol=2e-7, atol=1.2e-6)


def test_bias_rows_scalars_and_literals():
    x = edge_values((8, 16, 32), np.float32, 7)
    b = edge_values((1, 1, 32), np.float32, 8)
    rows = edge_values((32,), np.float32, 9)
    s = np.ones((1, 1), np.float32) * np.float32(0.25)
    node = fused_node(lambda x, b, r, s: (x + b) * r - s + 3.0, x, b, rows, s)
    assert [e.op.name for e in dict(node.params)["body"].eqns] == ["add", "mul", "sub", "add"]
    kernel, twin = run_both(node, [x, b, rows, s])
    assert_same_bits(kernel, twin)
    with np.errstate(all="ignore"):
        want = (x + b) * rows - s + np.float32(3)
    np.testing.assert_array_equal(kernel[0], want)


def test_several_outputs_and_a_transposed_input():
    x, y = edge_values((M, N), np.float32, 10), edge_values((N, M), np.float32, 11)

    def fn(x, y):
        h = x * gd.transpose(y) + 1.0
        return gd.relu(h), gd.reduce_sum(h)

    node = fused_node(fn, x, y)
    assert len(node.outputs) == 2
    args = [x, y.T] if node.inputs[1].ty.shape == (M, N) else [x, y]
    with np.errstate(all="ignore"):
        kernel, twin = run_both(node, args)
    assert_same_bits(kernel, twin)


def test_the_entry_is_exact_and_its_twin_is_the_adapter_s():
    entry = ENTRIES[("cpu", "fused_elementwise")]
    assert entry.exact and entry.numpy_out is fused_elementwise_numpy


def test_one_compile_per_cluster_text():
    x = np.ones((M, N), np.float32)
    a = fused_node(lambda x, y: (x * y + 1.0) * 0.5, x, x)
    b = fused_node(lambda u, v: (u * v + 1.0) * 0.5, x, x)
    assert dict(a.params)["formula"] == dict(b.params)["formula"]
    run_both(a, [x, x])
    count = len(fk._compiled)
    run_both(b, [x, x])
    assert len(fk._compiled) == count


def test_the_generated_source_reads_rows_by_column_and_has_no_fastmath():
    src = fk.kernel_source([("add", {}, [("x", 0), ("x", 1)], ("t", 0)),
                            ("mul", {}, [("t", 0), ("k", 0)], ("t", 1))],
                           [fk.FULL, fk.ROW], 1, [("t", 1)], ["float32", "float32"])
    assert "fastmath=False" in src and "prange(rows)" in src
    assert "x1[i]" in src and "x0r[i]" in src and "o0r[i] = t1" in src
    with pytest.raises(KeyError, match="exp"):
        fk.kernel_source([("exp", {}, [("x", 0)], ("t", 0))], [fk.FULL], 0, [("t", 0)],
                         ["float32"])


def test_without_a_writable_cache_folder_the_kernel_compiles_in_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv("GRAPHDIST_FUSED_DIR", str(blocked))
    monkeypatch.setattr(fk, "_compiled", {})
    x, y = edge_values((M, N), np.float32, 12), edge_values((M, N), np.float32, 13)
    node = fused_node(CHAINS["relu"], x, y)
    kernel, twin = run_both(node, [x, y])
    assert_same_bits(kernel, twin)
    assert len(fk._compiled) == 1


def test_a_strided_input_to_gelu_gives_the_unfused_program_s_bits(monkeypatch):
    """A transposed input: `gelu(t(x))` directly (unfused, gelu's kernel refuses the
    strided operand and the op's float64 reference runs; fused, the node runs its twin,
    which does the same), and `gelu(t(x) * 1.0)` (the product in C order, as the unfused
    program's buffer holds it, so gelu's rational form runs in both)."""
    from graphdist import pipeline

    x = edge_values((N, M), np.float32, 14)
    y = edge_values((M, N), np.float32, 15)
    for fn in (lambda x, y: gd.nn.gelu(gd.transpose(x), approximate=True) * y,
               lambda x, y: gd.nn.gelu(gd.transpose(x) * 1.0, approximate=True) * y):
        fused = gd.function(fn)
        with monkeypatch.context() as m:
            m.setattr(pipeline, "elementwise_fusion", lambda: [])
            want = gd.function(fn)(x, y)
        for _ in range(2):          # the first call's twin, then the kernel's path
            np.testing.assert_array_equal(fused(x, y), want)
            warmup.wait()
        assert [e for e in fused.replicated_graph.eqns if e.op is fused_elementwise_p]


def test_columns_beside_rows():
    """(x - mean) / std * gamma + beta, the statistics (m, 1) columns, gamma and beta rows."""
    x = edge_values((4, 32, N), np.float32, 16)
    mean = edge_values((4, 32, 1), np.float32, 17)
    std = np.abs(edge_values((4, 32, 1), np.float32, 18)) + np.float32(0.5)
    gamma, beta = edge_values((N,), np.float32, 19), edge_values((1, N), np.float32, 20)
    node = fused_node(lambda x, m, s, g, b: (x - m) / s * g + b, x, mean, std, gamma, beta)
    assert dict(node.params)["members"] == ("sub", "div", "mul", "add")
    kernel, twin = run_both(node, [x, mean, std, gamma, beta])
    assert_same_bits(kernel, twin)
    with np.errstate(all="ignore"):
        want = (x - mean) / std * gamma + beta
    np.testing.assert_array_equal(kernel[0], want)


def test_the_source_names_its_callees_version_and_only_gelu_loops_are_heavy(monkeypatch):
    """A change to gelu.py changes every generated source (so its file and Numba's cache
    entry), and a loop without gelu runs on one thread below 16 MiB touched."""
    plain = fk.kernel_source([("add", {}, [("x", 0), ("x", 1)], ("t", 0))], [fk.FULL, fk.FULL],
                             0, [("t", 0)], ["float32"])
    assert plain.startswith("# callees ") and "_gelu" not in plain.rpartition("def kernel(")[2]
    monkeypatch.setattr(fk, "_versions", ["callees changed"])
    assert fk.kernel_source([("add", {}, [("x", 0), ("x", 1)], ("t", 0))],
                            [fk.FULL, fk.FULL], 0, [("t", 0)], ["float32"]) != plain
