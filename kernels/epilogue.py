"""The backward epilogue: relu's gradient and the bias gradient in one pass. numpy runs them
as three (a comparison, a select writing dz, then a column sum reading dz back); this
reads ct and y once, writes dz once and keeps the column sums in registers.

Deterministic: the rows are summed in blocks of a fixed size (not one per thread), each
block row after row from zero, then the blocks' sums in block order, so the result does
not depend on the thread count; graphdist/ops/epilogue.py relu_grad_sum_numpy adds in the
same order (numpy's reduce over axis 0 adds row after row) and gives the same bits."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


def relu_grad_sum_ref(ct, y):
    """The spec: dz = ct where y > 0 else 0, and dz summed over every axis but the last.

    >>> dz, db = relu_grad_sum_ref(np.array([[1., 2.], [3., 4.]]), np.array([[1., -1.], [1., 1.]]))
    >>> db
    array([4., 4.])
    """
    dz = np.where(y > 0, ct, ct.dtype.type(0))
    return dz, dz.reshape(-1, dz.shape[-1]).sum(axis=0)


@njit(parallel=True, cache=True, error_model="numpy")
def _relu_grad_sum(ct, y, dz, partial, block):  # (R, O) each; partial (blocks, O)
    rows, o = dz.shape
    zero = dz.dtype.type(0)
    for b in prange(partial.shape[0]):
        acc = np.zeros(o, dz.dtype)          # local: with a row of `partial` as the
        for r in range(b * block, min(rows, (b + 1) * block)):   # accumulator the loop
            for k in range(o):               # did not vectorize (2.5 against 1.4 ms)
                v = ct[r, k] if y[r, k] > 0 else zero
                dz[r, k] = v
                acc[k] += v
        partial[b] = acc


@njit(cache=True)
def _sum_rows(partial, db):
    db[:] = 0
    for b in range(partial.shape[0]):
        for k in range(db.shape[0]):
            db[k] += partial[b, k]


def relu_grad_sum_cpu(dz, db, ct, y, block: int) -> bool:
    """dz, db = relu_grad_sum_ref(ct, y), written into dz and db, blocks of `block` rows;
    False (doing nothing) unless all are C-contiguous, one float dtype, dz/ct/y one shape
    and db (O,)."""
    if not (dz.shape == ct.shape == y.shape and dz.ndim >= 1 and db.shape == dz.shape[-1:]
            and dz.dtype == db.dtype == ct.dtype == y.dtype and dz.dtype.kind == "f"
            and all(a.flags.c_contiguous for a in (dz, db, ct, y))):
        return False
    o = dz.shape[-1]
    d2, c2, y2 = dz.reshape(-1, o), ct.reshape(-1, o), y.reshape(-1, o)
    partial = np.empty((max(1, -(-d2.shape[0] // block)), o), dz.dtype)
    with threads_for(3 * dz.nbytes):
        _relu_grad_sum(c2, y2, d2, partial, block)
    _sum_rows(partial, db)
    return True


# ---------------------------------------------------------------- pool gradient into dw
# conv2d_backprop_filter(x, max_pool2d_grad(a, y, g)) for 2x2 / stride 2 pools and a
# stride-1 VALID convolution (the tutorial CNN's first layer, whose input gradient is never
# needed): the routed gradient (22 MB at batch 256, three quarters zeros) is never written
# or read back. Per pool window, each channel's gradient goes to its first max (a == y in
# row-major window order, as max_pool2d_grad), and each of the window's four positions
# adds x's 3x3(xC) patch there times its masked gradient into dw, vectorized over the
# output channels. Images are summed in fixed blocks, then the blocks in order: the
# result does not depend on the thread count.


@njit(parallel=True, cache=True, error_model="numpy")
def _pool_grad_filter_grad(x, a, y, g, partial, block):
    n, oh2, ow2, o = g.shape
    kh, kw, c = partial.shape[1], partial.shape[2], partial.shape[3]
    zero = g.dtype.type(0)
    for blk in prange(partial.shape[0]):
        acc = np.zeros((kh, kw, c, o), partial.dtype)
        mask = np.empty((4, o), g.dtype)
        for b in range(blk * block, min(n, (blk + 1) * block)):
            for i in range(oh2):
                for j in range(ow2):
                    for k in range(o):
                        m = y[b, i, j, k]
                        gv = g[b, i, j, k]
                        h00 = a[b, 2 * i, 2 * j, k] == m
                        h01 = (a[b, 2 * i, 2 * j + 1, k] == m) & ~h00
                        h10 = (a[b, 2 * i + 1, 2 * j, k] == m) & ~(h00 | h01)
                        h11 = (a[b, 2 * i + 1, 2 * j + 1, k] == m) & ~(h00 | h01 | h10)
                        mask[0, k] = gv if h00 else zero
                        mask[1, k] = gv if h01 else zero
                        mask[2, k] = gv if h10 else zero
                        mask[3, k] = gv if h11 else zero
                    for t in range(4):
                        r0 = 2 * i + t // 2
                        s0 = 2 * j + t % 2
                        for p in range(kh):
                            for q in range(kw):
                                for ch in range(c):
                                    v = x[b, r0 + p, s0 + q, ch]
                                    for k in range(o):      # contiguous: vectorizes
                                        acc[p, q, ch, k] += v * mask[t, k]
        partial[blk] = acc


def pool_grad_filter_grad_cpu(dw, x, a, y, g, block: int) -> bool:
    """dw = conv2d_backprop_filter(x, max_pool2d_grad(a, y, g)) for 2x2/2 pools that tile
    the windows they read and a stride-1 VALID convolution; False (doing nothing) for other
    operands."""
    n, h, w, c = x.shape
    kh, kw = dw.shape[0], dw.shape[1]
    if not (a.ndim == 4 and a.shape[0] == n and a.shape[1:3] == (h - kh + 1, w - kw + 1)
            and y.shape == g.shape == (n, a.shape[1] // 2, a.shape[2] // 2, a.shape[3])
            and dw.shape == (kh, kw, c, a.shape[3])
            and x.dtype == a.dtype == y.dtype == g.dtype == dw.dtype
            and dw.dtype.kind == "f" and all(t.flags.c_contiguous for t in (x, a, y, g, dw))):
        return False
    partial = np.empty((max(1, -(-n // block)), kh, kw, c, a.shape[3]), dw.dtype)
    with threads_for(x.nbytes + a.nbytes + 2 * g.nbytes):
        _pool_grad_filter_grad(x, a, y, g, partial, block)
    _sum_blocks(partial.reshape(partial.shape[0], -1), dw.reshape(-1))
    return True


@njit(cache=True)
def _sum_blocks(partial, out):
    out[:] = 0
    for b in range(partial.shape[0]):
        for k in range(out.shape[0]):
            out[k] += partial[b, k]
