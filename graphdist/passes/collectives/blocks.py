"""The building blocks every lowering emits with: copies between devices, adds in a fixed
order, the mean's division, flattening views, shard views and one fused N-way node."""

from __future__ import annotations

import numpy as np

from graphdist.device.backends import backend_of_kind
from graphdist.ir import ArrayType, Eqn, Lit, Var
from graphdist.ir.builder import Builder
from graphdist.ops import OPS
from graphdist.ops.array import concat_p, fill_p, getitem_p, reshape_p
from graphdist.ops.collectives import copy_p, shard_length, shard_offsets, shard_sizes
from graphdist.ops.math import add_p, div_p


def finish_mean(b: Builder, total: Var, n: int, device: str, op: str) -> Var:
    """Mean = sum / n, divided (not multiplied by 1/n) as the reduce kernels do."""
    if op == "sum" or n == 1:
        return total
    return b.add1(div_p, [total, _lit(n, total)], device)


def _lit(value, like: Var):
    return Lit(np.asarray(value, dtype=like.ty.dtype)[()], ArrayType((), like.ty.dtype))


def sum_in_order(b: Builder, parts: list[Var], device: str) -> Var:
    total = parts[0]
    for p in parts[1:]:
        total = b.add1(add_p, [total, p], device)
    return total


def copy_to(b: Builder, x: Var, device: str) -> Var:
    return x if x.device == device else b.add1(copy_p, [x], device, device=device)


def near_equal(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous slices of `total`, the first ones one larger (the shards
    of a reduce_scatter, the ring's segments).

    >>> near_equal(10, 4)
    [3, 3, 2, 2]
    """
    return shard_sizes(total, parts)


def groups_of(devices, num_groups: int) -> list[tuple]:
    """Contiguous near-equal slices of `devices`; fewer groups when there are fewer devices.

    >>> groups_of(("cpu:0", "cpu:1", "cpu:2"), 2)
    [('cpu:0', 'cpu:1'), ('cpu:2',)]
    """
    out, start = [], 0
    for size in near_equal(len(devices), min(num_groups, len(devices))):
        out.append(tuple(devices[start:start + size]))
        start += size
    return out


def reshaped(b: Builder, x: Var, shape: tuple) -> Var:
    return x if x.ty.shape == shape else b.add1(reshape_p, [x], x.device, shape=shape)


def concat_on(b: Builder, parts: list[Var], device: str) -> Var:
    """parts concatenated along axis 0 on `device` (one part: itself)."""
    return parts[0] if len(parts) == 1 else b.add1(concat_p, parts, device, axis=0)


def flat_slice(b: Builder, x: Var, start: int, stop: int) -> Var:
    """Elements [start, stop) of x flattened, as a view on x's device."""
    flat = reshaped(b, x, (x.ty.size,))
    if (start, stop) == (0, x.ty.size):
        return flat
    return b.add1(getitem_p, [flat], x.device, index=(("slice", start, stop, None),))


def shard_of(b: Builder, total: Var, n: int, replica: int) -> Var:
    """Replica `replica`'s shard (of n) of `total`, where total lives: its chunk of the
    flattened value (a view), padded with zeros to every shard's length."""
    at, length = shard_offsets(total.ty.size, n), shard_length(total.ty.size, n)
    return padded(b, flat_slice(b, total, at[replica], at[replica + 1]), length)


def padded(b: Builder, chunk: Var, length: int) -> Var:
    """A flat chunk followed by zeros up to `length` elements, on the chunk's device."""
    if chunk.ty.size == length:
        return chunk
    zeros = b.add1(fill_p, [], chunk.device, shape=(length - chunk.ty.size,),
                   dtype=chunk.ty.dtype, value=0)
    return concat_on(b, [chunk, zeros] if chunk.ty.size else [zeros], chunk.device)


def shards_on_devices(b: Builder, totals: list[Var], n: int, devices: tuple,
                      first: int = 0) -> list[Var]:
    """Each device's shard, cut from the total it can see (totals[d] may live elsewhere:
    then only the shard is copied)."""
    return [copy_to(b, shard_of(b, totals[d], n, first + d), dev)
            for d, dev in enumerate(devices)]


def unpadded_views(b: Builder, xs: list[Var], n: int, total: int | None) -> list[Var]:
    """All-gather inputs without their padding: each padded shard's chunk, a view where it
    lives (total None: the values themselves)."""
    if total is None:
        return list(xs)
    return [flat_slice(b, x, 0, size) for x, size in zip(xs, shard_sizes(total, n))]


def fused_node(b: Builder, name: str, xs: list[Var], devices: tuple, params: dict,
               flatten: bool = True) -> list[Var]:
    """One node of op `name` on the first device reading every replica's value (flattened
    with views when `flatten`) and writing one result per device, typed by the op."""
    ins = [reshaped(b, x, (x.ty.size,)) for x in xs] if flatten else list(xs)
    params = tuple(params.items())
    types = OPS[name].out_types(*(x.ty for x in ins), **dict(params))
    outs = tuple(Var(ty, None, dev) for ty, dev in zip(types, devices))
    b.eqns.append(Eqn(OPS[name], tuple(ins), outs, params, device=devices[0], scope=b.scope))
    return list(outs)


def require_capability(who: str, devices, capability: str, what: str, hint: str) -> None:
    """Raise unless every device's backend declares `capability` (a Backend attribute,
    device/host.py): `what` says in words what the devices must be."""
    wrong = [dev for dev in devices
             if not getattr(backend_of_kind(str(dev).partition(":")[0]), capability)]
    if wrong:
        raise ValueError(f"{who}: expected only {what}, got "
                         f"{list(devices)} ({', '.join(wrong)} not); {hint}")
