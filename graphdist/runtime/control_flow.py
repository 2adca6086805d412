"""Lowering the control-flow eqns (cond, while, scan; ops/control_flow.py): each body is
lowered once, like any graph, into its own generated program, and the flat program gets a
Python `if` choosing between the branches' programs, or calls a generated runner: a Python
`for` / `while` around the body's program, its carry in locals and its stacked outputs
(ys, the per-iteration history reverse mode reads) written row by row into arrays made
once per call. Nothing is traced again per call or per iteration: compile time does not
depend on the trip count.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from graphdist.ops.control_flow import cond_p, scan_p, while_p
from graphdist.runtime.buffers import plan_buffers

LOWERED = (cond_p, while_p, scan_p)
_runner_ids = itertools.count()


def lowers(op) -> bool:
    """Does this module lower `op` (the emitter's hook)?"""
    return op in LOWERED


def body_program(parent, g, backend):
    """The generated function running body graph `g`, written by a new emitter of the
    calling one's type (plain arrays in, a tuple out; its results never alias its
    buffers, so a carry may be kept across iterations). It picks kernels as `parent` does
    (numpy forms while they load, in a tiered program's first form) and hands `parent` the
    kernels it calls, which load in the background with the program's own."""
    plan = plan_buffers(g, backend, fused=parent.plan.fused, deferred=parent.plan.deferred)
    child = type(parent)(g, plan, backend, {})
    fn = child.run().fn
    parent.kernel_calls.extend(child.kernel_calls)
    return fn


def lower_eqn(emitter, eqn, backend) -> None:
    """Emit eqn's line: outputs are fresh arrays, named v<k>."""
    params = dict(eqn.params)
    args = [emitter.ref(v) for v in eqn.inputs]
    names = [f"v{next(emitter.counter)}" for _ in eqn.outputs]
    target = f"{', '.join(names)}, = " if names else ""
    if eqn.op is cond_p:
        true_fn, false_fn = (emitter.glob("T", body_program(emitter, g, backend))
                             for g in params["branches"])
        rest = ", ".join(args[1:])
        emitter.emit(f"{target}({true_fn}({rest}) if {args[0]} else {false_fn}({rest}))", eqn)
    else:
        make = scan_runner if eqn.op is scan_p else while_runner
        runner = emitter.glob("R", make(functools.partial(body_program, emitter),
                                        backend, **params))
        emitter.emit(f"{target}{runner}({', '.join(args)})", eqn)
    emitter.name.update(zip(eqn.outputs, names))


def _compile(lines: list, env: dict, name: str):
    source = "\n".join(lines)
    exec(compile(source, f"<graphdist {name} {next(_runner_ids)}>", "exec"), env)
    fn = env["run"]
    fn.source = source
    return fn


def _empty(env: dict, backend, key: str, shape, dtype, zeros: bool = False) -> str:
    make = backend.xp.zeros if zeros else backend.xp.empty
    env[key] = functools.partial(make, tuple(shape), dtype)
    return f"{key}()"


def scan_runner(compile_body, backend, *, body, length, num_carry, num_xs, reverse, history):
    """run(*carry, *xs, *consts) -> (*carry, *ys, *history)."""
    env = {"BODY": compile_body(body, backend)}
    n_k = len(body.inputs) - num_carry - num_xs
    c = [f"c{i}" for i in range(num_carry)]
    x = [f"x{i}" for i in range(num_xs)]
    k = [f"k{i}" for i in range(n_k)]
    y_types = [v.ty for v in body.outputs[num_carry:]]
    ys = [f"Y{i}" for i in range(len(y_types))]
    hs = [f"H{i}" for i in range(num_carry)] if history else []
    lines = [f"def run({', '.join(c + x + k)}):"]
    stacked = [*zip(ys, y_types), *zip(hs, (v.ty for v in body.inputs[:num_carry]))]
    for name, ty in stacked:
        make = _empty(env, backend, "E" + name, (length, *ty.shape), ty.dtype)
        lines.append(f"    {name} = {make}")
    steps = f"range({length - 1}, -1, -1)" if reverse else f"range({length})"
    lines.append(f"    for i in {steps}:")
    lines += [f"        {h}[i] = {ci}" for h, ci in zip(hs, c)]
    y_now = [f"y{i}" for i in range(len(ys))]
    outs = c + y_now
    call = f"BODY({', '.join(c + [f'{xi}[i]' for xi in x] + k)})"
    lines.append(f"        {', '.join(outs)}, = {call}" if outs else f"        {call}")
    lines += [f"        {Y}[i] = {y}" for Y, y in zip(ys, y_now)]
    if not lines[-1].startswith("        "):
        lines.append("        pass")
    results = c + ys + hs
    lines.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    return _compile(lines, env, "scan")


def while_runner(compile_body, backend, *, body, cond, num_carry, maximum_iterations,
                 history):
    """run(*carry, *consts) -> (*carry[, trip count, *history])."""
    env = {"BODY": compile_body(body, backend), "COND": compile_body(cond, backend),
           "_i32": np.int32}
    n_k = len(body.inputs) - num_carry
    c = [f"c{i}" for i in range(num_carry)]
    k = [f"k{i}" for i in range(n_k)]
    hs = [f"H{i}" for i in range(num_carry)] if history else []
    lines = [f"def run({', '.join(c + k)}):", "    n = 0"]
    for name, v in zip(hs, body.inputs[:num_carry]):
        shape = (maximum_iterations, *v.ty.shape)
        lines.append(f"    {name} = {_empty(env, backend, 'E' + name, shape, v.ty.dtype, True)}")
    test = f"COND({', '.join(c + k)})[0]"
    if maximum_iterations is not None:
        test = f"n < {maximum_iterations} and {test}"
    lines.append(f"    while {test}:")
    lines += [f"        {h}[n] = {ci}" for h, ci in zip(hs, c)]
    lines.append(f"        {', '.join(c)}, = BODY({', '.join(c + k)})")
    lines.append("        n += 1")
    results = c + (["_i32(n)"] + hs if history else [])
    lines.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    return _compile(lines, env, "while")
