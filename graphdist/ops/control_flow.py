"""Control flow in compiled code: gd.cond, gd.while_loop, gd.fori_loop and gd.scan, as ops
that hold sub-graphs (docs/ir.md, "Sub-graphs").

Each branch or body is traced once into its own graph (Tracer.trace_body, trace.py): the
enclosing trace's tensors it uses become explicit inputs (closure captures), and a variable
it assigns becomes an output whose value the op threads on, so the assignment happens only
when that branch or iteration runs. The op's inputs are its operands followed by the
captured values; its params hold the graphs:

    cond[branches=(T, F)]   pred *operands *captured -> *results *assigned
    while[body=B, cond=C, num_carry=n, maximum_iterations=m, history=h]
                            *carry *consts -> *carry [trip_count *carry_history]
    scan[body=B, length=T, num_carry=n, num_xs=k, reverse=r, history=h]
                            *carry *xs *consts -> *carry *ys [*carry_history]

A loop carries its loop variables and then the variables its body assigns. `history`
keeps each iteration's carry, stacked (what reverse mode needs); DCE drops it when no
gradient reads it. The impls run the bodies through the reference interpreter (eager calls,
evaluate, constant folding); the runtime lowers them to a Python `if`/`for`/`while` around
each body's generated program (runtime/control_flow.py).
"""

from __future__ import annotations

import inspect
import linecache
import os

import numpy as np

from graphdist import pytree
from graphdist.errors import ShapeError, user_frame_text
from graphdist.ir import ArrayType, Graph, Var, evaluate
from graphdist.ir.bodies import bodies
from graphdist.ir.types import DEFAULT_FLOAT, is_float
from graphdist.ops.core import Op, Symbolic, bind, current_tracer

BOOL = np.dtype("bool")
INT32 = np.dtype("int32")
# a while_loop's trip count for the cost model when it has no maximum_iterations
ASSUMED_TRIP_COUNT = 10

_body_vjp = None    # body graph -> its vjp graph; autodiff.py registers it (it is above ops)


def register_body_vjp(fn) -> None:
    """autodiff.py hands its body differentiator here (ops may not import autodiff)."""
    global _body_vjp
    _body_vjp = fn


def takes_outputs(rule):
    """Mark a vjp rule that also gets the forward eqn's outputs and source line
    (`outputs=`, `source=`): autodiff.backward passes them."""
    rule.takes_outputs = True
    return rule


# ---------------------------------------------------------------- helpers


def graph_cost(g: Graph) -> tuple[int, int]:
    """(FLOPs, bytes) of running `g` once: the sum over its eqns (bodies included)."""
    flops = nbytes = 0
    for e in g.eqns:
        f, b = e.op.cost([v.ty for v in e.inputs], [v.ty for v in e.outputs], dict(e.params))
        flops, nbytes = flops + f, nbytes + b
    return flops, nbytes


def executed_nodes(g: Graph) -> tuple[int, int]:
    """(eqns one run of `g` executes, of them inside loop bodies): a scan's body counts its
    length times, a while_loop's its maximum_iterations (else ASSUMED_TRIP_COUNT, as the
    cost model), a cond its larger branch."""
    total = in_loops = 0
    for e in g.eqns:
        p = dict(e.params)
        total += 1
        if e.op is scan_p or e.op is while_p:
            trips = p["length"] if e.op is scan_p else (
                p["maximum_iterations"] if p["maximum_iterations"] is not None
                else ASSUMED_TRIP_COUNT)
            inner = sum(executed_nodes(b)[0] for b in bodies(e))
            total, in_loops = total + trips * inner, in_loops + trips * inner
        elif e.op is cond_p:
            runs = [executed_nodes(b) for b in p["branches"]]
            total += max(r[0] for r in runs)
            in_loops += max(r[1] for r in runs)
    return total, in_loops


def holds_collective(g: Graph):
    """The first collective eqn in `g` or its bodies, or None."""
    for e in g.eqns:
        if e.op.collective:
            return e
        for b in bodies(e):
            found = holds_collective(b)
            if found is not None:
                return found
    return None


def _types(vs) -> tuple:
    return tuple(v.ty for v in vs)


