"""conv2d's filter gradient (TF's Conv2DBackpropFilter) for few input channels, stride 1,
no dilation, directly from x and dy, or from a 2x2 max pool's argmax and gradient, making
dy as it goes (pooled_filter_grad_cpu: the first layer's dy, 22 MB at batch 256, is then
never written).

The tutorial CNN's first layer (x (256, 28, 28, 1), 3x3x1x32 filters) multiplies patches
(9 values a position) by dy (32 a position): a GEMM of M=9, N=32 and K=173,056 that
OpenBLAS runs at 35 GFLOP/s (1.8 ms alone, 2.9 in the step). Here each thread owns whole
images and adds, per filter tap, four neighbouring positions' products into the tap's row
of accumulators at once, so the accumulators are loaded and stored once per four
positions and the loop over the output channels vectorizes: 1.1 ms.

The order of the sums is fixed (dw does not depend on the thread count): per image, from
zero, output row after row, each row's positions in groups of four (then one by one for
the last ones), each group's four products added left to right and then into the sum;
then the images' sums in order. graphdist/ops/conv.py's filter_grad_groups_numpy repeats
it operation for operation: the same bits."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for

# four positions a group (the twin's ops/conv.py filter_groups): two ran 1.6 ms, eight 1.3,
# a 2x2 block of two rows 1.5, four along a row 1.1 (the first layer alone, 2 cores)
GROUP = 4


@njit(cache=True, error_model="numpy", inline="always")
def _four(acc, xb, kh, kw, i, j, d0, d1, d2, d3):
    """acc[t] += ((v0 d0 + v1 d1) + v2 d2) + v3 d3 for each tap t = (p, q, channel), vk the
    x value that output (i, j + k) reads through that tap."""
    c, o = xb.shape[2], acc.shape[1]
    for p in range(kh):
        line = xb[i + p]
        for q in range(kw):
            if c == 1:              # one channel apart: its loop costs 1.5 against 1.1 ms
                v0, v1 = line[j + q, 0], line[j + q + 1, 0]
                v2, v3 = line[j + q + 2, 0], line[j + q + 3, 0]
                a = acc[p * kw + q]
                for k in range(o):                   # contiguous: vectorizes
                    a[k] += ((v0 * d0[k] + v1 * d1[k]) + v2 * d2[k]) + v3 * d3[k]
                continue
            for ch in range(c):
                v0, v1 = line[j + q, ch], line[j + q + 1, ch]
                v2, v3 = line[j + q + 2, ch], line[j + q + 3, ch]
                a = acc[(p * kw + q) * c + ch]
                for k in range(o):
                    a[k] += ((v0 * d0[k] + v1 * d1[k]) + v2 * d2[k]) + v3 * d3[k]


@njit(cache=True, error_model="numpy", inline="always")
def _one(acc, xb, kh, kw, i, j, d0):
    c, o = xb.shape[2], acc.shape[1]
    for p in range(kh):
        line = xb[i + p]
        for q in range(kw):
            for ch in range(c):
                v0 = line[j + q, ch]
                a = acc[(p * kw + q) * c + ch]
                for k in range(o):
                    a[k] += v0 * d0[k]


@njit(parallel=True, cache=True, error_model="numpy")
def _filter_grad(x, dy, partial, kh, kw):
    n, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2]
    for b in prange(n):                      # one image per iteration: no two write alike
        acc, xb, db = partial[b], x[b], dy[b]
        acc[:] = 0
        for i in range(oh):
            row = db[i]
            j = 0
            while j + GROUP <= ow:
                _four(acc, xb, kh, kw, i, j, row[j], row[j + 1], row[j + 2], row[j + 3])
                j += GROUP
            while j < ow:
                _one(acc, xb, kh, kw, i, j, row[j])
                j += 1


@njit(parallel=True, cache=True, error_model="numpy")
def _pooled_filter_grad(x, idx, g, partial, kh, kw, oh, ow):
    # dy = max_pool2d_grad_argmax(idx, g) for 2x2 windows of stride 2 over the (oh, ow)
    # outputs, made four positions at a time as kernels/pool.py writes it (g + 0 where the
    # window's argmax points, else 0; 0 where no window reaches): _filter_grad's bits
    n, poh, pow_, o = g.shape
    zero = g.dtype.type(0)
    for b in prange(n):
        acc, xb = partial[b], x[b]
        acc[:] = 0
        d = np.zeros((4, o), g.dtype)
        for i in range(oh):
            pi, r2 = i // 2, 2 * (i % 2)
            j = 0
            while j + GROUP <= ow:
                for w in range(2):               # the group's two windows
                    q = j // 2 + w
                    if pi < poh and q < pow_:
                        for k in range(o):
                            t = np.int32(idx[b, pi, q, k])
                            v = g[b, pi, q, k] + zero
                            d[2 * w, k] = v if t == r2 else zero
                            d[2 * w + 1, k] = v if t == r2 + 1 else zero
                    else:
                        for k in range(o):
                            d[2 * w, k] = zero
                            d[2 * w + 1, k] = zero
                _four(acc, xb, kh, kw, i, j, d[0], d[1], d[2], d[3])
                j += GROUP
            while j < ow:
                q = j // 2
                if pi < poh and q < pow_:
                    for k in range(o):
                        t = np.int32(idx[b, pi, q, k])
                        v = g[b, pi, q, k] + zero
                        d[0, k] = v if t == r2 + j % 2 else zero
                else:
                    for k in range(o):
                        d[0, k] = zero
                _one(acc, xb, kh, kw, i, j, d[0])
                j += 1


@njit(cache=True, error_model="numpy")
def _sum_images(partial, dw):
    """dw = the images' sums added in order, from zero."""
    dw[:] = 0
    for b in range(partial.shape[0]):
        dw += partial[b]


