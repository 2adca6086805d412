"""The few exception classes graphdist raises; each subclasses what a Python user would catch."""

from __future__ import annotations


class ShapeError(ValueError):
    """Shapes that do not fit an op; the message names the op and both shapes."""


class TraceError(RuntimeError):
    """User code did something tracing cannot capture (data-dependent Python control flow...)."""


class GraphError(AssertionError):
    """Malformed IR. Always a bug in a pass, never the user's fault."""


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or does not match what is tracked."""


class WorkerError(RuntimeError):
    """Another worker (or replica) failed; the message names which one."""
