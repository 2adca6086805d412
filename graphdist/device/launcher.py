"""The process manager of `graphdist launch`: W worker processes on this host, and the MPI
job they form, without mpiexec.

MPICH's own launcher (hydra's mpiexec) listens for its control connections on every
network interface (0.0.0.0) for the whole job, and MPICH has no setting to change that
(its listening code binds INADDR_ANY). This one opens no port at all: each worker talks
to it over a socket pair, with the PMI-1 wire protocol MPICH's ranks speak to any
process manager (PMI_FD, PMI_RANK, PMI_SIZE: its key-value store for the ranks' business
cards, a barrier, abort). The ranks' own MPI traffic goes through shared memory, and the
sockets they listen on are bound to the loopback interface (LOOPBACK below).

Being every worker's parent, it knows how each one ended: a worker killed by a signal is
named by rank, pid and signal. The first failure (a non-zero exit, a signal, an MPI abort)
ends the job: the others are told which worker failed and how (a line in the launch's
status folder, then SIGUSR1, which graphdist/device/mpi.py turns into a WorkerError at
their next collective wait, or at once where it finds the worker in the user's own code),
and whoever is left after a grace period is killed.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import time

# the ranks' own sockets listen on the loopback interface only: MPICH's libfabric netmod over
# its tcp provider, bound to lo (the default UCX netmod listens on every interface); MPICH's
# shared memory carries the data between ranks of one host
LOOPBACK = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}
GRACE_SECONDS = 3.0        # for the others to raise and leave after a worker failed
LOST_FILE = "lost.json"    # which worker failed and how, for the others (mpi.py reads it)


class Worker:
    """One rank: its process and the launcher's end of its PMI socket."""

    def __init__(self, rank: int, process: subprocess.Popen, pmi: socket.socket):
        self.rank, self.process, self.pmi = rank, process, pmi
        self.pending = b""
        self.aborted = None           # the exit code of its MPI abort, once it asked
        self.stopped = False          # killed by the launcher, the job being over
        self.ended = None             # how it ended, in words, once it has

    @property
    def pid(self) -> int:
        return self.process.pid


