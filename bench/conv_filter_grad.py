"""conv2d's filter gradient alone at the tutorial CNN's two layers (batch 64: one replica's
share; 256: one device), interleaved: the former form (the whole batch's patches, then one
GEMM summing over every row), the op's form (patches of PATCH_BYTES at a time, one GEMM per
piece added into dw in order), and that form at other piece sizes; the forward pass (made
the same way, its rows written per piece) at the same piece sizes beside it. Then the whole
one-device CNN step (bench/cnn.py) compiled with either filter gradient, interleaved.

    python -m bench.conv_filter_grad [--repeat N]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from bench.common import interleaved, save, table
from graphdist.ops import OPS, conv
from graphdist.ops.window import window_geometry

LAYERS = {"conv1 28x28x1->32": (28, 1, 32), "conv2 13x13x32->64": (13, 32, 64)}
PIECES = (1 << 20, 2 << 20, 8 << 20)               # besides the default PATCH_BYTES
P = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}
KEY = ("cpu", "conv2d_backprop_filter")

_KEPT: dict = {}        # (shape, layout) -> the former form's patches, kept across calls


def kept_im2col(x, k_hw, strides, dilations, out_hw, pads):
    """ops/conv.py's _im2col, copied into a buffer kept across calls: glibc maps blocks of
    32 MiB and more afresh on each allocation here (page faults: 3.2 against 1.6 ms for the
    36 MB copy), which the former op did not pay inside a training step."""
    if any(p for pair in pads for p in pair):
        x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    n, c = x.shape[0], x.shape[3]
    sn, sh, sw, sc = x.strides
    win = np.lib.stride_tricks.as_strided(
        x, (n, *out_hw, *k_hw, c),
        (sn, sh * strides[0], sw * strides[1], sh * dilations[0], sw * dilations[1], sc))
    rows, depth = n * out_hw[0] * out_hw[1], k_hw[0] * k_hw[1] * c
    if c < conv.FEW_CHANNELS:
        win = win.transpose(3, 4, 5, 0, 1, 2)
    kept = _KEPT.setdefault((win.shape, c < conv.FEW_CHANNELS), np.empty(win.shape, x.dtype))
    np.copyto(kept, win)
    return kept.reshape(depth, rows).T if c < conv.FEW_CHANNELS else kept.reshape(rows, depth)


def one_product(dw, x, dy, *, filter_size, strides, padding, dilations):
    """The former filter gradient: the whole batch's patches (36 MB for the second layer at
    batch 256), then one GEMM (KH*KW*C, rows) @ (rows, O)."""
    out_hw, pads = window_geometry("", x.shape[1:3], filter_size, strides, dilations,
                                   padding, "")
    cols = kept_im2col(x, filter_size, strides, dilations, out_hw, pads)
    np.matmul(cols.T, dy.reshape(-1, dy.shape[3]), out=dw.reshape(-1, dy.shape[3]))


def in_pieces(op, nbytes):
    """The op's own form with PATCH_BYTES set to `nbytes` for the call."""
    def run(out, *ins, **params):
        default, conv.PATCH_BYTES = conv.PATCH_BYTES, nbytes
        try:
            OPS[op].out_impl(np, out, *ins, **params)
        finally:
            conv.PATCH_BYTES = default
    return run


def contenders(op):
    """{name: fn(out, *ins, **params)}, the baseline first."""
    mib = conv.PATCH_BYTES >> 20
    if op == "conv2d":
        forms = {"one piece": in_pieces(op, 1 << 40),
                 f"pieces of {mib} MiB (the op)": functools.partial(OPS[op].out_impl, np)}
    else:
        forms = {"former: one GEMM over the batch": one_product,
                 f"pieces of {mib} MiB (the op)": functools.partial(OPS[op].out_impl, np)}
    forms.update({f"pieces of {n >> 20} MiB": in_pieces(op, n) for n in PIECES})
    return forms


def timed_forms(x, dy, f, repeat: int, label: str) -> list:
    """[[op, form, timing, baseline timing]] for both ops at one shape, checked against the
    baseline and timed interleaved."""
    fns, base = {}, {}
    for op, out, ins, params in (
            ("conv2d_backprop_filter", np.empty_like(f), (x, dy), {"filter_size": (3, 3)}),
            ("conv2d", np.empty_like(dy), (x, f), {})):
        want = None
        for name, fn in contenders(op).items():
            fn(out, *ins, **params, **P)
            want = out.copy() if want is None else want
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)
            fns[op, name] = functools.partial(fn, out, *ins, **params, **P)
            base.setdefault(op, (op, name))
    t = interleaved(fns, repeat, label=label)
    return [[op, name, r, t[base[op]]] for (op, name), r in t.items()]


def steps(repeat: int) -> dict:
    """The tutorial CNN's one-device step lowered with the former form as its CPU filter
    gradient, and with the op's, timed side by side. The former keeps its patch buffer: one
    it allocated afresh on every call (36 MB, mapped anew by glibc, page faults) slowed the
    other step's GEMMs too (the op's filter gradient 6.7 -> 9.8 ms)."""
    from bench.models import cnn_steps_with

    return cnn_steps_with(KEY, {"former: one GEMM over the batch": one_product,
                                "pieces (the op)": None}, repeat)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (64, 256):
        for layer, (hw, c, o) in LAYERS.items():
            x = rng.standard_normal((batch, hw, hw, c)).astype(np.float32)
            dy = rng.standard_normal((batch, hw - 2, hw - 2, o)).astype(np.float32)
            f = rng.standard_normal((3, 3, c, o)).astype(np.float32)
            rows += [[layer, batch, op, name, r["median_s"] * 1e3, r["min_s"] * 1e3,
                      b["median_s"] / r["median_s"]]
                     for op, name, r, b in timed_forms(x, dy, f, args.repeat,
                                                       f"{layer} batch {batch}")]
    text = table(f"conv2d_backprop_filter and conv2d alone, float32, 3x3 VALID (median of "
                 f"{args.repeat}, interleaved)", ["layer", "batch", "op", "form", "median ms",
                                                  "min ms", "speed-up vs first"], rows)
    t = steps(args.repeat)
    step_text = table(f"tutorial CNN one-device step, batch 256, with either filter gradient "
                      f"(median of {args.repeat}, interleaved)",
                      ["form", "median ms", "min ms"],
                      [[k, r["median_s"] * 1e3, r["min_s"] * 1e3] for k, r in t.items()])
    save("conv_filter_grad", {"rows": [dict(zip(("layer", "batch", "op", "form", "median_ms",
                                                "min_ms", "speedup"), r)) for r in rows],
                              "steps": t, "table": text + "\n\n" + step_text})
    return rows


if __name__ == "__main__":
    main()
