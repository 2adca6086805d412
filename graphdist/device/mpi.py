"""This process's place among the workers: MPI (mpi4py over MPICH, the `mpi` extra).

`world()` is the process group a MultiWorkerMirroredStrategy runs on. Its collectives are
what the multi-worker nodes of a compiled step call (ops/mpi_collectives.py): each starts a
non-blocking MPI operation and waits for it while watching two things, so that no worker
hangs: the collective timeout (gd.config.set_collective_timeout), and notices from the
other workers. A worker that fails (in a step, between steps, at exit: the hooks of
`install_failure_hooks`) sends every other worker a notice with its error
(`Group.abort`), and a worker waiting in a collective raises gd.WorkerError naming that
rank. Every worker caught up in a failure says so as it leaves, and leaves only once the
others have said it too (or after a few seconds): the first to leave through MPI Abort
stops the whole job, and must not cut off another's report or traceback. Under `graphdist launch` the
launcher (device/launcher.py) also tells the others, by SIGUSR1, of a worker that could not
say so itself (killed by a signal). At a timeout the waiting worker asks the others where
they are (a notice each live one answers from its own wait) and names, from its small
flight recorder and their answers, the collective of every rank, the line that called it
and the line its node was traced at (`enter_program`), and which ranks had arrived. A
compiled program's schedule check is posted as it starts and settled before its first
collective (`_before_collective`). A worker that failed leaves through MPI Abort rather
than MPI_Finalize, which would wait for ever for a hung peer. Notices and `bcast_object`
carry JSON (arrays as raw bytes), never pickles: a rank runs no code another sends.
mpi4py is imported here only, when a multi-worker strategy is made.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

from graphdist import config
from graphdist.device import threads
from graphdist.errors import WorkerError

_NOTICE_TAG = 77
_ANSWER_SECONDS = 1.0     # how long a timed-out worker waits for the others to say where they are
_EXIT_GRACE_SECONDS = 3.0  # the longest a failed worker waits for the others to hear it
_RECENT = 6               # collectives each worker remembers (its flight recorder)
_world = []


def world() -> Group:
    """The process group of this MPI job (one per process)."""
    if not _world:
        _world.append(Group())
    return _world[0]


# ---------------------------------------------------------------- JSON with raw arrays
def encode(obj) -> bytes:
    """`obj` (JSON values, tuples as lists, numpy arrays anywhere inside) as bytes: an
    8-byte length, the JSON text, then each array's raw bytes. Decoding runs no code."""
    import numpy as np

    buffers = []

    def plain(value):
        if isinstance(value, np.ndarray):
            buffers.append(np.ascontiguousarray(value).tobytes())
            return {"__array__": len(buffers) - 1, "dtype": value.dtype.str,
                    "shape": list(value.shape)}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    text = json.dumps(plain(obj)).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(buffers)


def decode(data: bytes):
    """The inverse of `encode` (tuples come back as lists)."""
    import numpy as np

    size = int.from_bytes(data[:8], "little")
    tree = json.loads(data[8:8 + size].decode())
    at = 8 + size

    def build(value):
        nonlocal at
        if isinstance(value, dict) and "__array__" in value:
            dtype = np.dtype(value["dtype"])
            count = int(np.prod(value["shape"], dtype=np.int64)) * dtype.itemsize
            array = np.frombuffer(data[at:at + count], dtype).reshape(value["shape"]).copy()
            at += count
            return array
        if isinstance(value, dict):
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    return build(tree)


def _caller_line() -> tuple | None:
    """(file, line) of the innermost frame outside graphdist on this thread, or None (a
    device thread's collective has no user frame). Formatted only when reported."""
    if threading.current_thread() is not threading.main_thread():
        return None
    frame = sys._getframe(2)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None and frame.f_code.co_filename.startswith((package, "<graphdist")):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None