def _where_fn(fn) -> str:
    """'file.py:12  def true_fn(x):' for a user function (its first line)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return repr(fn)
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}  {line}"


def _name(fn) -> str:
    return getattr(fn, "__name__", "fn")


def _typed_leaf(x):
    """Python numbers a body returns take graphdist's default types (weak typing)."""
    if type(x) is bool:        # exact types: numpy scalars (np.float64) keep theirs
        return np.bool_(x)
    if type(x) is int:
        return np.int32(x)
    if type(x) is float:
        return DEFAULT_FLOAT.type(x)
    return x


class _Flat:
    """`fn` called on the unflattened tensors; it returns its outputs' leaves and keeps
    their structure in `.tree`."""

    def __init__(self, fn, tree):
        self.fn, self.tree = fn, tree
        self.out_tree = None

    def __call__(self, *tensors):
        out = self.fn(*pytree.unflatten(self.tree, tensors))
        leaves, _, self.out_tree = pytree.flatten(out)
        return [_typed_leaf(x) for x in leaves]


def _check_same(what: str, a_name: str, a_types, a_tree, b_name: str, b_types, b_tree,
                paths=None) -> None:
    """Two bodies (or a body and its loop variables) agree on structure, shapes and dtypes;
    else a TypeError / ShapeError naming both and the first output that differs."""
    if a_tree != b_tree or len(a_types) != len(b_types):
        raise TypeError(f"{what}: {a_name} and {b_name} return different structures "
                        f"({len(a_types)} vs {len(b_types)} values)")
    for k, (x, y) in enumerate(zip(a_types, b_types)):
        if x.dtype != y.dtype or x.shape != y.shape:
            err = TypeError if x.dtype != y.dtype else ShapeError
            which = paths[k] if paths and paths[k] else f"output {k}"
            raise err(f"{what}: {which} is {x} from {a_name} but {y} from {b_name}")


def _union(*lists) -> list:
    return list(dict.fromkeys(v for vs in lists for v in vs))


def _refuse_per_replica(what: str, found, decided_by: str) -> None:
    raise ValueError(
        f"{what}: its body holds a collective ({found.op}, traced at {found.source or '?'}) "
        f"and its {decided_by} may differ between replicas (it is computed from per-replica "
        "values): replicas would disagree on which collectives run. Compute it from "
        "mirrored variables, Python values or all-reduced values"
        f"\n  while tracing  {user_frame_text()}")


def _lift_all(tracer, leaves) -> list:
    return [tracer.lift(x) for x in leaves]


def _zeros_for(ty):
    from graphdist.ops.array import broadcast_to, cast

    return broadcast_to(cast(np.zeros((), ty.dtype), ty.dtype), ty.shape)


# ---------------------------------------------------------------- cond

cond_p = Op("cond", num_outputs=None, foldable=False)


@cond_p.def_shape
def _cond_shape(pred, *ins, branches):
    if pred.shape != () or pred.dtype != BOOL:
        raise TypeError(f"cond: the predicate must be a scalar bool tensor, got {pred}")
    for g in branches:
        if _types(g.inputs) != ins:
            raise TypeError(f"cond: a branch takes {_types(g.inputs)}, the operands are {ins}")
    return _types(branches[0].outputs)


@cond_p.def_impl
def _cond_impl(xp, pred, *ins, branches):
    return evaluate(branches[0] if bool(pred) else branches[1], *ins)


@cond_p.def_cost
def _cond_cost(ins, outs, *, branches):
    costs = [graph_cost(g) for g in branches]
    return max(c[0] for c in costs), max(c[1] for c in costs)


@cond_p.def_vjp
@takes_outputs
def _cond_vjp(cts, pred, *ins, branches, outputs, source):
    """The gradient is a cond of the branches' gradients, on the same predicate; each
    gradient branch recomputes its branch's forward values."""
    in_mask = [is_float(x.dtype) for x in ins]
    out_mask = [is_float(v.ty.dtype) for v in branches[0].outputs]
    if not any(in_mask):
        return (None,) * (1 + len(ins))
    seeds = [ct if ct is not None else _zeros_for(o.ty)
             for ct, o, m in zip(cts, outputs, out_mask) if m]
    grads = tuple(_body_vjp(g, out_mask, in_mask) for g in branches)
    got = iter(bind(cond_p, pred, *ins, *seeds, branches=grads))
    return (None, *(next(got) if m else None for m in in_mask))


