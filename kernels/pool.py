"""max_pool2d's gradient (TF's MaxPoolGrad) into a preallocated buffer, in one parallel pass
over the windows: numpy needs several masked passes per window tap and runs ~16x slower
(x (64, 26, 26, 32), 2x2 windows: 0.28 ms vs 4.6 ms on 2 cores)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


def max_pool_grad_ref(x, y, dy, ksize, strides, pads):
    """The spec: each window's dy goes to its first maximum in row-major scan order (TF's tie
    rule), windows that overlap add up. x (N, H, W, C); y, dy (N, OH, OW, C); pads (top, left).

    >>> max_pool_grad_ref(np.array([[[[1.], [3.]], [[3.], [0.]]]]), np.array([[[[3.]]]]),
    ...                   np.array([[[[5.]]]]), (2, 2), (2, 2), (0, 0))[0, ..., 0]
    array([[0., 5.],
           [0., 0.]])
    """
    n, h, w, c = x.shape
    dx = np.zeros_like(x)
    for b in range(n):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                for ch in range(c):
                    window = [(r, s) for r in range(i * strides[0] - pads[0],
                                                    i * strides[0] - pads[0] + ksize[0])
                              for s in range(j * strides[1] - pads[1],
                                             j * strides[1] - pads[1] + ksize[1])
                              if 0 <= r < h and 0 <= s < w]
                    hits = [(r, s) for r, s in window if x[b, r, s, ch] == y[b, i, j, ch]]
                    if hits:
                        dx[b, hits[0][0], hits[0][1], ch] += dy[b, i, j, ch]
    return dx


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_grad(x, y, dy, dx, kh, kw, sh, sw, top, left):
    # each window's first max, then the windows' gradients added tap after tap over all
    # windows, as the numpy form adds them: where windows overlap, a position's sum takes
    # its terms in that order (window after window took them in another: a CNN with a
    # 3x3 pool of stride 1 trained to other bits on this kernel than on its twin)
    n, h, w, c = x.shape
    oh, ow = y.shape[1], y.shape[2]
    for b in prange(n):
        dx[b] = 0
        first = np.full((oh, ow, c), -1, np.int32)
        for i in range(oh):
            for j in range(ow):
                for p in range(kh):
                    r = i * sh + p - top
                    if r < 0 or r >= h:
                        continue
                    for q in range(kw):
                        s = j * sw + q - left
                        if s < 0 or s >= w:
                            continue
                        for ch in range(c):
                            if first[i, j, ch] < 0 and x[b, r, s, ch] == y[b, i, j, ch]:
                                first[i, j, ch] = p * kw + q
        for p in range(kh):
            for q in range(kw):
                t = p * kw + q
                for i in range(oh):
                    r = i * sh + p - top
                    if r < 0 or r >= h:
                        continue
                    for j in range(ow):
                        s = j * sw + q - left
                        if s < 0 or s >= w:
                            continue
                        for ch in range(c):
                            if first[i, j, ch] == t:
                                dx[b, r, s, ch] += dy[b, i, j, ch]


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_grad_2x2(x, y, dy, dx):
    # 2x2 windows with stride 2 inside x: each position is written once, with no zero
    # pass and no read of dx, and the first max found by selects the channel loop
    # vectorizes (the general loop's per-channel branch does not): 2.6 against 10-11 ms
    # for the tutorial CNN's (256, 26, 26, 32) on 2 loaded cores. dy + 0 as the general
    # form's 0 + dy (-0.0 -> +0.0): the same bits.
    n, h, w, c = x.shape
    oh, ow = y.shape[1], y.shape[2]
    zero = dx.dtype.type(0)
    for b in prange(n):
        for i in range(oh):
            r0, r1 = 2 * i, 2 * i + 1
            for j in range(ow):
                s0, s1 = 2 * j, 2 * j + 1
                for ch in range(c):
                    m = y[b, i, j, ch]
                    g = dy[b, i, j, ch] + zero
                    h00 = x[b, r0, s0, ch] == m
                    h01 = (x[b, r0, s1, ch] == m) & ~h00
                    h10 = (x[b, r1, s0, ch] == m) & ~(h00 | h01)
                    h11 = (x[b, r1, s1, ch] == m) & ~(h00 | h01 | h10)
                    dx[b, r0, s0, ch] = g if h00 else zero
                    dx[b, r0, s1, ch] = g if h01 else zero
                    dx[b, r1, s0, ch] = g if h10 else zero
                    dx[b, r1, s1, ch] = g if h11 else zero
        for r in range(2 * oh, h):           # a last odd row or column no window reads
            for s in range(w):
                for ch in range(c):
                    dx[b, r, s, ch] = zero
        for r in range(2 * oh):
            for s in range(2 * ow, w):
                for ch in range(c):
                    dx[b, r, s, ch] = zero


def max_pool_grad_cpu(x, y, dy, dx, ksize, strides, pads) -> None:
    """dx[...] = max_pool_grad_ref(x, y, dy, ksize, strides, pads), written into dx."""
    with threads_for(x.nbytes + dx.nbytes):
        if tuple(ksize) == tuple(strides) == (2, 2) and tuple(pads) == (0, 0) and \
                2 * y.shape[1] <= x.shape[1] and 2 * y.shape[2] <= x.shape[2]:
            _max_pool_grad_2x2(x, y, dy, dx)
            return
        _max_pool_grad(x, y, dy, dx, ksize[0], ksize[1], strides[0], strides[1], pads[0],
                       pads[1])


def max_pool_ref(x, ksize, strides, pads, out_hw):
    """The spec of max_pool2d: each window's maximum over the taps inside x (padding never
    wins), NaN propagating as np.maximum does. x (N, H, W, C); pads (top, left).

    >>> max_pool_ref(np.arange(4.).reshape(1, 2, 2, 1), (2, 2), (2, 2), (0, 0), (1, 1))[..., 0]
    array([[[3.]]])
    """
    n, h, w, c = x.shape
    y = np.full((n, *out_hw, c), -np.inf, x.dtype)
    for i in range(out_hw[0]):
        for j in range(out_hw[1]):
            r0, s0 = i * strides[0] - pads[0], j * strides[1] - pads[1]
            win = x[:, max(r0, 0):max(r0 + ksize[0], 0), max(s0, 0):max(s0 + ksize[1], 0)]
            y[:, i, j] = np.max(win, axis=(1, 2))
    return y


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool(x, y, kh, kw, sh, sw, top, left):
    n, h, w, c = x.shape
    for b in prange(n):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                for ch in range(c):
                    y[b, i, j, ch] = -np.inf
                for p in range(kh):
                    r = i * sh + p - top
                    if r < 0 or r >= h:
                        continue
                    for q in range(kw):
                        s = j * sw + q - left
                        if s < 0 or s >= w:
                            continue
                        for ch in range(c):             # contiguous: vectorizes
                            v = x[b, r, s, ch]
                            m = y[b, i, j, ch]
                            y[b, i, j, ch] = v if (v > m or v != v) else m


def max_pool_cpu(x, y, ksize, strides, pads) -> None:
    """y[...] = max_pool_ref(x, ksize, strides, pads, y.shape[1:3]), written into y."""
    with threads_for(x.nbytes + y.nbytes):
        _max_pool(x, y, ksize[0], ksize[1], strides[0], strides[1], pads[0], pads[1])


# ---------------------------------------------------------------- with the argmax
# max pooling that also writes each window's first max as its tap index (int8, row-major in
# the window; -1 where the window holds a NaN), and the gradient routed by those indices:
# the backward pass then reads 1 byte a window instead of the pool's input (the tutorial
# CNN's first layer: 22 MB at batch 256), and that input can be freed after the forward
# pass. The same y as max_pool2d (the last NaN seen, as its kernel keeps) and the same dx
# as max_pool2d_grad (the first tap equal to y: x == y never holds for NaN).


@njit(inline="always")
def _argmax_step(v, m, k, t):
    """(m, k) after tap t of value v: NaN is taken (index -1); else a strictly larger
    value, or the first tap (k < 0) equal to the running max (-inf at the start)."""
    vn = v != v
    take = vn or (m == m and (v > m or (k < 0 and v == m)))
    if take:
        return v, (-1 if vn else t)
    return m, k


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_argmax(x, y, idx, kh, kw, sh, sw, top, left):
    n, h, w, c = x.shape
    for b in prange(n):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                for ch in range(c):
                    m, k = -np.inf, -1
                    for p in range(kh):
                        r = i * sh + p - top
                        if r < 0 or r >= h:
                            continue
                        for q in range(kw):
                            s = j * sw + q - left
                            if 0 <= s < w:
                                m, k = _argmax_step(x[b, r, s, ch], m, k, p * kw + q)
                    y[b, i, j, ch] = m
                    idx[b, i, j, ch] = k


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_argmax_2x2(x, y, idx):
    n, c = x.shape[0], x.shape[3]
    for b in prange(n):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                for ch in range(c):
                    m, k = _argmax_step(x[b, 2 * i, 2 * j, ch], -np.inf, -1, 0)
                    m, k = _argmax_step(x[b, 2 * i, 2 * j + 1, ch], m, k, 1)
                    m, k = _argmax_step(x[b, 2 * i + 1, 2 * j, ch], m, k, 2)
                    m, k = _argmax_step(x[b, 2 * i + 1, 2 * j + 1, ch], m, k, 3)
                    y[b, i, j, ch] = m
                    idx[b, i, j, ch] = k


def max_pool_argmax_cpu(x, y, idx, ksize, strides, pads) -> None:
    """y[...] = max_pool_ref(x, ...) and idx[...] = each window's first max as its tap
    index (p * KW + q; -1 for a window with a NaN), written into y and idx (int8)."""
    with threads_for(x.nbytes + y.nbytes):
        if _whole_2x2(x, y, ksize, strides, pads):
            _max_pool_argmax_2x2(x, y, idx)
            return
        _max_pool_argmax(x, y, idx, ksize[0], ksize[1], strides[0], strides[1], pads[0],
                         pads[1])


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_grad_argmax(idx, dy, dx, kh, kw, sh, sw, top, left):
    # windows that do not overlap (strides >= ksize): each input position gets at most one
    # window's gradient, so writing dy + 0 where the index points is max_pool2d_grad's sum
    n, h, w, c = dx.shape
    zero = dx.dtype.type(0)
    for b in prange(n):
        dx[b] = 0
        for i in range(dy.shape[1]):
            for j in range(dy.shape[2]):
                for ch in range(c):
                    k = idx[b, i, j, ch]
                    if k >= 0:
                        dx[b, i * sh + k // kw - top, j * sw + k % kw - left, ch] = \
                            dy[b, i, j, ch] + zero


@njit(parallel=True, cache=True, error_model="numpy")
def _max_pool_grad_argmax_2x2(idx, dy, dx):
    # whole indexing and the index widened to int32 vectorize: 0.42 ms for the tutorial
    # CNN's (256, 26, 26, 32) on 2 loaded cores, against 8.5 through row views of int8
    n, h, w, c = dx.shape
    oh, ow = dy.shape[1], dy.shape[2]
    zero = dx.dtype.type(0)
    for b in prange(n):
        for i in range(oh):
            for j in range(ow):
                for ch in range(c):
                    k = np.int32(idx[b, i, j, ch])
                    g = dy[b, i, j, ch] + zero
                    dx[b, 2 * i, 2 * j, ch] = g if k == 0 else zero
                    dx[b, 2 * i, 2 * j + 1, ch] = g if k == 1 else zero
                    dx[b, 2 * i + 1, 2 * j, ch] = g if k == 2 else zero
                    dx[b, 2 * i + 1, 2 * j + 1, ch] = g if k == 3 else zero
        for r in range(2 * oh, h):           # a last odd row or column no window reads
            for s in range(w):
                for ch in range(c):
                    dx[b, r, s, ch] = zero
        for r in range(2 * oh):
            for s in range(2 * ow, w):
                for ch in range(c):
                    dx[b, r, s, ch] = zero


def max_pool_grad_argmax_cpu(idx, dy, dx, ksize, strides, pads) -> None:
    """dx[...] = max_pool2d_grad's result for windows that do not overlap, from the first
    maxima's tap indices (max_pool_argmax_cpu) rather than the pool's input and output."""
    with threads_for(dx.nbytes + dy.nbytes):
        if _whole_2x2(dx, dy, ksize, strides, pads):
            _max_pool_grad_argmax_2x2(idx, dy, dx)
            return
        _max_pool_grad_argmax(idx, dy, dx, ksize[0], ksize[1], strides[0], strides[1],
                              pads[0], pads[1])


def _whole_2x2(x, y, ksize, strides, pads) -> bool:
    """2x2 windows of stride 2 inside x (no padding): the specialized loops."""
    return (tuple(ksize) == tuple(strides) == (2, 2) and tuple(pads) == (0, 0)
            and 2 * y.shape[1] <= x.shape[1] and 2 * y.shape[2] <= x.shape[2])
