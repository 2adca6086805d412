"""Building tensors from pieces or from a range: gd.stack (composed from reshape and concat,
so its gradient is theirs) and gd.arange (an op with no inputs, like fill)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType, as_dtype
from graphdist.ops.array import concat, reshape
from graphdist.ops.core import Op, bind, normalize_axis
from graphdist.ops.naming import user_op

arange_p = Op("arange", differentiable=False)


def arange_length(start, limit, delta) -> int:
    return max(math.ceil((limit - start) / delta), 0)      # numpy's count


@arange_p.def_shape
def _arange_shape(*, start, limit, delta, dtype):
    return ArrayType((arange_length(start, limit, delta),), dtype)


@arange_p.def_impl
def _arange_impl(xp, *, start, limit, delta, dtype):
    n = arange_length(start, limit, delta)
    if np.dtype(dtype).kind in "iu":
        return xp.arange(start, limit, delta, dtype=dtype)
    # start + i * delta in float64, rounded once (numpy's float32 arange adds up rounding)
    return (xp.arange(n, dtype=np.float64) * delta + start).astype(dtype)


arange_p.def_cost(lambda ins, outs, **_: (outs[0].size, outs[0].nbytes))


def arange(start, limit=None, delta=1, dtype=None):
    """[start, start + delta, ...) up to `limit` (exclusive), TF's tf.range signature with
    numpy's values; `arange(n)` is 0..n-1. The dtype defaults to int32 for int arguments
    and float32 otherwise (Python scalars are weakly typed). No gradient.

    >>> gd.arange(3)
    array([0, 1, 2], dtype=int32)
    """
    if limit is None:
        start, limit = 0, start
    values = (start, limit, delta)
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        raise TypeError(f"arange: start, limit and delta must be numbers (the length is "
                        f"fixed at trace time), got {values!r}")
    if delta == 0:
        raise ValueError("arange: delta must not be 0")
    ints = all(isinstance(v, numbers.Integral) for v in values)
    dtype = as_dtype(dtype if dtype is not None else "int32" if ints else "float32")
    kind = "int" if np.dtype(dtype).kind in "iu" else "float"
    if kind == "int" and not ints:
        raise TypeError(f"arange: integer dtype {dtype} needs integer arguments, got {values!r}")
    cast = int if kind == "int" else float
    return bind(arange_p, start=cast(start), limit=cast(limit), delta=cast(delta), dtype=dtype)


@user_op("stack")
def stack(values, axis=0):
    """Stack same-shape tensors along a new axis `axis`.

    >>> gd.stack([np.zeros(2), np.ones(2)], axis=1)
    array([[0., 1.],
           [0., 1.]])
    """
    values = list(values)
    if not values:
        raise ShapeError("stack: needs at least one value")
    shapes = [tuple(getattr(v, "shape", np.shape(v))) for v in values]
    if any(s != shapes[0] for s in shapes):
        raise ShapeError("stack: every value must have one shape, got "
                         + ", ".join(map(str, shapes)))
    dtypes = [np.dtype(v.dtype) for v in values if hasattr(v, "dtype")]  # scalars: weak
    if any(d != dtypes[0] for d in dtypes):
        raise TypeError("stack: every value must have one dtype, got "
                        + ", ".join(map(str, dtypes)) + "; use gd.cast to make them agree")
    (ax,) = normalize_axis("stack", axis, len(shapes[0]) + 1, shapes[0])
    new = shapes[0][:ax] + (1,) + shapes[0][ax:]
    return concat([reshape(v, new) for v in values], axis=ax)
