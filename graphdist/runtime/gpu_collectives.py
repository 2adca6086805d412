"""The GPU side of the nccl_all_reduce node (graphdist/ops/device_collectives.py).

Replicas on the same physical GPU share its memory, so one kernel per physical GPU sums
their buffers (in device order) on the first replica's stream. With several physical GPUs
those partial sums are then all-reduced by NCCL, one rank per physical GPU, and copied to
the other replicas of each GPU. The streams are ordered here: the summing stream waits for
every replica it reads, and every replica's stream waits for the result it receives.

Overlapped (issue 26; the `overlap` stage splits the node, runtime/overlap.py runs the two
halves): `start_all_reduce` runs the same reduction on the devices' communication streams,
each of which first waits for an event its device's compute stream records after the
bucket's producers, and records an event after the reduction; `finish_all_reduce` makes
each compute stream wait on that event, where the result is first read. Same kernels and
order: the same bits. The inline and the overlapped all-reduces share the NCCL
communicators, whose calls must run in one order on every GPU: the overlapped ones queue
on one communication stream per device, in program order, and the overlap stage puts every
pending wait before an inline collective (passes/overlap.py), so the compute stream's NCCL
call runs after them.
"""

from __future__ import annotations

import functools

import numpy as np

from graphdist.device.gpu import cupy, gpu_backend
from graphdist.runtime.streams import comm_lane, compute_lane


def nccl_all_reduce(outs, *xs, op, devices, comm: bool = False):
    """outs[k] = reduce(xs) for every replica k; outs[k] may be xs[k]. On the devices'
    compute streams, or with `comm` on their communication streams (ordered by the caller
    against the compute streams: start_all_reduce)."""
    from graphdist.kernels.reduce import all_reduce_gpu

    backends = [gpu_backend(d) for d in devices]
    lanes = [comm_lane(b) if comm else compute_lane(b) for b in backends]
    groups: dict[int, list[int]] = {}
    for k, b in enumerate(backends):
        groups.setdefault(b.physical, []).append(k)
    across = len(groups) > 1
    for members in groups.values():
        lead = lanes[members[0]]
        for k in members[1:]:
            lead.wait(lanes[k].record())
        with lead.active():
            dsts = [outs[members[0]]] if across else [outs[k] for k in members]
            all_reduce_gpu([xs[k] for k in members], "sum" if across else op,
                           outs=dsts, stream=lead.numba_stream())
    if across:
        _nccl_sum([outs[m[0]] for m in groups.values()], [lanes[m[0]] for m in groups.values()])
        for members in groups.values():
            lead = lanes[members[0]]
            with lead.active():
                total = outs[members[0]]
                if op == "mean":
                    backends[0].xp.divide(total, total.dtype.type(len(devices)), out=total)
                for k in members[1:]:
                    outs[k][...] = total
    for members in groups.values():
        lead = lanes[members[0]]
        for k in members[1:]:
            lanes[k].wait(lead.record())


def start_all_reduce(outs, xs, op, devices) -> tuple:
    """The all-reduce on the communication streams, started once the bucket exists: each
    communication stream waits for its compute stream (the bucket's producers, queued
    before now), then the reduction runs there. Returns an event of the first device's
    communication stream recorded where the reduction begins (for profiles) and each
    replica's event recorded after it on its communication stream (finish_all_reduce
    waits on them)."""
    backends = [gpu_backend(d) for d in devices]
    for b in backends:
        comm_lane(b).wait(compute_lane(b).record())
    begin = comm_lane(backends[0]).record()
    nccl_all_reduce(outs, *xs, op=op, devices=devices, comm=True)
    return begin, [comm_lane(b).record() for b in backends]


def finish_all_reduce(events, devices) -> None:
    """Each replica's compute stream waits for its communication stream's event: the
    results may be read after this, and the bucket overwritten."""
    for device, event in zip(devices, events):
        compute_lane(gpu_backend(device)).wait(event)


_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
               "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def _nccl_sum(bufs, lanes) -> None:
    """In-place NCCL sum of one buffer per physical GPU, each on its lane's stream."""
    nccl = cupy().cuda.nccl
    if not getattr(nccl, "available", True):
        raise RuntimeError(f"nccl_all_reduce: replicas on {len(bufs)} physical GPUs need NCCL, "
                           "which CuPy could not load (pip install nvidia-nccl-cu12); or pass "
                           "cross_device_ops=gd.RingAllReduce() to the strategy")
    name = _NCCL_TYPES.get(np.dtype(bufs[0].dtype).name)
    if name is None:
        raise TypeError(f"nccl_all_reduce: NCCL cannot reduce {bufs[0].dtype}; "
                        f"supported: {sorted(_NCCL_TYPES)}")
    comms = _communicators(tuple(lane.physical for lane in lanes))
    nccl.groupStart()
    try:
        for comm, buf, lane in zip(comms, bufs, lanes):
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, getattr(nccl, name),
                           nccl.NCCL_SUM, lane.stream.ptr)
    finally:
        nccl.groupEnd()


@functools.cache
def _communicators(physical: tuple[int, ...]):
    """One NCCL communicator per physical GPU, made once per set of GPUs."""
    return cupy().cuda.nccl.NcclCommunicator.initAll(list(physical))
