"""gd.config.check_numerics: the checks a generated program runs after each floating-point
node, and the guard that makes a step that found a NaN or Inf change no state.

The emitter (runtime/emit.py) writes one call of a `checker` after every node that makes a
float value; the checker's fast path is one reduction over the output. Only when it fails
does it look at the node's inputs to say which were finite. Optimizer kernels update
variables in place and some values are computed straight into a variable's storage, so a
check after such a node comes too late to keep the variable clean: `Guarded` copies every
variable component before the step and puts them back when the step raises NumericsError.
"""

from __future__ import annotations

import contextlib

import numpy as np

from graphdist.device.backends import backend_for
from graphdist.errors import NumericsError
from graphdist.ir import Var, eqn_text
from graphdist.ir.printer import Namer


def _finite(xp, x) -> bool:
    return bool(xp.isfinite(x).all())


def checker(eqn, k: int, xp, where: str, switch=None):
    """The check of output k of `eqn`, called as check(output, *inputs) right after the
    node ran. `where`: the device (and replica) it lies on, as the error names it; `switch`:
    a context that makes that device current, for an output on another device than the
    node's (a collective's)."""
    def check(out, *ins):
        if not _finite(xp, out):
            raise numerics_error(eqn, k, xp, where, out, ins)

    def check_there(out, *ins):
        with switch():
            check(out, *ins)

    return check if switch is None else check_there


@contextlib.contextmanager
def on_device(backend):
    """Make `backend`'s device and stream current, then give the caller back its own."""
    with backend.restoring_caller():
        backend.enter()
        yield


def numerics_error(eqn, k: int, xp, where: str, out, ins) -> NumericsError:
    op, namer = eqn.op.name, Namer()
    head = f"{_bad_text(xp, out)} in the output of  {eqn_text(eqn, namer, device=False)}  ({op}"
    head += f", output {k})" if len(eqn.outputs) > 1 else ")"
    lines = [f"{head} on {where}"]
    if eqn.source:
        lines.append(f"  traced at  {eqn.source}")
    arrays = [(v, x) for v, x in zip(eqn.inputs, ins) if isinstance(v, Var)
              and getattr(x, "dtype", None) is not None and x.dtype.kind in "fc"]
    if arrays:
        lines.append("  inputs: " + "; ".join(_input_text(namer(v), v, x, out)
                                              for v, x in arrays))
    lines.append("  the step changed no variable (gd.config.check_numerics(False) turns the "
                 "checks off)")
    return NumericsError("\n".join(lines), op=op, device=where, source=eqn.source)


def _input_text(name: str, v: Var, x, out) -> str:
    name = f"{name} ({v.ty})"
    backend = backend_for(v.device) if v.device else None
    xp = backend.xp if backend is not None else np
    with on_device(backend) if backend is not None else contextlib.nullcontext():
        if _overlaps(xp, x, out):
            return f"{name} overwritten in place by the output"
        return f"{name} {'finite' if _finite(xp, x) else 'has ' + _bad_text(xp, x)}"


def _overlaps(xp, a, b) -> bool:
    try:
        return a is b or bool(xp.may_share_memory(a, b))
    except TypeError:          # numpy scalars
        return False


def _bad_text(xp, x) -> str:
    """'NaN', 'Inf' or 'NaN and Inf', with how many of how many elements."""
    x = xp.asarray(x)
    nan, inf = int(xp.isnan(x).sum()), int(xp.isinf(x).sum())
    kinds = " and ".join(k for k, n in (("NaN", nan), ("Inf", inf)) if n)
    return f"{kinds} ({nan + inf} of {x.size} elements)" if x.size > 1 else kinds


class Guarded:
    """An executable whose failed step (NumericsError) puts back every variable component
    it may have written: the copies are taken before each call (on the host, through each
    device's backend: its own stream, its own device)."""

    def __init__(self, executable, variables):
        self.executable = executable
        self.variables = list({id(v): v for v in variables}.values())

    def __getattr__(self, name):       # graph, programs, source, devices...: the wrapped one's
        return getattr(self.executable, name)

    def __call__(self, arrays):
        saved = [(v, [_snapshot(backend_for(d), x) for d, x in zip(v.devices, v._values)],
                  v._lagging) for v in self.variables]
        try:
            return self.executable(arrays)
        except NumericsError:
            for v, copies, lagging in saved:
                for d, x, copy in zip(v.devices, v._values, copies):
                    backend_for(d).copy_in(x, copy)
                v._lagging = lagging
            raise


def _snapshot(backend, x) -> np.ndarray:
    """A host copy of component x (to_host may hand back x itself, or a view of it)."""
    return np.array(backend.to_host(x), copy=True)