def cond(pred, true_fn, false_fn, *operands):
    """true_fn(*operands) if pred else false_fn(*operands), as one node of the compiled
    step: both branches are traced (as closures when no operands are given), only the taken
    one runs. They must return the same structure, shapes and dtypes. A Python bool (or any
    concrete) `pred` picks the branch now; the other is never traced.

    >>> gd.cond(x.sum() > 0, lambda: x * 2.0, lambda: -x)       # doctest: +SKIP
    """
    tracer = current_tracer()
    if tracer is None or not isinstance(pred, Symbolic):
        value = np.asarray(pred.eager_value() if isinstance(pred, Symbolic) else pred)
        if value.shape != () or value.dtype != BOOL:
            raise TypeError(f"cond: the predicate must be a scalar bool, got "
                            f"{value.dtype}{list(value.shape)}")
        return (true_fn if bool(value) else false_fn)(*operands)
    p = tracer.lift(pred)
    if p.ty.shape != () or p.ty.dtype != BOOL:
        raise TypeError(f"cond: the predicate must be a scalar bool tensor, got {p.ty}"
                        f"\n  while tracing  {user_frame_text()}")
    leaves, _, tree = pytree.flatten(operands)
    ins = _lift_all(tracer, leaves)
    traced = []
    for fn, which in ((true_fn, "true_fn"), (false_fn, "false_fn")):
        flat = _Flat(fn, tree)
        name = f"{which} {_name(fn)!r} ({_where_fn(fn)})"
        traced.append((tracer.trace_body(flat, _types(ins), f"cond's {name}"), flat, name))
    (tb, tflat, tname), (fb, fflat, fname) = traced
    t_out = _types(tb.graph.outputs[: len(tb.graph.outputs) - len(tb.assigned)])
    f_out = _types(fb.graph.outputs[: len(fb.graph.outputs) - len(fb.assigned)])
    _check_same("cond", tname, t_out, tflat.out_tree, fname, f_out, fflat.out_tree)
    assigned = _union(tb.assigned, fb.assigned)
    entries = {**tb.entry, **fb.entry}
    slots = _union([entries[v] for v in assigned], tb.captured, fb.captured)
    branches = tuple(b.aligned(slots, assigned, entries) for b in (tb, fb))
    found = next((c for c in map(holds_collective, branches) if c is not None), None)
    if tracer.strategy is not None and found is not None:
        if tracer.per_replica(p):
            _refuse_per_replica("cond", found, "predicate")
        outs = _select_inline(tracer, p, branches, [*ins, *slots])
    else:
        outs = tracer.emit(cond_p, (p, *ins, *slots), {"branches": branches})
    outs = list(outs)
    for variable, v in zip(assigned, outs[len(t_out):]):
        tracer.set_state(variable, v.var)
    return pytree.unflatten(tflat.out_tree, outs[: len(t_out)])


def _select_inline(tracer, p, branches, ins) -> list:
    """Both branches inline and their results selected: how a cond whose branches hold a
    collective runs under a strategy (every replica then runs the same collectives)."""
    from graphdist.ops.math import where

    t = tracer.inline(branches[0], ins)
    f = tracer.inline(branches[1], ins)
    return [where(tracer.wrap(p), tracer.wrap(a), tracer.wrap(b)) for a, b in zip(t, f)]


# ---------------------------------------------------------------- while_loop

while_p = Op("while", num_outputs=None, foldable=False)


def _loop_out_types(carry, history, steps):
    if not history:
        return tuple(carry)
    return (*carry, ArrayType((), INT32),
            *(ArrayType((steps, *t.shape), t.dtype) for t in carry))


@while_p.def_shape
def _while_shape(*ins, body, cond, num_carry, maximum_iterations, history):
    carry = ins[:num_carry]
    if _types(body.inputs) != ins or _types(cond.inputs) != ins:
        raise TypeError(f"while_loop: the body takes {_types(body.inputs)}, the loop's "
                        f"inputs are {ins}")
    if _types(body.outputs) != carry:
        raise TypeError(f"while_loop: the body returns {_types(body.outputs)}, the loop "
                        f"carries {carry}")
    return _loop_out_types(carry, history, maximum_iterations)


