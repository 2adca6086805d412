"""Optimizer update ops: one eqn updates one variable and its slots. The fusion pass later
gathers a device's updates into one multi-tensor kernel; these impls are the reference."""

from __future__ import annotations

from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, require_float, same_dtype


def _check(op_name: str, p: ArrayType, *others: ArrayType) -> ArrayType:
    require_float(op_name, p)
    for t in others:
        if t != p:
            raise ValueError(f"{op_name}: slot or gradient {t} does not match the variable {p}")
    return p


def _elementwise_cost(flops_per_param: int, n_arrays: int):
    return lambda ins, outs, **_: (flops_per_param * ins[0].size, n_arrays * ins[0].nbytes)


sgd_p = Op("sgd_update", differentiable=False)          # p' = p - lr * (g + wd * p)
sgd_p.def_shape(lambda p, g, *, lr, weight_decay: _check("sgd_update", p, g))
sgd_p.def_cost(_elementwise_cost(3, 3))


@sgd_p.def_impl
def _sgd_impl(xp, p, g, *, lr, weight_decay):
    dt = p.dtype.type
    if weight_decay:
        g = g + dt(weight_decay) * p
    return p - dt(lr) * g


momentum_p = Op("sgd_momentum_update", num_outputs=2, differentiable=False)


@momentum_p.def_shape
def _momentum_shape(p, m, g, *, lr, momentum, nesterov, weight_decay):
    ty = _check("sgd_momentum_update", p, m, g)
    return ty, ty


momentum_p.def_cost(_elementwise_cost(6, 5))


@momentum_p.def_impl
def _momentum_impl(xp, p, m, g, *, lr, momentum, nesterov, weight_decay):
    dt = p.dtype.type
    if weight_decay:
        g = g + dt(weight_decay) * p
    m = dt(momentum) * m + g
    step = g + dt(momentum) * m if nesterov else m
    return p - dt(lr) * step, m


adam_p = Op("adam_update", num_outputs=3, differentiable=False)


@adam_p.def_shape
def _adam_shape(p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    ty = _check("adam_update", p, m, v, g)
    same_dtype("adam_update", p, lr_t)
    return ty, ty, ty


adam_p.def_cost(_elementwise_cost(12, 7))


@adam_p.def_impl
def _adam_impl(xp, p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    dt = p.dtype.type
    if weight_decay:  # AdamW: decoupled decay with the plain learning rate, before the step
        p = p - dt(lr * weight_decay) * p
    m = dt(beta_1) * m + dt(1 - beta_1) * g
    v = dt(beta_2) * v + dt(1 - beta_2) * (g * g)
    return p - lr_t * m / (xp.sqrt(v) + dt(epsilon)), m, v


# the fused kernels (runtime/kernel_table.py) update these inputs in place: output -> input
sgd_p.inplace = {0: 0}
momentum_p.inplace = {0: 0, 1: 1}
adam_p.inplace = {0: 0, 1: 1, 2: 2}


# ---------------------------------------------------------------- multi-tensor forms
# made by passes/fuse.py: one eqn updates every variable of a device. Inputs are grouped per
# variable (p0 m0 v0 g0 p1 m1 v1 g1 ...) followed by the shared scalars (lr_t); outputs
# likewise (p0' m0' v0' p1' ...), each updated in place on its input by the kernel.

class MultiTensor:
    """The multi-tensor form of a per-variable update op."""

    def __init__(self, single: Op, per_var_inputs: int, shared_inputs: int):
        self.single = single
        self.k = per_var_inputs
        self.shared = shared_inputs
        self.outs = single.num_outputs
        self.op = Op(f"{single.name.removesuffix('_update')}_multi_update", num_outputs=None,
                     differentiable=False)
        self.op.multi = self
        self.op.def_shape(self._shape)
        self.op.def_impl(self._impl)
        self.op.def_cost(self._cost)
        self.op.inplace = self._inplace

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


sgd_multi = MultiTensor(sgd_p, 2, 0)
momentum_multi = MultiTensor(momentum_p, 3, 0)
adam_multi = MultiTensor(adam_p, 4, 1)
