"""What a new op, kernel, pass or collective lowering touches, read from the registries and
checked against the table in docs/architecture.md ("What a new piece touches"): each kind of
piece lives in the files the table names, so adding one touches only those."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import graphdist
from graphdist.distribute import cross_device_ops
from graphdist.ops.core import OPS
from graphdist.passes.collectives import COLLECTIVES, LOWERINGS
from graphdist.runtime import kernel_table

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(graphdist.__file__).parent
RULES = ("shape_rule", "impl", "out_impl", "vjp", "cost_rule", "batch_rule")


def _module(fn) -> str:
    return Path(inspect.getsourcefile(inspect.unwrap(fn))).resolve().relative_to(
        PACKAGE).as_posix()


def _own_rule(fn) -> bool:
    """A rule written for this op, not one a shared factory made (`_unary.<locals>.impl`)."""
    return "<locals>" not in fn.__qualname__ and _module(fn) != "ops/core.py"


def files_of_an_op() -> int:
    """The most modules any op's own rules are spread over."""
    return max(len({_module(f) for a in RULES if (f := getattr(op, a)) is not None
                    and _own_rule(f)}) for op in OPS.values())


# machinery every optimizer update shares, not a kernel's own: the in-place numpy forms
# replay each update's one formula (kernels/formulas.py) with out=
SHARED_ADAPTERS = {"runtime/numpy_updates.py"}


def files_of_a_kernel_entry() -> int:
    """The files one kernel entry is written in: the adapter module it is registered in,
    and its kernel's code in kernels/ (whatever shared machinery it reuses aside)."""
    counts = []
    for e in kernel_table.ENTRIES.values():
        own = {_module(f) for f in (e.kernel, e.out, e.numpy, e.numpy_out)
               if callable(f) and getattr(f, "__module__", "").startswith("graphdist.")}
        own -= SHARED_ADAPTERS
        assert all(m.startswith("runtime/adapters/") for m in own), (e.op, own)
        counts.append(len(own) + 1)
    return max(counts)


def files_of_a_lowering() -> int:
    """The modules one lowering's collectives are written in, plus the one CrossDeviceOps
    class that names it."""
    counts = []
    for name, cls in LOWERINGS.items():
        own = {_module(getattr(cls, c)) for c in COLLECTIVES if c in vars(cls)}
        namers = [c for c in vars(cross_device_ops).values() if isinstance(c, type)
                  and issubclass(c, cross_device_ops.CrossDeviceOps)
                  and getattr(c, "lowering", None) == name and "lowering" in vars(c)]
        assert len(namers) == 1, f"lowering {name!r} is named by {namers}"
        counts.append(len(own | {"distribute/cross_device_ops.py"}))
    return max(counts)


def files_of_a_pass() -> int:
    """A pass is its module in graphdist/passes/ and one stage in pipeline.py: every
    function a stage runs comes from graphdist.passes."""
    tree = ast.parse((PACKAGE / "pipeline.py").read_text())
    imported = {a.asname or a.name: node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for a in node.names}
    staged = {arg.id for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) == "stage" for arg in node.args[1:]
              if isinstance(arg, ast.Name)}
    assert staged, "no stage(name, fn) calls found in pipeline.py"
    outside = {fn: imported.get(fn) for fn in staged
               if not (imported.get(fn) or "").startswith("graphdist.passes")}
    assert not outside, f"stages that run no pass of graphdist/passes/: {outside}"
    return 2


def files_of_a_backend() -> int:
    """A backend is its class in a module of graphdist/device/ and one register_backend
    line (device/backends.py); nothing above device/ names a kind (test_backends.py)."""
    from graphdist.device import backends

    counts = []
    for kind in backends.kinds():
        module = _module(type(backends.backend_of_kind(kind)))
        assert module.startswith("device/"), (kind, module)
        counts.append(len({module, "device/backends.py"}))
    return max(counts)


MEASURED = {"op": files_of_an_op, "device backend": files_of_a_backend, "kernel": files_of_a_kernel_entry,
            "pass": files_of_a_pass, "collective lowering": files_of_a_lowering}


def _documented() -> dict:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.partition("What a new piece touches")[2]
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^\| a new ([a-z ]+?) \| (\d+):", table, re.M)}


@pytest.mark.parametrize("piece", sorted(MEASURED))
def test_the_architecture_table_says_what_a_new_piece_touches(piece):
    documented = _documented()
    assert piece in documented, f"docs/architecture.md's table has no row for a new {piece}"
    assert MEASURED[piece]() == documented[piece], (
        f"a new {piece} touches {MEASURED[piece]()} files by the registries; "
        f"docs/architecture.md says {documented[piece]}")
