"""The few exception classes graphdist raises (each subclasses what a Python user would
catch), and how an error finds the user's source line to name."""

from __future__ import annotations

import linecache
import os
import sys


class ShapeError(ValueError):
    """Shapes that do not fit an op; the message names the op and both shapes."""


class TraceError(RuntimeError):
    """User code did something tracing cannot capture (data-dependent Python control flow...).

    The message ends with the user's source line, as every error raised while tracing
    does: `where` ('file.py:14  <source line>'; a variable's first use, say, for an error
    found after the trace) or, by default, the innermost frame outside graphdist when the
    error is made. A message that already names its line is kept as it is."""

    def __init__(self, message: str = "", where: str | None = None):
        if where is None:
            where = user_frame_text()
        if where and "\n  while tracing  " not in message:
            message = f"{message}\n  while tracing  {where}"
        super().__init__(message)


class GraphError(AssertionError):
    """Malformed IR. Always a bug in a pass, never the user's fault."""


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or does not match what is tracked."""


class WorkerError(RuntimeError):
    """Another worker (or replica) failed; the message names which one."""


class NumericsError(FloatingPointError):
    """A NaN or Inf in a node's output under gd.config.check_numerics(True): the message
    names the op, the device, the user's source line and which inputs were finite; `op`,
    `device` and `source` hold the same. The step that raised it changed no state."""

    def __init__(self, message: str, op: str = "", device: str = "", source: str = ""):
        super().__init__(message)
        self.op, self.device, self.source = op, device, source


# ---------------------------------------------------------------- the user's line
# Errors name the user's source line: the innermost frame outside graphdist.

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_KERNELS_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels")


def _ours(filename: str) -> bool:
    return filename.startswith((_PACKAGE_DIR, _KERNELS_DIR))


def user_frame_text(tb=None) -> str:
    """'file.py:14  <source line>' of the innermost frame outside graphdist: of the current
    stack, or of traceback `tb` (where an exception was raised)."""
    if tb is not None:
        where = None
        while tb is not None:
            if not _ours(tb.tb_frame.f_code.co_filename):
                where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
    else:
        f = sys._getframe(1)
        while f is not None and _ours(f.f_code.co_filename):
            f = f.f_back
        where = (f.f_code.co_filename, f.f_lineno) if f is not None else None
    if where is None:
        return ""
    filename, lineno = where
    return f"{os.path.basename(filename)}:{lineno}  {linecache.getline(filename, lineno).strip()}"


def first_use_text(graph, ref) -> str:
    """The source line of the first node of `graph` that reads or writes the variable whose
    StateRef is `ref` ('' if none says): where an error found after tracing points."""
    for eqn in graph.eqns:
        if any(value == ref for name, value in eqn.params if name == "var") and eqn.source:
            return eqn.source
    return ""
