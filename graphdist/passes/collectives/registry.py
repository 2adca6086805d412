"""The registry of collective lowerings: one `Lowering` per name, each giving all four
collectives (all_reduce, reduce_scatter, all_gather, broadcast) and their cost, and
declaring what the pipeline, the passes and the simulator need to know about it (does it
cross processes, is it one fused host node, does the executor run it inline), so that
none of them compares lowering names.

A lowering is a frozen dataclass whose fields are its options (`CrossDeviceOps.options()`
constructs it: `lowering_for`). Every method emits into a Builder and returns one Var per
device; `xs` holds one Var per device of this process, in replica order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from graphdist.errors import GraphError
from graphdist.ir.builder import Builder
from graphdist.passes.collectives import costs
from graphdist.passes.collectives.blocks import (concat_on, copy_to, shards_on_devices,
                                                 unpadded_views)

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
LOWERINGS: dict[str, type] = {}


def register(cls):
    """Register a Lowering subclass under its `name`; it must give every collective."""
    own = [m for m in ("all_reduce", "all_reduce_cost") if getattr(cls, m) is getattr(Lowering, m)]
    if not cls.name or own:
        raise TypeError(f"lowering {cls.__name__}: needs a name, and defines no {own} "
                        "(the base gives the other collectives and their costs)")
    LOWERINGS[cls.name] = cls
    return cls


def lowering_for(cross_device_ops) -> Lowering:
    """The lowering a CrossDeviceOps (or a lowering name) configures, with its options."""
    if isinstance(cross_device_ops, Lowering):
        return cross_device_ops
    name = cross_device_ops if isinstance(cross_device_ops, str) else cross_device_ops.lowering
    cls = LOWERINGS.get(name)
    if cls is None:
        raise GraphError(f"no collective lowering named {name!r} (have: {sorted(LOWERINGS)})")
    return cls() if isinstance(cross_device_ops, str) else cls(**cross_device_ops.options())


@dataclass(frozen=True)
class Pricing:
    """What a prediction knows beyond the link: whether the devices are logical devices of
    one host (then nothing overlaps and every copy and add is paid), the time of an
    elementwise add on this host (None: free), the hierarchical groups (None: sqrt n) and
    the local replicas of each worker process."""

    shared_host: bool = False
    add: object = None
    num_groups: int | None = None
    devices_per_worker: int = 1

    def groups(self, n: int) -> int:
        return self.num_groups or max(1, round(math.sqrt(n)))


@dataclass(frozen=True)
class Lowering:
    """Base: a lowering gives all_reduce; reduce_scatter defaults to its all_reduce and a
    view of each device's shard, all_gather to copies and a concatenation on every device,
    broadcast to copies from the source. The cost model prices each the same way."""

    name: ClassVar[str] = ""
    crosses_processes: ClassVar[bool] = False  # workers in other processes (one thread each)
    fused_host_node: ClassVar[bool] = False    # one node over every host replica's buffers
    one_process_only: ClassVar[bool] = False   # no meaning across machines (priced as ring)
    runs_inline: ClassVar[bool] = False        # the executor calls it in its own thread
    splits_to_overlap: ClassVar[bool] = False  # its all-reduce node may start early (overlap)
    uses_groups: ClassVar[bool] = False        # takes num_groups
    fused_nodes: ClassVar[tuple] = ()          # the ops of its fused nodes (what it made)

    # ------------------------------------------------------------ the collectives
    def all_reduce(self, b: Builder, xs: list, op: str, devices: tuple) -> list:
        raise NotImplementedError

    def reduce_scatter(self, b: Builder, xs: list, op: str, devices: tuple, n: int) -> list:
        """Device d's padded flat shard (of n near-equal chunks, the first ones one larger)
        of the reduction: by default the all-reduce's result on every device, cut there."""
        totals = self.all_reduce(b, xs, op, devices)
        return shards_on_devices(b, totals, n, devices, self.first_replica())

    def all_gather(self, b: Builder, xs: list, devices: tuple, n: int,
                   total: int | None = None) -> list:
        """Every replica's value (with `total`: each padded shard's chunk), concatenated in
        replica order on every device: each device copies the others', n - 1 copies in."""
        parts = unpadded_views(b, xs, n, total)
        return [concat_on(b, [copy_to(b, x, dev) for x in parts], dev) for dev in devices]

    def broadcast(self, b: Builder, xs: list, source: int, devices: tuple) -> list:
        """Every device gets a copy of the source replica's value."""
        src = xs[source]
        return [xs[d] if d == source else copy_to(b, src, dev)
                for d, dev in enumerate(devices)]

    def first_replica(self) -> int:
        """The global replica of this process's first device (other processes hold the
        rest under a lowering that crosses processes)."""
        return 0

    # ------------------------------------------------------------ the cost model
    def cost(self, collective: str, n: int, nbytes: float, link,
             pricing: Pricing = Pricing()) -> float:
        """Seconds for `collective` of `nbytes` (one replica's value) on n devices joined
        by `link` (latency a, bandwidth B)."""
        if collective not in COLLECTIVES:
            raise ValueError(f"{self.name}: no collective {collective!r} (have: "
                             f"{', '.join(COLLECTIVES)})")
        if collective == "all_gather":
            return costs.all_gather_cost(n, nbytes, link)
        if collective == "broadcast":
            return costs.broadcast_cost(n, nbytes, link)
        if pricing.shared_host:
            return self.shared_host_cost(n, nbytes, link, pricing)
        if collective == "reduce_scatter":
            return self.reduce_scatter_cost(n, nbytes, link, pricing)
        return self.all_reduce_cost(n, nbytes, link, pricing)

    def all_reduce_cost(self, n: int, nbytes: float, link, pricing: Pricing) -> float:
        raise NotImplementedError

    def reduce_scatter_cost(self, n: int, nbytes: float, link, pricing: Pricing) -> float:
        """By default what the default reduce_scatter runs: the all-reduce."""
        return self.all_reduce_cost(n, nbytes, link, pricing)

    def shared_host_cost(self, n: int, nbytes: float, link, pricing: Pricing) -> float:
        """The reduction among n logical devices of one host (nothing in parallel: every
        copy and add paid): by default as reduction to one device."""
        return costs.shared_one_device_cost(n, nbytes, link, pricing.add)
