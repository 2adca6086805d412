"""kernels/gemm.py: c += a @ b as one BLAS GEMM with beta=1, through the BLAS numpy links,
for any operand layout, against a float64 numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.kernels import gemm
from graphdist.ops import OPS
from graphdist.runtime.adapters.accumulate import matmul_accumulate_numpy

RNG = np.random.default_rng(9)
TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-13, atol=1e-13)}


def _check(c, a, b, dtype):
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    gemm.gemm_accumulate(c, a, b)
    np.testing.assert_allclose(c, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpys_blas_is_found(dtype):
    assert gemm.available(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["plain", "a transposed", "b transposed", "both transposed",
                                    "strided rows", "every other column", "a row", "a column"])
def test_every_layout_adds_the_product(dtype, layout):
    m, k, n = 7, 5, 6
    a = RNG.standard_normal((m, k)).astype(dtype)
    b = RNG.standard_normal((k, n)).astype(dtype)
    if layout == "a transposed":               # x^T, as a weight gradient's x^T @ dy
        a = RNG.standard_normal((k, m)).astype(dtype).T
    elif layout == "b transposed":
        b = RNG.standard_normal((n, k)).astype(dtype).T
    elif layout == "both transposed":
        a = RNG.standard_normal((k, m)).astype(dtype).T
        b = RNG.standard_normal((n, k)).astype(dtype).T
    elif layout == "strided rows":             # a leading dimension wider than the row
        a = RNG.standard_normal((m, k + 3)).astype(dtype)[:, :k]
    elif layout == "every other column":       # not readable by BLAS in place: copied
        a = RNG.standard_normal((m, 2 * k)).astype(dtype)[:, ::2]
    elif layout == "a row":
        a = a[:1]
    elif layout == "a column":
        b = b[:, :1]
    c = RNG.standard_normal((a.shape[0], b.shape[1])).astype(dtype)
    _check(c, a, b, dtype)


def test_an_operand_overlapping_c_is_read_before_c_is_written():
    c = RNG.standard_normal((4, 4)).astype(np.float32)
    want = c.astype(np.float64) + c.astype(np.float64) @ c.T.astype(np.float64)
    gemm.gemm_accumulate(c, c, c.T)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_empty_products_add_nothing():
    c = np.ones((3, 2), np.float32)
    gemm.gemm_accumulate(c, np.zeros((3, 0), np.float32), np.zeros((0, 2), np.float32))
    np.testing.assert_array_equal(c, 1)
    gemm.gemm_accumulate(np.zeros((0, 2), np.float32), np.zeros((0, 4), np.float32),
                         np.zeros((4, 2), np.float32))


def test_other_dtypes_take_numpys_product_and_add():
    c = np.arange(6, dtype=np.int64).reshape(2, 3)
    a, b = np.arange(4).reshape(2, 2), np.arange(6).reshape(2, 3)
    want = c + a @ b
    gemm.gemm_accumulate(c, a, b)
    np.testing.assert_array_equal(c, want)


def test_the_numpy_twin_is_the_ops_impl_in_place():
    c = RNG.standard_normal((3, 4)).astype(np.float32)
    a, b = RNG.standard_normal((3, 2)).astype(np.float32), RNG.standard_normal((2, 4)).astype(
        np.float32)
    want = OPS["matmul_accumulate"].impl(np, c, a, b)
    matmul_accumulate_numpy(c, a, b)
    np.testing.assert_array_equal(c, want)