@while_p.def_impl
def _while_impl(xp, *ins, body, cond, num_carry, maximum_iterations, history):
    carry, consts = list(ins[:num_carry]), ins[num_carry:]
    hist = ([xp.zeros((maximum_iterations, *c.shape), c.dtype) for c in carry]
            if history else [])
    n = 0
    while (maximum_iterations is None or n < maximum_iterations) and bool(
            evaluate(cond, *carry, *consts)[0]):
        for h, c in zip(hist, carry):
            h[n] = c
        carry = list(evaluate(body, *carry, *consts))
        n += 1
    return (*carry, np.int32(n), *hist) if history else tuple(carry)


@while_p.def_cost
def _while_cost(ins, outs, *, body, cond, num_carry, maximum_iterations, history):
    trips = maximum_iterations if maximum_iterations is not None else ASSUMED_TRIP_COUNT
    f1, b1 = graph_cost(body)
    f2, b2 = graph_cost(cond)
    return trips * (f1 + f2), trips * (b1 + b2)


@while_p.def_vjp
@takes_outputs
def _while_vjp(cts, *ins, body, cond, num_carry, maximum_iterations, history, outputs,
               source):
    """Reverse mode runs the iterations backwards from the trip count, each on the carry
    that iteration started from (kept stacked, bounded by maximum_iterations)."""
    if maximum_iterations is None:
        raise ValueError("while_loop: reverse-mode gradients need maximum_iterations (the "
                         "per-iteration values kept for the backward pass are bounded by "
                         "it); pass maximum_iterations=, or use gd.scan / gd.fori_loop with "
                         f"Python bounds\n  loop traced at  {source}")
    from graphdist.ops.math import greater_equal, subtract
    from graphdist.ops.sparse import gather

    carry_in, consts = ins[:num_carry], ins[num_carry:]
    trips, hist = outputs[num_carry], outputs[num_carry + 1:]
    c_mask = [is_float(x.dtype) for x in carry_in]
    k_mask = [is_float(x.dtype) for x in consts]
    if not any(c_mask) and not any(k_mask):
        return (None,) * len(ins)
    if not history:
        raise ValueError("while_loop: differentiated after its per-iteration values were "
                         f"dropped\n  loop traced at  {source}")
    grad = _body_vjp(body, c_mask, c_mask + k_mask)
    seeds = [ct if ct is not None else _zeros_for(o.ty)
             for ct, o, m in zip(cts[:num_carry], outputs, c_mask) if m]
    accs = [_zeros_for(x.ty) for x, m in zip(consts, k_mask) if m]
    n_ct = len(seeds)

    def step(k, *state):       # the history and constants are captured, not carried
        cts_now, acc = state[:n_ct], state[n_ct:]
        carry_k = [gather(h, k) for h in hist]
        got = current_tracer().call_graph(grad, [*carry_k, *consts, *cts_now])
        new_cts, k_cts = got[:n_ct], got[n_ct:]
        return (subtract(k, 1), *new_cts, *(a + c for a, c in zip(acc, k_cts)))

    final = while_loop(lambda k, *_: greater_equal(k, 0), step,
                       (subtract(trips, 1), *seeds, *accs),
                       maximum_iterations=maximum_iterations)
    got_c = iter(final[1:1 + n_ct])
    got_k = iter(final[1 + n_ct:1 + n_ct + len(accs)])
    return (*(next(got_c) if m else None for m in c_mask),
            *(next(got_k) if m else None for m in k_mask))


def _trace_loop_body(tracer, fn, carry_vars, extra_types, what, tree, shown=None):
    flat = _Flat(fn, tree)
    shown = shown or fn
    name = f"{what} {_name(shown)!r} ({_where_fn(shown)})"
    body = tracer.trace_body(flat, (*_types(carry_vars), *extra_types), name)
    return body, flat, name


