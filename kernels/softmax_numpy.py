"""The numpy twins of kernels/softmax.py: the same float operations in the same order, so
the same bits, with nothing to compile. A program's first calls run these while the Numba
kernels load in the background (runtime/warmup.py).

The kernels' row sums run over four lanes (j mod 4) in source order, the tail added to lane
0, then (s0 + s1) + (s2 + s3); `np.add.accumulate` is sequential by definition, so a lane's
running sum is that order. The shift takes the max over kept entries ignoring NaN (fmax),
as the kernel's `x > top` does, and numpy's exp runs in both."""

from __future__ import annotations

import numpy as np

from .softmax import _mask_rows, _runs


def _lane_sums(v):
    """Float64 row sums of (R, n) float64 `v` in the kernels' `_dot` order."""
    n = v.shape[1]
    full = n - n % 4
    lanes = [np.zeros(v.shape[0]) for _ in range(4)]
    if full:
        lanes = [np.add.accumulate(v[:, k:full:4], axis=1)[:, -1] for k in range(4)]
    if n % 4:
        tail = np.concatenate([lanes[0][:, None], v[:, full:]], axis=1)
        lanes[0] = np.add.accumulate(tail, axis=1)[:, -1]
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])


def _products(a, b):
    """a * b in their dtype, then widened to float64, as `_dot` forms its terms."""
    return np.multiply(a, b).astype(np.float64)


def softmax_cpu(x, mask, out) -> bool:
    """softmax_cpu's twin: its bits, its refusals (False where the kernel would refuse)."""
    if not _runs(x, out):
        return False
    n = x.shape[-1]
    rows, xs = out.reshape(-1, n), x.reshape(-1, n)
    keep = _mask_rows(mask, x.shape)
    keep = np.broadcast_to(keep[np.arange(xs.shape[0]) % keep.shape[0]], xs.shape)
    top = np.fmax.reduce(np.where(keep, xs, -np.inf), axis=1, initial=-np.inf)[:, None]
    with np.errstate(invalid="ignore"):
        shifted = np.where(keep & (top > -np.inf), xs - top, -np.inf)
    rows[...] = shifted
    np.exp(rows, out=rows)
    total = _lane_sums(rows.astype(np.float64))
    t = np.where(total > 0.0, total, 1.0).astype(rows.dtype)[:, None]
    np.divide(rows, t, out=rows)
    return True


def softmax_grad_cpu(g, y, out) -> bool:
    """softmax_grad_cpu's twin: y (g - sum(g y)) per row, with its bits."""
    if not _runs(g, y, out) or g.shape != y.shape:
        return False
    n = y.shape[-1]
    gs, ys = g.reshape(-1, n), y.reshape(-1, n)
    s = _lane_sums(_products(gs, ys)).astype(y.dtype)[:, None]
    np.multiply(ys, gs - s, out=out.reshape(-1, n))
    return True
