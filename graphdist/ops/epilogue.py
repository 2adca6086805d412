"""Fused epilogues: a matmul or conv2d with its bias add and activation in its output pass,
relu's gradient with the bias gradient's column sum in one pass, and a first layer's filter
gradient that makes its dy from a max pool's argmax as it goes. Nobody writes these: the
compile pass passes/epilogue.py makes them from the differentiated graph (matmul/conv2d ->
add(bias) -> relu | gelu, relu_grad -> reduce_sum over all axes but the last,
max_pool2d_grad_argmax -> conv2d_backprop_filter) when fused kernels are on, so they are
not differentiable. Each eqn keeps the names of the ops it replaced in its `members` param,
which every view prints.

Each op's generic impl here is xp-generic numpy/CuPy; the CPU runs its kernel entry
(runtime/adapters/epilogue.py: the Numba epilogue passes, with numpy twins that give the
same bits), through the same block loops below with other `EpilogueForms`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.conv import (EPILOGUE_BYTES, _conv2d_shape, _conv_cost, bias_act_numpy,
                                conv2d_backprop_filter_p, conv2d_blocks)
from graphdist.ops.core import Op, same_dtype
from graphdist.ops.math import relu_grad_p
from graphdist.ops.pool import max_pool2d_argmax_p, max_pool2d_grad_argmax_p
from graphdist.ops.window import window_geometry
from graphdist.ops.special import gelu_p

# the activations an epilogue applies: "none", relu, and gelu in its exact (erf) and tanh
# (GPT-2's, approximate=True) forms
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh")
GELU_FORMS = {"gelu": False, "gelu_tanh": True}      # act -> gelu's `approximate`
POOL = {"ksize": (2, 2), "strides": (2, 2), "padding": "VALID"}   # the pools fused here


@dataclass(frozen=True)
class EpilogueForms:
    """How an epilogue's pieces run: `bias_act(rows, bias, relu)` adds the bias (None: no
    add) and applies relu in place on (R, O) rows; `gelu(x, out, approximate)` writes
    gelu(x) into `out` (never x itself: the CPU kernel vectorizes only on distinct
    buffers); `relu_grad_sum(dz, db, ct, y)` writes relu_grad(ct, y) into dz and its column
    sums into db; `pool_argmax(a, y, idx)` writes the 2x2 max pool of stride 2 of a (N, H,
    W, C) into y and its argmax into idx (ops/pool.py max_pool2d_argmax)."""

    bias_act: object
    gelu: object
    relu_grad_sum: object
    pool_argmax: object


def generic_forms(xp) -> EpilogueForms:
    """The ops' own forms on array module `xp` (the reference the kernels are held to)."""
    def gelu(x, out, approximate):
        gelu_p.out_impl(xp, out, x, approximate=approximate)

    def pool_argmax(a, y, idx):
        y[...], idx[...] = max_pool2d_argmax_p.impl(xp, a, **POOL)

    return EpilogueForms(functools.partial(bias_act_numpy, xp), gelu,
                         functools.partial(relu_grad_sum_numpy, xp), pool_argmax)


