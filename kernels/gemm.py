"""C += A @ B in one GEMM: BLAS sgemm/dgemm with beta=1, through the BLAS numpy itself uses.

numpy's matmul has no beta, so accumulating a product into an existing array costs a
product into a temporary and a separate read-add-write pass over the result. BLAS's GEMM
computes C = alpha A B + beta C; with beta=1 the sum lands in C as the product's blocks are
written, and the extra pass is gone (gradient accumulation's dW += x^T dy).

Which BLAS: the one numpy's own extension module links (numpy's wheels bundle
scipy-openblas with its symbols renamed, `scipy_cblas_sgemm64_`; other builds export plain
`cblas_sgemm`). `dlsym` on numpy's module handle searches its dependencies, so this finds
whatever numpy was built against without knowing where the library file lies, and calls
the very GEMM numpy's matmul calls (same threads, same code path) through ctypes, which
releases the GIL for the call. Alternatives weighed: scipy.linalg.blas (scipy is not a
dependency), Numba's np.dot (calls scipy's cython BLAS, the same dependency), a path under
numpy.libs/ (only in wheels). A symbol name says its integer width (`64_`: 64-bit
indices), and one small GEMM is checked against numpy when the library is first bound;
when nothing fits, `gemm_accumulate` falls back to numpy's product and add (`available()`
says which).

Summation order: BLAS adds C to its A B blocks as it writes them, so C + A B is rounded
once per block rather than once for the product and once for the add: within float32
rounding of numpy's `c + a @ b`, not bit-identical to it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

# (symbol prefix, suffix, integer type of its sizes), most specific first
_NAMES = (("scipy_cblas_", "64_", ctypes.c_int64), ("cblas_", "64_", ctypes.c_int64),
          ("scipy_cblas_", "", ctypes.c_int), ("cblas_", "", ctypes.c_int))


def gemm_accumulate_ref(c, a, b):
    """The spec: c + a @ b (numpy: the product, then the add).

    >>> gemm_accumulate_ref(np.ones((2, 2)), np.eye(2), np.full((2, 2), 2.0))
    array([[3., 3.],
           [3., 3.]])
    """
    return c + a @ b


@functools.cache
def numpy_module_handle():
    """numpy's compiled core as a ctypes library: dlsym on it also finds the symbols of the
    BLAS numpy links (its bundled OpenBLAS), or None."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return ctypes.CDLL(importlib.import_module(name).__file__)
        except (ImportError, OSError):
            continue
    return None


@functools.cache
def _gemm(dtype: np.dtype):
    """(cblas ?gemm function, its integer type) for float32/float64, or None."""
    letter = {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}.get(np.dtype(dtype))
    handle = numpy_module_handle()
    if letter is None or handle is None:
        return None
    scalar = ctypes.c_float if letter == "s" else ctypes.c_double
    for prefix, suffix, index in _NAMES:
        fn = getattr(handle, f"{prefix}{letter}gemm{suffix}", None)
        if fn is None:
            continue
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, index, index, index, scalar,
                       ctypes.c_void_p, index, ctypes.c_void_p, index, scalar,
                       ctypes.c_void_p, index]
        if _agrees(fn, index, dtype):
            return fn, index
    return None


def _agrees(fn, index, dtype) -> bool:
    """One small GEMM with a transposed operand against numpy: the symbol takes the
    arguments we think it does."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3)).astype(dtype).T.copy().T      # (5, 3), column-major
    b = rng.standard_normal((3, 4)).astype(dtype)
    c = rng.standard_normal((5, 4)).astype(dtype)
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    _call(fn, index, c, a, b)
    return bool(np.allclose(c, want, rtol=1e-5, atol=1e-5))


def _layout(x):
    """(transpose flag, leading dimension) under which BLAS reads the 2-D array `x` in
    place (row-major, or a transposed view of one), or None: x must be copied first."""
    rows, cols = x.shape
    s0, s1 = x.strides
    item = x.itemsize
    if s0 % item or s1 % item or s0 < 0 or s1 < 0:
        return None
    if (cols == 1 or s1 == item) and (rows == 1 or s0 // item >= cols):
        return NO_TRANS, (s0 // item if rows > 1 else max(cols, 1))
    if (rows == 1 or s0 == item) and (cols == 1 or s1 // item >= rows):
        return TRANS, (s1 // item if cols > 1 else max(rows, 1))
    return None


def _call(fn, index, c, a, b) -> None:
    (m, k), n = a.shape, b.shape[1]
    # an operand BLAS cannot read in place, or one that overlaps c (which BLAS writes while
    # it reads), is copied first
    if _layout(a) is None or np.may_share_memory(a, c):
        a = np.ascontiguousarray(a).copy() if np.may_share_memory(a, c) else \
            np.ascontiguousarray(a)
    if _layout(b) is None or np.may_share_memory(b, c):
        b = np.ascontiguousarray(b).copy() if np.may_share_memory(b, c) else \
            np.ascontiguousarray(b)
    (ta, lda), (tb, ldb) = _layout(a), _layout(b)
    fn(ROW_MAJOR, ta, tb, index(m), index(n), index(k), 1.0, a.ctypes.data, index(lda),
       b.ctypes.data, index(ldb), 1.0, c.ctypes.data, index(max(n, 1)))


def available(dtype) -> bool:
    """Does `gemm_accumulate` run BLAS with beta=1 for this dtype here (else numpy)?"""
    return _gemm(np.dtype(dtype)) is not None


def gemm_accumulate(c, a, b) -> None:
    """c += a @ b in place, c (m, n) C-contiguous, a (m, k), b (k, n) of c's dtype, any
    strides (a transposed view is read in place; other layouts are copied first). One BLAS
    GEMM with beta=1 for float32/float64; numpy's product and add for anything else."""
    found = _gemm(c.dtype) if a.dtype == b.dtype == c.dtype else None
    if found is None or not c.flags.c_contiguous or c.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        np.add(c, a @ b, out=c)
        return
    if c.size == 0 or a.shape[1] == 0:          # nothing to add
        return
    _call(*found, c, a, b)
