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
