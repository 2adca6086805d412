"""Running an overlapped all-reduce (issue 26, item 1): what the start and wait ops
(ops/overlap_collectives.py) that the `overlap` stage (passes/overlap.py) puts in the step
do when they run.

A host start hands the collective's own kernel (the one the inline node would run: the
same sums in the same order, so the bits do not change) to the program's communication
thread, writing into buffers its channel keeps (fresh ones when the step returns them), and
returns a token; the wait joins it. numpy and the Numba kernels release the interpreter
lock, so the backward pass computes while the thread reduces. An MPI start posts the
non-blocking all-reduce (`Group.post_allreduce`) from the program's own thread and its wait
polls it (`Group.wait_for`: the abort notices and the timeout as ever), so every worker's
MPI calls keep the program's order. Each run's (start, end) goes to the channel's `spans`,
which the profile draws on the device's collectives lane (runtime/profile.py).

GPU collectives (`nccl_all_reduce`) already run on their own streams and are not split.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from graphdist.device.backends import backend_for
from graphdist.ir.types import ArrayType
from graphdist.ops.mpi_collectives import mpi_all_reduce_p
from graphdist.ops.overlap_collectives import (RUN, Channel, CommLane, collective_wait_p,
                                               host_all_reduce_start_p, is_start,
                                               mpi_all_reduce_start_p)

__all__ = ["collective_wait_p", "host_all_reduce_start_p", "is_start",
           "mpi_all_reduce_start_p"]

_lock = threading.Lock()


def _submit(lane: CommLane, fn):
    """Run fn on the lane's single thread (FIFO). A forked child has the parent's pool but
    not its thread: it starts its own."""
    with _lock:
        if lane.pool is None or lane.pid != os.getpid():
            lane.pool = ThreadPoolExecutor(1, thread_name_prefix="graphdist-comm")
            lane.pid = os.getpid()
    return lane.pool.submit(fn)


def _runner(channel: Channel):
    """fn(outs, *xs): what the inline node runs (runtime/kernel_table.py's choice)."""
    if channel.runner is None:
        from graphdist import config
        from graphdist.runtime import kernel_table

        backend = backend_for(channel.device or "cpu:0")
        types = [*channel.out_types, *channel.out_types]
        fn = kernel_table.kernel(backend, channel.collective, types,
                                 fused=config.fused_kernels())
        if fn is None:
            fn = kernel_table.out_impl(backend, channel.collective, types,
                                       fused=config.fused_kernels())
        params = channel.params
        channel.runner = lambda outs, *xs: fn(outs, *xs, **params)
    return channel.runner


def _buffers(channel: Channel, xp):
    if channel.handed_out or channel.outs is None:
        outs = tuple(xp.empty(t.shape, t.dtype) for t in channel.out_types)
        if channel.handed_out:
            return outs
        channel.outs = outs
    return channel.outs


def start(channel: Channel, xp, xs) -> None:
    if channel.pending is not None:      # a step that raised left one behind
        _drain(channel)
    if channel.collective is mpi_all_reduce_p:
        channel.pending = _PostedMpi(channel, xp, xs)
        return
    run, outs = _runner(channel), _buffers(channel, xp)
    errors = np.geterr()                 # the program's floating-point error settings

    def job():
        t0 = time.perf_counter()
        with np.errstate(**errors):
            run(outs, *xs)
        channel.spans.append((t0, time.perf_counter()))
        return outs

    channel.pending = _submit(channel.lane, job)


def wait(channel: Channel):
    pending, channel.pending = channel.pending, None
    if pending is None:
        raise RuntimeError(f"collective_wait[channel={channel!r}]: no collective was started")
    return pending.result()


def _drain(channel: Channel) -> None:
    pending, channel.pending = channel.pending, None
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
        self.outs = _buffers(channel, xp)
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


RUN.update(start=start, wait=wait)
