"""Workers agree on which collectives they run before any data moves (issue 23, item 2).

A compiled program that crosses worker processes (the "mpi" lowering) has a collective
schedule: its MPI nodes in program order, each with its kind, shapes, dtypes, reduce op and
lowering. `schedule_of` lists it and `fingerprint` hashes it (sha256 of a canonical JSON)
when the program is built. Every call of such a program, a step or an eager
`strategy.reduce`/`gather` (which compiles a small program of its own), exchanges a
16-byte header with the other workers: the group's call number and the fingerprint. It is
posted as the program starts and waited for just before the program's first collective
posts (`Group.enter_program`), so it travels while the forward and backward pass compute.
Headers that differ mean the workers are about to run different collectives (one called an
extra reduce, or compiled a different step): rather than sum one worker's 5 floats into the
other's gradient bucket, every worker raises WorkerError naming the first differing
collective and each rank's entry and source line, before any data moves (what the program
computed before its first collective is dropped with the error; the updates come after).
Collectives outside compiled code (`agree_on_collective`) wait for theirs at once.

The header costs one small all-gather per call of such a program; a step's own
collectives are checked by it too, since an extra eager collective on one worker meets the
other worker's next step (a check on eager calls alone would pair its header with the
step's gradient all-reduce). GRAPHDIST_SCHEDULE_CHECK=first checks each program at its
first call only (to measure the header's cost); =0 turns the check off.
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import sys

import numpy as np

from graphdist.errors import WorkerError
from graphdist.ir import Graph

_calls: dict = {}          # id(group) -> the number of checked calls made on it


def schedule_of(graph: Graph) -> list[dict]:
    """Each collective across workers of a placed graph, in program order."""
    entries = []
    for eqn in graph.eqns:
        # an overlapped all-reduce is its start's eqn (runtime/overlap.py)
        name = getattr(eqn.op, "name", str(eqn.op)).removesuffix("_start")
        if not name.startswith("mpi_"):
            continue
        params = eqn.attrs
        entries.append({
            "kind": name[len("mpi_"):],
            "shapes": [list(v.ty.shape) for v in eqn.inputs],
            "dtypes": [str(np.dtype(v.ty.dtype)) for v in eqn.inputs],
            "op": params.get("op", ""),
            "lowering": "mpi",
            "line": eqn.source,
        })
    return entries


def group_of(graph: Graph):
    """The process group of the graph's collectives (None: it has none)."""
    for eqn in graph.eqns:
        if getattr(eqn.op, "name", "").startswith("mpi_"):
            return eqn.attrs.get("group")
    return None


def fingerprint(entries: list[dict]) -> bytes:
    """sha256 of the schedule (the source lines left out: two workers may run the same
    collectives from different lines)."""
    canonical = [{k: v for k, v in e.items() if k != "line"} for e in entries]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True,
                                     separators=(",", ":")).encode()).digest()


def _mode() -> str:
    return os.environ.get("GRAPHDIST_SCHEDULE_CHECK", "every")


def _describe(e: dict) -> str:
    ops = f" {e['op']}" if e["op"] else ""
    shapes = ", ".join(f"{d}{tuple(s)}" for d, s in zip(e["dtypes"], e["shapes"]))
    where = f" (traced at {e['line'].strip()})" if e["line"] else ""
    return f"{e['kind']}{ops} of {shapes}{where}"


def _mismatch_text(rank: int, sides: list[dict]) -> str:
    """The message every worker raises: the first differing collective, each rank's."""
    schedules = [s["schedule"] for s in sides]
    longest = max(len(s) for s in schedules)
    first = next((k for k in range(longest)
                  if len({json.dumps(_unplaced(s, k), sort_keys=True)
                          for s in schedules}) > 1), 0)
    lines = [f"worker {rank}: the workers are about to run different collectives "
             f"(collective #{first} of their programs differs; no data was exchanged):"]
    for r, side in enumerate(sides):
        sched = side["schedule"]
        entry = _describe(sched[first]) if first < len(sched) else \
            f"nothing (its program has {len(sched)} collective(s))"
        lines.append(f"  rank {r}: call #{side['call']} at {side['caller'] or '?'}: {entry}")
    return "\n".join(lines)


