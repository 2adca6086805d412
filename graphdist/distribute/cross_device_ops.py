"""Cross-device ops: configuration only. Each class names how the step's collectives
(all_reduce, reduce_scatter, all_gather, broadcast) are lowered (`lowering`, a name in the
registry of passes/collectives) and with which options (`options()`: the fields of that
`Lowering`); the lowering itself, with its cost model, lives there with every other one."""

from __future__ import annotations


class CrossDeviceOps:
    """Base: a registered lowering's name and its options (`options()`), checked when
    constructed. A new one names a `Lowering` registered with
    `graphdist.passes.collectives.register`."""

    lowering: str = ""

    def options(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, add them there in device order, copy the
    result back: simple, and the fewest adds; the reducing device's link is the bottleneck."""

    lowering = "one_device"

    def __init__(self, reduce_to_device: str | None = None):
        self.reduce_to_device = reduce_to_device

    def options(self) -> dict:
        from graphdist.device.names import canonical

        return {"reduce_to_device": canonical(self.reduce_to_device)
                if self.reduce_to_device else None}

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


class RingAllReduce(CrossDeviceOps):
    """Reduce-scatter then all-gather around the device ring, as explicit copies and adds
    (the bandwidth optimum); `num_chunks=k` pipelines k pieces per segment."""

    lowering = "ring"

    def __init__(self, num_chunks: int | None = None):
        if num_chunks is not None and int(num_chunks) < 1:
            raise ValueError(f"RingAllReduce: num_chunks must be >= 1, got {num_chunks}")
        self.num_chunks = None if num_chunks is None else int(num_chunks)

    def options(self) -> dict:
        return {"num_chunks": self.num_chunks}

    def __repr__(self) -> str:
        return f"RingAllReduce(num_chunks={self.num_chunks!r})"


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Sum within groups (contiguous near-equal slices of the device list), exchange the
    partials between the group leaders, copy the result back to each group."""

    lowering = "hierarchical"

    def __init__(self, num_groups: int = 2):
        if int(num_groups) < 1:
            raise ValueError(f"HierarchicalCopyAllReduce: num_groups must be >= 1, "
                             f"got {num_groups}")
        self.num_groups = int(num_groups)

    def options(self) -> dict:
        return {"num_groups": self.num_groups}

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_groups={self.num_groups})"


class HostAllReduce(CrossDeviceOps):
    """One fused `host_all_reduce` node for host (cpu:N) devices: every replica's buffer read
    once and every replica's result written in a single parallel pass."""

    lowering = "host"


class NcclAllReduce(CrossDeviceOps):
    """One `nccl_all_reduce` node per all-reduce between GPUs. Constructible anywhere;
    lowering onto a device that is not a GPU raises ValueError."""

    lowering = "nccl"


class MpiAllReduce(CrossDeviceOps):
    """Across worker processes (what MultiWorkerMirroredStrategy uses): each worker sums its
    own replicas, MPI all-reduces the workers' sums, every local replica gets the result."""

    lowering = "mpi"

    def __init__(self, group, replicas: int, first: int):
        self.group, self.replicas, self.first = group, int(replicas), int(first)

    def options(self) -> dict:
        return {"group": self.group, "replicas": self.replicas, "first": self.first}

    def __repr__(self) -> str:
        return f"MpiAllReduce(workers={self.group.size})"


def choose_cross_device_ops(devices) -> CrossDeviceOps:
    """What `cross_device_ops=None` means for these devices: when all are of one kind, the
    lowering that kind's backend declares (`default_lowering`: the fused one-pass
    HostAllReduce for host devices, fastest on CPU, see docs/benchmarks.md; NcclAllReduce
    for GPUs, where logical GPUs sharing a physical one are summed by one kernel), else
    ReductionToOneDevice.

    >>> choose_cross_device_ops(["cpu:0", "cpu:1"])
    HostAllReduce()
    """
    from graphdist.device.backends import backend_of_kind
    from graphdist.device.names import device_kind

    backends = {backend_of_kind(device_kind(dev)) for dev in devices}
    if len(backends) != 1:
        return ReductionToOneDevice()
    return _by_lowering(backends.pop().default_lowering)()


def _by_lowering(name: str) -> type[CrossDeviceOps]:
    """The CrossDeviceOps class that names lowering `name` (and needs no options)."""
    found = [cls for cls in _subclasses(CrossDeviceOps) if cls.lowering == name]
    if not found:
        raise ValueError(f"no CrossDeviceOps names the lowering {name!r} (a backend's "
                         "default_lowering must be one a CrossDeviceOps class names)")
    return found[0]


def _subclasses(cls) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]
