"""A dependency-free one-line progress bar for the CLI, and the notice a slow compile
gives."""

from __future__ import annotations

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
    def __init__(self, total: int, width: int = 30, stream=None, unit: str = "steps"):
        self.total = total
        self.width = width
        self.unit = unit                    # what is counted: the rate reads "N unit/s"
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, done: int, text: str = "") -> None:
        if not self.tty and done != self.total and done % max(1, self.total // 10):
            return   # in logs, ten lines rather than one per step
        filled = int(self.width * done / max(1, self.total))
        rate = done / max(1e-9, time.perf_counter() - self.start)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{rate:6.1f} {self.unit}/s  {text}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()
