"""Passes are pure Graph -> Graph functions: golden text on tiny graphs, equivalence before
and after on random inputs, and check() after every one."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.errors import GraphError
from graphdist.ir import ArrayType, Eqn, Graph, Var, check
from graphdist.ops import OPS
from graphdist.passes import (eliminate_common_subexpressions, eliminate_dead_code, liveness,
                              place, schedule)
from graphdist.device.backends import CPU
from graphdist.runtime.lower import lower

F32 = np.dtype("float32")


def _tiny_graph():
    """x -> tanh twice (a common subexpression), an unused exp, a sum of the two tanh."""
    ty = ArrayType((4,), F32)
    x = Var(ty, "x")
    a, b, dead, c = Var(ty), Var(ty), Var(ty), Var(ty)
    eqns = (Eqn(OPS["tanh"], (x,), (a,)), Eqn(OPS["tanh"], (x,), (b,)),
            Eqn(OPS["exp"], (x,), (dead,)), Eqn(OPS["add"], (a, b), (c,)))
    return Graph(inputs=(x,), eqns=eqns, outputs=(c,))


def _run(g, x):
    return lower(g, CPU, {}, fused=False)(x)[0]


def test_dce_golden_and_pure():
    g = _tiny_graph()
    out = eliminate_dead_code(g)
    assert out is not g and len(g) == 4                 # the input is untouched
    assert str(out) == (
        "graph(x:f32[4]) {\n"
        "  a:f32[4] = tanh x\n"
        "  b:f32[4] = tanh x\n"
        "  c:f32[4] = add a b\n"
        "  return c\n"
        "}")
    assert eliminate_dead_code(out) is out              # fixpoint detected with `is`
    check(out)


def test_cse_golden_and_equivalent():
    g = eliminate_dead_code(_tiny_graph())
    out = eliminate_common_subexpressions(g)
    assert str(out) == (
        "graph(x:f32[4]) {\n"
        "  a:f32[4] = tanh x\n"
        "  b:f32[4] = add a a\n"
        "  return b\n"
        "}")
    check(out)
    x = np.random.default_rng(0).standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(_run(g, x), _run(out, x))
    assert eliminate_common_subexpressions(out) is out


def test_cse_never_merges_assigns_and_keeps_variable_order():
    v = gd.Variable(np.zeros(2, np.float32), name="v")

    @gd.function
    def f():
        v.assign_add(np.ones(2, np.float32))
        v.assign_add(np.ones(2, np.float32))
        return v.read_value()

    np.testing.assert_array_equal(f(), [2, 2])
    assert sum(e.op.name == "assign_var" for e in f.graph.eqns) == 2
    np.testing.assert_array_equal(v.numpy(), [2, 2])


def test_vjp_recomputation_is_shared_with_forward():
    @gd.function
    def f(x):
        return gd.value_and_grad(lambda x: gd.reduce_sum(gd.exp(x)))(x)

    f(np.ones(3, np.float32))
    assert sum(e.op.name == "exp" for e in f.graph.eqns) == 1


def test_place_puts_every_value_on_the_device():
    g = place(_tiny_graph(), "cpu:3")
    assert g.devices == ("cpu:3",)
    assert all(e.device == "cpu:3" for e in g.eqns)
    assert all(v.device == "cpu:3" for v in g.inputs)
    check(g)


def test_schedule_records_liveness_and_peak():
    g = schedule(eliminate_dead_code(_tiny_graph()))
    live = g.liveness
    a, b, c = (e.outputs[0] for e in g.eqns)
    assert live.last_use[a] == 2 and live.last_use[b] == 2
    assert live.last_use[c] == 3                        # a graph output lives to the end
    assert live.peak_bytes == 3 * 16                    # a, b and c live during the add


def test_views_extend_their_buffers_life():
    f = gd.function(lambda x: gd.reshape(gd.tanh(x), (2, 2)) * 2.0 + gd.exp(x)[0])
    f(np.ones(4, np.float32))
    g = f.replicated_graph
    live = liveness(g)
    tanh_out = next(e.outputs[0] for e in g.eqns if e.op.name == "tanh")
    reshape_eqn = next(e for e in g.eqns if e.op.name == "reshape")
    assert live.root[reshape_eqn.outputs[0]] is tanh_out


def test_check_catches_use_before_definition_and_wrong_types():
    ty = ArrayType((4,), F32)
    x, a, b = Var(ty, "x"), Var(ty), Var(ty)
    bad = Graph(inputs=(x,), eqns=(Eqn(OPS["tanh"], (a,), (b,)),), outputs=(b,))
    with pytest.raises(GraphError, match="before it is defined"):
        check(bad, where="mypass")
    wrong = Graph(inputs=(x,), eqns=(Eqn(OPS["tanh"], (x,), (Var(ArrayType((3,), F32)),)),),
                  outputs=())
    with pytest.raises(GraphError, match="shape rule"):
        check(wrong)


def test_check_catches_cross_device_reads():
    ty = ArrayType((4,), F32)
    x = Var(ty, "x", "cpu:1")
    y = Var(ty, None, "cpu:0")
    g = Graph(inputs=(x,), eqns=(Eqn(OPS["tanh"], (x,), (y,), device="cpu:0"),), outputs=(y,))
    with pytest.raises(GraphError, match="lives on cpu:1"):
        check(g)
