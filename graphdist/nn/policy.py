"""Keras's dtype policies for gd.nn layers: DTypePolicy (the dtype a layer keeps its variables
in and the dtype it computes in) and `dtype_policy(dtype)`, the policy a layer's `dtype=`
argument names (None: the global one, gd.config.precision()). The casts live in layers.py."""

from __future__ import annotations

import numpy as np

from graphdist import config
from graphdist.ir.types import as_dtype, is_float

MIXED = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


class DTypePolicy:
    """A layer's dtypes, as Keras's DTypePolicy: "float32" (or any float dtype name) keeps
    variables and computes in that dtype; "mixed_bfloat16" / "mixed_float16" keep float32
    variables (master weights) and compute in the low precision.

    >>> p = gd.nn.DTypePolicy("mixed_bfloat16"); p.compute_dtype, p.variable_dtype
    ('bfloat16', 'float32')
    """

    __slots__ = ("_compute", "_name", "_variable")

    def __init__(self, name: str = "float32"):
        if not isinstance(name, str):
            raise TypeError(f"DTypePolicy: the name must be a string, got {name!r}")
        if name in MIXED:
            self._compute, self._variable = MIXED[name], "float32"
        else:
            try:
                dtype = as_dtype(name)
            except TypeError:
                dtype = None
            if dtype is None or not is_float(dtype):
                raise ValueError(f"DTypePolicy: unknown policy {name!r}; use a float dtype "
                                 f"name or one of {sorted(MIXED)}")
            self._compute = self._variable = dtype.name
        self._name = name

    name = property(lambda self: self._name)
    compute_dtype = property(lambda self: self._compute, doc="the dtype of the computation")
    variable_dtype = property(lambda self: self._variable, doc="the dtype of the variables")

    def __eq__(self, other) -> bool:
        return isinstance(other, DTypePolicy) and other._name == self._name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'<DTypePolicy "{self._name}">'


def dtype_policy(dtype=None) -> DTypePolicy:
    """The policy `dtype` names: a DTypePolicy, a policy name, a float dtype (name, numpy type
    or dtype), or None for the global policy (gd.config.precision())."""
    if isinstance(dtype, DTypePolicy):
        return dtype
    if dtype is None:
        return DTypePolicy(config.precision())
    if isinstance(dtype, str):
        return DTypePolicy(dtype)
    try:
        return DTypePolicy(np.dtype(dtype).name)
    except TypeError:
        raise TypeError(f"dtype must be a DTypePolicy, a policy name or a float dtype, got "
                        f"{dtype!r}") from None


__all__ = ["DTypePolicy", "dtype_policy"]