def how_it_ended(returncode: int) -> str:
    """An exit status in words: 'exit 3' or 'killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


class Job:
    """W ranks of `command`, started at once, served until every one has ended."""

    def __init__(self, command: list, workers: int, env: dict, status_dir: str):
        self.size = workers
        self.status_dir = status_dir
        # unique per job: MPICH names its shared-memory segments after it, and a job killed
        # before it could remove them would otherwise meet the next one's
        self.kvs_name = f"graphdist_{os.getpid()}_{os.urandom(4).hex()}"
        self.kvs = {"PMI_process_mapping": f"(vector,(0,1,{workers}))"}
        self.barrier = set()
        self.failure = None           # the first worker the launcher saw fail
        self.kill_at = None
        self.selector = selectors.DefaultSelector()
        self.workers = [self._start(rank, command, env) for rank in range(workers)]

    def _start(self, rank: int, command: list, env: dict) -> Worker:
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env={
            **env, "PMI_FD": str(theirs.fileno()), "PMI_RANK": str(rank),
            "PMI_SIZE": str(self.size), "GRAPHDIST_LAUNCH_STATUS": self.status_dir})
        theirs.close()
        worker = Worker(rank, process, ours)
        self.selector.register(ours, selectors.EVENT_READ, worker)
        return worker

    # ------------------------------------------------------------ running
    def wait(self) -> int:
        """Serve the ranks until all have ended; the job's exit status: 0, or the first
        failure's (its exit code, or 128 + the signal that killed it)."""
        try:
            while any(w.ended is None for w in self.workers):
                for key, _ in self.selector.select(timeout=0.02):
                    self._serve(key.data)
                self._reap()
                if self.kill_at is not None and time.monotonic() > self.kill_at:
                    self._stop_the_rest()
        except BaseException:
            self._stop_the_rest()
            raise
        finally:
            self.selector.close()
        if self.failure is None:
            return 0
        first = self.failure
        if first.aborted is not None:
            return first.aborted or 1
        code = first.process.returncode
        return 128 - code if code < 0 else (code or 1)

    def _reap(self) -> None:
        for worker in self.workers:
            if worker.ended is not None or worker.process.poll() is None:
                continue
            code = worker.process.returncode
            worker.ended = (f"MPI abort with exit code {worker.aborted}"
                            if worker.aborted is not None else how_it_ended(code))
            if code != 0 or worker.aborted is not None:
                self._failed(worker)
            self._forget(worker)

    def _forget(self, worker: Worker) -> None:
        try:
            self.selector.unregister(worker.pmi)
        except (KeyError, ValueError):
            pass
        worker.pmi.close()

    def _failed(self, worker: Worker) -> None:
        """The first failure ends the job: the others that listen (their pid file says so)
        are told which worker failed and how; any left after the grace are killed."""
        if self.failure is not None or worker.stopped:
            return
        self.failure = worker
        how = worker.ended or (f"MPI abort with exit code {worker.aborted}")
        path = os.path.join(self.status_dir, LOST_FILE)
        with open(f"{path}.tmp", "w") as f:
            json.dump({"rank": worker.rank, "pid": worker.pid, "how": how}, f)
        os.replace(f"{path}.tmp", path)
        for other in self.workers:
            if other is not worker and other.ended is None and self._listens(other):
                try:
                    other.process.send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        self.kill_at = time.monotonic() + GRACE_SECONDS

    def _listens(self, worker: Worker) -> bool:
        """Whether the rank asked to be told of a failure (graphdist's failure hooks write
        its pid; any other program would die of SIGUSR1)."""
        try:
            with open(os.path.join(self.status_dir, f"rank{worker.rank}.pid")) as f:
                return int(f.read()) == worker.pid
        except (OSError, ValueError):
            return False

    def _stop_the_rest(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.stopped = True
                worker.process.kill()
        for worker in self.workers:
            worker.process.wait()
        self._reap()

    def first_failed(self, reports: dict) -> Worker:
        """The worker whose failure ended the job. The first to leave may be one that
        only heard of another's (a worker that fails waits a moment for its notice to
        arrive before it leaves): follow the reports' `blames` to the one that failed on
        its own."""
        worker, seen = self.failure, set()
        while worker.rank not in seen:
            seen.add(worker.rank)
            blamed = (reports.get(worker.rank) or {}).get("blames")
            if not isinstance(blamed, int) or not 0 <= blamed < self.size:
                break
            worker = self.workers[blamed]
        return worker

    def lines(self, reports: dict) -> list[str]:
        """One line per rank on how it ended: its own report (exit status, first error
        line) where it wrote one, else what the launcher saw."""
        out = []
        for worker in self.workers:
            report = reports.get(worker.rank)
            if report is not None:
                line = f"exit {report['status']}" + (f": {report['error']}"
                                                     if report["error"] else "")
            elif worker.stopped:
                line = (f"stopped by the launcher {GRACE_SECONDS:g} s after worker "
                        f"{self.failure.rank} failed" if self.failure is not None
                        else "stopped by the launcher")
            else:
                line = f"{worker.ended}, before it could report"
            out.append(f"worker {worker.rank} (pid {worker.pid}): {line}")
        return out

    # ------------------------------------------------------------ the PMI-1 wire protocol
    def _serve(self, worker: Worker) -> None:
        try:
            data = worker.pmi.recv(65536)
        except OSError:
            data = b""
        if not data:                  # the rank closed its end (exited): reaped soon
            self._forget(worker)
            return
        worker.pending += data
        while b"\n" in worker.pending:
            line, worker.pending = worker.pending.split(b"\n", 1)
            self._command(worker, line.decode(errors="replace"))

    def _command(self, worker: Worker, line: str) -> None:
        command, _, rest = line.partition(" ")
        fields = _fields(rest)
        name = command.partition("=")[2]
        reply = {
            "init": lambda: "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0",
            "get_maxes": lambda: "cmd=maxes kvsname_max=256 keylen_max=256 "
                                 "vallen_max=1024 rc=0",
            "get_appnum": lambda: "cmd=appnum appnum=0 rc=0",
            "get_universe_size": lambda: f"cmd=universe_size size={self.size} rc=0",
            "get_my_kvsname": lambda: f"cmd=my_kvsname kvsname={self.kvs_name} rc=0",
            "put": lambda: self._put(fields),
            "get": lambda: self._get(fields),
            "finalize": lambda: "cmd=finalize_ack rc=0",
        }.get(name)
        if name == "barrier_in":
            self.barrier.add(worker.rank)
            if len(self.barrier) == self.size:
                self.barrier.clear()
                for each in self.workers:
                    self._send(each, "cmd=barrier_out rc=0")
            return
        if name == "abort":           # hydra kills an aborting rank: MPI_Abort may not return
            worker.aborted = _int(fields.get("exitcode", "1"))
            self._failed(worker)
            worker.process.kill()
            return
        self._send(worker, reply() if reply else f"cmd={name} rc=1 msg=unknown_command")

    def _put(self, fields: dict) -> str:
        self.kvs[fields["key"]] = fields.get("value", "")
        return "cmd=put_result rc=0"

    def _get(self, fields: dict) -> str:
        value = self.kvs.get(fields.get("key", ""))
        if value is None:
            return "cmd=get_result rc=1 msg=key_not_found"
        return f"cmd=get_result rc=0 found=TRUE value={value}"

    def _send(self, worker: Worker, line: str) -> None:
        if worker.ended is None and worker.pmi.fileno() != -1:
            try:
                worker.pmi.sendall(line.encode() + b"\n")
            except OSError:
                pass


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 1


def _fields(text: str) -> dict:
    """'key=value key2=value 2' -> a dict; a value runs to the next ' key=' (an abort's
    message may hold spaces)."""
    fields, key = {}, None
    for word in text.split(" "):
        name, eq, value = word.partition("=")
        if eq and name.isidentifier():
            key = name
            fields[key] = value
        elif key is not None:
            fields[key] += " " + word
    return fields
