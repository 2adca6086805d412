"""Optimizer update ops: one eqn updates one variable and its slots. The fusion pass later
gathers a device's updates into one multi-tensor kernel; these impls are the reference.

The hyper-parameters come in as one float64 vector input, `hyper` (made by the hyper op from
the optimizer's variables), not as params: a new learning rate is a new value, not a new
graph. Its layout, and the update math, are kernels/formulas.py's (`SGDHyper`,
`MomentumHyper`, `AdamHyper`; `sgd`, `adam`): the impls below, the kernels and the in-place
numpy forms all compute from those, with the scalars rounded to the variable's dtype.
"""

from __future__ import annotations

import numpy as np

from graphdist.ir.types import ArrayType
from graphdist.kernels import formulas
from graphdist.kernels.formulas import AdamHyper, MomentumHyper, SGDHyper  # noqa: F401
from graphdist.ops.core import Op, require_float

F64 = np.dtype("float64")


def _check(op_name: str, p: ArrayType, *others: ArrayType) -> ArrayType:
    require_float(op_name, p)
    for t in others:
        if t != p:
            raise ValueError(f"{op_name}: slot or gradient {t} does not match the variable {p}")
    return p


def _check_hyper(op_name: str, hyper: ArrayType, sizes: tuple) -> None:
    if hyper.dtype != F64 or hyper.ndim != 1 or hyper.shape[0] not in sizes:
        want = " or ".join(f"f64[{n}]" for n in sizes)
        raise TypeError(f"{op_name}: hyper-parameters must be {want}, got {hyper}")


def _host(hyper) -> list:
    # Python floats, rounded by the formulas' scalars functions as the kernels round them. On
    # a GPU this reads 2-5 numbers back, a stream sync: only this reference path does (the
    # fused CUDA kernels read the device vector themselves)
    return hyper.tolist()


def _elementwise_cost(flops_per_param: int, n_arrays: int):
    return lambda ins, outs, **_: (flops_per_param * ins[0].size, n_arrays * ins[0].nbytes)


# ---------------------------------------------------------------- the hyper-parameter vector
hyper_p = Op("hyper", differentiable=False)     # f64[] scalars -> f64[n], the updates' input


@hyper_p.def_shape
def _hyper_shape(*xs):
    for x in xs:
        if x.shape != () or x.dtype != F64:
            raise TypeError(f"hyper: expected float64 scalars, got {x}")
    return ArrayType((len(xs),), F64)


# numpy's stack costs 2 us for three scalars, array() 0.2 us; on a GPU one stack launch
hyper_p.def_impl(lambda xp, *xs: np.array(xs, F64) if xp is np else xp.stack(xs))
hyper_p.def_cost(lambda ins, outs, **_: (0, 2 * outs[0].nbytes))


# ---------------------------------------------------------------- per-variable updates
# p' = p - lr * (g + wd * p); SGDHyper. The fused kernels (runtime/kernel_table.py) update
# the inputs `inplace` names: output -> input
sgd_p = Op("sgd_update", differentiable=False, inplace={0: 0})


@sgd_p.def_shape
def _sgd_shape(p, g, hyper):
    _check_hyper("sgd_update", hyper, (2,))
    return _check("sgd_update", p, g)


sgd_p.def_cost(_elementwise_cost(3, 3))


@sgd_p.def_impl
def _sgd_impl(xp, p, g, hyper):
    return formulas.sgd(p, None, g, *formulas.sgd_scalars(_host(hyper), p), False)[0]


# SGD on a row-sparse gradient (gd.IndexedSlices): p[indices] -= lr * rows, repeated indices
# accumulating in order; the rest of p is untouched, as the dense update of the scattered
# gradient leaves it (p - lr * 0). With weight decay every row changes: the update is then
# the dense one of the scattered gradient. An SGDHyper vector, as sgd_update's.
sparse_sgd_p = Op("sparse_sgd_update", differentiable=False, inplace={0: 0})


@sparse_sgd_p.def_shape
def _sparse_sgd_shape(p, indices, rows, hyper):
    _check_hyper("sparse_sgd_update", hyper, (2,))
    require_float("sparse_sgd_update", p)
    if indices.dtype.kind not in "iu" or indices.ndim != 1 or \
            rows.shape != indices.shape + p.shape[1:] or rows.dtype != p.dtype:
        raise ValueError(f"sparse_sgd_update: expected 1-D integer indices and one row of the "
                         f"variable {p} per index, got indices:{indices}, rows:{rows}")
    return p


