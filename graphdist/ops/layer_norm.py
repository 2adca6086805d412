"""Layer normalization as one op (and its gradient as one op), so a transformer block's
normalizations run as one fused kernel each way on CPU (kernels/layer_norm.py, listed in
runtime/kernel_table.py) rather than as a dozen array passes. The numpy impls here define
what the ops mean. Statistics are taken over the trailing `naxes` axes (so a leading
replica axis changes nothing) in float32, or float64 for float64 inputs."""

from __future__ import annotations

import functools

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.array import broadcast_to
from graphdist.ops.core import Op, bind, normalize_axis, require_float, same_dtype
from graphdist.ops.math import (
    add,
    divide,
    multiply,
    negative,
    reduce_mean,
    reduce_sum,
    sqrt,
    square,
    subtract,
)


def _acc(dtype) -> np.dtype:
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


def _check(op_name, x, affine, naxes, scale, center):
    require_float(op_name, x)
    if not 1 <= naxes <= x.ndim:
        raise ShapeError(f"{op_name}: cannot normalize over the last {naxes} axes of x:{x}")
    if len(affine) != int(scale) + int(center):
        raise ShapeError(f"{op_name}: expected {int(scale) + int(center)} gamma/beta "
                         f"operand(s) (scale={scale}, center={center}), got {len(affine)}")
    names = ("gamma", "beta")[int(not scale):][:len(affine)]
    same_dtype(op_name, x, *affine, names=("x",) + names)
    for name, ty in zip(names, affine):
        if ty.shape != x.shape[x.ndim - naxes:]:
            raise ShapeError(f"{op_name}: {name} must have the normalized shape "
                             f"{x.shape[x.ndim - naxes:]}, got x:{x}, {name}:{ty}")


def _stats(xp, x, naxes, epsilon):
    """x - mean and 1/sqrt(var + epsilon) over the last naxes axes, in the accumulation
    dtype."""
    axes = tuple(range(x.ndim - naxes, x.ndim))
    xa = x.astype(_acc(x.dtype), copy=False)
    d = xa - xa.mean(axis=axes, keepdims=True)
    return d, 1.0 / xp.sqrt((d * d).mean(axis=axes, keepdims=True) + epsilon)


layer_norm_p = Op("layer_norm")


@layer_norm_p.def_shape
def _layer_norm_shape(x, *affine, naxes, epsilon, scale, center):
    _check("layer_norm", x, affine, naxes, scale, center)
    return x


@layer_norm_p.def_impl
def _layer_norm_impl(xp, x, *affine, naxes, epsilon, scale, center):
    d, rstd = _stats(xp, x, naxes, epsilon)
    y = d * rstd                                                  # (..., D)
    if scale:
        y = y * affine[0].astype(y.dtype)
    if center:
        y = y + affine[-1].astype(y.dtype)
    return y.astype(x.dtype)


@layer_norm_p.def_vjp
def _layer_norm_vjp(ct, x, *affine, naxes, epsilon, scale, center):
    grads = layer_norm_grad(ct, x, affine[0] if scale else None, naxes=naxes, epsilon=epsilon,
                            scale=scale, center=center)
    return grads                 # dx, then dgamma and dbeta where the op has them


def _layer_norm_cost(ins, outs, *, naxes, **_):
    return 8 * ins[0].size, sum(t.nbytes for t in (*ins, *outs))


layer_norm_p.def_cost(_layer_norm_cost)
layer_norm_p.def_batch(lambda bx, x, *affine, **params: (
    bx.add(layer_norm_p, x, *affine, **params) if not any(map(bx.batched, affine))
    else bx.per_replica(layer_norm_p, (x, *affine), params)))

# the gradient: dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = ct gamma, xhat the
# normalized x; dgamma = sum of ct xhat and dbeta = sum of ct over the leading axes
layer_norm_grad_p = Op("layer_norm_grad", num_outputs=None)


@layer_norm_grad_p.def_shape
def _layer_norm_grad_shape(ct, x, *gamma, naxes, epsilon, scale, center):
    _check("layer_norm_grad", x, gamma, naxes, scale, False)
    if ct != x:
        raise ShapeError(f"layer_norm_grad: ct and x must have one type, got ct:{ct}, x:{x}")
    affine = ArrayType(x.shape[x.ndim - naxes:], x.dtype)
    return (x,) + (affine,) * (int(scale) + int(center))


