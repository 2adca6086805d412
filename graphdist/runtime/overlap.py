"""Communication hidden behind compute (issue 26, item 1): each bucket's all-reduce starts as
soon as its last gradient exists and is waited for where its result is first used.

The `overlap` stage (after `lower_collectives`, before `schedule`) splits every host or MPI
all-reduce node into two eqns the views show:

    t = host_all_reduce_start[op=sum, channel=c0] b0 b1 b2 b3
    ...                               # the rest of the backward pass runs meanwhile
    g0 g1 g2 g3 = collective_wait[channel=c0] t b0 b1 b2 b3

and schedules the program so that the starts come first: the device segments are
interleaved eqn by eqn (each device keeps its own order, so nothing changes numerically),
each start (with the reshapes and the bucket concat feeding it) runs as soon as its inputs
exist, which puts the buckets in reverse forward order as DDP does, and each wait sits just
before the first eqn that reads its results (or the next collective that is not split, so
that every worker issues its collectives in one order).

At run time a host start hands the collective's own kernel (the one the inline node would
run: the same sums in the same order, so the bits do not change) to the program's
communication thread and returns a token; the wait joins it. numpy and the Numba kernels
release the interpreter lock, so the backward pass computes while the thread reduces. An
MPI start posts the non-blocking all-reduce (`Group.post_allreduce`) from the program's own
thread and its wait polls it (`Group.wait_for`: the abort notices and the timeout as
ever), so every worker's MPI calls keep the program's order.
The wait names the bucket's inputs too, so their buffers stay alive (not reused by the
buffer plan) until the thread has read them; the results go to buffers the channel keeps
(fresh ones when the step returns them).

GPU collectives (`nccl_all_reduce`) already run on their own streams and are not split.
`gd.config.set_overlap(False)` runs every collective inline, where the step computed it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from graphdist.device.backends import backend_for
from graphdist.ir import Graph, Var
from graphdist.ir.types import ArrayType
from graphdist.ops.array import concat_p, reshape_p
from graphdist.ops.core import Op
from graphdist.ops.host_collectives import host_all_reduce_p
from graphdist.ops.mpi_collectives import mpi_all_reduce_p

TOKEN = ArrayType((), np.dtype(np.int32))

# the collectives the stage splits: host memory all-reduces, within a process or across
# worker processes
SPLIT_OPS = (host_all_reduce_p, mpi_all_reduce_p)

# ops that only lay a bucket out (flatten, concatenate): hoisted with the start they feed
_LAYOUT_OPS = (reshape_p, concat_p)

_SPANS_KEPT = 4096       # worker (start, end) times a channel keeps for profiles


class CommWorker:
    """The single communication thread of one program: collectives run in the order they
    were started (FIFO), which every worker process shares."""

    def __init__(self):
        self._pool = None
        self._pid = None
        self._lock = threading.Lock()

    def submit(self, fn):
        with self._lock:
            # a forked child has the parent's pool but not its thread: it starts its own
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="graphdist-comm")
                self._pid = os.getpid()
        return self._pool.submit(fn)


class Channel:
    """One split collective: its kernel, its result buffers and the run in flight. An op
    parameter, so hashed by identity; printed as c<k> in graph text."""

    _ids = itertools.count()

    def __init__(self, collective: Op, params: dict, device, out_types, worker: CommWorker,
                 handed_out: bool):
        self.collective = collective
        self.params = params
        self.device = device
        self.out_types = tuple(out_types)
        self.worker = worker
        self.handed_out = handed_out      # a result leaves the program: fresh arrays
        self.id = next(Channel._ids)
        self.spans = collections.deque(maxlen=_SPANS_KEPT)   # perf_counter (start, end)
        self._runner = None
        self._outs = None
        self._pending = None

    def __repr__(self) -> str:
        return f"c{self.id}"

    def runner(self):
        """fn(outs, *xs): what the inline node runs (runtime/kernel_table.py's choice)."""
        if self._runner is None:
            from graphdist import config
            from graphdist.runtime import kernel_table

            backend = backend_for(self.device) if self.device else backend_for("cpu:0")
            types = [*self.out_types, *self.out_types]
            fn = kernel_table.kernel(backend, self.collective, types,
                                     fused=config.fused_kernels())
            if fn is None:
                fn = kernel_table.out_impl(backend, self.collective, types,
                                           fused=config.fused_kernels())
            params = self.params
            self._runner = lambda outs, *xs: fn(outs, *xs, **params)
        return self._runner

    def buffers(self, xp):
        if self.handed_out or self._outs is None:
            outs = tuple(xp.empty(t.shape, t.dtype) for t in self.out_types)
            if self.handed_out:
                return outs
            self._outs = outs
        return self._outs

    def start(self, xp, xs):
        if self._pending is not None:      # a step that raised left one behind
            self._drain()
        if self.collective is mpi_all_reduce_p:
            self._pending = _PostedMpi(self, xp, xs)
            return
        run, outs = self.runner(), self.buffers(xp)

        def job():
            t0 = time.perf_counter()
            run(outs, *xs)
            self.spans.append((t0, time.perf_counter()))
            return outs

        self._pending = self.worker.submit(job)

    def wait(self):
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"collective_wait[{self!r}]: no collective was started")
        return pending.result()

    def _drain(self):
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except Exception:      # noqa: BLE001 - its step already raised; this one goes on
            pass