def filter_grad_groups_cpu(x, dy, dw) -> bool:
    """dw[...] = conv2d_backprop_filter(x, dy) for stride 1, no dilation and VALID padding
    (pad x first for SAME), the filter's size from dw (HWIO), in the order of the module
    docstring. x, dy, dw C-contiguous float32 or float64 of one dtype; False (nothing
    written) for other operands."""
    kh, kw = dw.shape[0], dw.shape[1]
    if not (x.ndim == dy.ndim == dw.ndim == 4 and x.dtype == dy.dtype == dw.dtype
            and x.dtype in (np.float32, np.float64) and x.flags.c_contiguous
            and dy.flags.c_contiguous and dw.flags.c_contiguous and dw.shape[2] == x.shape[3]
            and dy.shape == (x.shape[0], x.shape[1] - kh + 1, x.shape[2] - kw + 1,
                             dw.shape[3])):
        return False
    partial = np.empty((x.shape[0], kh * kw * x.shape[3], dw.shape[3]), dw.dtype)
    with threads_for(x.nbytes + dy.nbytes):
        _filter_grad(x, dy, partial, kh, kw)
    _sum_images(partial, dw.reshape(partial.shape[1:]))
    return True


def pooled_filter_grad_cpu(x, idx, g, dw, out_hw) -> bool:
    """dw[...] = conv2d_backprop_filter(x, dy) where dy (N, *out_hw, O) is the gradient a
    2x2 max pool of stride 2 (VALID) routes by its argmax (kernels/pool.py
    max_pool_grad_argmax_cpu): the bits of the two kernels one after the other, without
    writing dy. x as filter_grad_groups_cpu takes it; False (nothing written) for other
    operands."""
    kh, kw = dw.shape[0], dw.shape[1]
    n, o = g.shape[0], g.shape[3]
    if not (x.ndim == dw.ndim == 4 and g.ndim == 4 and idx.shape == g.shape
            and idx.dtype == np.int8 and x.dtype == g.dtype == dw.dtype
            and x.dtype in (np.float32, np.float64) and x.flags.c_contiguous
            and idx.flags.c_contiguous and g.flags.c_contiguous and dw.flags.c_contiguous
            and dw.shape[2] == x.shape[3] and dw.shape[3] == o
            and tuple(out_hw) == (x.shape[1] - kh + 1, x.shape[2] - kw + 1)
            and g.shape[1:3] == (out_hw[0] // 2, out_hw[1] // 2) and x.shape[0] == n):
        return False
    partial = np.empty((n, kh * kw * x.shape[3], o), dw.dtype)
    with threads_for(x.nbytes + g.nbytes * 4):
        _pooled_filter_grad(x, idx, g, partial, kh, kw, out_hw[0], out_hw[1])
    _sum_images(partial, dw.reshape(partial.shape[1:]))
    return True
