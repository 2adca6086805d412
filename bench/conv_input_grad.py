"""conv2d's input gradient alone at the tutorial CNN's two layers (batch 64: one replica's
share; 256: one device), interleaved: the former form (one GEMM per filter tap into strided
slices of dx), the op's numpy form (one GEMM into columns per 4 MiB of them, then one strided
add per tap) and the CPU kernel the runtime runs (the same GEMM, then a parallel Numba
col2im), the kernel also at other piece sizes (ops/conv.py PATCH_BYTES). Then the whole
one-device CNN step (bench/cnn.py) compiled with either form, interleaved.

    python -m bench.conv_input_grad [--repeat N]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from bench.common import interleaved, save, table
from graphdist.ops import OPS, conv
from graphdist.ops.window import taps, window_geometry
from graphdist.runtime.adapters.nn import conv2d_backprop_input_cpu

LAYERS = {"conv1 28x28x1->32": (28, 1, 32), "conv2 13x13x32->64": (13, 32, 64)}
PIECES = (1 << 20, 2 << 20, 8 << 20, 1 << 40)      # besides the default PATCH_BYTES
P = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}


def per_tap(dx, dy, f, *, input_size, strides, padding, dilations):
    """The former input gradient: per tap one GEMM dy @ f[i, j].T added into dx's strided
    slices (nine GEMMs with C columns each, nine passes over dx)."""
    n, oh, ow, o = dy.shape
    _, pads = window_geometry("", input_size, f.shape[:2], strides, dilations, padding, "")
    dx[...] = 0
    dy2, part = dy.reshape(-1, o), np.empty((n * oh * ow, f.shape[2]), dy.dtype)
    for (i, j), at_out, at_in in taps(f.shape[:2], strides, dilations, pads, input_size,
                                       (oh, ow)):
        np.matmul(dy2, f[i, j].T, out=part)
        dx[at_in] += part.reshape(n, oh, ow, -1)[at_out]


def kernel_in_pieces(nbytes):
    def run(dx, dy, f, **params):
        default, conv.PATCH_BYTES = conv.PATCH_BYTES, nbytes
        try:
            conv2d_backprop_input_cpu(dx, dy, f, **params)
        finally:
            conv.PATCH_BYTES = default
    return run


def contenders():
    mib = conv.PATCH_BYTES >> 20
    forms = {"former: per-tap GEMMs": per_tap,
             f"numpy form ({mib} MiB pieces)": functools.partial(
                 OPS["conv2d_backprop_input"].out_impl, np),
             f"Numba col2im ({mib} MiB pieces, the kernel)": conv2d_backprop_input_cpu}
    for nbytes in PIECES:
        name = "one piece" if nbytes >= 1 << 40 else f"{nbytes >> 20} MiB pieces"
        forms[f"Numba col2im ({name})"] = kernel_in_pieces(nbytes)
    return forms


def steps(repeat: int) -> dict:
    """The tutorial CNN's one-device step lowered with the former form as its CPU kernel,
    and with the kernel, timed side by side."""
    from bench.models import cnn_steps_with

    return cnn_steps_with(("cpu", "conv2d_backprop_input"),
                          {"former: per-tap GEMMs": per_tap,
                           "one GEMM + col2im (the kernel)": conv2d_backprop_input_cpu},
                          repeat)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (64, 256):
        for layer, (hw, c, o) in LAYERS.items():
            f = rng.standard_normal((3, 3, c, o)).astype(np.float32)
            dy = rng.standard_normal((batch, hw - 2, hw - 2, o)).astype(np.float32)
            dx = np.empty((batch, hw, hw, c), np.float32)
            want = np.empty_like(dx)
            per_tap(want, dy, f, input_size=(hw, hw), **P)
            fns = {}
            for name, fn in contenders().items():
                fn(dx, dy, f, input_size=(hw, hw), **P)
                np.testing.assert_allclose(dx, want, rtol=1e-4, atol=1e-4)
                fns[name] = functools.partial(fn, dx, dy, f, input_size=(hw, hw), **P)
            t = interleaved(fns, args.repeat, label=f"{layer} batch {batch}")
            base = t["former: per-tap GEMMs"]["median_s"]
            rows += [[layer, batch, name, r["median_s"] * 1e3, r["min_s"] * 1e3,
                      base / r["median_s"]] for name, r in t.items()]
    text = table(f"conv2d_backprop_input alone, float32, 3x3 VALID (median of {args.repeat}, "
                 f"interleaved)", ["layer", "batch", "form", "median ms", "min ms",
                                   "speed-up vs former"], rows)
    t = steps(args.repeat)
    step_text = table(f"tutorial CNN one-device step, batch 256, with either input gradient "
                      f"(median of {args.repeat}, interleaved)",
                      ["form", "median ms", "min ms"],
                      [[k, r["median_s"] * 1e3, r["min_s"] * 1e3] for k, r in t.items()])
    save("conv_input_grad", {"rows": [dict(zip(("layer", "batch", "form", "median_ms",
                                               "min_ms", "speedup"), r)) for r in rows],
                             "steps": t, "table": text + "\n\n" + step_text})
    return rows


if __name__ == "__main__":
    main()