def _not_user_code() -> tuple:
    """Where graphdist, the standard library and installed packages live (and '<frozen
    ...>' modules): computed before any signal handler needs it, since an import inside
    one can meet an import under way (importlib's own locks raised KeyError)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<",
            paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"])


_NOT_USER_CODE = _not_user_code()


def _in_user_code(frame) -> bool:
    """Whether `frame` (where a signal interrupted the main thread) is the user's own
    code: not graphdist's, not the standard library's, not an installed package's."""
    return frame is not None and not frame.f_code.co_filename.startswith(_NOT_USER_CODE)


def _line_text(where) -> str:
    import linecache

    if not where:
        return "no user line (a device thread)"
    filename, lineno = where
    return f"{os.path.basename(filename)}:{lineno}  {linecache.getline(filename, lineno).strip()}"


# ---------------------------------------------------------------- failing loudly
_exit_calls: list = []


def install_failure_hooks(group: Group) -> None:
    """Make any failure of this process reach the others at once: an uncaught exception
    (sys.excepthook) or a non-zero exit (sys.exit, seen at interpreter exit) sends the abort
    notice, and the process then leaves through `Group.leave`. A worker that raised a
    peer's WorkerError leaves the same way, so no process waits in MPI_Finalize for a
    hung one. A clean exit finalizes as usual. Installed once, by the first multi-worker
    strategy; not for a lone worker (no one to tell, no one to wait for)."""
    if group.size == 1 or getattr(sys.excepthook, "graphdist_group", None) is group:
        return
    previous_hook, previous_exit = sys.excepthook, sys.exit

    # each failing path reports to the launcher before it tells the others: a peer that
    # hears the notice leaves at once, and the job's teardown may then kill this process
    # before it gets to leave() (the launcher printed "no report" for it, 1 run in ~10)
    def excepthook(kind, error, tb):
        _report_to_launcher(group, 1, group.failed
                            or f"{kind.__name__}: {error}".splitlines()[0])
        group.abort(error)
        if group.failed is None:
            group.failed = f"{kind.__name__}: {error}".splitlines()[0]
        previous_hook(kind, error, tb)
        group.leave(1, group.failed)

    def exit(status=None):
        _exit_calls.append(status)
        previous_exit(status)

    def at_exit():
        status = _exit_calls[-1] if _exit_calls else None
        code = status if isinstance(status, int) else (0 if status is None else 1)
        if code == 0 and group.failed is None:
            _report_to_launcher(group, 0, "")
            return
        if code != 0:
            notice = (f"SystemExit: exited with status {code}"
                      + (f": {status}" if isinstance(status, str) else ""))
            _report_to_launcher(group, code, group.failed or notice)
            group.abort(notice)
        group.leave(code or 1, group.failed)

    excepthook.graphdist_group = group
    sys.excepthook, sys.exit = excepthook, exit
    import atexit

    atexit.register(at_exit)
    _listen_to_launcher(group)


def _listen_to_launcher(group: Group) -> None:
    """Under `graphdist launch`: write this rank's pid to the launch's status folder, which
    asks the launcher to send SIGUSR1 when another worker fails in a way it cannot tell
    (killed by a signal, or gone without a word); the launcher's lost.json says which and
    how, and this worker raises WorkerError naming it (graphdist/device/launcher.py)."""
    folder = os.environ.get("GRAPHDIST_LAUNCH_STATUS")
    if not folder or threading.current_thread() is not threading.main_thread():
        return
    import signal

    signal.signal(signal.SIGUSR1, group.launcher_says_lost)
    _write_whole(os.path.join(folder, f"rank{group.rank}.pid"), str(os.getpid()))


def _write_whole(path: str, text: str) -> None:
    """Write by rename: whole or not at all (the job's teardown may kill this process)."""
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def _report_to_launcher(group: Group, status: int, error_line: str) -> None:
    """`graphdist launch` prints one line per rank from these files (its
    GRAPHDIST_LAUNCH_STATUS folder); a rank killed before it could write has none.
    `blames`: the rank whose failure this worker's is (None: its own), so the launcher
    names the worker that failed first, whichever left first."""
    folder = os.environ.get("GRAPHDIST_LAUNCH_STATUS")
    if not folder:
        return
    try:
        _write_whole(os.path.join(folder, f"rank{group.rank}.json"),
                     json.dumps({"rank": group.rank, "status": status, "error": error_line,
                                 "blames": group.blamed}))
    except OSError:
        pass          # the report is a courtesy; the exit status still tells


