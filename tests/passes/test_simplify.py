"""simplify: constant folding and identity elimination, golden text and equivalence."""

from __future__ import annotations

import numpy as np

from graphdist.ir import ArrayType, Eqn, Graph, Lit, Var, check
from graphdist.ops import OPS
from graphdist.passes import eliminate_dead_code
from graphdist.passes.simplify import simplify
from graphdist.device.backends import CPU
from graphdist.runtime.lower import lower

F32 = np.dtype("float32")


def _lit(x):
    return Lit(np.float32(x), ArrayType((), F32))


def _graph():
    """x * broadcast(reshape(fill(1) * 0.25)) + reshape(x) with an identity reshape."""
    x = Var(ArrayType((2, 3), F32), "x")
    one, quarter, col, wide = (Var(ArrayType(s, F32)) for s in [(), (), (1, 1), (2, 3)])
    same, prod, out = (Var(ArrayType((2, 3), F32)) for _ in range(3))
    eqns = (
        Eqn(OPS["fill"], (), (one,), (("dtype", F32), ("shape", ()), ("value", 1))),
        Eqn(OPS["mul"], (one, _lit(0.25)), (quarter,)),
        Eqn(OPS["reshape"], (quarter,), (col,), (("shape", (1, 1)),)),
        Eqn(OPS["broadcast_to"], (col,), (wide,), (("shape", (2, 3)),)),
        Eqn(OPS["reshape"], (x,), (same,), (("shape", (2, 3)),)),
        Eqn(OPS["mul"], (x, wide), (prod,)),
        Eqn(OPS["add"], (prod, same), (out,)),
    )
    return Graph(inputs=(x,), eqns=eqns, outputs=(out,))


def test_folds_constants_and_drops_identities_golden():
    g = _graph()
    out = eliminate_dead_code(simplify(g))
    assert str(out) == (
        "graph(x:f32[2,3]) {\n"
        "  a:f32[2,3] = constant[value=<f32[2,3]>]\n"
        "  b:f32[2,3] = mul x a\n"
        "  c:f32[2,3] = add b x\n"
        "  return c\n"
        "}")
    check(out)
    assert len(g) == 7                                   # the input graph is untouched
    assert simplify(out) is out                          # fixpoint detected with `is`


def test_simplified_graph_computes_the_same():
    g = _graph()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    before = lower(g, CPU, {}, fused=False)(x)[0]
    after = lower(eliminate_dead_code(simplify(g)), CPU, {}, fused=False)(x)[0]
    np.testing.assert_array_equal(before, after)
    np.testing.assert_allclose(after, x * 0.25 + x)


def test_scalar_constants_become_literals_and_big_ones_stay_ops():
    big = Var(ArrayType((64, 64), F32))                  # 4096 elements: not folded
    half, out = Var(ArrayType((), F32)), Var(ArrayType((64, 64), F32))
    g = Graph(inputs=(), outputs=(out,), eqns=(
        Eqn(OPS["fill"], (), (big,), (("dtype", F32), ("shape", (64, 64)), ("value", 2))),
        Eqn(OPS["div"], (_lit(1.0), _lit(2.0)), (half,)),
        Eqn(OPS["mul"], (big, half), (out,)),
    ))
    out_g = simplify(g)
    assert [e.op.name for e in out_g.eqns] == ["fill", "mul"]
    assert str(out_g.eqns[1].inputs[1]) == "0.5"
