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
MPI calls keep the program's order. A GPU start (`nccl_all_reduce`, a collective that
orders its own streams) queues the reduction on the devices' communication streams after
an event of each compute stream, and its wait makes each compute stream wait on the
communication stream's event (runtime/gpu_collectives.py); the host thread never blocks.
Each run's (start, end) goes to the channel's `spans`, which the profile draws on the
device's collectives lane (runtime/profile.py); a GPU run's are read from CUDA events.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from graphdist.device import threads
from graphdist.device.backends import backend_for
from graphdist.ir.types import ArrayType
from graphdist.ops.mpi_collectives import mpi_all_reduce_p, mpi_reduce_scatter_p, \
    post_reduce_scatter
from graphdist.ops.overlap_collectives import (RUN, Channel, CommLane, collective_wait_p,
                                               host_all_reduce_start_p, is_start,
                                               mpi_all_reduce_start_p)

__all__ = ["collective_wait_p", "host_all_reduce_start_p", "is_start",
           "mpi_all_reduce_start_p"]

_lock = threading.Lock()


def _submit(lane: CommLane, fn):
    """Run fn on the lane's single thread (FIFO; a forked child starts its own)."""
    with _lock:
        if lane.pool is None:
            lane.pool = threads.ForkSafePool(1, "graphdist-comm")
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
    if channel.collective is mpi_reduce_scatter_p:
        channel.pending = _PostedMpiScatter(channel, xp, xs)
        return
    if channel.collective.orders_own_streams:
        channel.pending = _OnCommStreams(channel, xs)
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


class _OnCommStreams:
    """A GPU all-reduce queued on the devices' communication streams (the host thread moves
    on at once), into buffers the channel keeps, each made on its replica's device under
    that device's communication stream. The wait only orders the compute streams after it.

    Its span: events on the first device's streams, anchored to the host clock by an event
    recorded on its compute stream now. A profiled program synchronizes that stream after
    every node, so the anchor completes as it is recorded and the times are the GPU's;
    unprofiled, nothing reads them."""

    def __init__(self, channel: Channel, xs):
        from graphdist.runtime import gpu_collectives
        from graphdist.runtime.streams import compute_lane

        params = channel.params
        self.devices = params["devices"]
        self.channel = channel
        first = backend_for(self.devices[0])
        anchor, t_anchor = compute_lane(first).record(), time.perf_counter()
        self.outs = _gpu_buffers(channel, self.devices)
        begin, self.events = gpu_collectives.start_all_reduce(self.outs, xs, params["op"],
                                                              self.devices)
        end = self.events[0]
        channel.spans.append(lambda: _event_span(anchor, t_anchor, begin, end))

    def result(self):
        from graphdist.runtime import gpu_collectives

        gpu_collectives.finish_all_reduce(self.events, self.devices)
        return self.outs


def _gpu_buffers(channel: Channel, devices):
    """The results' buffers: one per replica on its device, allocated on its communication
    stream (CuPy's pool hands memory out per stream); fresh each run when the step returns
    one, else made once and kept."""
    from graphdist.runtime.streams import comm_lane

    if channel.outs is not None and not channel.handed_out:
        return channel.outs
    outs = []
    for device, t in zip(devices, channel.out_types):
        backend = backend_for(device)
        with comm_lane(backend).active():
            outs.append(backend.empty(t.shape, t.dtype))
    if not channel.handed_out:
        channel.outs = tuple(outs)
    return tuple(outs)


def _event_span(anchor, t_anchor: float, begin, end) -> tuple:
    """(start, end) on the host clock of the work between two events of one device."""
    from graphdist.device.gpu import cupy

    end.synchronize()
    elapsed = cupy().cuda.get_elapsed_time
    return (t_anchor + elapsed(anchor, begin) * 1e-3, t_anchor + elapsed(anchor, end) * 1e-3)


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


class _PostedMpiScatter:
    """An MPI reduce-scatter (zero_stage > 0) posted from the program's own thread and
    finished at its first reader: `mpi_reduce_scatter`'s out= form cut in its two halves
    (ops/mpi_collectives.py post_reduce_scatter), so the same MPI call and the same bits."""

    def __init__(self, channel: Channel, xp, xs):
        self.channel, self.t0 = channel, time.perf_counter()
        self.outs = _buffers(channel, xp)
        self.finish = post_reduce_scatter(xp, self.outs, xs, **channel.params)

    def result(self):
        self.finish()
        self.channel.spans.append((self.t0, time.perf_counter()))
        return self.outs


RUN.update(start=start, wait=wait)
