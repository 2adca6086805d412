"""Convolutions in TF's NHWC layout, one block per op: conv2d and its two backward ops (TF's
Conv2DBackpropInput / Conv2DBackpropFilter), plus the window geometry they share with
pooling (graphdist/ops/pool.py). The CPU path is im2col (a strided view, copied a few
images at a time) and a GEMM per piece, and for the input gradient a GEMM and col2im per
piece; padding, strides and dilations follow TF exactly."""

from __future__ import annotations

import functools

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, accumulate_in_float32, bind, same_dtype
from graphdist.ops.window import (describe, fold_replicas, operands, pair, require_nhwc, taps,
                                  window_geometry)

# ---------------------------------------------------------------- im2col

# below this many input channels the patches are copied as (KH*KW*C, rows): contiguous runs
# along W rather than C-long ones. Measured on 2 cores, x (64, 28, 28, 1) with 3x3x1x32:
# forward 0.24 vs 0.65 ms, filter gradient 0.37 vs 0.80 ms; from C=4 on the row-major copy
# wins (x (64, 13, 13, 32), 3x3x32x64: forward 1.66 vs 3.31 ms). Both beat a tensordot or
# einsum over the window view, per-tap GEMMs, and a direct Numba loop (4.4 ms).
FEW_CHANNELS = 4


# the forward pass and the filter gradient make and multiply the patches of at most this
# many bytes at a time (whole images), so the GEMM reads them while they are still in cache.
# x (256, 13, 13, 32) with 3x3x32x64 filters, 2 cores: forward 9.5 ms in one piece, 8.0-8.5
# ms in 4 MiB pieces, 9-10 ms in 9-18 MiB ones; the filter gradient below.
PATCH_BYTES = 4 << 20


