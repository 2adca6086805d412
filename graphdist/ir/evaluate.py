"""evaluate(g, *args): the reference interpreter. It runs a graph eqn by eqn on the ops'
numpy impls (JAX's `eval_jaxpr`): what passes, lowering and kernels are held against.
No buffers, kernels or devices: a placed graph runs its replicas one after another."""

from __future__ import annotations

import numpy as np

from graphdist.ir.graph import Graph, Lit
from graphdist.ir.printer import eqn_text
from graphdist.ir.types import ArrayType


def evaluate(g: Graph, *args, state: dict | None = None):
    """Run `g` on numpy; returns its results as a tuple. Variables' values come in as
    `state={ref: array}` (`ref` a `g.variables` entry, e.g. `w.ref`; required when the graph
    holds any), and with `state` given the call returns `(results, new_state)`, new_state
    keyed the same. A variable held once per replica takes (and gives back) a sequence of
    its components, one per replica.

    >>> results = evaluate(f.get_graph(x), x)                    # doctest: +SKIP
    """
    if len(args) != g.num_args:
        raise TypeError(f"evaluate: the graph takes {g.num_args} arguments, got {len(args)}")
    env = {v: _argument(v, x, f"argument {k}") for k, (v, x) in enumerate(zip(g.inputs, args))}
    env.update(_state_in(g, state))
    for eqn in g.eqns:
        if eqn.op.impl is None:
            raise NotImplementedError(f"evaluate: op '{eqn.op}' has no numpy impl; see "
                                      f"docs/adding_an_op.md\n  in  {eqn_text(eqn)}")
        ins = [np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]
               for v in eqn.inputs]
        out = eqn.op.impl(np, *ins, **dict(eqn.params))
        outs = (out,) if eqn.op.num_outputs == 1 else out
        env.update((v, np.asarray(x)) for v, x in zip(eqn.outputs, outs))
    values = [np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]
              for v in g.outputs]
    results = tuple(values[: g.num_results])
    if state is None:
        return results
    new_state: dict = {}
    for ref, x in zip(g.variables, values[g.num_results:]):
        new_state.setdefault(ref, []).append(x)
    return results, {ref: xs[0] if len(xs) == 1 else tuple(xs) for ref, xs in new_state.items()}


def _argument(v, x, what: str) -> np.ndarray:
    x = np.asarray(x)
    if ArrayType(x.shape, x.dtype) != v.ty:
        raise TypeError(f"evaluate: {what} ({v.hint or 'unnamed'}) is "
                        f"{ArrayType(x.shape, x.dtype)}, the graph takes {v.ty}")
    return x


def _state_in(g: Graph, state: dict | None) -> dict:
    held = list(g.variables)
    missing = [ref.name for ref in dict.fromkeys(held) if ref not in (state or {})]
    if missing:
        raise TypeError(f"evaluate: the graph holds variables {', '.join(missing)}; pass "
                        "state={ref: array} with each one's value")
    env = {}
    for k, (ref, v) in enumerate(zip(held, g.inputs[g.num_args:])):
        value = state[ref] if held.count(ref) == 1 else state[ref][held[:k].count(ref)]
        env[v] = _argument(v, value, f"variable {ref.name}")
    return env
