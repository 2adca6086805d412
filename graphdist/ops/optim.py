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


# ---------------------------------------------------------------- in-place kernels
# Each adapter takes the op's inputs in op order and updates the donated buffers in place
# (outputs -> inputs in `inplace`); graphdist.kernels is imported only when one runs.

def sgd_cpu_kernel(p, g, *, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, g, None, lr, 0.0, False, weight_decay)


def momentum_cpu_kernel(p, m, g, *, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, g, m, lr, momentum, nesterov, weight_decay)


def adam_cpu_kernel(p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_cpu

    adam_cpu(p, g, m, v, lr_t, beta_1, beta_2, epsilon, lr * weight_decay)


sgd_p.inplace = {0: 0}
momentum_p.inplace = {0: 0, 1: 1}
adam_p.inplace = {0: 0, 1: 1, 2: 2}
sgd_p.def_kernel("cpu", "graphdist.ops.optim:sgd_cpu_kernel")
momentum_p.def_kernel("cpu", "graphdist.ops.optim:momentum_cpu_kernel")
adam_p.def_kernel("cpu", "graphdist.ops.optim:adam_cpu_kernel")


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


def sgd_multi_cpu_kernel(*arrays, n, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:2 * n:2], arrays[1:2 * n:2], None, lr, 0.0, False, weight_decay)


def momentum_multi_cpu_kernel(*arrays, n, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:3 * n:3], arrays[2:3 * n:3], arrays[1:3 * n:3], lr, momentum,
                  nesterov, weight_decay)


def adam_multi_cpu_kernel(*arrays, n, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_multi_cpu

    adam_multi_cpu(arrays[0:4 * n:4], arrays[3:4 * n:4], arrays[1:4 * n:4], arrays[2:4 * n:4],
                   arrays[4 * n], beta_1, beta_2, epsilon, lr * weight_decay)


sgd_multi.op.def_kernel("cpu", "graphdist.ops.optim:sgd_multi_cpu_kernel")
momentum_multi.op.def_kernel("cpu", "graphdist.ops.optim:momentum_multi_cpu_kernel")
adam_multi.op.def_kernel("cpu", "graphdist.ops.optim:adam_multi_cpu_kernel")


# ---------------------------------------------------------------- GPU kernels
# The same updates on gpu:N devices: the CUDA kernels of graphdist.kernels, launched on the
# stream of the device running the node (kernels run in place on the donated buffers).

def _stream():
    from graphdist.runtime.gpu import current_numba_stream

    return current_numba_stream()


def sgd_multi_gpu_kernel(*arrays, n, lr, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:2 * n:2], arrays[1:2 * n:2], None, lr, 0.0, False, weight_decay,
                  stream=_stream())


def momentum_multi_gpu_kernel(*arrays, n, lr, momentum, nesterov, weight_decay):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:3 * n:3], arrays[2:3 * n:3], arrays[1:3 * n:3], lr, momentum,
                  nesterov, weight_decay, stream=_stream())


def adam_multi_gpu_kernel(*arrays, n, lr, beta_1, beta_2, epsilon, weight_decay):
    from graphdist.kernels.adam import adam_multi_gpu

    adam_multi_gpu(arrays[0:4 * n:4], arrays[3:4 * n:4], arrays[1:4 * n:4], arrays[2:4 * n:4],
                   arrays[4 * n], beta_1, beta_2, epsilon, lr * weight_decay, stream=_stream())


def sgd_gpu_kernel(p, g, *, lr, weight_decay):
    sgd_multi_gpu_kernel(p, g, n=1, lr=lr, weight_decay=weight_decay)


def momentum_gpu_kernel(p, m, g, *, lr, momentum, nesterov, weight_decay):
    momentum_multi_gpu_kernel(p, m, g, n=1, lr=lr, momentum=momentum, nesterov=nesterov,
                              weight_decay=weight_decay)


def adam_gpu_kernel(p, m, v, g, lr_t, *, lr, beta_1, beta_2, epsilon, weight_decay):
    adam_multi_gpu_kernel(p, m, v, g, lr_t, n=1, lr=lr, beta_1=beta_1, beta_2=beta_2,
                          epsilon=epsilon, weight_decay=weight_decay)


for _op, _name in [(sgd_p, "sgd"), (momentum_p, "momentum"), (adam_p, "adam")]:
    _op.def_kernel("gpu", f"graphdist.ops.optim:{_name}_gpu_kernel")
for _multi, _name in [(sgd_multi, "sgd"), (momentum_multi, "momentum"), (adam_multi, "adam")]:
    _multi.op.def_kernel("gpu", f"graphdist.ops.optim:{_name}_multi_gpu_kernel")