def _image_chunks(n: int, per_image: int, limit: int | None = None):
    """Slices of whole images whose patches take at most `limit` bytes (default
    PATCH_BYTES; at least one image)."""
    step = max(1, (PATCH_BYTES if limit is None else limit) // max(1, per_image))
    return [slice(a, min(n, a + step)) for a in range(0, n, step)]


def _im2col(xp, x, k_hw, strides, dilations, out_hw, pads, buf=None):
    """x (N, H, W, C) -> patches (N*OH*OW, KH*KW*C): a strided window view copied once
    (a transposed view of a (KH*KW*C, N*OH*OW) copy when C is small), into the front of the
    flat buffer `buf` when given (the blocked forms copy every block into one buffer
    rather than allocating megabytes per block)."""
    if any(p for pair in pads for p in pair):
        x = xp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    n, c = x.shape[0], x.shape[3]
    sn, sh, sw, sc = x.strides
    win = xp.lib.stride_tricks.as_strided(   # (N, OH, OW, KH, KW, C), a view
        x, (n, *out_hw, *k_hw, c),
        (sn, sh * strides[0], sw * strides[1], sh * dilations[0], sw * dilations[1], sc))
    rows, depth = n * out_hw[0] * out_hw[1], k_hw[0] * k_hw[1] * c
    few = c < FEW_CHANNELS
    if few:
        win = win.transpose(3, 4, 5, 0, 1, 2)
    if buf is None:
        cols = xp.ascontiguousarray(win)
    else:
        cols = buf[:rows * depth].reshape(win.shape)
        xp.copyto(cols, win)
    return cols.reshape(depth, rows).T if few else cols.reshape(rows, depth)


def _patch_buffer(xp, parts, x, k_hw, out_hw):
    """One flat buffer for the largest block's patches; None (a fresh array per block) off
    the host: the buffer saves glibc's mapping and faulting-in of megabytes per block, which
    a device's pool allocator does not cost, and the window view there may not be the
    device's own array type (the CUDA simulator's CuPy gives a host view), which
    ascontiguousarray takes and copyto does not."""
    if xp is not np:
        return None
    most = max(p.stop - p.start for p in parts)
    return xp.empty(most * out_hw[0] * out_hw[1] * k_hw[0] * k_hw[1] * x.shape[3], x.dtype)


def conv_direct_numpy(xp, x, f, out, strides, dilations, pads, bias=None, relu=False):
    """The numpy twin of kernels/conv.py's conv_direct_cpu, conv2d + bias + relu with the
    epilogue fused (the cold start's form): one multiply-add over the whole output per
    (tap, channel) in the kernel's order, taps in the padding skipped, then the bias and
    relu: the same float operations, so the same bits. pads: (top, left)."""
    out[...] = 0
    for (p, q), at_out, at_in in taps(f.shape[:2], strides, dilations,
                                       ((pads[0], 0), (pads[1], 0)), x.shape[1:3],
                                       out.shape[1:3]):
        for ch in range(x.shape[3]):
            out[at_out] += x[at_in][..., ch, None] * f[p, q, ch]
    if bias is not None:
        out += bias
    if relu:
        xp.maximum(out, 0, out=out)


def _conv_params(x, filters, strides, padding, dilations):
    where = operands(("x", "filters"), (x, filters))
    return {"strides": pair("conv2d", "strides", strides, where),
            "padding": padding.upper() if isinstance(padding, str) else padding,
            "dilations": pair("conv2d", "dilations", dilations, where)}


def _conv_cost(ins, outs, *, rows_macs, **_):
    return 2 * rows_macs, sum(t.nbytes for t in (*ins, *outs))


# ---------------------------------------------------------------- conv2d

conv2d_p = Op("conv2d", cost_kind="matmul")


@conv2d_p.def_shape
def _conv2d_shape(x, f, *, strides, padding, dilations):
    where = describe(("x", "filters"), (x, f), strides=strides, padding=padding,
                      dilations=dilations)
    require_nhwc("conv2d", "x", x, where)
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
    parts = _image_chunks(x.shape[0], out_hw[0] * out_hw[1] * f[..., 0].size * x.itemsize)
    buf = _patch_buffer(xp, parts, x, f.shape[:2], out_hw)
    for part in parts:
        cols = _im2col(xp, x[part], f.shape[:2], strides, dilations, out_hw, pads, buf)
        xp.matmul(cols, f.reshape(-1, o), out=out[part].reshape(-1, o))   # (rows, O)


# the fused form (conv2d + bias (+ relu)) makes the output in blocks of whole images whose
# patches and output together take at most this many bytes, so the bias add and relu run on
# a block still in cache instead of as two more passes over the whole activation (22 MB for
# the tutorial's first layer at batch 256). bench/conv2d.py: with the Numba epilogue 2.1x
# the three ops there (2.5 against 5.3 ms). 3 MiB rather than 4: the second layer's fused
# forward (256, 13, 13, 32) -> 64, min of 30 interleaved, twice: 4.72 / 4.89 ms in 3 MiB
# blocks, 4.89 / 5.07 in 2, 5.13 / 5.38 in 1, 5.36 / 5.56 in 4; the first layer level.
EPILOGUE_BYTES = 3 << 20


def bias_act_numpy(xp, rows, bias, relu):
    """rows += bias, then relu (np.maximum(., 0)) in place: the epilogue's numpy form, the
    twin of kernels/conv.py bias_act_cpu (same bits)."""
    if bias is not None:
        # the bias repeated along an output row: numpy's broadcast add over O-long inner
        # runs costs a loop per position; over longer runs it streams
        reps = max(k for k in range(1, 33) if rows.shape[0] % k == 0)
        rows.reshape(-1, reps * bias.size)[...] += xp.tile(bias, reps)
    if relu:
        xp.maximum(rows, 0, out=rows)


def conv2d_blocks(xp, out, x, f, finish, *, strides, padding, dilations) -> None:
    """out[...] = conv2d(x, f), one block of whole images at a time (patches and output
    together at most EPILOGUE_BYTES): im2col, one GEMM into the block's rows of out, then
    `finish(part, rows)` (part: the block's slice of the batch; rows: its (R, O) view of
    out) while they are still in cache. The fused forms' (epilogues') output pass. out
    None: each block goes into one scratch block instead, which `finish` consumes (a
    convolution whose output only a pool reads)."""
    out_hw, pads = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                   padding, "")
    o = f.shape[3]
    per_image = out_hw[0] * out_hw[1] * (f[..., 0].size + o) * x.itemsize
    parts = _image_chunks(x.shape[0], per_image, EPILOGUE_BYTES)
    buf = _patch_buffer(xp, parts, x, f.shape[:2], out_hw)
    scratch = None if out is not None else xp.empty(
        (max(p.stop - p.start for p in parts), *out_hw, o), x.dtype)
    for part in parts:
        rows = (out[part] if out is not None else scratch[:part.stop - part.start]
                ).reshape(-1, o)
        cols = _im2col(xp, x[part], f.shape[:2], strides, dilations, out_hw, pads, buf)
        xp.matmul(cols, f.reshape(-1, o), out=rows)
        finish(part, rows)


