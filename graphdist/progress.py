"""A dependency-free one-line progress bar for the CLI."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, width: int = 30, stream=None):
        self.total = total
        self.width = width
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, done: int, text: str = "") -> None:
        if not self.tty and done != self.total and done % max(1, self.total // 10):
            return   # in logs, ten lines rather than one per step
        filled = int(self.width * done / max(1, self.total))
        rate = done / max(1e-9, time.perf_counter() - self.start)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{rate:6.1f} steps/s  {text}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()
