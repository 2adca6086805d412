"""The six lowerings, each with its four collectives and its cost model beside them:

- "one_device": copy every replica's value to one device, add there, copy back;
- "ring": reduce-scatter then all-gather around the device ring, as copies and adds;
- "hierarchical": sum within groups, exchange between group leaders, copy back;
- "host": one fused node for host devices (one parallel pass);
- "nccl": one `nccl_all_reduce` node between GPUs;
- "mpi": one node per collective across worker processes (MultiWorkerMirroredStrategy).

Every lowering sums in a fixed order, so the same inputs give the same bits every run, and
every replica ends with the same bits (they all receive copies of one result per element);
a reduce_scatter's shard has the bits of the same lowering's all-reduce there. The fusion
of a host all-reduce with every replica's optimizer update that follows it is in
passes/fuse.py (`fuse_reduce_update`), the next stage of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphdist.ir.builder import Builder
from graphdist.ops.math import add_p
from graphdist.passes.collectives import costs
from graphdist.ops.collectives import shard_length
from graphdist.passes.collectives.blocks import (concat_on, copy_to, finish_mean, flat_slice,
                                                 fused_node, groups_of, near_equal, padded,
                                                 require_capability, reshaped, shard_of,
                                                 sum_in_order, unpadded_views)
from graphdist.passes.collectives.registry import Lowering, register


@register
@dataclass(frozen=True)
class OneDevice(Lowering):
    """Copy every replica's value to one device, add them there in device order, copy the
    result back: simple, and the fewest adds; the reducing device's link is the bottleneck.
    A reduce_scatter sends each device only its shard; an all_gather (nothing to add) is
    the base's direct copies."""

    name = "one_device"
    reduce_to_device: str | None = None

    def _target(self, devices: tuple) -> str:
        return self.reduce_to_device or devices[0]

    def _total(self, b: Builder, xs: list, op: str, devices: tuple):
        target = self._target(devices)
        parts = [copy_to(b, x, target) for x in xs]
        return finish_mean(b, sum_in_order(b, parts, target), len(devices), target, op)

    def all_reduce(self, b, xs, op, devices):
        if len(devices) == 1:
            return [finish_mean(b, xs[0], 1, devices[0], op)]
        total = self._total(b, xs, op, devices)
        return [copy_to(b, total, dev) for dev in devices]

    def reduce_scatter(self, b, xs, op, devices, n):
        total = self._total(b, xs, op, devices)
        return [copy_to(b, shard_of(b, total, n, d), dev) for d, dev in enumerate(devices)]

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.one_device_cost(n, nbytes, link)

    def reduce_scatter_cost(self, n, nbytes, link, pricing):
        return costs.one_device_reduce_scatter_cost(n, nbytes, link)


