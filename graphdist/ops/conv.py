"""Convolutions and pooling in TF's NHWC layout, one block per op: conv2d and its two
backward ops (TF's Conv2DBackpropInput / Conv2DBackpropFilter), max and average pooling and
theirs. The CPU path is im2col (a strided view, copied once) and one GEMM; padding, strides
and dilations follow TF exactly."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.array import reshape_p
from graphdist.ops.core import Op, bind, require_float, same_dtype

# ---------------------------------------------------------------- window geometry


def _pair(op_name: str, name: str, value, where: str) -> tuple[int, int]:
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


def _operands(names, values) -> str:
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


def _describe(names, tys, **params) -> str:
    return ", ".join([f"{n}:{t}" for n, t in zip(names, tys)]
                     + [f"{k}={v!r}" for k, v in params.items()])


def _nhwc(op_name: str, name: str, ty: ArrayType, where: str) -> None:
    if ty.ndim != 4:
        raise ShapeError(f"{op_name}: {name} must be rank 4 (NHWC), got {name}:{ty}; {where}")
    require_float(op_name, ty)


def _taps(k_hw, strides, dilations, pads, in_hw, out_hw):
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


# ---------------------------------------------------------------- im2col

# below this many input channels the patches are copied as (KH*KW*C, rows): contiguous runs
# along W rather than C-long ones. Measured on 2 cores, x (64, 28, 28, 1) with 3x3x1x32:
# forward 0.24 vs 0.65 ms, filter gradient 0.37 vs 0.80 ms; from C=4 on the row-major copy
# wins (x (64, 13, 13, 32), 3x3x32x64: forward 1.66 vs 3.31 ms). Both beat a tensordot or
# einsum over the window view, per-tap GEMMs, and a direct Numba loop (4.4 ms).
FEW_CHANNELS = 4


# the forward pass makes and multiplies the patches of at most this many bytes at a time
# (whole images), so the GEMM reads them while they are still in cache. x (256, 13, 13, 32)
# with 3x3x32x64 filters, 2 cores: 9.5 ms in one piece, 8.0-8.5 ms in 4 MiB pieces, 9-10 ms
# in 9-18 MiB ones. The filter gradient gained nothing from pieces (its GEMM sums over the
# rows): it stays one product.
PATCH_BYTES = 4 << 20


def _image_chunks(n: int, per_image: int):
    """Slices of whole images whose patches take at most PATCH_BYTES (at least one image)."""
    step = max(1, PATCH_BYTES // max(1, per_image))
    return [slice(a, min(n, a + step)) for a in range(0, n, step)]


def _im2col(xp, x, k_hw, strides, dilations, out_hw, pads):
    """x (N, H, W, C) -> patches (N*OH*OW, KH*KW*C): a strided window view copied once
    (a transposed view of a (KH*KW*C, N*OH*OW) copy when C is small)."""
    if any(p for pair in pads for p in pair):
        x = xp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    n, c = x.shape[0], x.shape[3]
    sn, sh, sw, sc = x.strides
    win = xp.lib.stride_tricks.as_strided(   # (N, OH, OW, KH, KW, C), a view
        x, (n, *out_hw, *k_hw, c),
        (sn, sh * strides[0], sw * strides[1], sh * dilations[0], sw * dilations[1], sc))
    rows, depth = n * out_hw[0] * out_hw[1], k_hw[0] * k_hw[1] * c
    if c < FEW_CHANNELS:
        return xp.ascontiguousarray(win.transpose(3, 4, 5, 0, 1, 2)).reshape(depth, rows).T
    return xp.ascontiguousarray(win).reshape(rows, depth)


def _conv_params(x, filters, strides, padding, dilations):
    where = _operands(("x", "filters"), (x, filters))
    return {"strides": _pair("conv2d", "strides", strides, where),
            "padding": padding.upper() if isinstance(padding, str) else padding,
            "dilations": _pair("conv2d", "dilations", dilations, where)}


def _fold(bx, op, ins, params, folded=None):
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


def _conv_cost(ins, outs, *, rows_macs, **_):
    return 2 * rows_macs, sum(t.nbytes for t in (*ins, *outs))


# ---------------------------------------------------------------- conv2d

conv2d_p = Op("conv2d")


@conv2d_p.def_shape
def _conv2d_shape(x, f, *, strides, padding, dilations):
    where = _describe(("x", "filters"), (x, f), strides=strides, padding=padding,
                      dilations=dilations)
    _nhwc("conv2d", "x", x, where)
    if f.ndim != 4:
        raise ShapeError(f"conv2d: filters must be rank 4 (HWIO), got filters:{f}; {where}")
    dtype = same_dtype("conv2d", x, f, names=("x", "filters"))
    if x.shape[3] != f.shape[2]:
        raise ShapeError(f"conv2d: x has {x.shape[3]} channels but the filters expect "
                         f"{f.shape[2]} (HWIO: filters.shape[2]); {where}")
    out_hw, _ = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                padding, where)
    return ArrayType((x.shape[0], *out_hw, f.shape[3]), dtype)


@conv2d_p.def_out
def _conv2d_out(xp, out, x, f, *, strides, padding, dilations):
    out_hw, pads = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                   padding, "")
    o = f.shape[3]
    for part in _image_chunks(x.shape[0], out_hw[0] * out_hw[1] * f[..., 0].size * x.itemsize):
        cols = _im2col(xp, x[part], f.shape[:2], strides, dilations, out_hw, pads)
        xp.matmul(cols, f.reshape(-1, o), out=out[part].reshape(-1, o))   # (rows, O)


@conv2d_p.def_impl
def _conv2d_impl(xp, x, f, *, strides, padding, dilations):
    out_hw, _ = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                padding, "")
    out = xp.empty((x.shape[0], *out_hw, f.shape[3]), x.dtype)
    _conv2d_out(xp, out, x, f, strides=strides, padding=padding, dilations=dilations)
    return out


@conv2d_p.def_vjp
def _conv2d_vjp(ct, x, f, *, strides, padding, dilations):
    p = {"strides": strides, "padding": padding, "dilations": dilations}
    return (bind(conv2d_backprop_input_p, ct, f, input_size=tuple(x.ty.shape[1:3]), **p),
            bind(conv2d_backprop_filter_p, x, ct, filter_size=tuple(f.ty.shape[:2]), **p))


conv2d_p.def_batch(lambda bx, x, f, **params: _fold(bx, conv2d_p, (x, f), params, (0,)))
conv2d_p.def_cost(lambda ins, outs, **_: _conv_cost(
    ins, outs, rows_macs=outs[0].size * ins[1].size // ins[1].shape[3]))

# ---------------------------------------------------------------- conv2d_backprop_input
# dx = the transposed convolution of dy: per tap one GEMM dy @ f[i, j].T added into the
# strided input positions it came from (x (64, 13, 13, 32), 3x3x32x64: 1.94 ms, vs 2.47 ms
# for one GEMM then col2im's strided adds)

conv2d_backprop_input_p = Op("conv2d_backprop_input")


@conv2d_backprop_input_p.def_shape
def _conv2d_backprop_input_shape(dy, f, *, input_size, strides, padding, dilations):
    where = _describe(("dy", "filters"), (dy, f), input_size=input_size, strides=strides,
                      padding=padding, dilations=dilations)
    _nhwc("conv2d_backprop_input", "dy", dy, where)
    dtype = same_dtype("conv2d_backprop_input", dy, f, names=("dy", "filters"))
    if f.ndim != 4 or f.shape[3] != dy.shape[3]:
        raise ShapeError(f"conv2d_backprop_input: filters must be HWIO with {dy.shape[3]} "
                         f"output channels; {where}")
    out_hw, _ = window_geometry("conv2d_backprop_input", tuple(input_size), f.shape[:2],
                                strides, dilations, padding, where)
    if out_hw != dy.shape[1:3]:
        raise ShapeError(f"conv2d_backprop_input: an input of size {tuple(input_size)} gives "
                         f"outputs of size {out_hw}, not dy's {dy.shape[1:3]}; {where}")
    return ArrayType((dy.shape[0], *input_size, f.shape[2]), dtype)


@conv2d_backprop_input_p.def_out
def _conv2d_backprop_input_out(xp, dx, dy, f, *, input_size, strides, padding, dilations):
    n, oh, ow, o = dy.shape
    _, pads = window_geometry("", tuple(input_size), f.shape[:2], strides, dilations, padding,
                              "")
    dx[...] = 0
    dy2 = dy.reshape(-1, o)                                  # (rows, O)
    part = xp.empty((n * oh * ow, f.shape[2]), dy.dtype)     # (rows, C)
    for (i, j), at_out, at_in in _taps(f.shape[:2], strides, dilations, pads, input_size,
                                       (oh, ow)):
        xp.matmul(dy2, f[i, j].T, out=part)
        dx[at_in] += part.reshape(n, oh, ow, -1)[at_out]


@conv2d_backprop_input_p.def_impl
def _conv2d_backprop_input_impl(xp, dy, f, *, input_size, **params):
    dx = xp.empty((dy.shape[0], *input_size, f.shape[2]), dy.dtype)
    _conv2d_backprop_input_out(xp, dx, dy, f, input_size=input_size, **params)
    return dx


@conv2d_backprop_input_p.def_vjp
def _conv2d_backprop_input_vjp(ct, dy, f, *, input_size, **p):
    # dx = C_f^T dy is bilinear: <ct, C_f^T dy> = <conv2d(ct, f), dy>
    return (bind(conv2d_p, ct, f, **p),
            bind(conv2d_backprop_filter_p, ct, dy, filter_size=tuple(f.ty.shape[:2]), **p))


conv2d_backprop_input_p.def_batch(
    lambda bx, dy, f, **params: _fold(bx, conv2d_backprop_input_p, (dy, f), params, (0,)))
conv2d_backprop_input_p.def_cost(lambda ins, outs, **_: _conv_cost(
    ins, outs, rows_macs=ins[0].size * ins[1].size // ins[1].shape[3]))

# ---------------------------------------------------------------- conv2d_backprop_filter

conv2d_backprop_filter_p = Op("conv2d_backprop_filter")


@conv2d_backprop_filter_p.def_shape
def _conv2d_backprop_filter_shape(x, dy, *, filter_size, strides, padding, dilations):
    where = _describe(("x", "dy"), (x, dy), filter_size=filter_size, strides=strides,
                      padding=padding, dilations=dilations)
    _nhwc("conv2d_backprop_filter", "x", x, where)
    _nhwc("conv2d_backprop_filter", "dy", dy, where)
    dtype = same_dtype("conv2d_backprop_filter", x, dy, names=("x", "dy"))
    out_hw, _ = window_geometry("conv2d_backprop_filter", x.shape[1:3], tuple(filter_size),
                                strides, dilations, padding, where)
    if (x.shape[0], *out_hw) != dy.shape[:3]:
        raise ShapeError(f"conv2d_backprop_filter: x gives outputs of shape "
                         f"{(x.shape[0], *out_hw)}, not dy's {dy.shape[:3]}; {where}")
    return ArrayType((*filter_size, x.shape[3], dy.shape[3]), dtype)


@conv2d_backprop_filter_p.def_out
def _conv2d_backprop_filter_out(xp, dw, x, dy, *, filter_size, strides, padding, dilations):
    out_hw, pads = window_geometry("", x.shape[1:3], tuple(filter_size), strides, dilations,
                                   padding, "")
    cols = _im2col(xp, x, tuple(filter_size), strides, dilations, out_hw, pads)
    o = dy.shape[3]
    xp.matmul(cols.T, dy.reshape(-1, o), out=dw.reshape(-1, o))   # (KH*KW*C, O)


@conv2d_backprop_filter_p.def_impl
def _conv2d_backprop_filter_impl(xp, x, dy, *, filter_size, **params):
    dw = xp.empty((*filter_size, x.shape[3], dy.shape[3]), x.dtype)
    _conv2d_backprop_filter_out(xp, dw, x, dy, filter_size=filter_size, **params)
    return dw


@conv2d_backprop_filter_p.def_vjp
def _conv2d_backprop_filter_vjp(ct, x, dy, *, filter_size, **p):
    # dw = sum over examples of x (x) dy: <ct, dw> = <conv2d(x, ct), dy>
    return (bind(conv2d_backprop_input_p, dy, ct, input_size=tuple(x.ty.shape[1:3]), **p),
            bind(conv2d_p, x, ct, **p))


# a sum over each replica's own examples: folding replicas together would sum theirs too
conv2d_backprop_filter_p.def_batch(
    lambda bx, x, dy, **params: bx.per_replica(conv2d_backprop_filter_p, (x, dy), params))
conv2d_backprop_filter_p.def_cost(lambda ins, outs, **_: _conv_cost(
    ins, outs, rows_macs=ins[1].size * outs[0].size // outs[0].shape[3]))

# ---------------------------------------------------------------- pooling


def _pool_shape(op_name, x, *, ksize, strides, padding):
    where = _describe(("x",), (x,), ksize=ksize, strides=strides, padding=padding)
    _nhwc(op_name, "x", x, where)
    out_hw, _ = window_geometry(op_name, x.shape[1:3], ksize, strides, (1, 1), padding, where)
    return ArrayType((x.shape[0], *out_hw, x.shape[3]), x.dtype)


def _pool_taps(x_shape, ksize, strides, padding):
    out_hw, pads = window_geometry("", x_shape[1:3], ksize, strides, (1, 1), padding, "")
    return out_hw, list(_taps(ksize, strides, (1, 1), pads, x_shape[1:3], out_hw))


def _pool_cost(ins, outs, *, ksize, **_):
    return outs[0].size * ksize[0] * ksize[1], sum(t.nbytes for t in (*ins, *outs))


def _pool_params(op_name, x, ksize, strides, padding):
    where = _operands(("x",), (x,))
    return {"ksize": _pair(op_name, "ksize", ksize, where),
            "strides": _pair(op_name, "strides", strides, where),
            "padding": padding.upper() if isinstance(padding, str) else padding}


max_pool2d_p = Op("max_pool2d")
max_pool2d_p.def_shape(lambda x, **p: _pool_shape("max_pool2d", x, **p))


@max_pool2d_p.def_impl
def _max_pool2d_impl(xp, x, *, ksize, strides, padding):
    out_hw, taps = _pool_taps(x.shape, ksize, strides, padding)
    y = xp.full((x.shape[0], *out_hw, x.shape[3]), -np.inf, x.dtype)
    for _, at_out, at_in in taps:                    # one pass per tap, no window copy
        xp.maximum(y[at_out], x[at_in], out=y[at_out])
    return y


max_pool2d_p.def_vjp(lambda ct, x, **p: (
    bind(max_pool2d_grad_p, x, bind(max_pool2d_p, x, **p), ct, **p),))
max_pool2d_p.def_batch(lambda bx, x, **params: _fold(bx, max_pool2d_p, (x,), params))
max_pool2d_p.def_cost(_pool_cost)


def _first_max(xp, x, y, taps):
    """Per tap, where it holds its window's max and no earlier tap did (TF's tie rule: the
    gradient goes to the first max in scan order)."""
    taken = xp.zeros(y.shape, dtype=bool)
    for _, at_out, at_in in taps:
        hit = (x[at_in] == y[at_out]) & ~taken[at_out]
        taken[at_out] |= hit
        yield at_out, at_in, hit


# TF's MaxPoolGrad(orig_input, orig_output, grad): each window's gradient to its first max
max_pool2d_grad_p = Op("max_pool2d_grad")


@max_pool2d_grad_p.def_shape
def _max_pool2d_grad_shape(x, y, dy, **p):
    want = _pool_shape("max_pool2d_grad", x, **p)
    same_dtype("max_pool2d_grad", x, y, dy, names=("x", "y", "dy"))
    if y.shape != want.shape or dy.shape != want.shape:
        raise ShapeError(f"max_pool2d_grad: y and dy must have the pooled shape {want}; "
                         + _describe(("x", "y", "dy"), (x, y, dy), **p))
    return x


@max_pool2d_grad_p.def_impl
def _max_pool2d_grad_impl(xp, x, y, dy, *, ksize, strides, padding):
    dx = xp.zeros_like(x)
    zero = x.dtype.type(0)
    for at_out, at_in, hit in _first_max(xp, x, y, _pool_taps(x.shape, ksize, strides,
                                                              padding)[1]):
        dx[at_in] += xp.where(hit, dy[at_out], zero)     # windows may overlap: add
    return dx


# linear in dy; x and y only pick the positions (piecewise constant: no gradient)
max_pool2d_grad_p.def_vjp(lambda ct, x, y, dy, **p: (
    None, None, bind(max_pool2d_grad_grad_p, x, y, ct, **p)))
max_pool2d_grad_p.def_batch(
    lambda bx, x, y, dy, **params: _fold(bx, max_pool2d_grad_p, (x, y, dy), params))
max_pool2d_grad_p.def_cost(lambda ins, outs, *, ksize, **_: (
    3 * ins[1].size * ksize[0] * ksize[1], sum(t.nbytes for t in (*ins, *outs))))

# TF's MaxPoolGradGrad: g (shaped like x) read at each window's first max
max_pool2d_grad_grad_p = Op("max_pool2d_grad_grad")


@max_pool2d_grad_grad_p.def_shape
def _max_pool2d_grad_grad_shape(x, y, g, **p):
    want = _pool_shape("max_pool2d_grad_grad", x, **p)
    same_dtype("max_pool2d_grad_grad", x, y, g, names=("x", "y", "g"))
    if y.shape != want.shape or g.shape != x.shape:
        raise ShapeError(f"max_pool2d_grad_grad: y must have the pooled shape {want} and g "
                         f"the shape of x; " + _describe(("x", "y", "g"), (x, y, g), **p))
    return y


@max_pool2d_grad_grad_p.def_impl
def _max_pool2d_grad_grad_impl(xp, x, y, g, *, ksize, strides, padding):
    out = xp.zeros_like(y)
    for at_out, at_in, hit in _first_max(xp, x, y, _pool_taps(x.shape, ksize, strides,
                                                              padding)[1]):
        xp.copyto(out[at_out], g[at_in], where=hit)
    return out


max_pool2d_grad_grad_p.def_vjp(lambda ct, x, y, g, **p: (
    None, None, bind(max_pool2d_grad_p, x, y, ct, **p)))
max_pool2d_grad_grad_p.def_batch(
    lambda bx, x, y, g, **params: _fold(bx, max_pool2d_grad_grad_p, (x, y, g), params))
max_pool2d_grad_grad_p.def_cost(lambda ins, outs, *, ksize, **_: (
    3 * ins[1].size * ksize[0] * ksize[1], sum(t.nbytes for t in (*ins, *outs))))


def _avg_counts(xp, x_shape, ksize, strides, padding, dtype):
    """How many input elements each window averages: with SAME only those inside the input
    (as TF does). A scalar where every window is whole."""
    out_hw, taps = _pool_taps(x_shape, ksize, strides, padding)
    counts = np.zeros(out_hw, dtype)
    for _, at_out, _ in taps:
        counts[at_out[1:]] += 1
    if counts.min() == ksize[0] * ksize[1]:
        return dtype.type(ksize[0] * ksize[1])
    return xp.asarray(counts[..., None])             # (OH, OW, 1)


avg_pool2d_p = Op("avg_pool2d")
avg_pool2d_p.def_shape(lambda x, **p: _pool_shape("avg_pool2d", x, **p))


@avg_pool2d_p.def_impl
def _avg_pool2d_impl(xp, x, *, ksize, strides, padding):
    out_hw, taps = _pool_taps(x.shape, ksize, strides, padding)
    y = xp.zeros((x.shape[0], *out_hw, x.shape[3]), x.dtype)
    for _, at_out, at_in in taps:
        y[at_out] += x[at_in]
    y /= _avg_counts(xp, x.shape, ksize, strides, padding, x.dtype)
    return y


avg_pool2d_p.def_vjp(lambda ct, x, **p: (
    bind(avg_pool2d_grad_p, ct, input_size=tuple(x.ty.shape[1:3]), **p),))
avg_pool2d_p.def_batch(lambda bx, x, **params: _fold(bx, avg_pool2d_p, (x,), params))
avg_pool2d_p.def_cost(_pool_cost)

# TF's AvgPoolGrad: each window's gradient spread evenly over the elements it averaged
avg_pool2d_grad_p = Op("avg_pool2d_grad")


@avg_pool2d_grad_p.def_shape
def _avg_pool2d_grad_shape(dy, *, input_size, **p):
    where = _describe(("dy",), (dy,), input_size=input_size, **p)
    _nhwc("avg_pool2d_grad", "dy", dy, where)
    x = ArrayType((dy.shape[0], *input_size, dy.shape[3]), dy.dtype)
    if _pool_shape("avg_pool2d_grad", x, **p).shape != dy.shape:
        raise ShapeError(f"avg_pool2d_grad: an input of size {tuple(input_size)} does not "
                         f"pool to dy's size; {where}")
    return x


@avg_pool2d_grad_p.def_impl
def _avg_pool2d_grad_impl(xp, dy, *, input_size, ksize, strides, padding):
    shape = (dy.shape[0], *input_size, dy.shape[3])
    share = dy / _avg_counts(xp, shape, ksize, strides, padding, dy.dtype)
    dx = xp.zeros(shape, dy.dtype)
    for _, at_out, at_in in _pool_taps(shape, ksize, strides, padding)[1]:
        dx[at_in] += share[at_out]
    return dx


avg_pool2d_grad_p.def_vjp(lambda ct, dy, *, input_size, **p: (bind(avg_pool2d_p, ct, **p),))
avg_pool2d_grad_p.def_batch(
    lambda bx, dy, **params: _fold(bx, avg_pool2d_grad_p, (dy,), params))
avg_pool2d_grad_p.def_cost(lambda ins, outs, *, ksize, **_: (
    ins[0].size * ksize[0] * ksize[1], ins[0].nbytes + outs[0].nbytes))

# ---------------------------------------------------------------- public functions


def conv2d(x, filters, strides=1, padding="SAME", dilations=1):
    """2-D convolution (cross-correlation, as TF's) of NHWC `x` with HWIO `filters`.

    `strides`/`dilations`: an int, a pair (h, w) or TF's [1, h, w, 1]; `padding` "SAME" or
    "VALID" (TF's rule: SAME gives ceil(size / stride) outputs, the smaller half of the
    padding before).

    >>> gd.nn.conv2d(np.ones((1, 5, 5, 2), np.float32), np.ones((3, 3, 2, 4), np.float32)).shape
    (1, 5, 5, 4)
    """
    return bind(conv2d_p, x, filters, **_conv_params(x, filters, strides, padding, dilations))


def max_pool2d(x, ksize, strides, padding):
    """Max over each `ksize` window of NHWC `x` (padding "SAME" or "VALID", as TF).

    >>> gd.nn.max_pool2d(np.arange(16.0).reshape(1, 4, 4, 1), 2, 2, "VALID")[0, ..., 0]
    array([[ 5.,  7.],
           [13., 15.]])
    """
    return bind(max_pool2d_p, x, **_pool_params("max_pool2d", x, ksize, strides, padding))


def avg_pool2d(x, ksize, strides, padding):
    """Mean over each `ksize` window of NHWC `x`; with SAME, of the elements inside the input.

    >>> gd.nn.avg_pool2d(np.arange(16.0).reshape(1, 4, 4, 1), 2, 2, "VALID")[0, ..., 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]])
    """
    return bind(avg_pool2d_p, x, **_pool_params("avg_pool2d", x, ksize, strides, padding))
