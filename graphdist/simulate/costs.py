"""What gd.simulate prices: one compute eqn by the calibrated per-op model, one collective
by its lowering's cost model (the registry in passes/collectives: each lowering prices
its own collectives beside their emission). The formulas are re-exported here under the
names they have always had."""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from graphdist.ops.math import matmul_p
from graphdist.passes.collectives import LOWERINGS, Pricing
from graphdist.passes.collectives.costs import (  # noqa: F401  (the public formulas)
    all_gather_cost,
    broadcast_cost,
    hierarchical_cost,
    host_cost,
    mpi_cost,
    one_device_cost,
    ring_cost,
)


def collective_seconds(lowering: str, collective: str, n: int, nbytes: float, link,
                       pricing: Pricing = Pricing()) -> float:
    """Seconds for `collective` of `nbytes` on n devices with the registered lowering."""
    return LOWERINGS[lowering]().cost(collective, n, nbytes, link, pricing)


def _all_reduce_of(name: str):
    def cost(n: int, nbytes: float, link, *args) -> float:
        return collective_seconds(name, "all_reduce", n, nbytes, link, _pricing(name, *args))
    cost.__name__ = f"{name}_all_reduce_cost"
    return cost


def _pricing(name: str, *args) -> Pricing:
    """The positional knobs the old per-lowering formulas took: hierarchical's num_groups,
    mpi's devices_per_worker and local link."""
    if not args:
        return Pricing(num_groups=2) if LOWERINGS[name].uses_groups else Pricing()
    if LOWERINGS[name].uses_groups:
        return Pricing(num_groups=args[0])
    return Pricing(devices_per_worker=args[0], add=args[1] if len(args) > 1 else None)


# every registered lowering's all-reduce cost, (n, nbytes, link) -> seconds, by name
COSTS = MappingProxyType({name: _all_reduce_of(name) for name in LOWERINGS})


def shared_host_cost(lowering: str, n: int, nbytes: float, link, num_groups: int = 2,
                     add=None) -> float:
    """The same all-reduce among n logical devices of one host: nothing runs in parallel,
    so every copy and add of the lowering is paid (each lowering's `shared_host_cost`:
    ring n*2(n-1) copies and n(n-1) adds of S/n, one_device 2(n-1) copies and n-1 adds of
    S, hierarchical 2(n-g) + g(g-1) copies and n-g + g(g-1) adds of S; host one fused
    pass). `add`: the time of an add reading two buffers of S bytes and writing one
    (priced as 3S bytes); None: adds are free."""
    return collective_seconds(lowering, "all_reduce", n, nbytes, link,
                              Pricing(shared_host=True, add=add, num_groups=num_groups))


def op_kind(op) -> str:
    """Which calibrated rate prices `op`: the cost kind it declares (ops/core.py
    COST_KINDS), "matmul", "reduce" or "elementwise", not a guess from its name."""
    return op.cost_kind


def per_unit(model: dict, size: float | None) -> float:
    """Seconds per unit of work (a FLOP, a byte touched) of an op of this `size` (a GEMM's
    smallest side, an elementwise op's bytes touched): the calibrated rates by size,
    interpolated in log(size) and held flat past the ends (None: the overall fit). A
    thin GEMM runs below the BLAS peak; a pass over buffers past the cache runs at the
    memory's rate."""
    table = model.get("by_size")
    if not table or size is None:
        return model["per_unit"]
    sizes = [math.log(r["size"]) for r in table]
    return float(np.interp(math.log(max(size, 1)), sizes, [r["per_unit"] for r in table]))


def _smallest_side(eqn) -> int | None:
    """min(M, K, N) of a 2-D matmul (batched: of its last two axes); None for others."""
    shapes = [v.ty.shape for v in eqn.inputs]
    if eqn.op is not matmul_p or len(shapes) != 2 or min(map(len, shapes)) < 2:
        return None
    (m, k), n = shapes[0][-2:], shapes[1][-1]
    return min(m, k, n)


def eqn_seconds(eqn, cal: dict) -> float:
    """The calibrated model's time of one eqn: per-node overhead + a + work / rate."""
    flops, nbytes = eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                                dict(eqn.params))
    kind = op_kind(eqn.op)
    model = cal["ops"][kind]
    if kind == "matmul":
        return (cal["node_overhead_s"] + model["a"]
                + flops * per_unit(model, _smallest_side(eqn)))
    return cal["node_overhead_s"] + model["a"] + nbytes * per_unit(model, nbytes)
