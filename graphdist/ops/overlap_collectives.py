"""The two halves of an overlapped all-reduce (issue 26): the `overlap` stage
(passes/overlap.py) replaces a host or MPI all-reduce node with

    t = host_all_reduce_start[op=sum, channel=c0] b0 b1 b2 b3
    ...                               # the rest of the backward pass runs meanwhile
    g0 g1 g2 g3 = collective_wait[channel=c0] t b0 b1 b2 b3

and a GPU `nccl_all_reduce` node with `nccl_all_reduce_start` and the same wait. The start
returns a token; the wait takes it and the bucket (so the bucket's buffers live until the
collective has read them: the buffer planner cannot hand them to another value before the
wait) and gives the results. Both share a `Channel`: which collective, its parameters, and
the run-time state of one run in flight. What runs them (the communication thread, MPI's
post and wait, the GPUs' communication streams) is runtime/overlap.py, which their impls
call (through `RUN`). The GPU start and the wait order the device streams themselves
(`orders_own_streams`: the lowering adds no events around them).
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op
from graphdist.ops.device_collectives import nccl_all_reduce_p
from graphdist.ops.host_collectives import host_all_reduce_p
from graphdist.ops.mpi_collectives import mpi_all_reduce_p, mpi_reduce_scatter_p

TOKEN = ArrayType((), np.dtype(np.int32))

_SPANS_KEPT = 4096       # (start, end) times of runs a channel keeps for profiles


class CommLane:
    """The communication thread of one program (made by runtime/overlap.py when first
    needed): its collectives run in the order they were started."""

    def __init__(self):
        self.pool = None


class Channel:
    """One split collective. An op parameter, hashed by identity, printed c<k>."""

    _ids = itertools.count()

    def __init__(self, collective: Op, params: dict, device, out_types, lane: CommLane,
                 handed_out: bool):
        self.collective = collective
        self.params = params
        self.device = device
        self.out_types = tuple(out_types)
        self.lane = lane
        self.handed_out = handed_out      # a result leaves the program: fresh arrays
        self.id = next(Channel._ids)
        # perf_counter (start, end) of each run, or a callable giving them once the run is
        # over (a GPU run's, read from its stream's events: times())
        self.spans = collections.deque(maxlen=_SPANS_KEPT)
        self.runner = None                # run-time state (runtime/overlap.py)
        self.outs = None
        self.pending = None

    def __repr__(self) -> str:
        return f"c{self.id}"

    def times(self) -> list:
        """The (start, end) perf_counter times of the runs kept (a profile's: each run is
        over by then), GPU runs' read from their events once and remembered."""
        for k, span in enumerate(self.spans):
            if callable(span):
                self.spans[k] = span()
        return list(self.spans)


# how a channel's collective starts and is waited for: runtime/overlap.py sets "start"
# (channel, xp, xs) and "wait" (channel) -> the results, when it is imported
RUN: dict = {}


def _start_shape(*xs, channel, **params):
    return TOKEN


def _start_impl(xp, *xs, channel, **params):
    RUN["start"](channel, xp, xs)
    return np.zeros((), np.int32)


def _wait_impl(xp, token, *xs, channel):
    return RUN["wait"](channel)


def _start_cost(ins, outs, *, channel, **params):
    return channel.collective.cost_rule(ins, list(channel.out_types), **params)


def _make_start(name: str, orders_own_streams: bool = False) -> Op:
    op = Op(name, collective=True, num_outputs=1, differentiable=False, stateful=True,
            orders_own_streams=orders_own_streams)
    op.def_shape(_start_shape)
    op.def_impl(_start_impl)
    op.def_cost(_start_cost)
    return op


# the start of each split collective ("mpi_" names what the schedule check counts)
host_all_reduce_start_p = _make_start("host_all_reduce_start")
mpi_all_reduce_start_p = _make_start("mpi_all_reduce_start")
# zero_stage > 0 across workers: a bucket's reduce-scatter posted while the backward goes on
mpi_reduce_scatter_start_p = _make_start("mpi_reduce_scatter_start")
# on the GPUs' communication streams, after an event of each replica's compute stream
nccl_all_reduce_start_p = _make_start("nccl_all_reduce_start", orders_own_streams=True)
START_OF = {host_all_reduce_p: host_all_reduce_start_p, mpi_all_reduce_p: mpi_all_reduce_start_p,
            nccl_all_reduce_p: nccl_all_reduce_start_p,
            mpi_reduce_scatter_p: mpi_reduce_scatter_start_p}
START_OPS = tuple(START_OF.values())

# a collective too: it hands every replica's buffer its result. On GPUs it makes each
# replica's compute stream wait for the communication stream's event (orders_own_streams:
# on host devices there are no streams and the flag says nothing)
collective_wait_p = Op("collective_wait", collective=True, num_outputs=None,
                       differentiable=False, stateful=True, orders_own_streams=True)
collective_wait_p.def_shape(lambda token, *xs, channel: channel.out_types)
collective_wait_p.def_impl(_wait_impl)
collective_wait_p.def_cost(lambda ins, outs, **_: (0, 0))


def is_start(op) -> bool:
    return op in START_OPS
