"""Program switches: host-side state that picks which compiled program a gd.function runs.

graphdist has no conditional op that could skip a collective inside one program (a
`where` computes both sides, so an all-reduce under it would run on every call). Where a
step must do different communication on different calls, as gradient accumulation's
micro-steps (no all-reduce) against its applying call (one all-reduce), the choice is made
on the host instead: the step is traced once per *state* of the switch, and every call
looks the current state up before it picks its program. A gd.function keeps the switches
its traces consulted (`record` during a trace) and adds their states to its signature
key, so that a flip costs one trace the first time, and a dictionary lookup after.

A switch is any object with `switch_state()`: a small hashable value read on the host
before each call (e.g. "is this the k-th micro-step?"). This module sits at the bottom of
the import layers so that gd.function (below the optimizers) can consult it.
"""

from __future__ import annotations

import contextlib
import threading


class _Recording(threading.local):
    def __init__(self):
        self.stack: list = []


_recording = _Recording()


def record(switch) -> None:
    """Called while tracing: the program being traced depends on `switch`'s current state
    (a no-op outside gd.function's tracing)."""
    if _recording.stack and all(s is not switch for s in _recording.stack[-1]):
        _recording.stack[-1].append(switch)


@contextlib.contextmanager
def recording():
    """Collect the switches a trace consults: `with recording() as seen: trace()`."""
    seen: list = []
    _recording.stack.append(seen)
    try:
        yield seen
    finally:
        _recording.stack.pop()


def states(switches) -> tuple:
    """Every switch's current state, in order: part of a gd.function's signature key."""
    return tuple(s.switch_state() for s in switches)


__all__ = ["record", "recording", "states"]
