"""What convolution and pooling share: the NHWC window geometry as TF computes it (output
sizes, SAME padding), the taps of a window over an input, argument and error helpers, and
the batching rule that folds the replica axis into the batch axis."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.array import reshape_p
from graphdist.ops.core import require_float

def pair(op_name: str, name: str, value, where: str) -> tuple[int, int]:
    """An int, a pair (h, w), or TF's [h] / [1, h, w, 1] -> (h, w)."""
    if isinstance(value, (int, np.integer)):
        return int(value), int(value)
    try:
        v = tuple(int(a) for a in value)
    except (TypeError, ValueError):
        v = ()
    if len(v) == 1:
        return v[0], v[0]
    if len(v) == 2:
        return v
    if len(v) == 4 and v[0] == 1 and v[3] == 1:
        return v[1], v[2]
    raise ValueError(f"{op_name}: {name} must be an int, a pair (h, w) or [1, h, w, 1] "
                     f"(NHWC: no {name} over the batch or channels), got {value!r}; {where}")


def operands(names, values) -> str:
    """What the public functions name in their errors: each operand's type, as x:f32[...]."""
    return ", ".join(f"{n}:{ArrayType(tuple(np.shape(v)), np.dtype(getattr(v, 'dtype', 'f8')))}"
                     for n, v in zip(names, values))


def window_geometry(op_name: str, in_hw, k_hw, strides, dilations, padding, where: str):
    """Output size and (before, after) padding per spatial axis, exactly as TF computes them:
    SAME pads max((ceil(n/s) - 1) * s + (k - 1) * d + 1 - n, 0), the smaller half before."""
    for name, v in (("strides", strides), ("dilations", dilations), ("window", k_hw)):
        if len(v) != 2 or min(v) < 1:
            raise ValueError(f"{op_name}: {name} must be positive, got {tuple(v)}; {where}")
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"{op_name}: padding must be 'SAME' or 'VALID', got {padding!r}; "
                         f"{where}")
    out_hw, pads = [], []
    for n, k, s, d in zip(in_hw, k_hw, strides, dilations):
        span = (k - 1) * d + 1
        if padding == "VALID":
            o, pad = ((n - span) // s + 1 if n >= span else 0), (0, 0)
        else:
            o = -(-n // s)
            total = max((o - 1) * s + span - n, 0)
            pad = (total // 2, total - total // 2)
        if o <= 0:
            raise ShapeError(f"{op_name}: the {span}-wide window does not fit the input "
                             f"(size {n}) with padding={padding!r}; {where}")
        out_hw.append(o)
        pads.append(pad)
    return tuple(out_hw), tuple(pads)


def describe(names, tys, **params) -> str:
    return ", ".join([f"{n}:{t}" for n, t in zip(names, tys)]
                     + [f"{k}={v!r}" for k, v in params.items()])


def require_nhwc(op_name: str, name: str, ty: ArrayType, where: str) -> None:
    if ty.ndim != 4:
        raise ShapeError(f"{op_name}: {name} must be rank 4 (NHWC), got {name}:{ty}; {where}")
    require_float(op_name, ty)


def taps(k_hw, strides, dilations, pads, in_hw, out_hw):
    """For each window tap (row-major, TF's scan order): the output positions whose tap falls
    inside the input, and the input positions it reads there, as (out_index, in_index) over
    NHWC. Padding never becomes an array: taps are clipped to the input instead."""
    def ranges(tap, axis):
        # output o reads input o * s + offset: keep the o whose input is in [0, n)
        s, n = strides[axis], in_hw[axis]
        offset = tap * dilations[axis] - pads[axis][0]
        lo = -(offset // s) if offset < 0 else 0
        hi = min(out_hw[axis], (n - 1 - offset) // s + 1) if n - 1 - offset >= 0 else 0
        start = lo * s + offset
        return slice(lo, hi), slice(start, start + (hi - lo - 1) * s + 1, s), hi > lo

    for i in range(k_hw[0]):
        oh, ih, ok_h = ranges(i, 0)
        for j in range(k_hw[1]):
            ow, iw, ok_w = ranges(j, 1)
            if ok_h and ok_w:
                yield (i, j), (slice(None), oh, ow), (slice(None), ih, iw)


def fold_replicas(bx, op, ins, params, folded=None):
    """Batching by folding the replica axis into the batch axis: the op once over all
    replicas' examples. Only for ops whose examples are independent (not a filter gradient,
    which sums over them) and whose other inputs every replica shares."""
    folded = range(len(ins)) if folded is None else folded
    if any(bx.batched(v) for k, v in enumerate(ins) if k not in folded):
        return bx.per_replica(op, ins, params)
    flat = []
    for k, v in enumerate(ins):
        if k in folded:
            shape = bx.logical(v).shape
            v = bx.add1(reshape_p, bx.stacked(v), shape=(bx.n * shape[0],) + shape[1:],
                        batched=False)
        flat.append(v)
    out = bx.add1(op, *flat, batched=False, **params)
    return bx.add(reshape_p, out, shape=(bx.n, out.ty.shape[0] // bx.n) + out.ty.shape[1:],
                  batched=True)