def while_loop(cond_fn, body_fn, loop_vars, maximum_iterations=None):
    """Repeat `loop_vars = body_fn(*loop_vars)` while `cond_fn(*loop_vars)`, at most
    `maximum_iterations` times (TF's order and calling convention). The body returns a
    tuple like `loop_vars`, keeping their shapes and dtypes. Reverse-mode gradients need
    `maximum_iterations`.

    >>> i, x = gd.while_loop(lambda i, x: i < 10, lambda i, x: (i + 1, x * 2.0),
    ...                      (0, x))                               # doctest: +SKIP
    """
    single = not isinstance(loop_vars, (tuple, list))
    loop_vars = (loop_vars,) if single else tuple(loop_vars)

    def body_tuple(*vs):         # TF: a one-variable body may return the value alone
        out = body_fn(*vs)
        return (out,) if single and not isinstance(out, (tuple, list)) else tuple(out)

    if maximum_iterations is not None:
        maximum_iterations = int(maximum_iterations)
        if maximum_iterations < 0:
            raise ValueError(f"while_loop: maximum_iterations must be >= 0, got "
                             f"{maximum_iterations}")
    tracer = current_tracer()
    leaves, _, tree = pytree.flatten(loop_vars)
    if tracer is None:
        return _eager_while(cond_fn, body_fn, loop_vars, maximum_iterations, single)
    carry = _lift_all(tracer, [_typed_leaf(x) for x in leaves])
    bb, bflat, bname = _trace_loop_body(tracer, body_tuple, carry, (),
                                        "while_loop's body_fn", tree, shown=body_fn)
    body_out = bb.graph.outputs[: len(bb.graph.outputs) - len(bb.assigned)]
    _check_same("while_loop", bname, _types(body_out), bflat.out_tree, "loop_vars",
                _types(carry), tree)
    cb, cflat, cname = _trace_loop_body(tracer, cond_fn, carry, (), "while_loop's cond_fn",
                                        tree)
    _check_predicate("while_loop", cb, cname)
    assigned = list(bb.assigned)
    entries = {**cb.entry, **bb.entry}
    carried = [entries[v] for v in assigned]
    consts = [v for v in _union(bb.captured, cb.captured) if v not in carried]
    slots = carried + consts
    body_g = bb.aligned(slots, assigned, entries)
    cond_g = _without_results(cb.aligned(slots, [], entries), 1)
    found = holds_collective(body_g) or holds_collective(cond_g)
    if tracer.strategy is not None and found is not None and _trip_count_varies(
            body_g, cond_g, [tracer.per_replica(v) for v in (*carry, *slots)],
            len(carry) + len(carried)):
        _refuse_per_replica("while_loop", found, "trip count")
    history = maximum_iterations is not None
    outs = tracer.emit(while_p, (*carry, *slots),
                       {"body": body_g, "cond": cond_g, "num_carry": len(carry) + len(carried),
                        "maximum_iterations": maximum_iterations, "history": history})
    outs = list(outs)
    for variable, v in zip(assigned, outs[len(carry):]):
        tracer.set_state(variable, v.var)
    result = pytree.unflatten(tree, outs[: len(carry)])
    return result[0] if single else result


def _trip_count_varies(body: Graph, cond: Graph, varying: list, num_carry: int) -> bool:
    """Whether a loop's predicate may differ between replicas: it reads a carry that is
    per-replica on entry or becomes so in some iteration (the body mixes a per-replica
    value into it), or a per-replica constant. A per-replica carry the predicate never
    reads (a value the body all-reduces, say) leaves the replicas in lock step."""
    return _loop_varying(body, cond, varying, num_carry)[0]


def _loop_varying(body: Graph, cond: Graph, varying: list, num_carry: int):
    """(does the predicate vary, which carries may vary after any iteration)."""
    varying = list(varying)
    while True:
        out = _varying_outputs(body, varying)
        grown = [a or b for a, b in zip(varying[:num_carry], out)]
        if grown == varying[:num_carry]:
            return _varying_outputs(cond, varying)[0], grown
        varying[:num_carry] = grown


def while_varying_outputs(eqn, varying_inputs: list) -> list:
    """Per output of a while eqn: may it differ between replicas (the tracer's per_replica
    rule)? A loop whose predicate agrees on every replica has the same trip count on all,
    and a carry that never takes a per-replica value agrees too (what lets the backward
    loop of a loop run in lock step be accepted in turn)."""
    p = dict(eqn.params)
    pred, carry = _loop_varying(p["body"], p["cond"], varying_inputs, p["num_carry"])
    if pred:
        return [True] * len(eqn.outputs)
    return carry + ([False] + carry if p["history"] else [])


def _varying_outputs(g: Graph, varying_inputs: list) -> list:
    """Per output of `g`: may it differ between replicas, given which inputs may? (Trace's
    per_replica rule inside a body: a collective's result agrees on every replica, a
    sync-on-read read or the replica id does not.)"""
    varying = {v for v, flag in zip(g.inputs, varying_inputs) if flag}
    for e in g.eqns:
        if e.op.collective:
            continue
        ref = dict(e.params).get("var")
        if (getattr(ref, "on_read", False) or e.op.name == "replica_id"
                or any(isinstance(v, Var) and v in varying for v in e.inputs)):
            varying.update(e.outputs)
    return [isinstance(v, Var) and v in varying for v in g.outputs]


