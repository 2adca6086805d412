"""The GPU side of the nccl_all_reduce node (graphdist/ops/device_collectives.py).

Replicas on the same physical GPU share its memory, so one kernel per physical GPU sums
their buffers (in device order) on the first replica's stream. With several physical GPUs
those partial sums are then all-reduced by NCCL, one rank per physical GPU, and copied to
the other replicas of each GPU. The streams are ordered here: the summing stream waits for
every replica it reads, and every replica's stream waits for the result it receives.
"""

from __future__ import annotations

import functools

import numpy as np

from graphdist.device.gpu import cupy, gpu_backend


def nccl_all_reduce(outs, *xs, op, devices):
    """outs[k] = reduce(xs) for every replica k; outs[k] may be xs[k]."""
    from graphdist.kernels.reduce import all_reduce_gpu

    backends = [gpu_backend(d) for d in devices]
    groups: dict[int, list[int]] = {}
    for k, b in enumerate(backends):
        groups.setdefault(b.physical, []).append(k)
    across = len(groups) > 1
    for members in groups.values():
        lead = backends[members[0]]
        for k in members[1:]:
            lead.wait(backends[k].record())
        with lead.cuda_device, lead.stream:
            dsts = [outs[members[0]]] if across else [outs[k] for k in members]
            all_reduce_gpu([xs[k] for k in members], "sum" if across else op,
                           outs=dsts, stream=lead.numba_stream())
    if across:
        _nccl_sum([outs[m[0]] for m in groups.values()], [backends[m[0]] for m in groups.values()])
        for members in groups.values():
            lead = backends[members[0]]
            with lead.cuda_device, lead.stream:
                total = outs[members[0]]
                if op == "mean":
                    lead.xp.divide(total, total.dtype.type(len(devices)), out=total)
                for k in members[1:]:
                    outs[k][...] = total
    for members in groups.values():
        lead = backends[members[0]]
        for k in members[1:]:
            backends[k].wait(lead.record())


_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
               "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def _nccl_sum(bufs, backends) -> None:
    """In-place NCCL sum of one buffer per physical GPU, each on its device's stream."""
    nccl = cupy().cuda.nccl
    if not getattr(nccl, "available", True):
        raise RuntimeError(f"nccl_all_reduce: replicas on {len(bufs)} physical GPUs need NCCL, "
                           "which CuPy could not load (pip install nvidia-nccl-cu12); or pass "
                           "cross_device_ops=gd.RingAllReduce() to the strategy")
    name = _NCCL_TYPES.get(np.dtype(bufs[0].dtype).name)
    if name is None:
        raise TypeError(f"nccl_all_reduce: NCCL cannot reduce {bufs[0].dtype}; "
                        f"supported: {sorted(_NCCL_TYPES)}")
    comms = _communicators(tuple(b.physical for b in backends))
    nccl.groupStart()
    try:
        for comm, buf, backend in zip(comms, bufs, backends):
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, getattr(nccl, name),
                           nccl.NCCL_SUM, backend.stream.ptr)
    finally:
        nccl.groupEnd()


@functools.cache
def _communicators(physical: tuple[int, ...]):
    """One NCCL communicator per physical GPU, made once per set of GPUs."""
    return cupy().cuda.nccl.NcclCommunicator.initAll(list(physical))
