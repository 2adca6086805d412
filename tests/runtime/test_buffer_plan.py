"""The lowering's buffer plan (runtime/buffers.py), tested alone on plain data: where each
value is computed, when buffers go back to the pool, when an input's buffer or a variable's
storage is written over, and that no two values alive at once share a buffer."""

from __future__ import annotations

import re

import numpy as np
import pytest

import graphdist as gd
from graphdist.device.backends import CPU
from graphdist.ir import ArrayType, Eqn, Graph, StateRef, Var
from graphdist.ir.liveness import liveness
from graphdist.ops import OPS
from graphdist.runtime.buffers import ARENA_MIN_BYTES, Buffer, plan_buffers
from graphdist.runtime.lower import lower

F32 = np.dtype("float32")
BIG = ArrayType((ARENA_MIN_BYTES // 4,), F32)    # just big enough for an arena buffer
SMALL = ArrayType((8,), F32)


def _eqn(name, *ins, ty=BIG, **params):
    out = Var(ty)
    return Eqn(OPS[name], ins, (out,), tuple(sorted(params.items()))), out


def _plan(g, **kw):
    return plan_buffers(g, CPU, fused=False, **kw)


def test_a_buffer_goes_back_to_the_pool_after_its_last_use_and_is_reused():
    x = Var(BIG, "x")
    e0, a = _eqn("tanh", x)
    e1, b = _eqn("exp", x)
    e2, c = _eqn("add", a, b)       # a and b die here; c takes a's buffer
    e3, d = _eqn("tanh", x)         # b's buffer, from the pool
    e4, out = _eqn("mul", c, d)
    g = Graph((x,), (e0, e1, e2, e3, e4), (out,))
    plan = _plan(g)
    assert [f.kind for f in plan.forms] == ["ufunc"] * 4 + ["call"]   # out: returned, fresh
    pa, pb, pc, pd = (plan.places[v] for v in (a, b, c, d))
    assert pa.kind == pb.kind == "arena" and pa.buffer is not pb.buffer
    assert pc.buffer is pa.buffer and pc.source is a           # donated: a dies at e2
    assert plan.frees[2] == [pb.buffer]                        # b's buffer freed after e2
    assert pd.buffer is pb.buffer and pd.source is None        # ...and reused by e3
    assert plan.places[out].kind == "fresh" and plan.copy_results == (False,)


def test_the_emitted_program_writes_where_the_plan_says():
    x = Var(BIG, "x")
    e0, a = _eqn("tanh", x)
    e1, b = _eqn("exp", x)
    e2, c = _eqn("add", a, b)
    e3, d = _eqn("tanh", x)
    e4, out = _eqn("mul", c, d)
    program = lower(Graph((x,), (e0, e1, e2, e3, e4), (out,)), CPU, {}, fused=False)
    targets = re.findall(r"out=(\w+)\)", program.source)       # e0..e3, in order
    assert len(targets) == 4 and len(set(targets)) == 2
    assert targets[2] == targets[0] and targets[3] == targets[1]
    x_value = np.linspace(-1, 1, BIG.size, dtype=np.float32)
    for _ in range(2):                                          # buffers reused across calls
        np.testing.assert_allclose(program(x_value)[0],
                                   (np.tanh(x_value) + np.exp(x_value)) * np.tanh(x_value),
                                   rtol=1e-6)


def test_an_input_is_donated_only_where_it_dies_and_only_once_per_eqn():
    x = Var(BIG, "x")
    e0, a = _eqn("tanh", x)
    e1, b = _eqn("exp", a)          # a is read again below: not donated
    e2, c = _eqn("add", a, b)       # a dies here (b too): a, the first input, is donated
    e3, d = _eqn("mul", c, c)       # c read twice by the eqn that kills it: not donated
    e4, out = _eqn("tanh", d)
    g = Graph((x,), (e0, e1, e2, e3, e4), (out,))
    plan = _plan(g)
    assert plan.places[b].buffer is not plan.places[a].buffer
    assert plan.places[c].buffer is plan.places[a].buffer
    assert plan.places[d].source is None and plan.places[d].buffer is not plan.places[c].buffer


def _state_graph(read_again: bool):
    """w := tanh(w) + x; with read_again, the old w is also returned."""
    x, w_in = Var(BIG, "x"), Var(BIG, "w")
    ref = StateRef(0, "w", ("cpu:0",))
    e0, r = _eqn("read_var", w_in, var=ref)
    e1, t = _eqn("tanh", r)
    e2, s = _eqn("add", t, x)
    e3, new = _eqn("assign_var", w_in, s, var=ref)
    outs = (r, new) if read_again else (new,)
    return Graph((x, w_in), (e0, e1, e2, e3), outs, variables=(ref,)), w_in, r, t, s


def test_a_final_state_is_computed_into_the_variables_storage_when_the_old_value_is_dead():
    g, w_in, r, t, s = _state_graph(read_again=False)
    plan = _plan(g)
    assert plan.places[r].kind == "alias" and plan.places[r].source is w_in
    assert plan.places[t].kind == "arena"                  # never over the variable's storage
    assert plan.places[s].kind == "storage" and plan.places[s].source is w_in


def test_a_final_state_waits_in_a_buffer_while_the_old_value_is_still_read():
    g, w_in, r, t, s = _state_graph(read_again=True)
    plan = _plan(g)
    assert plan.places[s].kind == "arena"
    assert plan.copy_results == (True,)        # the old value lives in storage: copied out


@pytest.mark.parametrize("op, into_storage", [("add", True), ("matmul", False)])
def test_only_an_elementwise_op_may_overwrite_the_storage_it_reads(op, into_storage):
    ty = ArrayType((64, 64), F32)                          # w := w + m, or w := w @ m
    m, w_in = Var(ty, "m"), Var(ty, "w")
    ref = StateRef(0, "w", ("cpu:0",))
    e0, r = _eqn("read_var", w_in, ty=ty, var=ref)
    e1, s = _eqn(op, r, m, ty=ty)                          # the old w dies here
    e2, new = _eqn("assign_var", w_in, s, ty=ty, var=ref)
    plan = _plan(Graph((m, w_in), (e0, e1, e2), (new,), variables=(ref,)))
    assert plan.places[s].kind == ("storage" if into_storage else "arena")


def test_small_values_are_fresh_arrays_dropped_after_their_last_use():
    x = Var(SMALL, "x")
    e0, a = _eqn("tanh", x, ty=SMALL)
    e1, b = _eqn("exp", a, ty=SMALL)
    e2, out = _eqn("add", b, x, ty=SMALL)
    g = Graph((x,), (e0, e1, e2), (out, x))
    plan = _plan(g)
    assert {plan.places[v].kind for v in (a, b, out)} == {"fresh"}
    assert plan.drops == {1: [(a,)], 2: [(b,)]} and not plan.frees
    assert plan.copy_results == (False, True)  # a fresh result is handed over, an input copied


def test_values_another_device_reads_are_never_freed_or_donated():
    x = Var(BIG, "x")
    e0, a = _eqn("tanh", x)
    e1, b = _eqn("exp", a)
    e2, out = _eqn("tanh", b)
    g = Graph((x,), (e0, e1, e2), (out,))
    plain = _plan(g)
    assert plain.places[b].source is a                     # a dies at e1: donated to b
    pinned = _plan(g, exports=(a,))
    assert pinned.live.last_use[a] == len(g.eqns)
    assert pinned.places[b].source is None and pinned.places[b].buffer is not \
        pinned.places[a].buffer
    assert all(pinned.places[a].buffer not in freed for freed in pinned.frees.values())


# ---------------------------------------------------------------- a traced training step

def _train_step(optimizer, returns_old_weight=False):
    rng = np.random.default_rng(0)
    w = gd.Variable(rng.standard_normal((128, 64)).astype(np.float32), name="w")
    v = gd.Variable(rng.standard_normal((64, 32)).astype(np.float32), name="v")

    @gd.function
    def step(x, y):
        old = w.read_value()
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean((gd.relu(x @ w) @ v - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, [w, v]), [w, v]))
        return (loss, old) if returns_old_weight else loss

    step(rng.standard_normal((64, 128)).astype(np.float32),
         rng.standard_normal((64, 32)).astype(np.float32))
    return step.replicated_graph, w


def _root_buffer(buffer: Buffer) -> Buffer:
    while buffer.base is not None:
        buffer = buffer.base
    return buffer


@pytest.mark.parametrize("fused", [False, True])
def test_no_two_values_alive_at_once_share_a_buffer(fused):
    g, _ = _train_step(gd.optimizers.Adam(learning_rate=0.1))
    plan = plan_buffers(g, CPU, fused=fused)
    defined = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    holders: dict = {}
    for v, place in plan.places.items():
        if place.kind == "arena":
            holders.setdefault(_root_buffer(place.buffer), []).append(v)
    assert holders and any(len(vs) > 1 for vs in holders.values())     # reuse happened
    for vs in holders.values():
        vs.sort(key=defined.get)
        for old, new in zip(vs, vs[1:]):
            last = plan.live.last_use[plan.live.root.get(old, old)]
            assert last <= defined[new]                     # dead by the time it is written
            if last == defined[new]:                        # over a dying input: donated
                assert plan.places[new].source is not None
    for i, freed in plan.frees.items():                     # freed right after last use
        for buffer in freed:
            (holder,) = [v for v, p in plan.places.items() if p.kind == "arena"
                         and p.buffer is buffer and defined[v] <= i
                         and plan.live.last_use.get(v) == i]
            assert holder is not None
    assert plan.live is g.liveness or plan.live.last_use == liveness(g).last_use


def test_an_in_place_update_writes_the_variables_storage_unless_the_old_value_is_returned():
    g, w = _train_step(gd.optimizers.SGD(learning_rate=0.1))
    plan = plan_buffers(g, CPU, fused=True)
    state_of_w = g.inputs[g.num_args + g.variables.index(w.ref)]
    updates = [i for i, f in enumerate(plan.forms) if f.kind == "inplace"]
    assert updates
    written = {plan.places[v].source for i in updates for v in g.eqns[i].outputs
               if plan.places[v].kind == "storage"}
    assert state_of_w in written

    g, w = _train_step(gd.optimizers.SGD(learning_rate=0.1), returns_old_weight=True)
    plan = plan_buffers(g, CPU, fused=True)
    state_of_w = g.inputs[g.num_args + g.variables.index(w.ref)]
    update = next(e for i, e in enumerate(g.eqns) if plan.forms[i].kind == "inplace"
                  and any(plan.live.root.get(x) is state_of_w for x in e.inputs))
    kinds = {plan.places[v].kind for v in update.outputs}
    assert "copy" in kinds and plan.copy_results[1]       # old w: copied out, updated copy