@layer_norm_grad_p.def_impl
def _layer_norm_grad_impl(xp, ct, x, *gamma, naxes, epsilon, scale, center):
    d, rstd = _stats(xp, x, naxes, epsilon)
    xhat = d * rstd
    axes = tuple(range(x.ndim - naxes, x.ndim))
    cta = ct.astype(xhat.dtype)
    g = cta * gamma[0].astype(xhat.dtype) if scale else cta
    dx = rstd * (g - g.mean(axis=axes, keepdims=True)
                 - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    lead = tuple(range(x.ndim - naxes))
    outs = [dx.astype(x.dtype)]
    if scale:
        outs.append((cta * xhat).sum(axis=lead).astype(x.dtype))
    if center:
        outs.append(cta.sum(axis=lead).astype(x.dtype))
    return tuple(outs)


layer_norm_grad_p.def_cost(lambda ins, outs, **_: (12 * ins[0].size,
                                                   sum(t.nbytes for t in (*ins, *outs))))


@layer_norm_grad_p.def_vjp
def _layer_norm_grad_vjp(cts, ct, x, *gamma, naxes, epsilon, scale, center):
    # Second order (a gradient penalty through a layer norm). P(v): the dx this op gives for
    # ct = v and no gamma (P is self-adjoint: the Jacobian of xhat, transposed); a, bg, bb:
    # the cotangents of dx, dgamma, dbeta. Then d ct = gamma P(a) + bg xhat + bb,
    # d gamma = sum(ct P(a)) and d x = P(u) - rstd xhat mean(a dx) with
    # u = bg ct - rstd (a mean(g xhat) + g mean(a xhat)).
    a, *rest = cts
    bg = rest.pop(0) if scale else None
    bb = rest.pop(0) if center else None
    axes = tuple(range(x.ty.ndim - naxes, x.ty.ndim))

    def project(v):
        return layer_norm_grad(v, x, naxes=naxes, epsilon=epsilon, scale=False,
                               center=False)[0]

    def mean(v):
        return reduce_mean(v, axis=axes, keepdims=True)

    centered = subtract(x, mean(x))
    rstd = divide(1.0, sqrt(add(mean(square(centered)), epsilon)))
    xhat = multiply(centered, rstd)
    g = multiply(ct, gamma[0]) if scale else ct
    d_ct, d_x, d_gamma = [], [], None
    if a is not None:
        pa = project(a)
        d_ct.append(multiply(pa, gamma[0]) if scale else pa)
        if scale:
            d_gamma = reduce_sum(multiply(ct, pa), axis=tuple(range(x.ty.ndim - naxes)))
        u = add(multiply(a, mean(multiply(g, xhat))), multiply(g, mean(multiply(a, xhat))))
        dx = project(g)                      # this op's own dx (shared by CSE)
        d_x += [negative(project(multiply(u, rstd))),
                negative(multiply(multiply(rstd, xhat), mean(multiply(a, dx))))]
    if bg is not None:
        d_ct.append(multiply(bg, xhat))
        d_x.append(project(multiply(bg, ct)))
    if bb is not None:
        d_ct.append(broadcast_to(bb, x.ty.shape))
    return (_total(d_ct), _total(d_x)) + ((d_gamma,) if scale else ())


def _total(terms):
    return functools.reduce(add, terms) if terms else None


def layer_norm_grad(ct, x, gamma=None, *, naxes, epsilon, scale, center) -> tuple:
    """(dx, [dgamma], [dbeta]) of layer_norm: one op."""
    return tuple(bind(layer_norm_grad_p, ct, x, *([gamma] if scale else []), naxes=naxes,
                      epsilon=epsilon, scale=scale, center=center))


def layer_norm(x, gamma=None, beta=None, axis=-1, epsilon: float = 1e-5):
    """(x - mean) / sqrt(var + epsilon) * gamma + beta, the statistics over `axis` (the last
    axis, or a tuple of trailing axes); gamma and beta (each optional) have the shape of
    those axes. One op; float16/bfloat16 inputs get float32 statistics.

    >>> gd.nn.layer_norm(np.array([[1.0, 3.0]]), epsilon=0.0)
    array([[-1.,  1.]])
    """
    shape = tuple(getattr(x, "shape", np.shape(x)))
    axes = normalize_axis("layer_norm", axis, len(shape), shape)
    naxes = len(axes)
    if not axes or axes != tuple(range(len(shape) - naxes, len(shape))):
        raise ShapeError(f"layer_norm: axis must be the last axis or a tuple of trailing "
                         f"axes, got axis={axis} for x of shape {shape}")
    affine = [v for v in (gamma, beta) if v is not None]
    return bind(layer_norm_p, x, *affine, naxes=naxes, epsilon=float(epsilon),
                scale=gamma is not None, center=beta is not None)