class _PostedMpi:
    """An MPI all-reduce posted from the program's own thread (`Group.post_allreduce`) and
    waited for at its first reader, with the steps of `mpi_all_reduce`'s out= form around
    it (the same local sum, the same MPI call: the same bits). No thread: a second thread
    polling MPI would hold the interpreter lock between its polls, and MPI calls from two
    threads of a worker could reach the wire in different orders on different workers."""

    def __init__(self, channel: Channel, xp, xs):
        params = channel.params
        self.channel, self.xp = channel, xp
        self.outs = channel.buffers(xp)
        self.acc = self.outs[0].reshape(-1)
        self.what = f"an all-reduce of {ArrayType(xs[0].shape, xs[0].dtype)}"
        self.t0 = time.perf_counter()
        send = None
        if len(xs) == 1:
            send = xs[0].reshape(-1)
        else:
            xp.add(xs[0].reshape(-1), xs[1].reshape(-1), out=self.acc)
            for x in xs[2:]:
                xp.add(self.acc, x.reshape(-1), out=self.acc)
        self.request = params["group"].post_allreduce(self.acc, send)

    def result(self):
        params, xp, acc = self.channel.params, self.xp, self.acc
        if self.request is not None:
            params["group"].wait_for(self.request, self.what)
        if params["op"] == "mean":
            xp.divide(acc, acc.dtype.type(params["replicas"]), out=acc)
        for out in self.outs[1:]:
            xp.copyto(out, acc.reshape(out.shape))
        self.channel.spans.append((self.t0, time.perf_counter()))
        return self.outs


# ------------------------------------------------------------------ ops
def _start_shape(*xs, channel, **params):
    return TOKEN


def _start_impl(xp, *xs, channel, **params):
    channel.start(xp, xs)
    return np.zeros((), np.int32)


def _start_cost(ins, outs, *, channel, **params):
    return channel.collective.cost_rule(ins, list(channel.out_types), **params)


def _wait_shape(token, *xs, channel):
    return channel.out_types


def _wait_impl(xp, token, *xs, channel):
    return channel.wait()


def _make_start(name: str) -> Op:
    op = Op(name, collective=True, num_outputs=1, differentiable=False, stateful=True)
    op.def_shape(_start_shape)
    op.def_impl(_start_impl)
    op.def_cost(_start_cost)
    return op


# the start of each split collective ("mpi_" names what the schedule check counts)
host_all_reduce_start_p = _make_start("host_all_reduce_start")
mpi_all_reduce_start_p = _make_start("mpi_all_reduce_start")
START_OF = {host_all_reduce_p: host_all_reduce_start_p, mpi_all_reduce_p: mpi_all_reduce_start_p}
# a collective too: it hands every replica's buffer its result
collective_wait_p = Op("collective_wait", collective=True, num_outputs=None,
                       differentiable=False, stateful=True)
collective_wait_p.def_shape(_wait_shape)
collective_wait_p.def_impl(_wait_impl)
collective_wait_p.def_cost(lambda ins, outs, **_: (0, 0))