def _without_results(g: Graph, n: int) -> Graph:
    return g.replace(outputs=g.outputs[:n])


def _check_predicate(what: str, body, name: str) -> None:
    outs = body.graph.outputs[: len(body.graph.outputs) - len(body.assigned)]
    if body.assigned:
        raise ValueError(f"{what}: {name} assigns variable "
                         f"{body.assigned[0].name!r}; the loop condition may only read")
    if len(outs) != 1 or outs[0].ty != ArrayType((), BOOL):
        raise TypeError(f"{what}: {name} must return one scalar bool, got "
                        f"{[str(v.ty) for v in outs]}")


def _eager_while(cond_fn, body_fn, loop_vars, maximum_iterations, single):
    n = 0
    while (maximum_iterations is None or n < maximum_iterations) and bool(
            np.asarray(cond_fn(*loop_vars))):
        out = body_fn(*loop_vars)
        loop_vars = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        n += 1
    return loop_vars[0] if single else loop_vars


# ---------------------------------------------------------------- scan

scan_p = Op("scan", num_outputs=None, foldable=False)


@scan_p.def_shape
def _scan_shape(*ins, body, length, num_carry, num_xs, reverse, history):
    carry, xs = ins[:num_carry], ins[num_carry:num_carry + num_xs]
    for x in xs:
        if not x.shape or x.shape[0] != length:
            raise ShapeError(f"scan: xs {x} has no leading axis of length {length}")
    expect = (*carry, *(ArrayType(x.shape[1:], x.dtype) for x in xs), *ins[num_carry + num_xs:])
    if _types(body.inputs) != expect:
        raise TypeError(f"scan: the body takes {_types(body.inputs)}, the scan gives {expect}")
    outs = _types(body.outputs)
    if outs[:num_carry] != carry:
        raise TypeError(f"scan: the body returns the carry as {outs[:num_carry]}, it came "
                        f"in as {carry}")
    ys = tuple(ArrayType((length, *t.shape), t.dtype) for t in outs[num_carry:])
    hist = tuple(ArrayType((length, *t.shape), t.dtype) for t in carry) if history else ()
    return (*carry, *ys, *hist)


@scan_p.def_impl
def _scan_impl(xp, *ins, body, length, num_carry, num_xs, reverse, history):
    carry = list(ins[:num_carry])
    xs, consts = ins[num_carry:num_carry + num_xs], ins[num_carry + num_xs:]
    ys = [xp.empty((length, *v.ty.shape), v.ty.dtype) for v in body.outputs[num_carry:]]
    hist = [xp.empty((length, *c.shape), c.dtype) for c in carry] if history else []
    for i in (range(length - 1, -1, -1) if reverse else range(length)):
        for h, c in zip(hist, carry):
            h[i] = c
        outs = evaluate(body, *carry, *(x[i] for x in xs), *consts)
        carry = list(outs[:num_carry])
        for y, o in zip(ys, outs[num_carry:]):
            y[i] = o
    return (*carry, *ys, *hist)


@scan_p.def_cost
def _scan_cost(ins, outs, *, body, length, num_carry, num_xs, reverse, history):
    flops, nbytes = graph_cost(body)
    return length * flops, length * nbytes


