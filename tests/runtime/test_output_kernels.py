"""An op with an out= kernel runs that kernel for a program output too (issue 29): a value
returned to the caller, of any size, gets a fresh array the kernel writes, never the op's
reference impl (a returned gelu ran its 40-pass reference: 74 ms against 0.6 ms)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.device.backends import CPU
from graphdist.ir import ArrayType, Eqn, Graph, Var
from graphdist.kernels import gelu as gelu_kernels
from graphdist.ops import OPS
from graphdist.runtime import kernel_table
from graphdist.runtime.buffers import ARENA_MIN_BYTES, plan_buffers

F32 = np.dtype("float32")
BIG = ArrayType((ARENA_MIN_BYTES // 4, 4), F32)
SMALL = ArrayType((8,), F32)

# every registered CPU out= kernel of an op with one output (collectives are their lowering)
ONE_OUTPUT = sorted(op for (kind, op), e in kernel_table.ENTRIES.items()
                    if kind == "cpu" and e.out is not None and OPS[op].num_outputs == 1
                    and not OPS[op].collective)


def _graph(name: str, ty: ArrayType, returned: bool):
    """op `name` on two inputs of type ty (the plan reads no more of them than their
    types); its result returned, or only read by a tanh."""
    op = OPS[name]
    ins = (Var(ty, "x0"), Var(ty, "x1"))
    out = Var(ty, "y")
    eqns = [Eqn(op, ins, (out,), ())]
    if not returned:
        last = Var(ty, "z")
        eqns.append(Eqn(OPS["tanh"], (out,), (last,), ()))
        out_of_graph = last
    else:
        out_of_graph = out
    return Graph(ins, tuple(eqns), (out_of_graph,)), out


def test_ops_with_out_kernels_are_listed():
    assert {"gelu", "gelu_grad", "softmax", "relu_grad", "where"} <= set(ONE_OUTPUT)


@pytest.mark.parametrize("name", ONE_OUTPUT)
@pytest.mark.parametrize("ty", [BIG, SMALL], ids=["big", "small"])
def test_the_plan_runs_the_kernel_into_a_fresh_array_for_a_returned_value(name, ty):
    g, y = _graph(name, ty, returned=True)
    plan = plan_buffers(g, CPU, fused=True)
    form = plan.forms[0]
    assert form.kind == "out"
    assert form.out_kernel is kernel_table.entry("cpu", name).out
    assert form.out_impl is form.out_kernel
    assert plan.places[y].kind == "fresh"
    assert plan.copy_results == (False,)       # handed to the caller, never copied


@pytest.mark.parametrize("name", ONE_OUTPUT)
def test_kept_values_take_an_arena_buffer_when_big_and_the_impl_when_small(name):
    """A small value the program keeps runs the op's numpy impl: the kernel call costs about
    8 us more than numpy on 8 floats (thread-team and dispatch overhead)."""
    g, y = _graph(name, BIG, returned=False)
    plan = plan_buffers(g, CPU, fused=True)
    assert plan.forms[0].kind == "out" and plan.places[y].kind == "arena"
    g, y = _graph(name, SMALL, returned=False)
    plan = plan_buffers(g, CPU, fused=True)
    assert plan.forms[0].kind == "call" and plan.places[y].kind == "fresh"


def test_a_small_value_a_reducing_kernel_makes_runs_that_kernel():
    """A first layer's filter gradient (1 KiB from 22 MB at batch 256) is small and kept
    (the optimizer reads it), but its kernel's work is its inputs' (the entry says
    `reduces`): the kernel, into a fresh array (the impl ran there: 2.9 against 2.0 ms in
    the tutorial CNN's step). A matmul with its bias, whose kernel only adds the bias to
    the small output, keeps the impl."""
    x = Var(ArrayType((64, 28, 28, 1), F32), "x")
    dy = Var(ArrayType((64, 26, 26, 32), F32), "dy")
    dw, last = Var(ArrayType((3, 3, 1, 32), F32), "dw"), Var(ArrayType((3, 3, 1, 32), F32), "z")
    params = (("dilations", (1, 1)), ("filter_size", (3, 3)), ("padding", "VALID"),
              ("strides", (1, 1)))
    g = Graph((x, dy), (Eqn(OPS["conv2d_backprop_filter"], (x, dy), (dw,), params),
                        Eqn(OPS["tanh"], (dw,), (last,), ())), (last,))
    plan = plan_buffers(g, CPU, fused=True)
    assert plan.forms[0].kind == "out" and plan.places[dw].kind == "fresh"
    assert plan.forms[0].out_kernel is kernel_table.entry("cpu", "conv2d_backprop_filter").out
    h, w = Var(ArrayType((64, 1024), F32), "h"), Var(ArrayType((1024, 10), F32), "w")
    b, y = Var(ArrayType((10,), F32), "b"), Var(ArrayType((64, 10), F32), "y")
    last = Var(ArrayType((64, 10), F32), "z")
    params = (("act", "none"), ("has_bias", True), ("keep", False),
              ("members", ("matmul", "add")))
    g = Graph((h, w, b), (Eqn(OPS["matmul_bias_act"], (h, w, b), (y,), params),
                          Eqn(OPS["tanh"], (y,), (last,), ())), (last,))
    assert plan_buffers(g, CPU, fused=True).forms[0].kind == "call"


@pytest.mark.parametrize("name", ["gelu", "softmax"])
def test_without_fused_kernels_the_plan_keeps_the_reference(name):
    g, y = _graph(name, BIG, True)
    plan = plan_buffers(g, CPU, fused=False)
    assert plan.forms[0].kind == "call" and plan.places[y].kind == "fresh"


@pytest.mark.parametrize("approximate", [False, True])
def test_a_returned_gelu_runs_its_kernel(approximate, monkeypatch):
    """End to end: the registered kernel is called on the program's output, which is a
    new array each call, and the step returns the kernel's bits."""
    entry = kernel_table.entry("cpu", "gelu")
    calls = []

    def spy(out, x, **params):
        calls.append(out.shape)
        entry.out(out, x, **params)

    monkeypatch.setitem(kernel_table.ENTRIES, ("cpu", "gelu"), entry.replace(out=spy))
    x = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    f = gd.function(lambda x: gd.nn.gelu(x, approximate=approximate))
    first, second = f(x), f(x)
    assert calls == [(64, 512)] * 2
    assert not np.shares_memory(first, second)
    want = np.empty_like(x)
    assert gelu_kernels.gelu_cpu(x, want, approximate)
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want)
    assert "= E" in f.program_source()              # the fresh array, allocated per call
