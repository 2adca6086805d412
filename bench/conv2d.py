"""conv2d and its two gradients at the tutorial CNN's shapes (bench/models.py cnn_logits:
28x28x1 -> 32 and 13x13x32 -> 64, 3x3 VALID), each as the CPU runtime runs it, in GFLOP/s
against this machine's sgemm measured in the same run: a 1024^3 float32 matmul, and the
conv's own GEMM alone (the same M x K x N on contiguous operands, i.e. without im2col or
col2im). Then the first layer's forward with its bias + relu: the three ops as the step
runs them against kernels/conv.py's direct kernel with the epilogue fused, interleaved.

    python -m bench.conv2d [--repeat N] [--batch 64 256]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from bench.common import interleaved, save, table
from graphdist.kernels.conv import bias_act_cpu, conv_direct_cpu
from graphdist.ops import OPS, conv
from graphdist.runtime.adapters.nn import conv2d_backprop_input_cpu

LAYERS = {"conv1 28x28x1->32": (28, 1, 32), "conv2 13x13x32->64": (13, 32, 64)}
P = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}


def op_forms(x, f, dy):
    """{op: fn()} of the three conv ops as the CPU runtime runs them (out-forms into kept
    buffers; the input gradient through its registered kernel), and the conv's GEMM alone."""
    hw, o = x.shape[1], f.shape[3]
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.empty_like(f)
    rows, depth = dy.size // o, f.size // o
    rng = np.random.default_rng(1)
    cols = rng.standard_normal((rows, depth), dtype=np.float32)
    gemm_out = np.empty((rows, o), np.float32)
    return {"forward": functools.partial(OPS["conv2d"].out_impl, np, y, x, f, **P),
            "input grad": functools.partial(conv2d_backprop_input_cpu, dx, dy, f,
                                            input_size=(hw, hw), **P),
            "filter grad": functools.partial(OPS["conv2d_backprop_filter"].out_impl, np, dw,
                                             x, dy, filter_size=(3, 3), **P),
            "its GEMM alone": functools.partial(np.matmul, cols, f.reshape(depth, o),
                                                out=gemm_out)}


def sgemm_form():
    """A 1024^3 float32 matmul, timed interleaved with each layer's ops: the machine's
    sgemm rate in the same moments (the best over the run is the reference)."""
    a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    return functools.partial(np.matmul, a, a, out=np.empty_like(a))


def op_rows(batch: int, repeat: int) -> tuple[list, float]:
    """Per layer and op: [layer, batch, op, median ms, min ms, GFLOP/s, its GEMM's time over
    the op's], and the best sgemm GFLOP/s seen."""
    peak = 0.0
    rng = np.random.default_rng(0)
    rows = []
    for layer, (hw, c, o) in LAYERS.items():
        x = rng.standard_normal((batch, hw, hw, c), dtype=np.float32)
        f = rng.standard_normal((3, 3, c, o), dtype=np.float32)
        dy = rng.standard_normal((batch, hw - 2, hw - 2, o), dtype=np.float32)
        flops = 2 * dy.size * 9 * c
        forms = {**op_forms(x, f, dy), "sgemm 1024^3": sgemm_form()}
        t = interleaved(forms, repeat, label=f"{layer} batch {batch}")
        peak = max(peak, 2 * 1024 ** 3 / t.pop("sgemm 1024^3")["min_s"] / 1e9)
        gemm = t["its GEMM alone"]["min_s"]
        for op, r in t.items():
            gflops = flops / r["min_s"] / 1e9
            rows.append([layer, batch, op, r["median_s"] * 1e3, r["min_s"] * 1e3, gflops,
                         gemm / r["min_s"]])
    return rows, peak