def _unplaced(schedule: list[dict], k: int):
    return None if k >= len(schedule) else {x: v for x, v in schedule[k].items()
                                            if x != "line"}


def agree(group, schedule: list[dict], digest: bytes) -> None:
    """Exchange (call number, digest) with every worker; raise on every worker where any
    differs. Called before the program's first collective."""
    Header(group, schedule, digest, sys._getframe(1))()


class Header:
    """One check: this worker's (call number, digest) all-gathered with every worker's,
    posted when made; calling it waits for the exchange and raises WorkerError on every
    worker where any differs (then exchanging the schedules, to name them)."""

    def __init__(self, group, schedule: list[dict], digest: bytes, frame=None,
                 on_agreed=None):
        self.call = _calls.get(id(group), 0)
        _calls[id(group)] = self.call + 1
        self.group, self.schedule, self.frame, self.on_agreed = group, schedule, frame, on_agreed
        if group.size == 1:
            self.request = None
            return
        self.header = np.array([self.call, int.from_bytes(digest[:8], "little", signed=True)],
                               np.int64)
        self.every = np.empty(2 * group.size, np.int64)
        self.request = group.post_allgather(self.header, self.every)

    def __call__(self) -> None:
        group = self.group
        if self.request is not None:
            group.wait_for(self.request, "the check of the workers' collective schedules")
            if not (self.every.reshape(group.size, 2) == self.header).all():
                mine = json.dumps({"call": self.call, "caller": _caller_text(self.frame),
                                   "schedule": self.schedule})
                sides = [json.loads(b) for b in group.allgather_bytes(
                    mine.encode(), "the exchange of differing collective schedules")]
                raise WorkerError(_mismatch_text(group.rank, sides))
        if self.on_agreed is not None:
            self.on_agreed()


def _caller_text(frame) -> str:
    """'file.py:14  <line>' of the innermost frame outside graphdist from `frame` out (the
    frame that called the program: its thread may be a device thread by now)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None and frame.f_code.co_filename.startswith((package, "<graphdist")):
        frame = frame.f_back
    if frame is None:
        return ""
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    return f"{os.path.basename(filename)}:{lineno}  {linecache.getline(filename, lineno).strip()}"


def agree_on_collective(group, kind: str, shape=(), dtype: str = "", op: str = "") -> None:
    """The same check for one collective outside compiled code (a checkpoint's rendezvous,
    an object broadcast): call it on every worker just before the collective, with what it
    moves. A worker that is elsewhere (in a step, another collective) makes every worker
    raise WorkerError naming both."""
    schedule = [{"kind": kind, "shapes": [list(shape)], "dtypes": [str(dtype)], "op": op,
                 "lowering": "mpi", "line": ""}]
    agree(group, schedule, fingerprint(schedule))


class ScheduleChecked:
    """An executable whose program runs collectives across workers, checked first: at its
    first call always, and at every call unless GRAPHDIST_SCHEDULE_CHECK says otherwise."""

    def __init__(self, inner, group, schedule: list[dict]):
        self.inner = inner
        self.group = group
        self.schedule = schedule
        self.digest = fingerprint(schedule)
        self.lines = [e["line"] for e in schedule]
        self.checked = False

    def __call__(self, arrays):
        """Run the program, its header in flight meanwhile: posted now, settled by the
        group before the program's first collective posts (so the exchange overlaps the
        computation before it, and no data moves unless the workers agree)."""
        mode = _mode()
        header = None
        if mode != "0" and not (self.checked and mode == "first"):
            header = Header(self.group, self.schedule, self.digest, sys._getframe(1),
                            self._agreed)
        # the group's flight recorder pairs the program's collectives with their traced lines
        outer = self.group.enter_program(self.lines, header)
        try:
            result = self.inner(arrays)
        except BaseException:
            self.group.leave_program(outer, settle=False)
            raise
        self.group.leave_program(outer)
        return result

    def _agreed(self) -> None:
        self.checked = True

    def __getattr__(self, name):
        return getattr(self.inner, name)


def checked(executable, graph: Graph):
    """`executable`, wrapped in the schedule check where its graph crosses workers."""
    group = group_of(graph)
    if group is None:
        return executable
    return ScheduleChecked(executable, group, schedule_of(graph))