@scan_p.def_vjp
@takes_outputs
def _scan_vjp(cts, *ins, body, length, num_carry, num_xs, reverse, history, outputs, source):
    """A scan the other way round: each step recomputes its body's forward values from the
    carry that iteration started from (kept stacked by the forward scan) and gives the
    cotangents of its carry, its slice of xs and (summed in the carry) the constants."""
    carry_in = ins[:num_carry]
    xs, consts = ins[num_carry:num_carry + num_xs], ins[num_carry + num_xs:]
    n_y = len(body.outputs) - num_carry
    hist = outputs[num_carry + n_y:]
    c_mask = [is_float(x.dtype) for x in carry_in]
    x_mask = [is_float(x.dtype) for x in xs]
    k_mask = [is_float(x.dtype) for x in consts]
    y_mask = [is_float(v.ty.dtype) for v in body.outputs[num_carry:]]
    if not any(c_mask + x_mask + k_mask):
        return (None,) * len(ins)
    if not history:
        raise ValueError("scan: differentiated after its per-iteration values were dropped"
                         f"\n  scan traced at  {source}")
    grad = _body_vjp(body, c_mask + y_mask, c_mask + x_mask + k_mask)
    seeds = [ct if ct is not None else _zeros_for(o.ty)
             for ct, o, m in zip(cts[:num_carry], outputs, c_mask) if m]
    y_cts = [ct if ct is not None else _zeros_for(o.ty)
             for ct, o, m in zip(cts[num_carry:num_carry + n_y], outputs[num_carry:], y_mask)
             if m]
    accs = [_zeros_for(k.ty) for k, m in zip(consts, k_mask) if m]
    n_c, n_k, n_x = len(seeds), len(accs), sum(x_mask)

    def step(state, sliced):
        cts_now, acc = state[:n_c], state[n_c:]
        carry_i = sliced[:num_carry]
        x_i = sliced[num_carry:num_carry + num_xs]
        yct_i = sliced[num_carry + num_xs:]
        got = current_tracer().call_graph(grad, [*carry_i, *x_i, *consts, *cts_now, *yct_i])
        new_cts, x_cts, k_cts = got[:n_c], got[n_c:n_c + n_x], got[n_c + n_x:]
        return (*new_cts, *(a + c for a, c in zip(acc, k_cts))), tuple(x_cts)

    final, x_grads = scan(step, (*seeds, *accs), (*hist, *xs, *y_cts), length=length,
                          reverse=not reverse)
    got_c, got_k = iter(final[:n_c]), iter(final[n_c:n_c + n_k])
    got_x = iter(x_grads)
    return (*(next(got_c) if m else None for m in c_mask),
            *(next(got_x) if m else None for m in x_mask),
            *(next(got_k) if m else None for m in k_mask))


def scan(f, init, xs=None, length=None, reverse=False):
    """JAX's scan: `carry, y = f(carry, x)` for each x along xs's leading axis (from the
    end with reverse=True); returns `(carry, ys)`, ys stacked on axis 0. One node whatever
    the length: compile time does not grow with it.

    >>> total, partial = gd.scan(lambda c, x: (c + x, c + x), 0.0, xs)   # doctest: +SKIP
    """
    tracer = current_tracer()
    x_leaves, _, x_tree = pytree.flatten(xs)
    c_leaves, _, c_tree = pytree.flatten(init)
    if xs is None:
        x_leaves, x_tree = [], (tuple, ())
    if tracer is None:
        return _eager_scan(f, init, xs, x_leaves, x_tree, length, reverse)
    c_vars = [tracer.lift(_typed_leaf(x)) for x in c_leaves]
    x_vars = [tracer.lift(x) for x in x_leaves]
    length = _scan_length(x_vars, length)
    n_c = len(c_vars)
    x_types = tuple(ArrayType(v.ty.shape[1:], v.ty.dtype) for v in x_vars)

    tree = (tuple, (c_tree, x_tree))
    flat = _Flat(lambda c, x: f(c, None if xs is None else x), tree)
    name = f"scan's f {_name(f)!r} ({_where_fn(f)})"
    tb = tracer.trace_body(flat, (*_types(c_vars), *x_types), name)
    out = tb.graph.outputs[: len(tb.graph.outputs) - len(tb.assigned)]
    out_tree = flat.out_tree
    if out_tree is None or out_tree[0] not in (tuple, list) or len(out_tree[1]) != 2:
        raise TypeError(f"scan: {name} must return a pair (carry, y)")
    c_out_tree, y_tree = out_tree[1]
    n_c_out = _count(c_out_tree)
    _check_same("scan", name, _types(out[:n_c_out]), c_out_tree, "init", _types(c_vars),
                c_tree)
    assigned = list(tb.assigned)
    carried = [tb.entry[v] for v in assigned]
    consts = [v for v in tb.captured if v not in carried]
    g = tb.aligned(carried + consts, assigned, tb.entry)
    n_a, n_x = len(assigned), len(x_vars)
    # inputs (*c, *x, *carried, *consts) -> (*c, *carried, *x, *consts);
    # outputs (*c, *y, *carried) -> (*c, *carried, *y)
    ins = g.inputs
    g = Graph((*ins[:n_c], *ins[n_c + n_x:n_c + n_x + n_a], *ins[n_c:n_c + n_x],
               *ins[n_c + n_x + n_a:]), g.eqns,
              (*g.outputs[:n_c], *g.outputs[len(g.outputs) - n_a:],
               *g.outputs[n_c:len(g.outputs) - n_a]))
    history = True      # what reverse mode reads; DCE drops it when no gradient does
    outs = list(tracer.emit(scan_p, (*c_vars, *carried, *x_vars, *consts),
                            {"body": g, "length": length, "num_carry": n_c + n_a,
                             "num_xs": n_x, "reverse": bool(reverse), "history": history}))
    for variable, v in zip(assigned, outs[n_c:n_c + n_a]):
        tracer.set_state(variable, v.var)
    n_y = len(g.outputs) - n_c - n_a
    carry = pytree.unflatten(c_tree, outs[:n_c])
    ys = pytree.unflatten(y_tree, outs[n_c + n_a:n_c + n_a + n_y])
    return carry, ys


