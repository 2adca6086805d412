"""Cross-device ops: each one is a *lowering* of the logical all_reduce (and broadcast) into
explicit per-device copies and adds in the placed graph, so the graph shows what runs.

Every lowering sums in a fixed order, so the same inputs give the same bits every run, and
every replica ends with the same bits (they all receive copies of one result per element).
"""

from __future__ import annotations

from graphdist.ir import Var
from graphdist.ops import OPS
from graphdist.passes.builder import Builder


class CrossDeviceOps:
    """Base: subclasses implement `all_reduce`; `broadcast` copies from the source."""

    def all_reduce(self, b: Builder, xs: list[Var], op: str, devices: tuple) -> list[Var]:
        """Emit eqns into `b` that leave reduce(xs) on every device; return one Var per device."""
        raise NotImplementedError

    def broadcast(self, b: Builder, xs: list[Var], source: int, devices: tuple) -> list[Var]:
        src = xs[source]
        return [src if d == source else b.add1(OPS["copy_to"], [src], dev, device=dev)
                for d, dev in enumerate(devices)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def finish_mean(b: Builder, total: Var, n: int, device: str, op: str) -> Var:
    """Mean = sum / n, divided (not multiplied by 1/n) as the reduce kernels do."""
    if op == "sum" or n == 1:
        return total
    return b.add1(OPS["div"], [total, _lit(n, total)], device)


def _lit(value, like: Var):
    import numpy as np

    from graphdist.ir import ArrayType, Lit

    return Lit(np.asarray(value, dtype=like.ty.dtype)[()], ArrayType((), like.ty.dtype))


def sum_in_order(b: Builder, parts: list[Var], device: str) -> Var:
    total = parts[0]
    for p in parts[1:]:
        total = b.add1(OPS["add"], [total, p], device)
    return total


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, add them there in device order, copy the
    result back: simple, and the fewest adds; the reducing device's link is the bottleneck."""

    def __init__(self, reduce_to_device: str | None = None):
        self.reduce_to_device = reduce_to_device

    def all_reduce(self, b, xs, op, devices):
        n = len(devices)
        if n == 1:
            return [finish_mean(b, xs[0], 1, devices[0], op)]
        from graphdist.distribute.devices import canonical

        target = canonical(self.reduce_to_device) if self.reduce_to_device else devices[0]
        parts = [x if x.device == target else b.add1(OPS["copy_to"], [x], target, device=target)
                 for x in xs]
        result = finish_mean(b, sum_in_order(b, parts, target), n, target, op)
        return [result if dev == target else b.add1(OPS["copy_to"], [result], dev, device=dev)
                for dev in devices]

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


def choose_cross_device_ops(devices) -> CrossDeviceOps:
    """What `cross_device_ops=None` means for these devices."""
    return ReductionToOneDevice()