class Group:
    """The MPI world: rank, size and the collectives, each bounded by the collective
    timeout and broken off by a peer's abort notice. Hashes by identity (an op parameter)."""

    def __init__(self):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError("MultiWorkerMirroredStrategy needs MPI: pip install "
                              "'graphdist[mpi]' (mpi4py and mpich), then start the workers "
                              "with `graphdist launch -n W script.py` or mpiexec") from e
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()          # the steps' collectives
        self.notices = MPI.COMM_WORLD.Dup()       # abort notices, apart from them
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._sent: list = []
        self.failed = None        # the first line of this worker's failure, once it has one
        self.blamed = None        # the rank whose failure made this worker fail
        self._announced = False   # whether this worker sent its own abort notice
        self._leaving = False
        self._waiting = False     # in a collective's wait (where a lost worker is checked)
        self._lost = False        # the launcher said another worker failed
        self.recent = collections.deque(maxlen=_RECENT)    # the flight recorder
        self._calls = 0
        self._program = None      # (traced lines, calls before it) of the running program
        self._header = None       # its schedule check, in flight until its first collective
        # the workers on this host share its cores (BLAS and kernel threads per worker)
        host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        self.on_this_host = host.Get_size()
        host.Free()
        threads.set_processes_per_host(self.on_this_host)

    def __repr__(self) -> str:
        return f"<MPI group: rank {self.rank} of {self.size}>"

    # ------------------------------------------------------------ collectives
    def allreduce(self, buf, what: str = "an all-reduce", send=None) -> None:
        """buf <- the sum of every worker's buf (in place), or of every worker's `send`
        (read straight from it: no copy into buf first)."""
        if self.size > 1:
            self._before_collective()
            source = self.MPI.IN_PLACE if send is None else send
            self._wait(self.comm.Iallreduce(source, buf, op=self.MPI.SUM), what)
        elif send is not None:
            buf[...] = send

    def post_allreduce(self, buf, send=None):
        """Start `allreduce(buf, send=send)` and return its request for `wait_for` (None:
        one worker, done already): an overlapped all-reduce (runtime/overlap.py) posts here
        and waits where its result is first read."""
        if self.size == 1:
            if send is not None:
                buf[...] = send
            return None
        self._before_collective()
        source = self.MPI.IN_PLACE if send is None else send
        return self.comm.Iallreduce(source, buf, op=self.MPI.SUM)

    def bcast(self, buf, root: int, what: str = "a broadcast") -> None:
        """buf <- root's buf (in place)."""
        if self.size > 1:
            self._before_collective()
            self._wait(self.comm.Ibcast(buf, root=root), what)

    def allgather(self, send, recv, what: str = "an all-gather") -> None:
        """recv <- every worker's `send`, concatenated in rank order."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return
        self._before_collective()
        self._wait(self.comm.Iallgather(send, recv), what)

    def reduce_scatter(self, send, recv, what: str = "a reduce-scatter") -> None:
        """recv <- this worker's block of the sum of every worker's `send` (blocks of
        recv.size elements, in rank order), read straight from `send`: half the bytes of
        an all-reduce."""
        request = self.post_reduce_scatter(send, recv)
        if request is not None:
            self._wait(request, what)

    def post_reduce_scatter(self, send, recv):
        """Start `reduce_scatter(send, recv)` and return its request for `wait_for` (None:
        one worker, done already): an overlapped reduce-scatter posts here."""
        if self.size == 1:
            recv[...] = send.reshape(-1)[:recv.size]
            return None
        self._before_collective()
        return self.comm.Ireduce_scatter_block(send, recv, op=self.MPI.SUM)

    def barrier(self, what: str = "a barrier") -> None:
        if self.size > 1:
            self._before_collective()
            self._wait(self.comm.Ibarrier(), what)

    def bcast_object(self, obj, root: int = 0, what: str = "a broadcast"):
        """`obj` from `root` on every worker (set-up values, file names): JSON values and
        numpy arrays (see `encode`; tuples arrive as lists), never a pickle."""
        if self.size == 1:
            return obj
        import numpy as np

        data = encode(obj) if self.rank == root else b""
        size = np.array([len(data)], np.int64)
        self.bcast(size, root, what)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root \
            else np.empty(int(size[0]), np.uint8)
        self.bcast(buf, root, what)
        return obj if self.rank == root else decode(buf.tobytes())

    # ------------------------------------------------------------ the running program
    def enter_program(self, traced_lines: list, header=None):
        """A compiled program starts: its k-th collective is the one `traced_lines[k]`
        (its MPI nodes' source lines, in order) was traced at, for the flight recorder.
        `header`: the schedule check's exchange, posted as the program starts (see
        `post_allgather`) so that it travels while the program computes; a callable that
        waits for it and raises on a mismatch, run before the program's first collective
        is posted. Returns what to hand `leave_program` (an outer program, if any)."""
        outer = (self._program, self._header)
        self._program = (traced_lines, self._calls)
        self._header = header
        return outer

    def leave_program(self, outer, settle: bool = True) -> None:
        """The program ended: a header still in flight (its collectives did not run) is
        settled, unless the program raised (its header is dropped: the failure is what
        the other workers hear of)."""
        try:
            if settle and self._header is not None:
                self._before_collective()
        finally:
            self._program, self._header = outer

    def post_allgather(self, send, recv):
        """Start an all-gather (recv <- every worker's send) and return its request, for
        `wait_for`: the schedule check's header."""
        return self.comm.Iallgather(send, recv)

    def wait_for(self, request, what: str) -> None:
        self._wait(request, what)

    def _before_collective(self) -> None:
        """Settle the running program's schedule header before its first collective moves
        data; its collectives count from there (the flight recorder's traced lines)."""
        if self._header is None:
            return
        header, self._header = self._header, None
        header()
        if self._program is not None:
            self._program = (self._program[0], self._calls)

    def _traced_line(self) -> str:
        if self._program is None:
            return ""
        lines, before = self._program
        k = self._calls - before - 1
        return lines[k].strip() if 0 <= k < len(lines) and lines[k] else ""

    # ------------------------------------------------------------ failures
    def abort(self, error: BaseException | str) -> None:
        """Tell every other worker that this one failed, and why (they raise WorkerError).
        Once per worker; a WorkerError (another's failure, already announced) is not sent."""
        if isinstance(error, WorkerError) or self.failed is not None:
            return
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.failed = text.splitlines()[0] if text else "failed"
        self._announced = True
        self._notify({"kind": "abort", "error": text[:2000]})

    def _notify(self, notice: dict, ranks=None) -> None:
        import numpy as np

        if self.size == 1:
            return
        data = np.frombuffer(json.dumps({**notice, "rank": self.rank}).encode(), np.uint8)
        self._sent += [(data, self.notices.Isend(data, dest=r, tag=_NOTICE_TAG))
                       for r in (ranks if ranks is not None else range(self.size))
                       if r != self.rank]

    def _next_notice(self) -> dict | None:
        import numpy as np

        status = self.MPI.Status()
        if not self.notices.Iprobe(source=self.MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            return None
        buf = np.empty(status.Get_count(self.MPI.BYTE), np.uint8)
        self.notices.Recv(buf, source=status.Get_source(), tag=_NOTICE_TAG)
        return json.loads(buf.tobytes().decode())

    def launcher_says_lost(self, signum=None, frame=None) -> None:
        """SIGUSR1 from `graphdist launch`: another worker failed (see
        `_listen_to_launcher`). In a collective's wait, or at the next one, the wait
        raises. Interrupted in the user's own code (asleep, hung in a loop of the script)
        this raises now, so that worker too says why it stops, as Ctrl-C would; never
        inside graphdist or a library (a Numba compile, a lock), where an exception from
        nowhere could leave things half done: those go on to their next collective, or
        are stopped by the launcher. A worker already failing goes on leaving."""
        self._lost = True
        if not self._waiting and self.failed is None and not self._leaving \
                and _in_user_code(frame):
            self._fail(self._lost_worker("ran outside any collective"))

    def _lost_worker(self, where: str) -> WorkerError:
        try:
            with open(os.path.join(os.environ["GRAPHDIST_LAUNCH_STATUS"], "lost.json")) as f:
                lost = json.load(f)
        except (KeyError, OSError, ValueError):
            lost = {"rank": "?", "how": "failed", "pid": "?"}
        self.blamed = lost["rank"] if self.blamed is None else self.blamed
        return WorkerError(f"worker {lost['rank']} failed ({lost['how']}, pid {lost['pid']}; "
                           f"seen by graphdist launch) while worker {self.rank} {where}")

    def _check_notices(self, what: str) -> None:
        """Raise WorkerError for a peer's abort notice or the launcher's word that a worker
        was lost; answer a timed-out peer's question (where is this worker?) and go on
        waiting."""
        if self._lost:
            self._fail(self._lost_worker(f"waited in {what}"))
        while (notice := self._next_notice()) is not None:
            if notice["kind"] == "abort":
                self.blamed = notice["rank"]
                self._fail(WorkerError(f"worker {notice['rank']} failed while worker "
                                       f"{self.rank} waited in {what}: {notice['error']}"))
            if notice["kind"] == "where":
                self._notify({"kind": "here", "recent": self._recorded()}, [notice["rank"]])

    def _fail(self, error: WorkerError):
        if self.failed is None:
            self.failed = str(error).splitlines()[0]
        raise error

    def _recorded(self) -> list:
        """The flight recorder as text: each collective's caller line, and the line its
        node was traced at (for a compiled program's)."""
        return [{**entry, "line": _line_text(entry["line"]) + (
            f"; traced at {entry['traced']}" if entry["traced"] else "")}
            for entry in self.recent]

    def _wait(self, request, what: str) -> None:
        """Wait for `request` as a blocking MPI call would, by polling it: MPICH makes
        progress on a collective only inside such calls, so a sleep between polls would
        stall every round of a large all-reduce. Every millisecond it also looks for a
        peer's notice and the timeout; after 50 ms (a peer is late) it polls less
        eagerly, leaving the core to other work. With more workers than cores it yields
        the core after every poll. The collective goes into the flight recorder."""
        self._calls += 1
        entry = {"call": self._calls, "what": what, "line": _caller_line(),
                 "traced": self._traced_line(), "done": False}
        self.recent.append(entry)
        timeout = config.collective_timeout()
        start = time.perf_counter()
        give_way = threads.oversubscribed()
        self._waiting = True
        try:
            self._poll(request, what, entry, timeout, start, give_way)
        finally:
            self._waiting = False
        entry["done"] = True

    def _poll(self, request, what: str, entry: dict, timeout: float, start: float,
              give_way: bool) -> None:
        check = start + 1e-3
        while not request.Test():
            if give_way:          # the peer we wait for may need this core (MPICH yields too)
                os.sched_yield()
            now = time.perf_counter()
            if now < check:
                continue
            self._check_notices(what)
            if now - start > timeout:
                self._fail(self._timed_out(timeout, what))
            check = now + 1e-3
            if now - start > 0.05:
                time.sleep(1e-4)

    def _timed_out(self, timeout: float, what: str) -> WorkerError:
        """The timeout's error: each rank's collective and line, from the answers of those
        still waiting in one (asked now) and this worker's flight recorder."""
        self._notify({"kind": "where"})
        answers = {self.rank: self._recorded()}
        until = time.perf_counter() + _ANSWER_SECONDS
        while len(answers) < self.size and time.perf_counter() < until:
            if self._lost:
                return self._lost_worker(f"waited in {what}")
            notice = self._next_notice()
            if notice is None:
                time.sleep(1e-3)
            elif notice["kind"] == "here":
                answers[notice["rank"]] = notice["recent"]
            elif notice["kind"] == "abort":
                self.blamed = notice["rank"]
                return WorkerError(f"worker {notice['rank']} failed while worker {self.rank} "
                                   f"waited in {what}: {notice['error']}")
        mine = answers[self.rank][-1]
        arrived = sorted(r for r, recent in answers.items() if recent and not recent[-1]["done"]
                         and recent[-1]["call"] == mine["call"]
                         and recent[-1]["what"] == mine["what"])
        lines = [f"worker {self.rank}: timed out after {timeout:g} s in {what} (call "
                 f"{mine['call']}, at {mine['line']}); ranks that had arrived: {arrived}; "
                 "gd.config.set_collective_timeout to change"]
        for rank in range(self.size):
            recent = answers.get(rank)
            if recent is None:
                lines.append(f"  worker {rank}: no answer in {_ANSWER_SECONDS:g} s: hung, "
                             "dead, or busy outside any collective")
                continue
            state = "waiting in" if recent and not recent[-1]["done"] else "last finished"
            last = recent[-1] if recent else None
            lines.append(f"  worker {rank}: {state} " + (f"call {last['call']}, {last['what']} "
                         f"at {last['line']}" if last else "no collective yet"))
            lines += [f"    recent: call {e['call']}, {e['what']} at {e['line']}"
                      f"{'' if e['done'] else ' (not finished)'}" for e in recent[:-1]]
        return WorkerError("\n".join(lines))

    # ------------------------------------------------------------ leaving
    def leave(self, status: int, error_line: str) -> None:
        """A failed worker's way out: report to the launcher, say it is leaving, wait until
        the others caught up in the failure have said so too, then MPI Abort (never
        MPI_Finalize, which waits for hung peers). Once: MPI_Abort may return before the
        launcher stops this process, and the interpreter's exit would come here again."""
        if self._leaving:
            os._exit(status or 1)
        self._leaving = True
        _report_to_launcher(self, status, error_line)
        sys.stdout.flush()
        sys.stderr.flush()
        self._notify({"kind": "leaving"})
        self._until_others_leave(time.perf_counter() + _EXIT_GRACE_SECONDS)
        self.MPI.COMM_WORLD.Abort(status or 1)
        os._exit(status or 1)

    def _until_others_leave(self, deadline: float) -> None:
        """Wait until this worker's notices are sent and, if it took part in a failure (it
        failed first, or raised another's), until every other worker has said it is
        leaving: MPI Abort stops every process of the job, so the first to call it would
        otherwise cut off the others' reports and tracebacks (a peer between steps hears
        of the failure at its next collective). At most until `deadline`: a dead, hung or
        busy peer does not answer, and one the launcher saw die never will."""
        waiting_for = set()
        if self._announced or self.blamed is not None:
            waiting_for = set(range(self.size)) - {self.rank}
            if self._lost and isinstance(self.blamed, int):
                waiting_for.discard(self.blamed)
        while time.perf_counter() < deadline:
            while (notice := self._next_notice()) is not None:
                if notice["kind"] == "leaving":
                    waiting_for.discard(notice["rank"])
            if not waiting_for and all(r.Test() for _, r in self._sent):
                return
            time.sleep(1e-3)

    def allgather_bytes(self, data: bytes, what: str = "an all-gather of bytes") -> list:
        """Every worker's `data` (of any length), in rank order: the lengths first, then
        the bytes padded to the longest (descriptions exchanged when workers disagree)."""
        import numpy as np

        if self.size == 1:
            return [bytes(data)]
        lengths = np.empty(self.size, np.int64)
        self.allgather(np.array([len(data)], np.int64), lengths, what)
        width = max(int(lengths.max()), 1)
        mine = np.zeros(width, np.uint8)
        mine[:len(data)] = np.frombuffer(data, np.uint8)
        every = np.empty(width * self.size, np.uint8)
        self.allgather(mine, every, what)
        return [every[r * width:r * width + int(n)].tobytes() for r, n in enumerate(lengths)]
