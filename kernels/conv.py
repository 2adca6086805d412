"""col2im for conv2d's input gradient (TF's Conv2DBackpropInput): after one GEMM has made
every window tap's share of dx, dy (rows, O) @ filters (O, KH*KW*C) -> columns
(N, OH, OW, KH, KW, C), this adds each tap's columns into the input position it came
from. numpy needs one strided add per tap over all of dx; this is one parallel pass.

Deterministic: each thread owns whole images of dx and adds a position's taps in row-major
window order, starting from zero, the order of the numpy form in graphdist/ops/conv.py,
so both give the same bits."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


def col2im_ref(cols, input_hw, strides, dilations, pads):
    """The spec: dx[b, r, s] = the sum over the taps (p, q) and outputs (i, j) with
    r = i * sh + p * dh - top and s = j * sw + q * dw - left of cols[b, i, j, p, q].
    cols (N, OH, OW, KH, KW, C); pads (top, left).

    >>> col2im_ref(np.ones((1, 2, 2, 2, 2, 1)), (3, 3), (1, 1), (1, 1), (0, 0))[0, ..., 0]
    array([[1., 2., 1.],
           [2., 4., 2.],
           [1., 2., 1.]])
    """
    n, oh, ow, kh, kw, c = cols.shape
    dx = np.zeros((n, *input_hw, c), cols.dtype)
    for i in range(oh):
        for j in range(ow):
            for p in range(kh):
                for q in range(kw):
                    r = i * strides[0] + p * dilations[0] - pads[0]
                    s = j * strides[1] + q * dilations[1] - pads[1]
                    if 0 <= r < input_hw[0] and 0 <= s < input_hw[1]:
                        dx[:, r, s] += cols[:, i, j, p, q]
    return dx


@njit(inline="always")
def _span(tap, stride, dilation, pad, n_in, n_out):
    """The outputs o in [lo, hi) whose tap reads input o * stride + offset inside [0, n_in),
    and that offset: the clipped range, so the loops below need no test per element."""
    offset = tap * dilation - pad
    lo = (-offset + stride - 1) // stride if offset < 0 else 0
    hi = min(n_out, (n_in - 1 - offset) // stride + 1) if n_in - 1 - offset >= 0 else 0
    return lo, max(lo, hi), offset


@njit(parallel=True, cache=True, error_model="numpy")
def _col2im(cols, dx, sh, sw, dh, dw, top, left):
    n, h, w, c = dx.shape
    oh, ow, kh, kw = cols.shape[1], cols.shape[2], cols.shape[3], cols.shape[4]
    for b in prange(n):                      # one image per iteration: no two write alike
        dx[b] = 0
        for p in range(kh):                  # taps in row-major order: a fixed sum order
            i_lo, i_hi, r_off = _span(p, sh, dh, top, h, oh)
            for q in range(kw):
                j_lo, j_hi, s_off = _span(q, sw, dw, left, w, ow)
                for i in range(i_lo, i_hi):
                    r = i * sh + r_off
                    for j in range(j_lo, j_hi):
                        s = j * sw + s_off
                        for ch in range(c):  # contiguous: vectorizes
                            dx[b, r, s, ch] += cols[b, i, j, p, q, ch]


def col2im_cpu(cols, dx, strides, dilations, pads) -> None:
    """dx[...] = col2im_ref(cols, dx.shape[1:3], strides, dilations, pads), written into dx
    (C-contiguous, cols' dtype)."""
    with threads_for(cols.nbytes + dx.nbytes):
        _col2im(cols, dx, strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1])


# ---------------------------------------------------------------- direct conv, fused epilogue
# conv2d + bias + relu for few input channels (the tutorial CNN's first layer: one channel,
# 3x3x1x32, 26x26 outputs). There the three ops are each one pass over a 22 MB activation
# at batch 256 (on 2 cores: conv 1.6 ms, bias add 1.5, relu 1.8 in the step's profile), and
# the convolution does 9 multiply-adds per output: memory-bound. This kernel reads the input
# directly (no patches) and adds the bias and applies relu to each output row while it is
# still in L1: the activation is written once. Alone, without an epilogue, it is slower than
# im2col + GEMM (2.6 against 1.2 ms: it loads and stores the output row per tap), so the
# op path keeps the GEMM; it is the epilogue form for a conv + bias (+ relu) chain.


@njit(parallel=True, cache=True, error_model="numpy")
def _conv_direct(x, f, bias, relu, out, sh, sw, dh, dw, top, left):
    n, h, w, c = x.shape
    kh, kw = f.shape[0], f.shape[1]
    oh, ow, o = out.shape[1], out.shape[2], out.shape[3]
    for b in prange(n):                      # one image per iteration: no two write alike
        out[b] = 0
        for i in range(oh):
            rows = out[b, i]                 # (OW, O): stays in L1 over the taps
            for p in range(kh):              # taps in (p, q, channel) order, skipping
                r = i * sh + p * dh - top    # those in the padding, as the twin does
                if r < 0 or r >= h:
                    continue
                line = x[b, r]
                for q in range(kw):
                    j_lo, j_hi, s_off = _span(q, sw, dw, left, w, ow)
                    for ch in range(c):
                        taps = f[p, q, ch]
                        for j in range(j_lo, j_hi):
                            v = line[j * sw + s_off, ch]
                            row = rows[j]
                            for k in range(o):       # contiguous: vectorizes
                                row[k] += v * taps[k]
            if bias.shape[0]:                # the epilogue, on the row while in L1
                for j in range(ow):
                    row = rows[j]
                    for k in range(o):
                        row[k] += bias[k]
            if relu:
                for j in range(ow):
                    row = rows[j]
                    for k in range(o):
                        v = row[k]
                        if v <= 0:           # np.maximum(v, 0)'s bits: -0.0 -> 0.0,
                            row[k] = 0       # NaN stays


def conv_direct_cpu(x, f, out, strides, dilations, pads, bias=None, relu=False) -> None:
    """out[...] = conv2d(x, f) (+ bias) (then relu), NHWC / HWIO, C-contiguous, one dtype;
    pads (top, left). The same bits as graphdist/ops/conv.py's conv_direct_numpy: taps
    summed from zero in (row, column, channel) order, then + bias, then np.maximum(., 0)."""
    bias = np.zeros(0, out.dtype) if bias is None else bias
    with threads_for(x.nbytes + out.nbytes):
        _conv_direct(x, f, bias, bool(relu), out, strides[0], strides[1], dilations[0],
                     dilations[1], pads[0], pads[1])


@njit(parallel=True, cache=True, error_model="numpy")
def _bias_act(rows, bias, relu):
    n, o = rows.shape
    for r in prange(n):
        row = rows[r]
        if bias.shape[0]:                    # none: no add (-0.0 + 0.0 would be +0.0)
            for k in range(o):
                row[k] += bias[k]
        if relu:
            for k in range(o):
                if row[k] <= 0:              # np.maximum(v, 0)'s bits: -0.0 -> 0.0,
                    row[k] = 0               # NaN stays


def bias_act_cpu(rows, bias, relu) -> None:
    """rows[...] = rows + bias, then np.maximum(., 0) when `relu`: one parallel pass (numpy:
    a broadcast add and a maximum, two single-threaded passes; for the tutorial's 22 MB
    first activation 1.2 + 1.6 ms on 2 cores). rows (R, O) C-contiguous; the same bits as
    numpy's two passes. bias None: relu alone."""
    bias = np.zeros(0, rows.dtype) if bias is None else bias
    with threads_for(rows.nbytes):
        _bias_act(rows, bias, bool(relu))
