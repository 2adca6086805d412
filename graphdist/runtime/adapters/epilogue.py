"""Kernel adapters of the fused epilogues (ops/epilogue.py, made by passes/epilogue.py) on the
CPU: the matmul's or convolution's GEMM as numpy runs it, then the bias add and activation
on each block of rows while it is in cache as one parallel Numba pass (kernels/conv.py
bias_act_cpu, kernels/gelu.py), and relu's gradient with the bias gradient's column sum
in one pass (kernels/epilogue.py). Each twin runs the same loops with the kernels' numpy
twins (ops/conv.py bias_act_numpy, kernels/gelu_numpy.py, ops/epilogue.py
relu_grad_sum_numpy): the same bits with nothing to load."""

from __future__ import annotations

import importlib

import numpy as np

from graphdist.runtime.adapters.registry import register_kernel


def _forms(twin: bool):
    """The EpilogueForms of the Numba kernels, or with twin=True of their numpy twins;
    operands a kernel refuses run the op's generic form."""
    from graphdist.ops.conv import bias_act_numpy
    from graphdist.ops.epilogue import SUM_ROWS, EpilogueForms, generic_forms, relu_grad_sum_numpy

    generic = generic_forms(np)
    gelu_module = importlib.import_module(
        "graphdist.kernels.gelu_numpy" if twin else "graphdist.kernels.gelu")

    def gelu(x, out, approximate):
        if not gelu_module.gelu_cpu(x, out, approximate):
            generic.gelu(x, out, approximate)

    if twin:
        return EpilogueForms(lambda rows, bias, relu: bias_act_numpy(np, rows, bias, relu),
                             gelu, lambda dz, db, ct, y: relu_grad_sum_numpy(np, dz, db, ct, y),
                             generic.pool_argmax)
    from graphdist.kernels.conv import bias_act_cpu
    from graphdist.kernels.epilogue import relu_grad_sum_cpu
    from graphdist.kernels.pool import max_pool_argmax_cpu

    def bias_act(rows, bias, relu):
        if rows.flags.c_contiguous:
            bias_act_cpu(rows, bias, relu)
        else:
            generic.bias_act(rows, bias, relu)

    def relu_grad_sum(dz, db, ct, y):
        if not relu_grad_sum_cpu(dz, db, ct, y, SUM_ROWS):
            relu_grad_sum_numpy(np, dz, db, ct, y)

    def pool_argmax(a, y, idx):
        max_pool_argmax_cpu(a, y, idx, (2, 2), (2, 2), (0, 0))

    return EpilogueForms(bias_act, gelu, relu_grad_sum, pool_argmax)


def _outputs_of(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def _part_of(outs, part):
    """The outputs' rows of `part` of the batch, in the form the op's out-form takes."""
    return tuple(o[part] for o in outs) if isinstance(outs, tuple) else outs[part]


def _adapters(op_name: str, runner: str, by_images: bool = False) -> tuple:
    """(kernel form, numpy twin) of `op_name`: ops/epilogue.py `runner` with the Numba
    forms or their twins (each made on first call: importing this loads no Numba)."""
    made: dict = {}

    def with_forms(twin):
        def run(outs, *ins, **params):
            if twin not in made:
                made[twin] = _forms(twin)
                made["runner"] = getattr(importlib.import_module("graphdist.ops.epilogue"),
                                         runner)
            fn = made["runner"]        # looked up once: 16 calls a step of the digits MLP
            if by_images:        # each image's rows on their own: split over the cores
                from graphdist.device.threads import split_batch

                first = outs[0] if isinstance(outs, tuple) else outs
                split_batch(first.shape[0], lambda part: fn(
                    np, _part_of(outs, part), ins[0][part], *ins[1:], forms=made[twin],
                    **params), sum(o.nbytes for o in _outputs_of(outs)))
                return
            fn(np, outs, *ins, forms=made[twin], **params)

        run.__name__ = run.__qualname__ = f"{op_name}_{'numpy' if twin else 'cpu'}"
        return run

    return with_forms(False), with_forms(True)


for _op, _runner, _by_images in (("matmul_bias_act", "matmul_bias_act_out", False),
                                 ("conv2d_bias_act", "conv2d_bias_act_out", True),
                                 ("conv2d_bias_act_pool", "conv2d_bias_act_pool_out", True),
                                 ("relu_grad_bias_sum", "relu_grad_bias_sum_out", False)):
    _kernel, _twin = _adapters(_op, _runner, _by_images)
    register_kernel(_op, kind="cpu", out=True, numpy=_twin, exact=True)(_kernel)

