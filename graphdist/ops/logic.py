"""Rounding, logical ops and cumulative sums: gd.floor, gd.ceil, gd.round (halves to even,
as numpy), gd.logical_and / logical_or / logical_not (bool tensors, broadcasting) and
gd.cumsum(x, axis). Comparisons (gd.equal, gd.less...) live in ops/math.py.

Gradients: the rounding ops are piecewise constant, so theirs is zero (as JAX gives);
logical ops have none; cumsum's is the cumulative sum of the cotangent taken from the other
end (TF's Cumsum gradient).
"""

from __future__ import annotations

from graphdist.ir.types import ArrayType
from graphdist.ops.array import zeros_like
from graphdist.ops.core import Op, bind, broadcast_shapes, normalize_axis, require_float

def _rounding(name: str, ufunc: str) -> Op:
    op = Op(name, elementwise=True, ufunc=ufunc)

    @op.def_shape
    def _shape(x):
        require_float(name, x)
        return x

    op.def_impl(lambda xp, x: getattr(xp, ufunc)(x))
    op.def_vjp(lambda ct, x: (zeros_like(x),))
    return op


floor_p = _rounding("floor", "floor")
ceil_p = _rounding("ceil", "ceil")
round_p = _rounding("round", "rint")          # rint: halves to even, as np.round


def _require_bool(op_name: str, *tys: ArrayType) -> None:
    for t in tys:
        if t.dtype.kind != "b":
            raise TypeError(f"{op_name}: expected bool tensors, got "
                            f"{', '.join(map(str, tys))}; compare first (x > 0) or gd.cast")


def _logical(name: str, ufunc: str) -> Op:
    op = Op(name, elementwise=True, ufunc=ufunc, differentiable=False)

    @op.def_shape
    def _shape(x, y):
        _require_bool(name, x, y)
        return ArrayType(broadcast_shapes(name, x, y, names=("x", "y")), x.dtype)

    op.def_impl(lambda xp, x, y: getattr(xp, ufunc)(x, y))
    return op


logical_and_p = _logical("logical_and", "logical_and")
logical_or_p = _logical("logical_or", "logical_or")
logical_not_p = Op("logical_not", elementwise=True, ufunc="logical_not", differentiable=False)


@logical_not_p.def_shape
def _logical_not_shape(x):
    _require_bool("logical_not", x)
    return x


logical_not_p.def_impl(lambda xp, x: xp.logical_not(x))

cumsum_p = Op("cumsum")


@cumsum_p.def_shape
def _cumsum_shape(x, *, axis, reverse):
    if x.dtype.kind == "b":
        raise TypeError(f"cumsum: expected a numeric tensor, got {x}; use gd.cast first")
    normalize_axis("cumsum", axis, x.ndim, x.shape)
    return x


@cumsum_p.def_impl
def _cumsum_impl(xp, x, *, axis, reverse):
    if not reverse:
        return xp.cumsum(x, axis=axis, dtype=x.dtype)
    flipped = xp.flip(x, axis=axis)
    return xp.flip(xp.cumsum(flipped, axis=axis, dtype=x.dtype), axis=axis)


@cumsum_p.def_vjp
def _cumsum_vjp(ct, x, *, axis, reverse):
    return (bind(cumsum_p, ct, axis=axis, reverse=not reverse),)


def floor(x):
    """The largest integer <= x, elementwise (float tensors).

    >>> gd.floor(np.array([-1.5, 1.5]))
    array([-2.,  1.])
    """
    return bind(floor_p, x)


def ceil(x):
    """The smallest integer >= x, elementwise (float tensors)."""
    return bind(ceil_p, x)


def round(x):  # noqa: A001 - TF's and numpy's name, as docs/api.md promises
    """x rounded to the nearest integer, halves to even (numpy's round, TF's round).

    >>> gd.round(np.array([0.5, 1.5, 2.5]))
    array([0., 2., 2.])
    """
    return bind(round_p, x)


def logical_and(x, y):
    """x AND y elementwise, for bool tensors (broadcasting)."""
    return bind(logical_and_p, x, y)


def logical_or(x, y):
    """x OR y elementwise, for bool tensors (broadcasting)."""
    return bind(logical_or_p, x, y)


def logical_not(x):
    """NOT x elementwise, for a bool tensor."""
    return bind(logical_not_p, x)


def cumsum(x, axis=0, reverse=False):
    """Cumulative sum along `axis` (TF's default axis 0); reverse=True sums from the end.

    >>> gd.cumsum(np.array([1, 2, 3]))
    array([1, 3, 6])
    """
    ndim = len(getattr(x, "shape", ()))
    (axis,) = normalize_axis("cumsum", axis, ndim, getattr(x, "shape", None))
    return bind(cumsum_p, x, axis=int(axis), reverse=bool(reverse))
