"""A dependency-free one-line progress bar for the CLI, and the notice a slow compile
gives."""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time

# a first call that takes longer than this says what it is doing (trace, passes, kernels)
SLOW_SECONDS = 1.0


@contextlib.contextmanager
def slow_notice(what: str, stream=None):
    """If the block runs longer than SLOW_SECONDS, say `what` is happening (on stderr, from
    a timer thread, while it still runs) and then how long it took."""
    stream = stream or sys.stderr
    start = time.perf_counter()
    told = threading.Event()

    def tell():
        told.set()
        stream.write(f"graphdist: {what} ...\n")
        stream.flush()

    timer = threading.Timer(SLOW_SECONDS, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if told.is_set():
            stream.write(f"graphdist: done in {time.perf_counter() - start:.1f} s\n")
            stream.flush()


class ProgressBar:
    """`[####......] 40/100  812.3 steps/s  loss 0.4121`, redrawn in place on a terminal
    (ten lines in a log).

    The rate is the current one: steps over the time between the oldest and the newest of
    the last `window` updates, as Keras' progress bar leaves out its first step. The time up
    to the first update (the first call traces and compiles) counts only while it is all
    there is; an average since the start would go on charging the compile to every step.
    `clock` (seconds, time.perf_counter by default) is there for tests."""

    def __init__(self, total: int, width: int = 30, stream=None, unit: str = "steps",
                 window: int = 10, clock=time.perf_counter):
        self.total = total
        self.width = width
        self.unit = unit                    # what is counted: the rate reads "N unit/s"
        self.stream = stream or sys.stdout
        self.clock = clock
        self.start = clock()
        self.recent = collections.deque(maxlen=max(2, window))   # (done, time) per update
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def rate(self) -> float:
        """Steps per second now (0 before the first update)."""
        if not self.recent:
            return 0.0
        done, now = self.recent[-1]
        if len(self.recent) == 1:           # only the first call so far: compile included
            return done / max(1e-9, now - self.start)
        first_done, first_time = self.recent[0]
        return (done - first_done) / max(1e-9, now - first_time)

    def update(self, done: int, text: str = "") -> None:
        self.recent.append((done, self.clock()))
        if not self.tty and done != self.total and done % max(1, self.total // 10):
            return   # in logs, ten lines rather than one per step
        filled = int(self.width * done / max(1, self.total))
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{self.rate():6.1f} {self.unit}/s  {text}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()
