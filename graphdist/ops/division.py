"""Floor division and its remainder, `//` and `%`: gd.floor_divide and gd.mod, with
numpy's semantics for float and integer tensors (the quotient rounded toward -inf, the
remainder taking the divisor's sign: -7 // 2 == -4, -7 % 2 == 1, 7 % -2 == -1).

Integer division by zero raises ZeroDivisionError, as Python's `7 // 0` does and TF's CPU
kernels do (InvalidArgumentError), eagerly and when a compiled step runs: numpy would give
0 with a RuntimeWarning, a silent wrong value inside a compiled step (which runs with
numpy's warnings off). Float division by zero follows IEEE as numpy does (inf, nan).

Gradients: floor_divide is piecewise constant, so its gradient is zero (TF registers
none; JAX gives zeros); mod's is TF's FloorMod gradient, d/dx = 1 and
d/dy = -floor_divide(x, y).
"""

from __future__ import annotations

from graphdist.ir.types import ArrayType, is_float
from graphdist.ops.array import zeros_like
from graphdist.ops.core import Op, bind, broadcast_types
from graphdist.ops.math import multiply, negative, unbroadcast


def _shape(op_name: str, x: ArrayType, y: ArrayType) -> ArrayType:
    ty = broadcast_types(op_name, x, y, names=("x", "y"))
    if not (is_float(ty.dtype) or ty.dtype.kind in "iu"):
        raise TypeError(f"{op_name}: expected int or float tensors, got x:{x}, y:{y}; "
                        f"use gd.cast first")
    return ty


def check_divisor(op_name: str, xp, y) -> None:
    """An integer divisor with a zero raises ZeroDivisionError (one reduction when none is)."""
    if y.dtype.kind not in "iu" or not y.size or y.all():
        return
    where = ""
    if y.ndim:
        zeros = y == 0
        at = tuple(int(k[0]) for k in xp.nonzero(zeros))
        where = (f" at {at[0] if len(at) == 1 else at} of the divisor {tuple(y.shape)} "
                 f"({int(zeros.sum())} of {y.size} are 0)")
    raise ZeroDivisionError(f"{op_name}: integer division by zero{where}; numpy would give "
                            f"0, silently in a compiled step: guard the divisor (gd.where)")


def _division(name: str, ufunc: str) -> Op:
    """An elementwise op computing numpy's `ufunc`, its integer divisor checked first."""
    op = Op(name, elementwise=True)
    op.def_shape(lambda x, y: _shape(name, x, y))

    @op.def_impl
    def _impl(xp, x, y):
        check_divisor(name, xp, y)
        return getattr(xp, ufunc)(x, y)

    @op.def_out(may_alias=True)          # a ufunc with out=: correct when out is an input
    def _out(xp, out, x, y):
        check_divisor(name, xp, y)
        getattr(xp, ufunc)(x, y, out=out)

    op.def_cost(lambda ins, outs: (outs[0].size, sum(t.nbytes for t in (*ins, *outs))))
    return op


floor_divide_p = _division("floor_divide", "floor_divide")
floor_divide_p.def_vjp(lambda ct, x, y: (zeros_like(x), zeros_like(y)))

mod_p = _division("mod", "remainder")
mod_p.def_vjp(lambda ct, x, y: (unbroadcast(ct, x.ty),
                                unbroadcast(negative(multiply(ct, floor_divide(x, y))), y.ty)))


def floor_divide(x, y):
    """x // y elementwise, rounded toward -inf (numpy's floor_divide; TF's floordiv).

    >>> gd.floor_divide(np.array([-7, 7]), 2)
    array([-4,  3])
    """
    return bind(floor_divide_p, x, y)


def mod(x, y):
    """x % y elementwise, with the sign of y (numpy's remainder; TF's floormod):
    x == floor_divide(x, y) * y + mod(x, y).

    >>> gd.mod(np.array([-7.0, 7.0]), -2.0)
    array([-1., -1.])
    """
    return bind(mod_p, x, y)
