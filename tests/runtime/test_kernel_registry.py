"""The kernel registry (runtime/kernel_table.py, runtime/adapters/): one entry per (device
kind, op), registered beside its adapter, and the lookup policy that picks a form from it.

The policy is pinned against the five tables it replaced (issue 22, item 2), written out
below as data: for every op, device kind, dtype and flag combination, the lookups return
the function those tables gave. A kernel registered from a test is what programs run.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir.types import ArrayType
from graphdist.ops import OPS
from graphdist.runtime import kernel_table, numpy_updates
from graphdist.runtime.adapters import collectives, nn, optim, sparse

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- the tables it replaced
# KERNELS, NUMPY_KERNELS, OUT_KERNELS, NUMPY_OUT_KERNELS and EXACT_FALLBACK as they stood
# before the registry, each function named by the module that holds it now.

OLD_KERNELS = {
    ("cpu", "sgd_update"): optim.sgd_cpu,
    ("cpu", "sparse_sgd_update"): optim.sparse_sgd_cpu,
    ("cpu", "sgd_momentum_update"): optim.momentum_cpu,
    ("cpu", "adam_update"): optim.adam_cpu,
    ("cpu", "sgd_multi_update"): optim.sgd_multi_cpu,
    ("cpu", "sgd_momentum_multi_update"): optim.momentum_multi_cpu,
    ("cpu", "adam_multi_update"): optim.adam_multi_cpu,
    ("cpu", "host_reduce_update"): collectives.reduce_update_cpu,
    ("gpu", "sgd_update"): optim.sgd_gpu,
    ("gpu", "sgd_momentum_update"): optim.momentum_gpu,
    ("gpu", "adam_update"): optim.adam_gpu,
    ("gpu", "sgd_multi_update"): optim.sgd_multi_gpu,
    ("gpu", "sgd_momentum_multi_update"): optim.momentum_multi_gpu,
    ("gpu", "adam_multi_update"): optim.adam_multi_gpu,
    ("gpu", "nccl_all_reduce"): collectives.nccl_all_reduce_gpu,
}
OLD_NUMPY_KERNELS = {
    ("cpu", "sgd_update"): numpy_updates.sgd,
    ("cpu", "sgd_momentum_update"): numpy_updates.momentum,
    ("cpu", "adam_update"): numpy_updates.adam,
    ("cpu", "sgd_multi_update"): numpy_updates.sgd_multi,
    ("cpu", "sgd_momentum_multi_update"): numpy_updates.momentum_multi,
    ("cpu", "adam_multi_update"): numpy_updates.adam_multi,
    ("cpu", "host_reduce_update"): numpy_updates.reduce_update,
}
OLD_OUT_KERNELS = {
    ("cpu", "host_all_reduce"): collectives.host_all_reduce_cpu,
    ("cpu", "where"): nn.where_cpu,
    ("cpu", "relu_grad"): nn.relu_grad_cpu,
    ("cpu", "max_pool2d"): nn.max_pool2d_cpu,
    ("cpu", "max_pool2d_grad"): nn.max_pool2d_grad_cpu,
    ("cpu", "conv2d_backprop_input"): nn.conv2d_backprop_input_cpu,
    ("cpu", "gelu"): nn.gelu_cpu,
    ("cpu", "gelu_grad"): nn.gelu_grad_cpu,
    ("cpu", "layer_norm"): nn.layer_norm_cpu,
    ("cpu", "layer_norm_grad"): nn.layer_norm_grad_cpu,
    ("cpu", "softmax"): nn.softmax_cpu,
    ("cpu", "softmax_grad"): nn.softmax_grad_cpu,
    ("cpu", "scatter_rows"): sparse.scatter_rows_cpu,
    ("cpu", "sum_duplicates"): sparse.sum_duplicates_cpu,
}
OLD_NUMPY_OUT_KERNELS = {
    # the input gradient's twin splits the batch as its kernel does (device/threads.py
    # split_batch), so it is a function of its own, no longer the op's impl
    ("cpu", "conv2d_backprop_input"): nn._input_grad_numpy,
    ("cpu", "gelu"): nn.gelu_numpy,
    ("cpu", "gelu_grad"): nn.gelu_grad_numpy,
    ("cpu", "softmax"): nn.softmax_numpy,
    ("cpu", "softmax_grad"): nn.softmax_grad_numpy,
}
OLD_EXACT_FALLBACK = frozenset({
    "sgd_update", "sparse_sgd_update", "sgd_momentum_update", "adam_update",
    "sgd_multi_update", "sgd_momentum_multi_update", "adam_multi_update",
    "host_reduce_update", "host_all_reduce", "where", "relu_grad", "max_pool2d",
    "max_pool2d_grad", "conv2d_backprop_input", "scatter_rows", "sum_duplicates",
    "gelu", "gelu_grad", "softmax", "softmax_grad",
})
OLD_OPS = {op for (_, op) in (*OLD_KERNELS, *OLD_OUT_KERNELS)}


def old_kernel(kind, op, low_precision, *, fused, deferred):
    """The old kernel(): None for float16/bfloat16 operands; the in-place numpy form when
    deferred (exact ops) or unfused (in-place ops); else KERNELS."""
    if low_precision:
        return None
    if deferred and op.name in OLD_EXACT_FALLBACK or not fused and op.inplace:
        return OLD_NUMPY_KERNELS.get((kind, op.name))
    return OLD_KERNELS.get((kind, op.name))


def old_out_kernel(kind, op, low_precision, *, fused, deferred):
    """The old out_kernel(): nothing unfused but collectives; the numpy twin when deferred
    (exact ops); else OUT_KERNELS."""
    if not (fused or op.collective) or low_precision:
        return None
    if deferred and op.name in OLD_EXACT_FALLBACK:
        return OLD_NUMPY_OUT_KERNELS.get((kind, op.name))
    return OLD_OUT_KERNELS.get((kind, op.name))


def _backend(kind: str):
    """A backend as the lookup sees it: the kernel kind it names (device/host.py)."""
    return SimpleNamespace(kind=kind, kernel_kind=kind, xp=np)


FLAGS = [dict(fused=f, deferred=d) for f, d in itertools.product((True, False), repeat=2)]


@pytest.mark.parametrize("kind", ["cpu", "gpu", "xpu"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_every_lookup_gives_what_the_old_tables_gave(kind, dtype):
    backend = _backend(kind)
    types = [ArrayType((4, 3), np.dtype(dtype))]
    low = dtype == "float16"
    checked = 0
    for name, op in sorted(OPS.items()):
        if name not in OLD_OPS and kernel_table.entry(kind, name) is not None:
            continue                    # a kernel registered since: not the old tables' business
        for flags in FLAGS:
            want = old_kernel(kind, op, low, **flags)
            assert kernel_table.kernel(backend, op, types, **flags) is want, (name, flags)
            want_out = old_out_kernel(kind, op, low, **flags)
            assert kernel_table.out_kernel(backend, op, types, **flags) is want_out, \
                (name, flags)
            got = kernel_table.out_impl(backend, op, types, **flags)
            if want_out is not None:
                assert got is want_out
            elif op.out_impl is None:
                assert got is None
            else:
                assert isinstance(got, functools.partial) and got.func is op.out_impl \
                    and got.args == (np,), (name, flags)
            checked += 1
    assert checked >= 4 * 90
    # the old tables' exact ops are still exact (kernels registered since say so themselves)
    assert kernel_table.exact_ops() & OLD_OPS == OLD_EXACT_FALLBACK


def test_the_registry_holds_the_old_tables_entries():
    old = set(OLD_KERNELS) | set(OLD_OUT_KERNELS)
    assert old <= set(kernel_table.ENTRIES)
    for key in old:
        found = kernel_table.ENTRIES[key]
        assert (found.kernel, found.out) == (OLD_KERNELS.get(key), OLD_OUT_KERNELS.get(key))


def test_the_lookup_flags_are_keyword_only():
    op = OPS["adam_update"]
    with pytest.raises(TypeError):
        kernel_table.kernel(_backend("cpu"), op, (), True, False)
    with pytest.raises(TypeError):
        kernel_table.out_kernel(_backend("cpu"), op, (), True, False)


# ---------------------------------------------------------------- registering a kernel


@pytest.fixture
def counting_tanh():
    """A CPU out= kernel for tanh that counts its calls, registered for the test only."""
    calls = []

    @kernel_table.register_kernel("tanh", kind="cpu", out=True)
    def tanh_cpu(out, x):
        calls.append(x.shape)
        np.tanh(x, out=out)

    try:
        yield calls
    finally:
        kernel_table.ENTRIES.pop(("cpu", "tanh"), None)


def test_a_registered_kernel_is_what_programs_run(counting_tanh):
    x = np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32)
    f = gd.function(lambda x: gd.tanh(x) * 2.0)   # tanh's 25 KiB: a planned buffer
    got = f(x)
    assert counting_tanh == [(64, 100)]         # in place of numpy's ufunc
    np.testing.assert_allclose(got, 2 * np.tanh(x), rtol=1e-6)
    f(x)
    assert len(counting_tanh) == 2


def test_an_unregistered_kernel_runs_no_more(counting_tanh):
    kernel_table.unregister_kernel("tanh", kind="cpu")
    x = np.ones((64, 100), np.float32)
    np.testing.assert_allclose(gd.function(lambda x: gd.tanh(x) * 2.0)(x), 2 * np.tanh(x))
    assert counting_tanh == []


def test_an_exact_twin_stands_in_while_deferred_and_unfused_ops_pass_over_it():
    def kernel(out, x):
        np.tanh(x, out=out)

    def twin(out, x):
        np.tanh(x, out=out)

    kernel_table.register_kernel("tanh", kind="cpu", out=True, numpy=twin, exact=True)(kernel)
    try:
        op, types = OPS["tanh"], [ArrayType((4,), np.dtype("float32"))]
        pick = functools.partial(kernel_table.out_kernel, _backend("cpu"), op, types)
        assert pick() is kernel and pick(deferred=True) is twin
        assert pick(fused=False) is None and pick(fused=False, deferred=True) is None
        assert "tanh" in kernel_table.exact_ops() and kernel_table.is_numpy_twin(twin)
    finally:
        kernel_table.unregister_kernel("tanh", kind="cpu")
    assert "tanh" not in kernel_table.exact_ops()


def test_a_second_entry_for_one_op_and_kind_is_refused():
    before = dict(kernel_table.ENTRIES)
    with pytest.raises(ValueError, match=r"'cpu' kernel for op 'relu_grad' is already"):
        kernel_table.register_kernel("relu_grad", kind="cpu", out=True)(np.copyto)
    assert kernel_table.ENTRIES == before


def test_a_kernel_for_an_unknown_op_names_it():
    with pytest.raises(ValueError, match="op 'tanhh': no op has that name"):
        kernel_table.register_kernel("tanhh", kind="cpu", out=True)(np.tanh)
    with pytest.raises(KeyError, match="no 'cpu' kernel is registered for op 'tanh'"):
        kernel_table.unregister_kernel("tanh", kind="cpu")


# ---------------------------------------------------------------- what entries promise


def test_every_exact_entry_has_a_numpy_twin_of_each_form():
    exact = [e for e in kernel_table.ENTRIES.values() if e.exact]
    assert len(exact) >= 20
    for e in exact:
        assert e.kernel is None or e.numpy is not None, e
        assert e.out is None or e.numpy_out is not None, e


def test_an_exact_entry_without_a_twin_is_refused():
    with pytest.raises(ValueError, match=r"\('cpu', 'tanh'\): exact=True needs a numpy twin"):
        kernel_table.register_kernel("tanh", kind="cpu", out=True, exact=True)(np.tanh)
    assert kernel_table.entry("cpu", "tanh") is None


def test_gpu_kernels_register_alike_and_nothing_loads_cupy_or_numba_at_import():
    adam = kernel_table.entry("gpu", "adam_multi_update")
    assert adam.kernel is optim.adam_multi_gpu and not adam.exact
    code = ("import sys, graphdist.runtime.kernel_table as k; assert k.ENTRIES; "
            "print(sorted(m for m in ('cupy', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_docs_give_the_one_entry_recipe():
    for doc in ("docs/adding_an_op.md", "docs/architecture.md"):
        text = (ROOT / doc).read_text()
        assert "register_kernel" in text, doc
        for old in ("OUT_KERNELS", "NUMPY_KERNELS", "EXACT_FALLBACK", "KERNELS["):
            assert old not in text, (doc, old)


def test_a_backend_finds_kernels_by_the_kernel_kind_it_names_not_by_its_device_kind():
    """A new device kind in host memory reuses the "cpu" kernels by naming that kernel kind."""
    relu_grad = OPS["relu_grad"]
    reuses = SimpleNamespace(kind="xpu", kernel_kind="cpu", xp=np)
    assert kernel_table.out_kernel(reuses, relu_grad) is \
        kernel_table.entry("cpu", "relu_grad").out
    assert kernel_table.out_kernel(SimpleNamespace(kind="xpu", kernel_kind="xpu", xp=np),
                                   relu_grad) is None
