"""Ops are objects (issue 22, item 3): graph code compares op objects or asks an op's declared
flags, never its name, and an Op equals only itself, so a misspelt name cannot be a silent
False. The scan below reads graphdist/ outside graphdist/ops/ (where ops are defined and
named) for the patterns that compared names."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import ArrayType, Eqn, Var
from graphdist.ops import OPS, Op
from graphdist.ops.array import constant_p, reshape_p, shape_p
from graphdist.ops.collectives import all_reduce_p, replica_id_p
from graphdist.ops.core import COST_KINDS
from graphdist.ops.math import add_p, max_p, min_p, rmax_p
from graphdist.ops.optim import adam_multi, adam_p, momentum_multi, sgd_multi
from graphdist.ops.state import assign_p, read_p
from graphdist.simulate.costs import eqn_seconds

PACKAGE = pathlib.Path(gd.__file__).parent

# Files whose op-name comparisons or OPS["..."] lookups wait for another change (path ->
# why). Keep this empty where possible: each entry is a known debt.
PENDING: dict[str, str] = {}


# ---------------------------------------------------------------- the scan


def _string_set(node, constants: dict) -> tuple[str, ...] | None:
    """The strings `node` stands for: a str literal, a tuple/list/set of them, or a module
    constant bound to one; None for anything else."""
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return tuple(e.value for e in node.elts)
    return None


def _module_constants(tree: ast.Module) -> dict:
    """Module-level NAME = ("a", "b") bindings: `op in NAME` compares names as well."""
    found = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Name):
            strings = _string_set(stmt.value, {})
            if strings is not None:
                found[stmt.targets[0].id] = strings
    return found


def _op_expr(node) -> str | None:
    """'attr' for `<x>.op` / `<x>.op.name` / `op.name` (always an op or its name), 'name' for
    a bare `op` / `op_name` (which may also be a reduction kind, "sum" or "mean"), else None."""
    if isinstance(node, ast.Attribute) and node.attr == "op":
        return "attr"
    if isinstance(node, ast.Attribute) and node.attr == "name":
        inner = node.value
        if (isinstance(inner, ast.Attribute) and inner.attr == "op") or (
                isinstance(inner, ast.Name) and inner.id == "op"):
            return "attr"
    if isinstance(node, ast.Name) and node.id in ("op", "op_name"):
        return "name"
    return None


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, text) of each op-name comparison in `source`: `<x>.op == "add"`,
    `<x>.op.name != "add"`, `op in ("add", ...)`, `<x>.op.name.startswith(...)` and
    `OPS["add"]`. A bare `op` counts only against registered op names."""
    tree = ast.parse(source)
    constants = _module_constants(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            kinds = {_op_expr(s) for s in sides} - {None}
            strings = [x for s in sides for x in (_string_set(s, constants) or ())]
            if strings and ("attr" in kinds or ("name" in kinds
                                                 and any(x in OPS for x in strings))):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith") \
                and _op_expr(node.func.value) == "attr":
            hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id == "OPS" and isinstance(node.slice, ast.Constant):
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def _graph_code() -> list[pathlib.Path]:
    ops_dir = PACKAGE / "ops"
    return [p for p in sorted(PACKAGE.rglob("*.py")) if ops_dir not in p.parents]


@pytest.mark.parametrize("text", [
    'if eqn.op == "assign_var": pass',
    'if e.op.name != "reshape": pass',
    'if eqn.op in ("all_reduce", "broadcast"): pass',
    'if op.name not in ("constant",): pass',
    'if op in ("read_var", "assign_var"): pass',
    'ALIASES = ("read_var", "stop_gradient")\nif e.op in ALIASES: pass',
    'if e.op.name.startswith("max"): pass',
    'x = OPS["reshape"]',
    'if e.op == "asign_var": pass',          # a typo is caught too: any string
])
def test_the_scan_finds_each_pattern(text):
    assert len(name_comparisons(text)) == 1


@pytest.mark.parametrize("text", [
    'if eqn.op is assign_p: pass',
    'if e.op in (reshape_p, split_p): pass',
    'if params["op"] == "mean": pass',      # a reduction kind, not an op
    'if op == "sum": pass',
    'x = OPS[params["update"]]',             # a name the graph carries: a lookup is fine
])
def test_the_scan_passes_object_comparisons_and_other_strings(text):
    assert name_comparisons(text) == []


def test_graph_code_compares_ops_not_names():
    found = []
    for path in _graph_code():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel in PENDING:
            continue
        found += [f"{rel}:{line}: {text}"
                  for line, text in name_comparisons(path.read_text(encoding="utf-8"))]
    assert found == [], "compare op objects or ask a flag:\n" + "\n".join(found)


def test_pending_entries_still_exist_and_still_need_it():
    for rel in PENDING:
        path = PACKAGE.parent / rel
        assert path.exists(), rel
        assert name_comparisons(path.read_text(encoding="utf-8")), \
            f"{rel} compares no names any more: take it off PENDING"


# ---------------------------------------------------------------- Op equality


@pytest.fixture
def fresh_op():
    op = Op("test_op_objects_x")
    yield op
    del OPS[op.name]


def test_an_op_never_equals_its_name(fresh_op):
    assert (fresh_op == "test_op_objects_x") is False
    assert ("test_op_objects_x" == fresh_op) is False
    assert fresh_op != "test_op_objects_x"
    assert fresh_op not in ("test_op_objects_x",)
    assert fresh_op == fresh_op and fresh_op in (reshape_p, fresh_op)


def test_registered_ops_do_not_equal_their_names():
    assert all(op != name for name, op in OPS.items())
    assert {op.name for op in OPS.values()} == set(OPS)   # the registry is keyed by name


def test_op_declares_every_attribute_it_carries(fresh_op):
    with pytest.raises(AttributeError):
        fresh_op.multi = object()             # an undeclared flag is refused
    with pytest.raises(AttributeError):
        fresh_op.orders_own_stream = True     # as is a misspelt one
    fresh_op.orders_own_streams = True        # a declared one may be set
    assert fresh_op.orders_own_streams


def test_unknown_cost_kind_is_refused_with_the_op_named():
    with pytest.raises(ValueError, match="test_op_objects_y.*reduction"):
        Op("test_op_objects_y", cost_kind="reduction")
    assert "test_op_objects_y" not in OPS


# ---------------------------------------------------------------- declared flags


def test_foldable_is_declared_per_op():
    # state and collectives never fold; replica_id exists per replica only after
    # replication, a constant is already folded, shape is left to run
    for op in (read_p, assign_p, all_reduce_p, replica_id_p, constant_p, shape_p):
        assert not op.foldable, op
    for op in (add_p, reshape_p, max_p):
        assert op.foldable, op
    assert [op for op in OPS.values() if op.foldable and (op.stateful or op.collective)] == []


def test_multi_tensor_forms_point_at_their_single_update():
    for multi in (sgd_multi, momentum_multi, adam_multi):
        assert multi.op.multi_tensor is multi
        assert multi.single.multi_tensor is None
    assert adam_multi.single is adam_p
    fused = [op for op in OPS.values() if op.multi_tensor is not None]
    assert {op.name for op in fused} >= {"sgd_multi_update", "adam_multi_update",
                                         "sgd_momentum_multi_update"}


def test_assign_var_overwrites_state_and_only_it():
    assert [op for op in OPS.values() if op.overwrites_state] == [assign_p]


def test_the_nccl_collectives_order_their_own_streams():
    # the inline all-reduce, and the overlapped start (communication stream after the
    # compute stream's event) and wait (compute stream after the communication stream's)
    assert {op.name for op in OPS.values() if op.orders_own_streams} == {
        "nccl_all_reduce", "nccl_all_reduce_start", "collective_wait"}


# ---------------------------------------------------------------- pricing by cost kind


def _old_name_rule(name: str) -> str:
    """How simulate priced an op before ops declared cost_kind: by its name."""
    if any(k in name for k in ("matmul", "conv", "einsum", "dot")):
        return "matmul"
    return "reduce" if name.startswith(("reduce", "sum", "mean", "softmax", "max")) \
        else "elementwise"


def test_cost_kinds_are_the_old_rule_but_maximum():
    """Every op is priced as before, except `maximum`, an elementwise op that the name rule
    took for a reduction ("max..."). Collectives are priced by their lowering instead."""
    changed = {name: (_old_name_rule(name), op.cost_kind) for name, op in OPS.items()
               if not op.collective and op.cost_kind != _old_name_rule(name)}
    assert changed == {"maximum": ("reduce", "elementwise")}
    assert all(op.cost_kind in COST_KINDS for op in OPS.values())


def _calibration() -> dict:
    """Rates one apart per kind, so the price says which kind priced it."""
    rate = {"elementwise": 1e-9, "reduce": 1e-6, "matmul": 1e-3}
    return {"node_overhead_s": 0.0,
            "ops": {k: {"a": 0.0, "per_unit": r} for k, r in rate.items()}}


def _eqn(op, n: int) -> Eqn:
    ty = ArrayType((n,), np.dtype("float32"))
    ins = (Var(ty), Var(ty)) if op.elementwise else (Var(ty),)
    params = {} if op.elementwise else {"axis": None, "keepdims": False}
    out = op.out_types(*(v.ty for v in ins), **params)
    return Eqn(op, ins, tuple(Var(t) for t in out), tuple(sorted(params.items())))


def test_simulator_prices_maximum_as_elementwise_not_a_reduction():
    cal = _calibration()
    n = 1000
    for op in (max_p, min_p, add_p):
        eqn = _eqn(op, n)
        _, nbytes = op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs], {})
        assert nbytes == 3 * 4 * n                                 # reads two, writes one
        assert eqn_seconds(eqn, cal) == pytest.approx(nbytes * 1e-9), op
    reduction = _eqn(rmax_p, n)
    _, nbytes = rmax_p.cost([v.ty for v in reduction.inputs],
                            [v.ty for v in reduction.outputs], {"axis": None, "keepdims": False})
    assert eqn_seconds(reduction, cal) == pytest.approx(nbytes * 1e-6)
