"""Background kernel compilation: a program's first calls run while its Numba kernels load.

A step's first call used to wait for every Numba kernel it uses: about 0.25 s to load
them from the on-disk cache (Numba's own start-up, mostly) and several seconds to compile
them with a cold cache (a fresh checkout, a new Numba). Most kernels have a numpy form that
gives the same bits (kernel_table.exact_ops()), so a program starts on those
forms while one background thread calls each kernel once on zeros of the real operand
types (which compiles or loads it), then switches to the kernels between two calls.
The optimizer updates run as in-place numpy forms then (runtime/numpy_updates.py), not as
their functional impls: a step on them takes ~1.4x the kernels' time rather than ~2.8x.

Results do not depend on which form ran: the forms are bit-identical (tested per op and on
whole training steps), so a run with a cold cache gives the bits of a run with a warm
one. Only the speed of the first steps differs. Kernels without an exact numpy form
(layer_norm's: it sums in LLVM's reassociated order) still load before the first call.

`gd.config.set_background_compile(False)` (or GRAPHDIST_BACKGROUND_COMPILE=0) waits for
every kernel first, as before; profiles always do (they time what runs from then on).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
from dataclasses import dataclass

import numpy as np

from graphdist import config

# forms of a kernel call (runtime/lower.py): fn(*ins) updating inputs in place,
# fn(out, *ins), fn((out0, out1, ...), *ins)
INPLACE, OUT, OUTS = "inplace", "out", "outs"


@dataclass(frozen=True)
class KernelCall:
    """One kernel call of a program, as its operand types: enough to make Numba compile the
    same specialization without the program's data."""
    op: str
    fn: functools.partial       # the kernel with the node's params bound
    form: str
    inputs: tuple               # ArrayType of each Var input, or the literal's value
    outputs: tuple              # ArrayTypes of the outputs (for OUT / OUTS)

    def key(self) -> tuple:
        kernel = self.fn.func
        return (getattr(kernel, "__module__", None), getattr(kernel, "__qualname__", None),
                self.form, repr(sorted(self.fn.keywords.items())),
                tuple(_type_key(t) for t in self.inputs),
                tuple(_type_key(t) for t in self.outputs))

    def run_on_zeros(self) -> None:
        ins = [_zeros(t) for t in self.inputs]
        if self.form == INPLACE:
            self.fn(*ins)
        elif self.form == OUT:
            self.fn(_zeros(self.outputs[0]), *ins)
        else:
            self.fn(tuple(_zeros(t) for t in self.outputs), *ins)


def _type_key(t):
    if hasattr(t, "shape") and hasattr(t, "dtype") and not isinstance(t, np.generic):
        return (t.shape, str(t.dtype))
    return repr(t)


def _zeros(t):
    if hasattr(t, "shape") and hasattr(t, "dtype") and not isinstance(t, np.generic):
        return np.zeros(t.shape, t.dtype)
    return t                    # a literal input: its own value


_loaded: set = set()            # KernelCall keys this process has already run
_jobs: queue.Queue = queue.Queue()
_worker: threading.Thread | None = None
_pending = 0                    # jobs queued or running
_idle = threading.Condition()
_running = threading.Event()    # cleared by paused(): new programs stay on their first form
_running.set()


def pending(calls) -> list:
    """The calls whose kernels this process has not loaded yet (in order, no repeats)."""
    seen, out = set(), []
    for call in calls:
        key = call.key()
        if key not in _loaded and key not in seen:
            seen.add(key)
            out.append(call)
    return out


def tiered(fast, first, calls):
    """`first` (a Program on exact numpy forms) that becomes `fast` once the background
    thread, started when its first call returns, has loaded every kernel in `calls`; the
    two programs share the variables' storage, so a step's updates land in the same arrays
    whichever form ran."""
    first.line_eqns.update(fast.line_eqns)   # errors name the node in either form
    first.source = fast.source
    first.events = fast.events
    first.warming = True
    first.deferred_calls = calls
    numpy_forms = first.fn

    def switch() -> None:
        first.fn = fast.fn
        first.warming = False

    def first_call(*arrays):
        # the warm-up starts once this call is done: loading Numba (0.4 s of mostly Python)
        # beside the first step would hold the GIL it needs
        try:
            return numpy_forms(*arrays)
        finally:
            if first.fn is first_call:
                first.fn = numpy_forms
                _submit(calls, switch)

    first.fn = first_call
    return first


def _submit(calls, done) -> None:
    global _worker, _pending
    with _idle:
        _pending += 1
    _jobs.put((calls, done))
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_work, name="graphdist-kernel-warmup", daemon=True)
        _worker.start()


def _work() -> None:
    global _pending
    while True:
        calls, done = _jobs.get()
        _running.wait()
        try:
            for call in calls:
                if call.key() in _loaded:
                    continue
                try:
                    call.run_on_zeros()
                except Exception as e:  # noqa: BLE001 - the real call compiles it or says why
                    config.logger.debug("kernel warm-up of %s failed: %s", call.fn.func, e)
                _loaded.add(call.key())
        finally:
            done()
            with _idle:
                _pending -= 1
                _idle.notify_all()


def load_now(calls) -> None:
    """Load the kernels of `calls` not loaded yet, in the calling thread: a profiled program
    does before its first run, which must time the kernels and not their loading (a first
    profile charged 310 ms of it to one optimizer-update node)."""
    for call in pending(calls):
        try:
            call.run_on_zeros()
        except Exception as e:  # noqa: BLE001 - the real call compiles it or says why
            config.logger.debug("kernel load of %s failed: %s", call.fn.func, e)
        _loaded.add(call.key())


def wait(timeout: float | None = None) -> bool:
    """Block until every queued warm-up has finished (True), or `timeout` seconds passed."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout)


@contextlib.contextmanager
def paused():
    """Hold every warm-up back while inside: programs first called here run their numpy
    forms until the block ends (tests compare those forms with the kernels this way)."""
    _running.clear()
    try:
        yield
    finally:
        _running.set()


def enabled() -> bool:
    return config.background_compile()


def _forget_in_child() -> None:
    """A forked child has no warm-up thread: it drops the parent's queue (whose locks that
    thread may have held) and keeps the programs still warming on their numpy forms, which
    is also what it should run: the kernels' OpenMP threads do not survive a fork."""
    global _idle, _jobs, _worker, _pending, _running
    _idle, _jobs, _worker, _pending = threading.Condition(), queue.Queue(), None, 0
    was_running, _running = _running.is_set(), threading.Event()
    if was_running:
        _running.set()


# a short script's warm-up finishes before the interpreter does, so the kernels land in
# Numba's on-disk cache and its next run starts warm (bounded: a compile that never ends
# must not keep the process from exiting)
EXIT_WAIT_S = 300.0
atexit.register(wait, EXIT_WAIT_S)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
