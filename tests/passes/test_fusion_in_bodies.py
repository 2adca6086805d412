"""Fusion inside control-flow bodies: the epilogues and fuse_elementwise stages rewrite the
branches of a cond and the bodies of scan, fori_loop and while_loop as they rewrite the
step (passes/core.py in_bodies), and the program gives the unfused program's bits, forward
and gradients, on the first call (the bodies' kernels loading: numpy twins) and after."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist import pipeline
from graphdist.ir.bodies import bodies
from graphdist.ops.epilogue import matmul_bias_act_p
from graphdist.ops.fused import fused_elementwise_p
from graphdist.runtime import warmup

M, N = 1024, 128        # 131072 elements a value: fuse_elementwise's MIN_ELEMENTS


@pytest.fixture(autouse=True)
def _kernels_loaded():
    yield
    warmup.wait()


def fused_ops(g) -> set:
    """The fused ops anywhere in g, bodies included (nested ones too)."""
    found = set()
    for e in g.eqns:
        if e.op in (fused_elementwise_p, matmul_bias_act_p):
            found.add(e.op.name)
        elif bodies(e):
            for body in bodies(e):
                found |= fused_ops(body)
    return found


def top_level_fused(g) -> set:
    return {e.op.name for e in g.eqns if e.op in (fused_elementwise_p, matmul_bias_act_p)}


def layer(h, w, b):
    """A dense layer and a residual chain: matmul + bias + relu, then scale and add."""
    return gd.relu(h @ w + b) * 0.5 + h


def loops(kind: str):
    """forward(x, w, b, flag) with the layer inside a body of `kind`."""
    if kind == "cond":
        return lambda x, w, b, flag: gd.cond(flag, lambda: layer(x, w, b),
                                             lambda: x * 2.0 - x * x)
    if kind == "fori_loop":
        return lambda x, w, b, flag: gd.fori_loop(0, 3, lambda i, h: layer(h, w, b), x)
    if kind == "scan":
        def forward(x, w, b, flag):
            def body(h, _):
                h = layer(h, w, b)
                return h, gd.reduce_sum(h)
            return gd.scan(body, x, length=3)[0]
        return forward
    if kind == "while_loop":
        return lambda x, w, b, flag: gd.while_loop(
            lambda i, h: i < 3, lambda i, h: (i + 1, layer(h, w, b)), (0, x),
            maximum_iterations=3)[1]
    raise AssertionError(kind)


def step_of(forward):
    def step(x, w, b, flag):
        with gd.GradientTape() as tape:
            tape.watch(w)
            tape.watch(b)
            out = forward(x, w, b, flag)
            loss = gd.reduce_sum(out * out)
        return (out, *tape.gradient(loss, [w, b]))
    return step


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((M, N)).astype(np.float32),
            (rng.standard_normal((N, N)) * 0.05).astype(np.float32),
            rng.standard_normal(N).astype(np.float32))


@pytest.mark.parametrize("kind", ["cond", "fori_loop", "scan", "while_loop"])
def test_bodies_fuse_and_give_the_unfused_bits_forward_and_gradients(kind, monkeypatch):
    x, w, b = inputs()
    step = step_of(loops(kind))
    fused, plain = gd.function(step), gd.function(step)
    flag = np.bool_(True)
    got = fused(x, w, b, flag)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "epilogues", lambda: [])
        m.setattr(pipeline, "elementwise_fusion", lambda: [])
        want = plain(x, w, b, flag)
    assert {"matmul_bias_act", "fused_elementwise"} <= fused_ops(fused.replicated_graph), kind
    assert not fused_ops(plain.replicated_graph)
    warmup.wait()                  # the first call ran the twins; now the kernels
    again = fused(x, w, b, flag)
    for a, k, want_k in zip(got, again, want):
        np.testing.assert_array_equal(a, want_k)
        np.testing.assert_array_equal(k, want_k)


def test_both_branches_of_a_cond_fuse_and_the_false_one_runs_too(monkeypatch):
    x, w, b = inputs(1)
    step = gd.function(step_of(loops("cond")))
    outs = [step(x, w, b, np.bool_(k % 2 == 0)) for k in range(2)]
    with monkeypatch.context() as m:
        m.setattr(pipeline, "epilogues", lambda: [])
        m.setattr(pipeline, "elementwise_fusion", lambda: [])
        plain = gd.function(step_of(loops("cond")))
        want = [plain(x, w, b, np.bool_(k % 2 == 0)) for k in range(2)]
    forward = [e for e in step.replicated_graph.eqns if e.op.name == "cond"][0]  # then its vjp
    true_branch, false_branch = dict(forward.params)["branches"]
    assert "matmul_bias_act" in fused_ops(true_branch)
    assert "fused_elementwise" in fused_ops(false_branch)      # x * 2 - x * x
    for got, expected in zip(outs, want):
        for a, e in zip(got, expected):
            np.testing.assert_array_equal(a, e)


def test_the_bodies_stay_unplaced_and_the_step_around_them_is_unchanged():
    """What fusion makes inside a body runs on the holder's device, as the body's other eqns
    do; the top level is fused as before (here nothing there to fuse)."""
    x, w, b = inputs(2)
    f = gd.function(lambda x, w, b: gd.fori_loop(0, 2, lambda i, h: layer(h, w, b), x))
    f(x, w, b)
    g = f.replicated_graph
    assert not top_level_fused(g)
    (loop,) = [e for e in g.eqns if bodies(e)]
    for body in bodies(loop):
        assert all(e.device is None for e in body.eqns)


def test_a_body_hands_its_kernels_to_the_program_and_waits_for_them_like_it():
    """A body's program is written like its holder's: with the kernels it calls listed for
    the background load, and numpy forms in the tiered program's first form."""
    from graphdist.device.backends import backend_for
    from graphdist.runtime.lower import _emitter

    x, w, b = inputs(3)
    f = gd.function(lambda x, w, b: gd.fori_loop(0, 2, lambda i, h: layer(h, w, b), x))
    f(x, w, b)
    g = f.replicated_graph
    backend = backend_for(g.devices[0])
    storage = {}
    kernels = _emitter(g, backend, storage, fused=True)
    kernels.run()
    twins = _emitter(g, backend, storage, fused=True, deferred=True)
    twins.run()
    assert {"fused_elementwise", "matmul_bias_act"} <= {c.op for c in kernels.kernel_calls}
    assert "fused_elementwise" not in {c.op for c in twins.kernel_calls}


def test_a_loop_inside_a_branch_fuses_at_every_depth(monkeypatch):
    x, w, b = inputs(4)

    def step(x, w, b, flag):
        return gd.cond(flag, lambda: gd.fori_loop(0, 2, lambda i, h: layer(h, w, b), x),
                       lambda: x * 2.0 - x * x)

    fused = gd.function(step)
    got = fused(x, w, b, np.bool_(True))
    with monkeypatch.context() as m:
        m.setattr(pipeline, "epilogues", lambda: [])
        m.setattr(pipeline, "elementwise_fusion", lambda: [])
        want = gd.function(step)(x, w, b, np.bool_(True))
    (cond,) = [e for e in fused.replicated_graph.eqns if e.op.name == "cond"]
    true_branch = dict(cond.params)["branches"][0]
    (loop,) = [e for e in true_branch.eqns if bodies(e)]
    assert loop.device is None                       # unplaced again, as the branch's eqns
    assert {"matmul_bias_act", "fused_elementwise"} <= fused_ops(bodies(loop)[0])
    warmup.wait()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fused(x, w, b, np.bool_(True)), want)