@register
@dataclass(frozen=True)
class Ring(Lowering):
    """Reduce-scatter then all-gather around the device ring, as explicit copy_to/add nodes.

    The flat buffer is cut into n near-equal segments (n devices). Segment c starts on device
    c+1 and travels the ring: each of n-1 steps copies the partial sum to the next device,
    which adds its own slice, so segment c is summed in the order c+1, c+2, ..., c (mod n)
    and ends complete on device c (divided by n there for a mean): that is the
    reduce_scatter. n-1 all-gather steps then pass every complete segment around the ring;
    each device concatenates the segments and reshapes. Each device sends and receives
    2(n-1)/n of the buffer, the bandwidth optimum. An all_gather alone is that second half.

    `num_chunks=k` cuts each segment into k pieces that travel the ring independently, so a
    device can add piece p while piece p+1 is being copied (pipelining, k times more nodes).
    The pieces follow their segment's path, so the bits do not depend on k. Empty segments
    and pieces (a buffer smaller than n*k elements) are skipped.
    """

    name = "ring"
    num_chunks: int | None = None

    def _pieces(self, size: int, n: int) -> list[tuple]:
        """(segment, start, stop) of every non-empty piece."""
        pieces, start = [], 0
        for c, seg in enumerate(near_equal(size, n)):
            for length in near_equal(seg, self.num_chunks or 1):
                if length:
                    pieces.append((c, start, start + length))
                start += length
        return pieces

    def _reduce_scatter(self, b, xs, op, devices) -> tuple[list, list]:
        """The pieces and {piece: complete value} on each device (its own segment's)."""
        n = len(devices)
        pieces = self._pieces(xs[0].ty.size, n)
        flats = [reshaped(b, x, (x.ty.size,)) for x in xs]
        views = [{p: flat_slice(b, flats[d], p[1], p[2]) for p in pieces} for d in range(n)]
        partial = {p: views[(p[0] + 1) % n][p] for p in pieces}
        for step in range(n - 1):
            for p in pieces:
                d = (p[0] + 2 + step) % n
                partial[p] = b.add1(add_p, [copy_to(b, partial[p], devices[d]),
                                                 views[d][p]], devices[d])
        done = [{} for _ in range(n)]
        for p in pieces:
            done[p[0]][p] = finish_mean(b, partial[p], n, devices[p[0]], op)
        return pieces, done

    def _all_gather(self, b, pieces, done, devices) -> list:
        """Every piece around the ring: n-1 steps; each device concatenates them all."""
        n = len(devices)
        for step in range(n - 1):
            for p in pieces:
                d = (p[0] + 1 + step) % n
                done[d][p] = copy_to(b, done[(d - 1) % n][p], devices[d])
        return [concat_on(b, [done[d][p] for p in pieces], dev) for d, dev in enumerate(devices)]

    def all_reduce(self, b, xs, op, devices):
        size = xs[0].ty.size
        if len(devices) == 1 or size == 0:
            return [finish_mean(b, x, 1, dev, op) for x, dev in zip(xs, devices)]
        pieces, done = self._reduce_scatter(b, xs, op, devices)
        flats = self._all_gather(b, pieces, done, devices)
        return [reshaped(b, flat, x.ty.shape) for flat, x in zip(flats, xs)]

    def reduce_scatter(self, b, xs, op, devices, n):
        size = xs[0].ty.size
        if len(devices) == 1 or size == 0:
            return [shard_of(b, x, n, d) for d, x in enumerate(xs)]
        pieces, done = self._reduce_scatter(b, xs, op, devices)
        out = []
        for d, dev in enumerate(devices):
            mine = [done[d][p] for p in pieces if p[0] == d]
            chunk = concat_on(b, mine, dev) if mine else flat_slice(b, xs[d], 0, 0)
            out.append(padded(b, chunk, shard_length(size, n)))
        return out

    def all_gather(self, b, xs, devices, n, total=None):
        if len(devices) == 1:
            return super().all_gather(b, xs, devices, n, total)
        pieces = [(d, 0, 0) for d in range(len(devices))]      # one per replica
        done = [{p: x} for p, x in zip(pieces, unpadded_views(b, xs, n, total))]
        return self._all_gather(b, pieces, done, devices)

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.ring_cost(n, nbytes, link)

    def reduce_scatter_cost(self, n, nbytes, link, pricing):
        return costs.ring_reduce_scatter_cost(n, nbytes, link)

    def shared_host_cost(self, n, nbytes, link, pricing):
        return costs.shared_ring_cost(n, nbytes, link, pricing.add)


@register
@dataclass(frozen=True)
class Hierarchical(Lowering):
    """Two levels: each group of devices (contiguous near-equal slices of the device list)
    sums onto its first device in device order; the group leaders exchange their partials
    and each sums all of them in group order (so every leader holds the same bits) and
    divides for a mean; each leader then copies the result (a reduce_scatter: each member's
    shard) to its group."""

    name = "hierarchical"
    uses_groups = True
    num_groups: int = 2

    def _totals(self, b, xs, op, devices) -> tuple[list, dict]:
        index = {dev: d for d, dev in enumerate(devices)}
        groups = groups_of(devices, self.num_groups)
        partials = [sum_in_order(b, [copy_to(b, xs[index[dev]], group[0]) for dev in group],
                                 group[0]) for group in groups]
        totals = {g[0]: finish_mean(b, sum_in_order(b, [copy_to(b, p, g[0]) for p in partials],
                                                    g[0]), len(devices), g[0], op)
                  for g in groups}
        return groups, totals

    def all_reduce(self, b, xs, op, devices):
        groups, totals = self._totals(b, xs, op, devices)
        return [copy_to(b, totals[group[0]], dev) for group in groups for dev in group]

    def reduce_scatter(self, b, xs, op, devices, n):
        groups, totals = self._totals(b, xs, op, devices)
        leader = {dev: group[0] for group in groups for dev in group}
        return [copy_to(b, shard_of(b, totals[leader[dev]], n, d), dev)
                for d, dev in enumerate(devices)]

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.hierarchical_cost(n, nbytes, link, pricing.groups(n))

    def reduce_scatter_cost(self, n, nbytes, link, pricing):
        return costs.hierarchical_reduce_scatter_cost(n, nbytes, link, pricing.groups(n))

    def shared_host_cost(self, n, nbytes, link, pricing):
        return costs.shared_hierarchical_cost(n, nbytes, link, pricing.groups(n), pricing.add)


