"""ArrayType (shape + dtype) and the dtype names the IR prints."""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# bfloat16 comes from ml_dtypes (as in JAX); numpy gives it kind "V", so ask is_float()
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype("float16")
DTYPES = {
    np.dtype("float32"): "f32", np.dtype("float64"): "f64", FLOAT16: "f16", BFLOAT16: "bf16",
    np.dtype("int32"): "i32", np.dtype("int64"): "i64", np.dtype("bool"): "bool",
}
FLOATS = (np.dtype("float32"), np.dtype("float64"), FLOAT16, BFLOAT16)
LOW_PRECISION = (FLOAT16, BFLOAT16)   # computed with float32 accumulation
DEFAULT_FLOAT = np.dtype("float32")


def is_float(dtype) -> bool:
    """Is `dtype` one of graphdist's float dtypes (bfloat16 included)?"""
    return np.dtype(dtype) in FLOATS


def as_dtype(dtype) -> np.dtype:
    """The numpy dtype for a name, type or dtype; only the dtypes graphdist supports."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"unknown dtype {dtype!r}; use one of {sorted(map(str, DTYPES))}") from None
    if dt not in DTYPES:
        raise TypeError(f"unsupported dtype {dt}; use one of {sorted(map(str, DTYPES))}")
    return dt


@dataclass(frozen=True, slots=True)
class ArrayType:
    shape: tuple[int, ...]
    dtype: np.dtype

    def __str__(self) -> str:
        return f"{DTYPES.get(self.dtype, str(self.dtype))}[{','.join(map(str, self.shape))}]"

    __repr__ = __str__

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def type_of(value) -> ArrayType:
    a = np.asarray(value)
    return ArrayType(tuple(a.shape), a.dtype)
