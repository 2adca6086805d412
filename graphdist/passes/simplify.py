"""simplify: fold small constant subexpressions (the gradient seed, 1/N scales...) into
literals and constants, and drop identity reshapes/broadcasts/transposes. Graphs read better
and the program runs fewer calls."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.ir import ArrayType, Graph, Lit, Var, evaluate
from graphdist.ops import array
from graphdist.ops.array import Const
from graphdist.ir.bodies import map_bodies
from graphdist.passes.core import substitute

FOLD_MAX_ELEMENTS = 1024


# ops that are the identity when their result's type is their operand's (a transpose: when
# its perm is too)
_IDENTITY_WHEN_SAME_TYPE = (array.reshape_p, array.broadcast_p, array.transpose_p,
                            array.cast_p, array.stop_gradient_p)


def _identity(eqn) -> bool:
    if eqn.op in _IDENTITY_WHEN_SAME_TYPE:
        (x,) = eqn.inputs
        return isinstance(x, Var) and x.ty == eqn.outputs[0].ty and (
            eqn.op is not array.transpose_p or dict(eqn.params)["perm"] in (
                None if x.ty.ndim < 2 else (), tuple(range(x.ty.ndim))))
    return False


def simplify(g: Graph) -> Graph:
    consts: dict = {}          # Var -> its value, for values known at compile time
    mapping: dict = {}
    kept = []
    changed = False

    def value_of(v):
        if isinstance(v, Lit):
            return np.asarray(v.value, dtype=v.ty.dtype)
        return consts.get(mapping.get(v, v))

    memo: dict = {}
    for eqn in g.eqns:
        new = map_bodies(eqn, simplify, memo)            # branch and loop bodies too
        changed = changed or new is not eqn
        eqn = new
        op = eqn.op
        foldable = (op.foldable
                    and all(t.size <= FOLD_MAX_ELEMENTS for t in (v.ty for v in eqn.outputs)))
        values = [value_of(v) for v in eqn.inputs] if foldable else None
        if foldable and all(x is not None for x in values):
            for v, x in zip(eqn.outputs, _fold(eqn, value_of)):
                consts[v] = np.asarray(x, dtype=v.ty.dtype).reshape(v.ty.shape)
            changed = True
            continue
        if _identity(eqn):
            mapping[eqn.outputs[0]] = mapping.get(eqn.inputs[0], eqn.inputs[0])
            changed = True
            continue
        if op is array.constant_p:
            consts[eqn.outputs[0]] = dict(eqn.params)["value"].value
        kept.append(eqn)
    if not changed:
        return g
    # values still needed become literals (scalars) or constant eqns (small arrays)
    needed = {v for e in kept for v in e.inputs if isinstance(v, Var)} | {
        v for v in g.outputs if isinstance(v, Var)}
    prologue = []
    for v, x in consts.items():
        if v not in needed or any(v in e.outputs for e in kept):
            continue
        if x.ndim == 0:
            mapping[v] = Lit(x[()], ArrayType((), x.dtype))
        else:
            prologue.append(_constant_eqn(v, x))
    eqns = prologue + kept
    return substitute(replace(g, eqns=tuple(eqns)), eqns, mapping)


def _fold(eqn, value_of) -> tuple:
    """The values of eqn's outputs, its inputs all known: the eqn run alone by evaluate."""
    known = tuple(dict.fromkeys(v for v in eqn.inputs if isinstance(v, Var)))
    return evaluate(Graph(known, (eqn,), eqn.outputs), *(value_of(v) for v in known))


def _constant_eqn(v: Var, x: np.ndarray):
    from graphdist.ir import Eqn

    return Eqn(array.constant_p, (), (v,), (("value", Const(np.require(x, requirements="C"))),),
               device=v.device)