@register
@dataclass(frozen=True)
class Host(Lowering):
    """One fused node for host (cpu:N) devices per collective: it runs on the first device,
    reads every replica's buffer once and writes every replica's result in a single
    parallel pass (sum in device order), as an NCCL node does on GPUs:
    `host_all_reduce`, `host_reduce_scatter` (each replica's shard only) and
    `host_all_gather` (every result straight from the sources)."""

    name = "host"
    fused_host_node = True
    splits_to_overlap = True
    one_process_only = True
    fused_nodes = ("host_all_reduce", "host_reduce_update", "host_reduce_scatter",
                   "host_all_gather", "host_reduce_scatter_update_all_gather")

    @staticmethod
    def _require(devices) -> None:
        require_capability("HostAllReduce", devices, "shares_host_memory",
                           "devices in host memory", "HostAllReduce runs on host (cpu:N) "
                           "devices; use NcclAllReduce or RingAllReduce for GPUs")

    def all_reduce(self, b, xs, op, devices):
        self._require(devices)
        if len(devices) == 1:
            return [finish_mean(b, xs[0], 1, devices[0], op)]
        outs = fused_node(b, "host_all_reduce", xs, devices, {"op": op})
        return [reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]

    def reduce_scatter(self, b, xs, op, devices, n):
        self._require(devices)
        if len(devices) == 1:
            return [shard_of(b, xs[0], 1, 0)]
        return fused_node(b, "host_reduce_scatter", xs, devices, {"op": op})

    def all_gather(self, b, xs, devices, n, total=None):
        self._require(devices)
        if len(devices) == 1:
            return super().all_gather(b, xs, devices, n, total)
        return fused_node(b, "host_all_gather", unpadded_views(b, xs, n, total), devices, {},
                          flatten=False)

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.host_cost(n, nbytes, link)

    def shared_host_cost(self, n, nbytes, link, pricing):
        return costs.host_cost(n, nbytes, link)


@register
@dataclass(frozen=True)
class Nccl(Lowering):
    """One `nccl_all_reduce` node between GPUs: replicas sharing a physical GPU are summed
    there by one kernel, the physical GPUs' partial sums are all-reduced by NCCL. Its
    reduce_scatter is that node and a view of each shard; all_gather and broadcast are
    device-to-device copies (NCCL's own ReduceScatter/AllGather would move less: not yet).
    Priced as the ring NCCL runs for large messages."""

    name = "nccl"
    splits_to_overlap = True
    fused_nodes = ("nccl_all_reduce",)

    @staticmethod
    def _require(devices) -> None:
        require_capability("NcclAllReduce", devices, "nccl", "devices NCCL runs between",
                           "NCCL runs between GPUs; use "
                           "HostAllReduce or RingAllReduce for host devices")

    def all_reduce(self, b, xs, op, devices):
        self._require(devices)
        if len(devices) == 1:
            return [finish_mean(b, xs[0], 1, devices[0], op)]
        outs = fused_node(b, "nccl_all_reduce", xs, devices, {"op": op, "devices": tuple(devices)})
        return [reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]

    def all_gather(self, b, xs, devices, n, total=None):
        self._require(devices)
        return super().all_gather(b, xs, devices, n, total)

    def broadcast(self, b, xs, source, devices):
        self._require(devices)
        return super().broadcast(b, xs, source, devices)

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.ring_cost(n, nbytes, link)

    def reduce_scatter_cost(self, n, nbytes, link, pricing):
        return costs.ring_reduce_scatter_cost(n, nbytes, link)


@register
@dataclass(frozen=True)
class Mpi(Lowering):
    """Across worker processes (MultiWorkerMirroredStrategy): one node per collective sums
    (or gathers) this worker's replicas in order, works with the other workers through
    MPI and writes every local replica's result (a mean divides by every worker's
    replicas). `group`: the process group; `replicas`: every worker's; `first`: this
    worker's first global replica. The executor calls MPI inline: nothing overlaps it."""

    name = "mpi"
    crosses_processes = True
    runs_inline = True
    splits_to_overlap = True
    fused_nodes = ("mpi_all_reduce", "mpi_reduce_scatter", "mpi_all_gather", "mpi_broadcast")
    group: object = None
    replicas: int = 1
    first: int = 0

    def first_replica(self) -> int:
        return self.first

    def all_reduce(self, b, xs, op, devices):
        outs = fused_node(b, "mpi_all_reduce", xs, devices,
                          {"group": self.group, "op": op, "replicas": self.replicas})
        return [reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]

    def reduce_scatter(self, b, xs, op, devices, n):
        return fused_node(b, "mpi_reduce_scatter", xs, devices,
                          {"first": self.first, "group": self.group, "op": op,
                           "replicas": self.replicas})

    def all_gather(self, b, xs, devices, n, total=None):
        """With `total` (padded shards of a flat value), every replica's chunk length, so
        that the gathered value drops the padding."""
        params = {"group": self.group, "replicas": self.replicas}
        if total is not None:
            params["rows"] = tuple(near_equal(total, self.replicas))
        return fused_node(b, "mpi_all_gather", xs, devices, params, flatten=False)

    def broadcast(self, b, xs, source, devices):
        return fused_node(b, "mpi_broadcast", xs, devices,
                          {"first": self.first, "group": self.group, "local": len(devices),
                           "source": source}, flatten=False)

    def all_reduce_cost(self, n, nbytes, link, pricing):
        return costs.mpi_cost(n, nbytes, link, pricing.devices_per_worker, pricing.add)