def _outputs(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def _finish(forms, pre, y, bias, act) -> None:
    """The epilogue on one block: `pre` holds the GEMM's rows; y the activation's rows (pre
    itself for relu and none, which run in place)."""
    if act in GELU_FORMS:
        if bias is not None:
            forms.bias_act(pre, bias, False)
        forms.gelu(pre, y, GELU_FORMS[act])
    elif bias is not None or act == "relu":
        forms.bias_act(pre, bias, act == "relu")


def _fused_shape(base: ArrayType, bias, act: str, keep: bool, name: str):
    if act not in ACTIVATIONS:
        raise ValueError(f"{name}: act must be one of {ACTIVATIONS}, got {act!r}")
    if bias is not None and (bias.shape != base.shape[-1:] or bias.dtype != base.dtype):
        raise ShapeError(f"{name}: the bias must be {ArrayType(base.shape[-1:], base.dtype)} "
                         f"(one per output channel), got bias:{bias}")
    if keep and act not in GELU_FORMS:
        raise ValueError(f"{name}: keep=True (the pre-activation as an output too) is for "
                         f"gelu, whose gradient reads it; got act={act!r}")
    return (base, base) if keep else (base,)


def _check_inputs(name: str, bias: bool, n_inputs: int, n_base: int) -> None:
    if n_inputs != n_base + int(bias):
        raise ShapeError(f"{name}: expected {n_base + int(bias)} inputs "
                         f"({'with' if bias else 'without'} a bias), got {n_inputs}")


# ---------------------------------------------------------------- matmul_bias_act
# x (..., K) @ w (K, O) as one GEMM over x's rows, + bias (O,), then the activation: one
# node of a matmul -> add -> relu / gelu chain. With gelu the GEMM and bias go to pre-
# activation rows (the `pre` output when the gradient needs it, else a block-sized scratch
# buffer) and gelu writes the output from them.

matmul_bias_act_p = Op("matmul_bias_act", num_outputs=None, cost_kind="matmul",
                       differentiable=False)


@matmul_bias_act_p.def_shape
def _matmul_bias_act_shape(x, w, *bias, act, has_bias, keep, members):
    _check_inputs("matmul_bias_act", has_bias, 2 + len(bias), 2)
    same_dtype("matmul_bias_act", x, w, names=("x", "w"))
    if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ShapeError(f"matmul_bias_act: needs x (..., K) @ w (K, O), got x:{x} @ w:{w}")
    out = ArrayType((*x.shape[:-1], w.shape[1]), x.dtype)
    return _fused_shape(out, bias[0] if bias else None, act, keep, "matmul_bias_act")


def matmul_bias_act_out(xp, outs, x, w, *bias, act, has_bias, keep, members,
                        forms: EpilogueForms | None = None):
    """outs = (y,) or (pre, y): the GEMM of x's rows, then the epilogue (`forms`, default
    the generic ones) per block of rows while they are in cache."""
    forms = forms or generic_forms(xp)
    outs = _outputs(outs)
    y = outs[-1].reshape(-1, w.shape[1])
    pre = outs[0].reshape(-1, w.shape[1]) if keep else None
    x2 = x.reshape(-1, w.shape[0])
    b = bias[0] if bias else None
    if act not in GELU_FORMS:                 # in place on y: one GEMM, one pass
        xp.matmul(x2, w, out=y)
        _finish(forms, y, y, b, act)
        return
    step = max(1, EPILOGUE_BYTES // max(1, (w.shape[0] + w.shape[1]) * x.itemsize))
    scratch = None if keep else xp.empty((min(step, y.shape[0]), w.shape[1]), y.dtype)
    for a in range(0, y.shape[0], step):
        rows = slice(a, min(y.shape[0], a + step))
        into = pre[rows] if keep else scratch[:rows.stop - rows.start]
        xp.matmul(x2[rows], w, out=into)
        _finish(forms, into, y[rows], b, act)


matmul_bias_act_p.def_out(matmul_bias_act_out)


def _impl_from_out(shape_rule, out_form):
    """The op's impl: fresh outputs of the shapes `shape_rule` gives, filled by `out_form`."""
    def impl(xp, *args, **params):
        outs = tuple(xp.empty(t.shape, t.dtype) for t in shape_rule(
            *(ArrayType(a.shape, a.dtype) for a in args), **params))
        out_form(xp, outs, *args, **params)
        return outs
    return impl


matmul_bias_act_p.def_impl(_impl_from_out(_matmul_bias_act_shape, matmul_bias_act_out))


matmul_bias_act_p.def_cost(lambda ins, outs, **_: (
    2 * outs[0].size * ins[0].shape[-1] + 2 * outs[0].size,
    sum(t.nbytes for t in (*ins, *outs))))

# ---------------------------------------------------------------- conv2d_bias_act
# conv2d (NHWC, HWIO; ops/conv.py) + bias + activation in its output pass: per block of
# whole images, im2col, one GEMM, then the epilogue on the block's rows in cache
# (ops/conv.py conv2d_blocks). The tutorial CNN's first layer at batch 256 on 2 cores
# (bench/conv2d.py): 2.5 ms against 5.3 for conv2d, add and relu apart.

conv2d_bias_act_p = Op("conv2d_bias_act", num_outputs=None, cost_kind="matmul",
                       differentiable=False)


@conv2d_bias_act_p.def_shape
def _conv2d_bias_act_shape(x, f, *bias, strides, padding, dilations, act, has_bias, keep,
                           members):
    _check_inputs("conv2d_bias_act", has_bias, 2 + len(bias), 2)
    out = _conv2d_shape(x, f, strides=strides, padding=padding, dilations=dilations)
    return _fused_shape(out, bias[0] if bias else None, act, keep, "conv2d_bias_act")


def conv2d_bias_act_out(xp, outs, x, f, *bias, strides, padding, dilations, act, has_bias,
                        keep, members, forms: EpilogueForms | None = None):
    """outs = (y,) or (pre, y) of conv2d(x, f) + bias, activated, per block of images."""
    forms = forms or generic_forms(xp)
    outs = _outputs(outs)
    o = f.shape[3]
    b = bias[0] if bias else None
    y = outs[-1]
    if act not in GELU_FORMS:
        conv2d_blocks(xp, y, x, f, lambda part, rows: _finish(forms, rows, rows, b, act),
                      strides=strides, padding=padding, dilations=dilations)
        return
    pre = outs[0] if keep else xp.empty(y.shape, y.dtype)
    conv2d_blocks(xp, pre, x, f,
                  lambda part, rows: _finish(forms, rows, y[part].reshape(-1, o), b, act),
                  strides=strides, padding=padding, dilations=dilations)


conv2d_bias_act_p.def_out(conv2d_bias_act_out)


conv2d_bias_act_p.def_impl(_impl_from_out(_conv2d_bias_act_shape, conv2d_bias_act_out))


conv2d_bias_act_p.def_cost(lambda ins, outs, **_: (
    _conv_cost(ins[:2], outs[:1], rows_macs=outs[0].size * ins[1].size // ins[1].shape[3])[0]
    + 2 * outs[0].size, sum(t.nbytes for t in (*ins, *outs))))

# ---------------------------------------------------------------- conv2d_bias_act_pool
# conv2d_bias_act followed by a 2x2 max pool of stride 2 with its argmax (ops/pool.py
# max_pool2d_argmax) that is its output's only reader: each block of images is convolved,
# biased, activated and pooled while in cache, and only the pooled values and their argmax
# are written (the tutorial CNN's first layer: its 22 MB activation never is). The same
# bits as the two ops. passes/epilogue.py makes it after the argmax rewrite.

conv2d_bias_act_pool_p = Op("conv2d_bias_act_pool", num_outputs=2, cost_kind="matmul",
                            differentiable=False)


@conv2d_bias_act_pool_p.def_shape
def _conv2d_bias_act_pool_shape(x, f, *bias, strides, padding, dilations, act, has_bias,
                                members):
    if act not in ("none", "relu"):
        raise ValueError(f"conv2d_bias_act_pool: act must be 'none' or 'relu', got {act!r}")
    (out,) = _conv2d_bias_act_shape(x, f, *bias, strides=strides, padding=padding,
                                    dilations=dilations, act=act, has_bias=has_bias,
                                    keep=False, members=members)
    return max_pool2d_argmax_p.out_types(out, **POOL)


def conv2d_bias_act_pool_out(xp, outs, x, f, *bias, strides, padding, dilations, act,
                             has_bias, members, forms: EpilogueForms | None = None):
    """outs = (pooled y, argmax idx): per block of images, conv2d_bias_act's output pass
    into a scratch block, then the pool of that block."""
    forms = forms or generic_forms(xp)
    y, idx = outs
    b = bias[0] if bias else None
    out_hw, _ = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                padding, "")

    def finish(part, rows):
        _finish(forms, rows, rows, b, act)
        forms.pool_argmax(rows.reshape(part.stop - part.start, *out_hw, f.shape[3]), y[part],
                          idx[part])

    conv2d_blocks(xp, None, x, f, finish, strides=strides, padding=padding,
                  dilations=dilations)


conv2d_bias_act_pool_p.def_out(conv2d_bias_act_pool_out)
conv2d_bias_act_pool_p.def_impl(_impl_from_out(_conv2d_bias_act_pool_shape,
                                               conv2d_bias_act_pool_out))
conv2d_bias_act_pool_p.def_cost(lambda ins, outs, **_: (
    2 * 4 * outs[0].size * ins[1].size // ins[1].shape[3] + 10 * outs[0].size,
    sum(t.nbytes for t in (*ins, *outs))))


# ---------------------------------------------------------------- relu_grad_bias_sum
# dz = relu_grad(ct, y) and db = dz summed over every axis but the last (the bias
# gradient), in one pass over ct and y: the sum reads no dz back (the tutorial CNN's first
# layer: 22 MB at batch 256, 2.6 ms for the sum alone on 2 cores). The column sums run in
# blocks of SUM_ROWS rows, each summed row by row from zero, then the blocks' sums in
# order: a fixed order whatever the thread count, which the numpy twin repeats.

SUM_ROWS = 1024

relu_grad_bias_sum_p = Op("relu_grad_bias_sum", num_outputs=2, cost_kind="elementwise",
                          differentiable=False)


@relu_grad_bias_sum_p.def_shape
def _relu_grad_bias_sum_shape(ct, y, *, members):
    relu_grad_p.out_types(ct, y)
    if ct.ndim < 1:
        raise ShapeError(f"relu_grad_bias_sum: needs rank >= 1, got ct:{ct}")
    return ct, ArrayType(ct.shape[-1:], ct.dtype)


def relu_grad_sum_numpy(xp, dz, db, ct, y) -> None:
    """dz = relu_grad(ct, y) and db = its column sums, in the kernel's order (blocks of
    SUM_ROWS rows, each summed row after row from zero, then the blocks in order): numpy's
    reduce over axis 0 of a C-contiguous block adds row after row, so the twin of
    kernels/epilogue.py relu_grad_sum_cpu gives its bits."""
    o = dz.shape[-1]
    d2, c2, y2 = dz.reshape(-1, o), ct.reshape(-1, o), y.reshape(-1, o)
    # ct where y > 0, else +0.0, as bits: ct's bits AND all-ones or zero (numpy's masked
    # copy or where takes 22 ms on the tutorial's 22 MB first activation, this 3 ms)
    ints = xp.dtype(f"i{dz.itemsize}")
    keep = xp.negative((y2 > 0).astype(ints))
    xp.bitwise_and(c2.view(ints), keep, out=d2.view(ints))
    whole, tail = divmod(d2.shape[0], SUM_ROWS)
    partial = xp.zeros((max(1, whole + (tail > 0)), o), dz.dtype)
    if whole:       # every full block in one reduce: axis 1 of (blocks, SUM_ROWS, O)
        xp.add.reduce(d2[:whole * SUM_ROWS].reshape(whole, SUM_ROWS, o), axis=1,
                      out=partial[:whole])
    if tail:
        xp.add.reduce(d2[whole * SUM_ROWS:], axis=0, out=partial[whole])
    xp.add.reduce(partial, axis=0, out=db)


@relu_grad_bias_sum_p.def_out
def relu_grad_bias_sum_out(xp, outs, ct, y, *, members,
                            forms: EpilogueForms | None = None):
    (forms or generic_forms(xp)).relu_grad_sum(*_outputs(outs), ct, y)


@relu_grad_bias_sum_p.def_impl
def _relu_grad_bias_sum_impl(xp, ct, y, *, members):
    dz, db = xp.empty(ct.shape, ct.dtype), xp.empty(ct.shape[-1:], ct.dtype)
    relu_grad_bias_sum_out(xp, (dz, db), ct, y, members=members)
    return dz, db


relu_grad_bias_sum_p.def_cost(lambda ins, outs, **_: (
    2 * outs[0].size, sum(t.nbytes for t in (*ins, *outs))))

# ---------------------------------------------------------------- conv2d_backprop_filter_pooled
# conv2d_backprop_filter(x, max_pool2d_grad_argmax(idx, g)) for a 2x2 max pool of stride 2
# (VALID) over the convolution's output: on the CPU one pass that makes each group of
# outputs' dy from the pool's argmax and gradient as it adds their products into the filter
# gradient (kernels/conv_filter.py), never writing dy (the tutorial CNN's first layer: 22
# MB at batch 256). passes/epilogue.py makes it where the pool's gradient is read only by
# the filter gradient (a first layer: no input gradient) and the filter gradient runs as
# kernels/conv_filter.py's groups.

conv2d_backprop_filter_pooled_p = Op("conv2d_backprop_filter_pooled", cost_kind="matmul",
                                     differentiable=False)


@conv2d_backprop_filter_pooled_p.def_shape
def _pooled_filter_grad_shape(x, idx, g, *, input_size, filter_size, strides, padding,
                              dilations, members):
    dy = max_pool2d_grad_argmax_p.out_types(idx, g, input_size=input_size, **POOL)
    return conv2d_backprop_filter_p.out_types(x, dy, filter_size=filter_size, strides=strides,
                                              padding=padding, dilations=dilations)


def pooled_filter_grad_out(xp, dw, x, idx, g, *, input_size, members, **conv) -> None:
    """The two ops one after the other: the reference the CPU kernel gives the bits of."""
    dy = max_pool2d_grad_argmax_p.impl(xp, idx, g, input_size=input_size, **POOL)
    conv2d_backprop_filter_p.out_impl(xp, dw, x, dy, **conv)


conv2d_backprop_filter_pooled_p.def_out(pooled_filter_grad_out)


@conv2d_backprop_filter_pooled_p.def_impl
def _pooled_filter_grad_impl(xp, x, idx, g, *, filter_size, **params):
    dw = xp.empty((*filter_size, x.shape[3], g.shape[3]), x.dtype)
    pooled_filter_grad_out(xp, dw, x, idx, g, filter_size=filter_size, **params)
    return dw


conv2d_backprop_filter_pooled_p.def_cost(lambda ins, outs, **p: (
    2 * 4 * ins[2].size * outs[0].size // outs[0].shape[3],
    sum(t.nbytes for t in (*ins, *outs))))
