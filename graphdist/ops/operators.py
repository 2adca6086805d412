"""Python operators for symbolic values (`+ - * / // % ** @`, comparisons, indexing), shared by
gd.Tensor and gd.Variable."""

from __future__ import annotations

from graphdist.ops import array as A
from graphdist.ops import division as D
from graphdist.ops import math as M


class Operators:
    __slots__ = ()
    __array_ufunc__ = None          # numpy defers to our reflected operators
    __hash__ = object.__hash__      # `==` is elementwise, so hash by identity

    def __add__(self, o): return M.add(self, o)
    def __radd__(self, o): return M.add(o, self)
    def __sub__(self, o): return M.subtract(self, o)
    def __rsub__(self, o): return M.subtract(o, self)
    def __mul__(self, o): return M.multiply(self, o)
    def __rmul__(self, o): return M.multiply(o, self)
    def __truediv__(self, o): return M.divide(self, o)
    def __rtruediv__(self, o): return M.divide(o, self)
    def __floordiv__(self, o): return D.floor_divide(self, o)
    def __rfloordiv__(self, o): return D.floor_divide(o, self)
    def __mod__(self, o): return D.mod(self, o)
    def __rmod__(self, o): return D.mod(o, self)
    def __pow__(self, o): return M.power(self, o)
    def __rpow__(self, o): return M.power(o, self)
    def __matmul__(self, o): return M.matmul(self, o)
    def __rmatmul__(self, o): return M.matmul(o, self)
    def __neg__(self): return M.negative(self)
    def __pos__(self): return self
    def __abs__(self): return M.abs(self)
    def __lt__(self, o): return M.less(self, o)
    def __le__(self, o): return M.less_equal(self, o)
    def __gt__(self, o): return M.greater(self, o)
    def __ge__(self, o): return M.greater_equal(self, o)
    def __eq__(self, o): return M.equal(self, o)
    def __ne__(self, o): return M.not_equal(self, o)
    def __getitem__(self, index): return A.getitem(self, index)

    @property
    def T(self):
        return A.transpose(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)