START_OPS = tuple(START_OF.values())


def is_start(op) -> bool:
    return op in START_OPS


# ------------------------------------------------------------------ the stage
def overlap_collectives(g: Graph) -> Graph:
    """Split each host/MPI all-reduce into a start and a wait and schedule them to overlap
    the compute (see the module docstring). A graph without one comes back as it is."""
    if not any(e.op in SPLIT_OPS for e in g.eqns):
        return g
    worker = CommWorker()
    returned = {v for v in g.outputs[: g.num_results] if isinstance(v, Var)}
    order = _hoisted_order(g.eqns)
    starts, waits = [], {}
    for eqn in order:
        if eqn.op not in SPLIT_OPS:
            starts.append(eqn)
            continue
        start, wait = _split(eqn, worker, returned)
        starts.append(start)
        waits[start] = wait
    return replace(g, eqns=tuple(_place_waits(starts, waits)), liveness=None)


def _split(eqn, worker: CommWorker, returned: set):
    params = dict(eqn.params)
    channel = Channel(eqn.op, params, eqn.device, [v.ty for v in eqn.outputs], worker,
                      any(v in returned for v in eqn.outputs))
    token = Var(TOKEN, hint=f"{eqn.op.name}_started", device=eqn.device)
    start = replace(eqn, op=START_OF[eqn.op], outputs=(token,),
                    params=tuple({**params, "channel": channel}.items()))
    wait = replace(eqn, op=collective_wait_p, inputs=(token, *eqn.inputs),
                   params=(("channel", channel),))
    return start, wait


def _hoisted_order(eqns) -> list:
    """Eqns in an order the data allows: each device's eqns in their own order, the devices
    interleaved eqn by eqn, and every split collective (with the layout ops that only feed
    it) as soon as its inputs exist."""
    producer = {v: i for i, e in enumerate(eqns) for v in e.outputs}
    consumers: dict = collections.defaultdict(set)
    for i, e in enumerate(eqns):
        for v in e.inputs:
            if isinstance(v, Var) and v in producer:
                consumers[producer[v]].add(i)
    hoisted = {i for i, e in enumerate(eqns) if e.op in SPLIT_OPS}
    for i in range(len(eqns) - 1, -1, -1):      # consumers come after producers
        if eqns[i].op in _LAYOUT_OPS and consumers[i] and consumers[i] <= hoisted:
            hoisted.add(i)
    deps = {i: {producer[v] for v in e.inputs if isinstance(v, Var) and v in producer}
            for i, e in enumerate(eqns)}
    key, chains = {}, {}
    lane_rank = {}
    for i, e in enumerate(eqns):
        if i in hoisted:
            key[i] = (0, i, 0)
            continue
        lane = lane_rank.setdefault(e.device, len(lane_rank))
        chain = chains.setdefault(e.device, [])
        if chain:
            deps[i].add(chain[-1])       # a device's eqns keep their order
        key[i] = (1, len(chain), lane)
        chain.append(i)
    waiting = {i: len(d) for i, d in deps.items()}
    users: dict = collections.defaultdict(list)
    for i, d in deps.items():
        for j in d:
            users[j].append(i)
    ready = [(key[i], i) for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(eqns[i])
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (key[j], j))
    if len(out) != len(eqns):
        raise AssertionError("overlap: the eqns' dependencies have a cycle")
    return out


def _place_waits(eqns: list, waits: dict) -> list:
    """Each wait just before the first eqn reading its results, or before the next
    collective that is not split (every worker then issues its collectives in one order),
    or at the end."""
    out, pending = [], []          # pending: (wait, the Vars it makes)
    for eqn in eqns:
        reads = {v for v in eqn.inputs if isinstance(v, Var)}
        inline = eqn.op.collective and not is_start(eqn.op) and eqn.op is not collective_wait_p
        due = [w for w, made in pending if inline or made & reads]
        for w in due:
            out.append(w)
        pending = [(w, made) for w, made in pending if w not in due]
        out.append(eqn)
        if eqn in waits:
            pending.append((waits[eqn], set(waits[eqn].outputs)))
    out.extend(w for w, _ in pending)
    return out