def epilogue_rows(batch: int, repeat: int) -> list:
    """Each layer's conv2d + bias + relu: the three ops as the step runs them (the op's
    im2col + GEMM, the bias add, relu's out-form: each a pass over the whole activation)
    against ops/conv.py's blocked im2col with the epilogue fused, and (few channels) the
    direct kernel with it fused; the forward alone in both forms beside them."""
    rng = np.random.default_rng(0)
    rows = []
    for layer, (hw, c, o) in LAYERS.items():
        x = rng.standard_normal((batch, hw, hw, c), dtype=np.float32)
        f = rng.standard_normal((3, 3, c, o), dtype=np.float32)
        b = rng.standard_normal(o, dtype=np.float32)
        y, z, fused = (np.empty((batch, hw - 2, hw - 2, o), np.float32) for _ in range(3))

        def three_ops(x=x, f=f, b=b, y=y, z=z):
            OPS["conv2d"].out_impl(np, y, x, f, **P)
            np.add(y, b, out=z)
            OPS["relu"].out_impl(np, y, z)

        forms = {"conv + bias add + relu: three ops": three_ops,
                 "blocked im2col + GEMM, bias + relu fused (numpy)": functools.partial(
                     conv.conv2d_bias_act_out, np, fused, x, f, b, True, **P),
                 "blocked im2col + GEMM, bias + relu fused (Numba pass)": functools.partial(
                     conv.conv2d_bias_act_out, np, fused, x, f, b, True, **P,
                     epilogue=bias_act_cpu)}
        if c < conv.FEW_CHANNELS:
            forms["direct kernel, bias + relu fused"] = functools.partial(
                conv_direct_cpu, x, f, fused, (1, 1), (1, 1), (0, 0), b, True)
            forms["conv alone: direct kernel"] = functools.partial(
                conv_direct_cpu, x, f, fused, (1, 1), (1, 1), (0, 0))
        forms["conv alone: im2col + GEMM (the op)"] = functools.partial(
            OPS["conv2d"].out_impl, np, z, x, f, **P)
        three_ops()
        for name, fn in forms.items():
            if "fused" in name:
                fn()
                np.testing.assert_allclose(fused, y, rtol=1e-4, atol=1e-3)
        t = interleaved(forms, repeat, label=f"{layer} epilogue batch {batch}")
        base = t["conv + bias add + relu: three ops"]["median_s"]
        rows += [[layer, batch, k, r["median_s"] * 1e3, r["min_s"] * 1e3,
                  base / r["median_s"]] for k, r in t.items()]
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args(argv)
    rows, peak = [], 0.0
    for batch in args.batch:
        more, best = op_rows(batch, args.repeat)
        rows, peak = rows + more, max(peak, best)
    rows = [[*r[:6], r[5] / peak, r[6]] for r in rows]
    text = table(f"conv ops alone, float32, 3x3 VALID, as the CPU runtime runs them (median "
                 f"and min of {args.repeat}, interleaved per layer; GFLOP/s from the min) "
                 f"against sgemm 1024^3 = {peak:.0f} GFLOP/s (best, timed among them) and the conv's "
                 f"own GEMM alone",
                 ["layer", "batch", "op", "median ms", "min ms", "GFLOP/s", "of sgemm",
                  "of its GEMM"], rows)
    epi = [r for batch in args.batch for r in epilogue_rows(batch, args.repeat)]
    epi_text = table(f"forward with bias + relu (median and min of {args.repeat}, "
                     f"interleaved)", ["layer", "batch", "form", "median ms", "min ms",
                                       "speed-up vs three ops (median)"], epi)
    print(text + "\n\n" + epi_text)
    save("conv2d", {"sgemm_gflops": peak,
                    "ops": [dict(zip(("layer", "batch", "op", "median_ms", "min_ms",
                                      "gflops", "of_sgemm", "of_gemm"), r)) for r in rows],
                    "epilogue": [dict(zip(("layer", "batch", "form", "median_ms", "min_ms",
                                           "speedup"), r)) for r in epi],
                    "table": text + "\n\n" + epi_text})
    return {"ops": rows, "epilogue": epi}


if __name__ == "__main__":
    main()