def conv2d_bias_act_out(xp, out, x, f, bias=None, relu=False, *, strides, padding,
                        dilations, epilogue=None):
    """out[...] = conv2d(x, f) (+ bias) (then relu, np.maximum(., 0)), the epilogue fused
    into the output pass (conv2d_blocks): `epilogue(rows, bias, relu)` on each block's
    rows while they are in cache (default numpy's bias_act_numpy; the CPU kernel:
    kernels/conv.py bias_act_cpu, one parallel pass, same bits). Programs run it through
    the fused op ops/epilogue.py conv2d_bias_act, which the compile pass
    passes/epilogue.py makes from conv2d -> add(bias) -> relu."""
    epilogue = epilogue or functools.partial(bias_act_numpy, xp)

    def finish(part, rows):
        if bias is not None or relu:
            epilogue(rows, bias, relu)

    conv2d_blocks(xp, out, x, f, finish, strides=strides, padding=padding,
                  dilations=dilations)


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


conv2d_p.def_batch(lambda bx, x, f, **params: fold_replicas(bx, conv2d_p, (x, f), params, (0,)))
conv2d_p.def_cost(lambda ins, outs, **_: _conv_cost(
    ins, outs, rows_macs=outs[0].size * ins[1].size // ins[1].shape[3]))

# ---------------------------------------------------------------- conv2d_backprop_input
# dx = the transposed convolution of dy: one GEMM dy (rows, O) @ f (O, KH*KW*C) makes every
# tap's share of dx as columns, col2im adds each tap's into the input positions it came
# from. Per PATCH_BYTES of columns at a time (whole images), so col2im reads them from
# cache. bench/conv_input_grad.py, 2 cores, the CPU kernel (Numba col2im), x (256, 13, 13,
# 32), 3x3x32x64: 5.9 ms in 4-8 MiB pieces, 6.5 in 2 MiB, 7.6 in 1 MiB, 8.7 in one piece;
# the former form (per tap a GEMM dy @ f[i, j].T added into strided slices of dx): 10.2 ms;
# numpy's col2im: 9.6 ms. x (256, 28, 28, 1), 3x3x1x32: 2.0 ms against 3.5.

conv2d_backprop_input_p = Op("conv2d_backprop_input", cost_kind="matmul")


@conv2d_backprop_input_p.def_shape
def _conv2d_backprop_input_shape(dy, f, *, input_size, strides, padding, dilations):
    where = describe(("dy", "filters"), (dy, f), input_size=input_size, strides=strides,
                      padding=padding, dilations=dilations)
    require_nhwc("conv2d_backprop_input", "dy", dy, where)
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


def col2im_numpy(xp, cols, dx, strides, dilations, pads):
    """cols (N, OH, OW, KH, KW, C) -> dx (N, H, W, C): each tap's columns added into the
    input positions it read, taps in row-major order from zero. The CPU kernel
    (kernels/conv.py) adds in the same order: both give the same bits. pads: (top, left)."""
    dx[...] = 0
    for (i, j), at_out, at_in in taps(cols.shape[3:5], strides, dilations,
                                       ((pads[0], 0), (pads[1], 0)), dx.shape[1:3],
                                       cols.shape[1:3]):
        dx[at_in] += cols[at_out + (i, j)]


def _columns(xp, buf, dy, w, k_hw, c):
    """One GEMM: dy (N, OH, OW, O) -> columns indexed (N, OH, OW, KH, KW, C) in buf, stored
    taps first ((KH*KW*C, rows), a transposed view) below FEW_CHANNELS, where the strided
    adds then run along W rather than over C-long runs."""
    n, oh, ow, o = dy.shape
    rows, depth = n * oh * ow, w.shape[0]
    if c < FEW_CHANNELS:
        cols = buf[:rows * depth].reshape(depth, rows)
        xp.matmul(w, dy.reshape(rows, o).T, out=cols)
        return cols.reshape(*k_hw, c, n, oh, ow).transpose(3, 4, 5, 0, 1, 2)
    cols = buf[:rows * depth].reshape(rows, depth)
    xp.matmul(dy.reshape(rows, o), w.T, out=cols)
    return cols.reshape(n, oh, ow, *k_hw, c)


def input_grad_by_columns(xp, dx, dy, f, *, input_size, strides, padding, dilations,
                          col2im):
    """dx = conv2d_backprop_input(dy, f) written into dx: per chunk of whole images, one
    GEMM into columns, then `col2im(cols, dx_part, strides, dilations, (top, left))`.
    Taps-first columns (few channels) always take numpy's col2im: its strided adds over
    contiguous runs were as fast as a Numba loop (x (256, 28, 28, 1): 0.7-0.8 ms)."""
    n, oh, ow, o = dy.shape
    kh, kw, c, _ = f.shape
    _, pads = window_geometry("", tuple(input_size), (kh, kw), strides, dilations, padding,
                              "")
    parts = _image_chunks(n, oh * ow * kh * kw * c * dy.itemsize)
    buf = xp.empty((parts[0].stop - parts[0].start) * oh * ow * kh * kw * c, dy.dtype)
    add = col2im if c >= FEW_CHANNELS else functools.partial(col2im_numpy, xp)
    for part in parts:
        cols = _columns(xp, buf, dy[part], f.reshape(-1, o), (kh, kw), c)
        add(cols, dx[part], strides, dilations, (pads[0][0], pads[1][0]))


@conv2d_backprop_input_p.def_out
def _conv2d_backprop_input_out(xp, dx, dy, f, **params):
    input_grad_by_columns(xp, dx, dy, f, col2im=functools.partial(col2im_numpy, xp),
                          **params)


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
    lambda bx, dy, f, **params: fold_replicas(bx, conv2d_backprop_input_p, (dy, f), params, (0,)))
conv2d_backprop_input_p.def_cost(lambda ins, outs, **_: _conv_cost(
    ins, outs, rows_macs=ins[0].size * ins[1].size // ins[1].shape[3]))

# ---------------------------------------------------------------- conv2d_backprop_filter
# dw = patches^T @ dy: a small (KH*KW*C, O) result summed over every row of the batch. Per
# PATCH_BYTES of patches at a time (whole images), each piece's product added into dw in
# the pieces' order (deterministic), so the GEMM reads patches still in cache rather than
# 36 MB of them written out first. bench/conv_filter_grad.py, 2 cores, x (256, 13, 13, 32),
# 3x3x32x64: 6.6-6.9 ms in the CNN step against 7.7-7.9 for one product; alone 6.5-7.6 ms
# in 2-4 MiB pieces, the best size moving between runs, and in this VM's slow spells each
# GEMM call costs more (4 MiB pieces 9.4 ms, one product 8.1). Batch 64 and one input
# channel: within noise. A parallel Numba im2col is slower per piece (thread start-up: 0.12
# against numpy's 0.09 ms for 30 images), a direct Numba kernel for one input channel no
# faster than the GEMM.

conv2d_backprop_filter_p = Op("conv2d_backprop_filter", cost_kind="matmul")


@conv2d_backprop_filter_p.def_shape
def _conv2d_backprop_filter_shape(x, dy, *, filter_size, strides, padding, dilations):
    where = describe(("x", "dy"), (x, dy), filter_size=filter_size, strides=strides,
                      padding=padding, dilations=dilations)
    require_nhwc("conv2d_backprop_filter", "x", x, where)
    require_nhwc("conv2d_backprop_filter", "dy", dy, where)
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
    o = dy.shape[3]
    dw2 = dw.reshape(-1, o)                                        # (KH*KW*C, O)
    parts = _image_chunks(x.shape[0], out_hw[0] * out_hw[1] * dw[..., 0].size * x.itemsize)
    part_dw = xp.empty_like(dw2) if len(parts) > 1 else None
    buf = _patch_buffer(xp, parts, x, tuple(filter_size), out_hw)
    for k, part in enumerate(parts):                # in order: a fixed sum order
        cols = _im2col(xp, x[part], tuple(filter_size), strides, dilations, out_hw, pads,
                       buf)
        xp.matmul(cols.T, dy[part].reshape(-1, o), out=part_dw if k else dw2)
        if k:
            dw2 += part_dw


# the filter gradient runs as kernels/conv_filter.py's groups up to this many accumulators
# (taps x output channels, KH*KW*C*O), for few input channels, stride 1 and no dilation;
# past it OpenBLAS's GEMM is as fast or faster. 2 cores, against the GEMM in pieces: 3x3x1
# to 32 channels (x (256, 28, 28, 1)) 0.71x the time, 3x3x3 to 32 0.72-0.95x, 5x5x1 to 32
# 0.90x, 3x3x1 to 16 0.98x; 3x3x3 to 64 1.03x, 5x5x1 to 64 1.08x, 5x5x3 to 16 1.36x.
FILTER_GROUP_ACCUMULATORS = 27 * 32


def filter_grad_groups_fit(x_shape, out_channels, *, filter_size, strides, padding,
                           dilations, dtype):
    """The ((top, bottom), (left, right)) padding of x when the filter gradient runs as
    kernels/conv_filter.py's groups (FILTER_GROUP_ACCUMULATORS; float32 or float64), else
    None."""
    taps = filter_size[0] * filter_size[1] * x_shape[3]
    if x_shape[3] >= FEW_CHANNELS or taps * out_channels > FILTER_GROUP_ACCUMULATORS or \
            tuple(strides) != (1, 1) or tuple(dilations) != (1, 1) or \
            np.dtype(dtype) not in (np.float32, np.float64):
        return None
    _, pads = window_geometry("", x_shape[1:3], tuple(filter_size), strides, dilations,
                              padding, "")
    return pads


def padded(xp, x, pads):
    """x with `pads` ((top, bottom), (left, right)) of zeros around its images, C-contiguous."""
    if any(p for pair in pads for p in pair):
        return xp.pad(x, ((0, 0), *pads, (0, 0)))
    return xp.ascontiguousarray(x)


def filter_groups(oh: int, ow: int, group: int = 4):
    """The output positions of kernels/conv_filter.py's groups, in its order: row after
    row, each row's positions `group` at a time, then its last ones one by one."""
    for i in range(oh):
        whole = ow - ow % group
        for j in range(0, whole, group):
            yield tuple((i, j + k) for k in range(group))
        for j in range(whole, ow):
            yield ((i, j),)


def filter_grad_groups_numpy(xp, x, dy, dw) -> None:
    """The numpy twin of kernels/conv_filter.py's filter_grad_groups_cpu (x already padded):
    per image from zero, each group's products added left to right and then into the sum,
    then the images in order - the kernel's float operations in its order, the same bits
    (tests/kernels/test_conv_filter.py). A Python loop over the output positions: the
    cold start's form."""
    n, oh, ow, o = dy.shape
    kh, kw, c = dw.shape[:3]
    acc = xp.zeros((n, kh * kw * c, o), dw.dtype)

    def term(i, j):
        return x[:, i:i + kh, j:j + kw, :].reshape(n, -1, 1) * dy[:, i, j, None, :]

    for group in filter_groups(oh, ow):
        s = term(*group[0])
        for at in group[1:]:
            s += term(*at)
        acc += s
    dw2 = dw.reshape(acc.shape[1:])
    dw2[...] = 0
    for b in range(n):
        dw2 += acc[b]


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

# float16/bfloat16 convolutions run their GEMMs in float32 and cast the result back
for _op in (conv2d_p, conv2d_backprop_input_p, conv2d_backprop_filter_p):
    accumulate_in_float32(_op)

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