@sparse_sgd_p.def_impl
def _sparse_sgd_impl(xp, p, indices, rows, hyper):
    from graphdist.ops.sparse import _add_at, _scatter_rows_impl, check_slices

    check_slices(xp, indices, p.shape[0])       # before any row changes
    lr, _, weight_decay = formulas.sgd_scalars(_host(hyper), p)
    if weight_decay != 0:
        g = _scatter_rows_impl(xp, indices, rows, shape=p.shape)
        return formulas.sgd(p, None, g, lr, 0, weight_decay, False)[0]
    out = p.copy()
    _add_at(xp, out, indices, -(lr * rows))      # p + -(lr g) is exactly p - lr g
    return out


sparse_sgd_p.def_cost(lambda ins, outs, **_: (2 * ins[2].size, 3 * ins[2].nbytes))


# a MomentumHyper vector. momentum 0 (assigned after construction) is plain SGD and leaves
# the buffer as it is, as the kernels do
momentum_p = Op("sgd_momentum_update", num_outputs=2, differentiable=False,
                inplace={0: 0, 1: 1})


@momentum_p.def_shape
def _momentum_shape(p, m, g, hyper, *, nesterov):
    _check_hyper("sgd_momentum_update", hyper, (3,))
    ty = _check("sgd_momentum_update", p, m, g)
    return ty, ty


momentum_p.def_cost(_elementwise_cost(6, 5))


@momentum_p.def_impl
def _momentum_impl(xp, p, m, g, hyper, *, nesterov):
    return formulas.sgd(p, m, g, *formulas.sgd_scalars(_host(hyper), p), nesterov)


# an AdamHyper vector: [lr_t, beta_1, beta_2, epsilon] (Adam) or [..., lr * weight_decay]
# (AdamW), with the bias-corrected lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
adam_p = Op("adam_update", num_outputs=3, differentiable=False,
            inplace={0: 0, 1: 1, 2: 2})


@adam_p.def_shape
def _adam_shape(p, m, v, g, hyper):
    _check_hyper("adam_update", hyper, (4, 5))
    ty = _check("adam_update", p, m, v, g)
    return ty, ty, ty


adam_p.def_cost(_elementwise_cost(12, 7))


@adam_p.def_impl
def _adam_impl(xp, p, m, v, g, hyper):
    return formulas.adam(p, m, v, g, *formulas.adam_scalars(_host(hyper), p))


# ---------------------------------------------------------------- multi-tensor forms
# made by passes/fuse.py: one eqn updates every variable of a device. Inputs are grouped per
# variable (p0 m0 v0 g0 p1 m1 v1 g1 ...) followed by the shared hyper vector; outputs
# likewise (p0' m0' v0' p1' ...), each updated in place on its input by the kernel.

class MultiTensor:
    """The multi-tensor form of a per-variable update op."""

    def __init__(self, single: Op, per_var_inputs: int, shared_inputs: int):
        self.single = single
        self.k = per_var_inputs
        self.shared = shared_inputs
        self.outs = single.num_outputs
        self.op = Op(f"{single.name.removesuffix('_update')}_multi_update", num_outputs=None,
                     differentiable=False, multi_tensor=self, inplace=self._inplace)
        self.op.def_shape(self._shape)
        self.op.def_impl(self._impl)
        self.op.def_cost(self._cost)

    def groups(self, ins, n: int):
        shared = tuple(ins[n * self.k:])
        return [tuple(ins[j * self.k:(j + 1) * self.k]) + shared for j in range(n)]

    def _shape(self, *ins, n, **params):
        if len(ins) != n * self.k + self.shared:
            raise ValueError(f"{self.op.name}: expected {n} x {self.k} + {self.shared} inputs, "
                             f"got {len(ins)}")
        return tuple(t for group in self.groups(ins, n)
                     for t in self.single.out_types(*group, **params))

    def _impl(self, xp, *ins, n, **params):
        outs = []
        for group in self.groups(ins, n):
            out = self.single.impl(xp, *group, **params)
            outs += list(out) if isinstance(out, tuple) else [out]
        return tuple(outs)

    def _cost(self, ins, outs, *, n, **params):
        totals = [self.single.cost(list(g), [], params) for g in self.groups(ins, n)]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    def _inplace(self, params) -> dict:
        return {j * self.outs + o: j * self.k + o
                for j in range(dict(params)["n"]) for o in range(self.outs)}


sgd_multi = MultiTensor(sgd_p, 2, 1)
momentum_multi = MultiTensor(momentum_p, 3, 1)
adam_multi = MultiTensor(adam_p, 4, 1)
