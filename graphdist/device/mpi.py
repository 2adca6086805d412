"""This process's place among the workers: MPI (mpi4py over MPICH, the `mpi` extra).

`world()` is the process group a MultiWorkerMirroredStrategy runs on. Its collectives are
what the multi-worker nodes of a compiled step call (ops/mpi_collectives.py): each starts a
non-blocking MPI operation and waits for it while watching two things, so that no worker
hangs: the collective timeout (gd.config.set_collective_timeout), and abort notices. A
worker whose step raises sends every other worker a notice with its error
(`Group.abort`), and a worker waiting in a collective raises gd.WorkerError naming that
rank. mpi4py is imported here only, when a multi-worker strategy is made.
"""

from __future__ import annotations

import os
import time

from graphdist import config
from graphdist.device import threads
from graphdist.errors import WorkerError

_ABORT_TAG = 77
_world = []


def world() -> Group:
    """The process group of this MPI job (one per process)."""
    if not _world:
        _world.append(Group())
    return _world[0]


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
        # the workers on this host share its cores (BLAS and kernel threads per worker)
        host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        self.on_this_host = host.Get_size()
        host.Free()
        threads.set_processes_per_host(self.on_this_host)

    def __repr__(self) -> str:
        return f"<MPI group: rank {self.rank} of {self.size}>"

    # ------------------------------------------------------------ collectives
    def allreduce(self, buf, what: str = "an all-reduce") -> None:
        """buf <- the sum of every worker's buf (in place)."""
        if self.size > 1:
            self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM), what)

    def bcast(self, buf, root: int, what: str = "a broadcast") -> None:
        """buf <- root's buf (in place)."""
        if self.size > 1:
            self._wait(self.comm.Ibcast(buf, root=root), what)

    def allgather(self, send, recv, what: str = "an all-gather") -> None:
        """recv <- every worker's `send`, concatenated in rank order."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return
        self._wait(self.comm.Iallgather(send, recv), what)

    def barrier(self, what: str = "a barrier") -> None:
        if self.size > 1:
            self._wait(self.comm.Ibarrier(), what)

    def bcast_object(self, obj, root: int = 0, what: str = "a broadcast"):
        """A picklable object from `root` on every worker (set-up values, file names)."""
        if self.size == 1:
            return obj
        import pickle

        import numpy as np

        size = np.array([len(pickle.dumps(obj)) if self.rank == root else 0], np.int64)
        self.bcast(size, root, what)
        data = np.frombuffer(pickle.dumps(obj), np.uint8).copy() if self.rank == root \
            else np.empty(int(size[0]), np.uint8)
        self.bcast(data, root, what)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    # ------------------------------------------------------------ failures
    def abort(self, error: BaseException) -> None:
        """Tell every other worker that this one failed, and why (they raise WorkerError)."""
        if self.size == 1 or isinstance(error, WorkerError):
            return
        text = f"{type(error).__name__}: {error}"[:2000]
        self._sent += [self.notices.isend(text, dest=r, tag=_ABORT_TAG)
                       for r in range(self.size) if r != self.rank]

    def _check_notices(self, what: str) -> None:
        status = self.MPI.Status()
        if self.notices.Iprobe(source=self.MPI.ANY_SOURCE, tag=_ABORT_TAG, status=status):
            text = self.notices.recv(source=status.Get_source(), tag=_ABORT_TAG)
            raise WorkerError(f"worker {status.Get_source()} failed while worker {self.rank} "
                              f"waited in {what}: {text}")

    def _wait(self, request, what: str) -> None:
        """Wait for `request` as a blocking MPI call would, by polling it: MPICH makes
        progress on a collective only inside such calls, so a sleep between polls would
        stall every round of a large all-reduce. Every millisecond it also looks for a
        peer's abort notice and the timeout; after 50 ms (a peer is late) it polls less
        eagerly, leaving the core to other work. With more workers than cores it yields
        the core after every poll."""
        timeout = config.collective_timeout()
        start = time.perf_counter()
        check = start + 1e-3
        give_way = threads.oversubscribed()
        while not request.Test():
            if give_way:          # the peer we wait for may need this core (MPICH yields too)
                os.sched_yield()
            now = time.perf_counter()
            if now < check:
                continue
            self._check_notices(what)
            if now - start > timeout:
                raise WorkerError(f"worker {self.rank}: timed out after {timeout:g} s in {what} "
                                  "(a worker died or stopped calling the step; "
                                  "gd.config.set_collective_timeout to change)")
            check = now + 1e-3
            if now - start > 0.05:
                time.sleep(1e-4)

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
