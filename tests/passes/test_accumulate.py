"""fuse_accumulate (passes/accumulate.py): an accumulator's `acc + a @ b` becomes one
matmul_accumulate node, and nothing else does."""

from __future__ import annotations

import numpy as np

import graphdist as gd
from graphdist.optimizers.roles import with_role
from graphdist.passes.accumulate import fuse_accumulate

RNG = np.random.default_rng(5)
A = RNG.standard_normal((6, 4)).astype(np.float32)
B = RNG.standard_normal((6, 3)).astype(np.float32)


def _ops(g) -> list:
    return [e.op.name for e in g.eqns]


def _traced(role: str, also_return_product=False, dtype=np.float32):
    acc = gd.Variable(np.ones((4, 3), dtype), name="acc", trainable=False)
    if role:
        with_role(role, acc)

    @gd.function
    def step(a, b):
        product = gd.matmul(gd.transpose(a), b)
        acc.assign(acc.read_value() + product)
        return product if also_return_product else gd.reduce_sum(a)

    a, b = A.astype(dtype), B.astype(dtype)
    return step, acc, step.get_stages(a, b), (a, b)


def test_an_accumulators_add_of_a_product_becomes_one_node():
    step, acc, stages, args = _traced("accumulator")
    before, after = stages["fuse_optimizer"], stages["fuse_accumulate"]
    assert "matmul_accumulate" not in _ops(before) and "add" in _ops(before)
    assert "matmul_accumulate" in _ops(after)
    assert "matmul" not in _ops(after) and "add" not in _ops(after)
    step(*args)
    np.testing.assert_allclose(acc.numpy(), 1 + A.T.astype(np.float64) @ B, rtol=1e-6)


def test_the_fused_node_takes_the_products_place_in_the_order():
    _, _, stages, _ = _traced("accumulator")
    ops = _ops(stages["fuse_accumulate"])
    # where the matmul was (right after the transpose), not at the add's later place
    assert ops.index("matmul_accumulate") == ops.index("transpose") + 2   # its read between


def test_a_plain_variable_keeps_numpys_rounding():
    # v.assign(v + x @ y) in user code: the fused GEMM would round differently, so only
    # gradient accumulators (StateRef.role) are rewritten
    _, _, stages, _ = _traced("")
    assert "matmul_accumulate" not in _ops(stages["fuse_accumulate"])


def test_a_product_read_elsewhere_is_not_fused():
    _, _, stages, _ = _traced("accumulator", also_return_product=True)
    assert "matmul_accumulate" not in _ops(stages["fuse_accumulate"])


def test_the_pass_returns_its_input_when_nothing_fuses():
    _, _, stages, _ = _traced("")
    g = stages["fuse_optimizer"]
    assert fuse_accumulate(g) is g


def test_float64_accumulators_fuse_too():
    step, acc, stages, args = _traced("accumulator", dtype=np.float64)
    assert "matmul_accumulate" in _ops(stages["fuse_accumulate"])
    step(*args)
    np.testing.assert_allclose(acc.numpy(), 1 + A.T.astype(np.float64) @ B.astype(np.float64),
                               rtol=1e-14)