def _count(tree) -> int:
    if tree is None:
        return 1
    if tree[0] is dict:
        return sum(_count(t) for t in tree[2])
    return sum(_count(t) for t in tree[1])


def _scan_length(x_vars, length) -> int:
    lengths = {v.ty.shape[0] if v.ty.shape else None for v in x_vars}
    if None in lengths:
        raise ShapeError("scan: every xs leaf needs a leading axis to scan over, got "
                         f"{[str(v.ty) for v in x_vars]}\n  while tracing  {user_frame_text()}")
    if length is not None:
        lengths.add(int(length))
    if len(lengths) != 1:
        raise ShapeError(f"scan: xs leading axes and length disagree: {sorted(lengths)}"
                         f"\n  while tracing  {user_frame_text()}")
    return lengths.pop()


def _eager_scan(f, init, xs, x_leaves, x_tree, length, reverse):
    x_leaves = [np.asarray(x) for x in x_leaves]
    n = _scan_length([type("V", (), {"ty": ArrayType(x.shape, x.dtype)}) for x in x_leaves],
                     length) if x_leaves else int(length)
    carry, ys = init, []
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        x = None if xs is None else pytree.unflatten(x_tree, [a[i] for a in x_leaves])
        carry, y = f(carry, x)
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry, _stack_trees(ys, n, f)


def _stack_trees(ys, n, f):
    from graphdist.ops.construct import stack

    if n == 0:
        raise ValueError(f"scan: a zero-length scan of {_name(f)!r} outside a trace has no ys "
                         "to stack")
    leaves = [pytree.flatten(y)[0] for y in ys]
    tree = pytree.flatten(ys[0])[2]
    stacked = [stack([row[k] for row in leaves]) for k in range(len(leaves[0]))]
    return pytree.unflatten(tree, stacked)


# ---------------------------------------------------------------- fori_loop


def fori_loop(lower, upper, body_fn, init):
    """JAX's fori_loop: `carry = body_fn(i, carry)` for i in [lower, upper). Python bounds
    make a scan (differentiable); traced bounds a while_loop.

    >>> gd.fori_loop(0, 10, lambda i, c: c + i, 0)                   # doctest: +SKIP
    """
    static = all(isinstance(b, (int, np.integer)) for b in (lower, upper))
    if static:
        lower, upper = int(lower), int(upper)
        if current_tracer() is None:
            carry = init
            for i in range(lower, upper):
                carry = body_fn(np.int32(i), carry)
            return carry

        def step(state, _):
            i, carry = state
            return (i + 1, body_fn(i, carry)), ()

        (_, carry), _ = scan(step, (np.int32(lower), init), None,
                             length=max(upper - lower, 0))
        return carry

    def loop_cond(i, carry):
        return i < upper

    def loop_body(i, carry):
        return i + 1, body_fn(i, carry)

    from graphdist.ops.array import cast

    start = lower if isinstance(lower, Symbolic) else np.int32(lower)
    if isinstance(upper, Symbolic) and getattr(upper, "dtype", None) != np.dtype(
            getattr(start, "dtype", INT32)):
        start = cast(start, upper.dtype)
    return while_loop(loop_cond, loop_body, (start, init))[1]
