"""The tutorial CNN (Conv2D 32 3x3 relu, MaxPool, Conv2D 64 3x3 relu, MaxPool, Flatten,
Dense 64 relu, Dense 10) on 28x28x1 inputs, global batch 256, Adam: graphdist on one device
against TensorFlow (tf.function), JAX (jit) and PyTorch (eager), and on 4 logical CPU
devices (one copy per device, the default) against TF MirroredStrategy and JAX pmap, in
one run; merged replicas (opt-in) beside them, and graphdist's steps in fresh processes as
the peers run. Then the conv ops alone: GFLOP/s of the forward and both backward
convolutions against this machine's sgemm, measured in the run. Target: graphdist at least
as fast as the fastest peer on 1 device and on 4 (the table's footer). A peer that is not
installed gets a row saying so. The run drops the environment's OpenBLAS pin
(OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE) by running itself again without it, as on a user's
machine, and says so; the peers start without it too.

    python -m bench.cnn [--no-peers] [--repeat N]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import graphdist as gd
from bench.common import (add_peer_arguments, fresh_process_rows, peer_python, run_peer, save,
                          table, unpinned_rerun, versus_best_peer, versus_text)
from bench.models import graphdist_side_by_side, make_cnn_step
from bench.peers.common import CNN_BATCH, cnn_data
from graphdist.ops import OPS
from graphdist.runtime.adapters.nn import conv2d_backprop_input_cpu

PEERS = [("bench.peers.jax_cnn", 1), ("bench.peers.tf_cnn", 1), ("bench.peers.torch_cnn", 1),
         ("bench.peers.jax_cnn", 4), ("bench.peers.tf_cnn", 4)]


def steps(repeat: int) -> tuple[dict, float]:
    x, y = cnn_data()
    return graphdist_side_by_side(make_cnn_step, (x, y), repeat)


GROUPS = {"conv2d_bias_act": "conv2d", "conv2d_bias_act_pool": "conv2d",
          "conv2d_backprop_filter_pooled": "conv2d_backprop_filter",
          "max_pool2d_argmax": "max_pool2d", "max_pool2d_grad_argmax": "max_pool2d_grad",
          "relu": "relu and its gradient", "relu_grad": "relu and its gradient",
          "greater": "relu and its gradient",
          "where": "relu and its gradient", "add": "bias add and its gradient",
          "reduce_sum": "bias add and its gradient"}


def op_profile(repeat: int = 5) -> dict:
    """graphdist's one-device step, per op (ms, from f.profile after a warm-up), grouped as
    bench/peers/tf_cnn_ops.py times TensorFlow's ops."""
    x, y = cnn_data()
    step, _ = make_cnn_step(gd.OneDeviceStrategy("cpu:0"))
    for _ in range(2):
        step.profile((x, y))               # the profiled program's first runs touch its pages
    totals: dict = {}
    for _ in range(repeat):
        for e in step.profile((x, y))["traceEvents"]:
            if e.get("ph") == "X":
                name = GROUPS.get(e["name"], e["name"])
                totals[name] = totals.get(name, 0.0) + e["dur"] / 1e3 / repeat
    return totals


def sgemm_gflops(n: int = 1024, repeat: int = 10) -> float:
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, a, out=out)
    best = min(_timed(lambda: np.matmul(a, a, out=out)) for _ in range(repeat))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def conv_gflops(batch: int, repeat: int = 20) -> list:
    """GFLOP/s of conv2d and its two backward ops on the tutorial's two layers, each as the
    CPU runtime runs it (the gradients: their kernels, bench/conv_input_grad.py and
    kernels/conv_filter.py)."""
    from graphdist.runtime import kernel_table

    filter_grad = kernel_table.entry("cpu", "conv2d_backprop_filter").out
    rng = np.random.default_rng(0)
    p = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}
    rows = []
    for name, (hw, c, o) in {"conv1 28x28x1->32": (28, 1, 32),
                             "conv2 13x13x32->64": (13, 32, 64)}.items():
        x = rng.random((batch, hw, hw, c), dtype=np.float32)
        f = rng.random((3, 3, c, o), dtype=np.float32)
        y = OPS["conv2d"].impl(np, x, f, **p)
        dy = rng.random(y.shape, dtype=np.float32)
        flops = 2 * y.size * 9 * c
        cases = {"forward": lambda: OPS["conv2d"].impl(np, x, f, **p),
                 "backprop input": lambda: conv2d_backprop_input_cpu(
                     np.empty_like(x), dy, f, input_size=(hw, hw), **p),
                 "backprop filter": lambda: filter_grad(
                     np.empty_like(f), x, dy, filter_size=(3, 3), **p)}
        for what, fn in cases.items():
            fn()
            best = min(_timed(fn) for _ in range(repeat))
            rows.append((name, what, best, flops / best / 1e9))
    return rows


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser()
    add_peer_arguments(ap)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if unpinned_rerun("bench.cnn", argv):
        return {}
    t, diff = steps(args.repeat)
    base = t["graphdist 1 device"]["median_s"]
    entry = {name: {**r, "vs_graphdist_1": r["median_s"] / base} for name, r in t.items()}
    entry.update(fresh_process_rows("bench.peers.graphdist_cnn", PEERS, base, args.no_peers,
                                    args.rounds))
    rows = [_row(name, r) for name, r in entry.items()]
    text = table(f"tutorial CNN, 28x28x1, global batch {CNN_BATCH}, Adam (median of "
                 f"{args.repeat}; max |param diff| 4 vs 1 device after 3 steps: {diff:.1e}; "
                 "every contender starts from the same weights and batch)",
                 ["contender", "median ms", "min ms", "vs graphdist 1 dev", "first call s",
                  "loss 1", "loss 3"], rows)
    targets = versus_best_peer(entry)
    if targets:
        print(versus_text(targets) + "\n")
        text += "\n" + versus_text(targets)
    ours = op_profile()
    ran = "TF tf.function" in entry             # tf_cnn.py ran (so TF is installed)
    theirs = run_peer(peer_python(), "bench.peers.tf_cnn_ops") if ran else None
    names = sorted(ours, key=lambda k: -ours[k])[:9]
    ops_text = table("one-device step per op, ms: graphdist's profile next to TensorFlow's ops "
                     "timed alone at the same shapes (TF fuses some of them in its step; "
                     "graphdist's conv2d row holds its fused bias adds, relus and 2x2 pools "
                     "(conv2d_bias_act_pool), its filter gradient row the first layer's "
                     "pool gradient (conv2d_backprop_filter_pooled))",
                     ["op", "graphdist ms", "TF ms"],
                     [[k, ours[k], "" if not theirs or k not in theirs["ops_s"]
                       else theirs["ops_s"][k] * 1e3] for k in names])
    peak = sgemm_gflops()
    convs = conv_gflops(CNN_BATCH // 4) + conv_gflops(CNN_BATCH)
    conv_text = table(f"conv ops alone (float32, best of 20) against sgemm 1024^3 = "
                      f"{peak:.0f} GFLOP/s",
                      ["layer", "op", "batch", "ms", "GFLOP/s", "of sgemm"],
                      [[layer, op, CNN_BATCH // 4 if k < len(convs) // 2 else CNN_BATCH,
                        s * 1e3, g, g / peak] for k, (layer, op, s, g) in enumerate(convs)])
    save("cnn", {"results": entry, "versus_best_peer": targets,
                 "max_param_diff_after_3_steps": diff, "sgemm_gflops": peak,
                 "openblas_pin": "dropped (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset)",
                 "ops_ms": ours, "tf_ops_ms": theirs and {k: v * 1e3 for k, v in
                                                         theirs["ops_s"].items()},
                 "convs": [dict(zip(("layer", "op", "seconds", "gflops"), c)) for c in convs],
                 "table": text + "\n\n" + ops_text + "\n\n" + conv_text})
    return entry


def _row(name: str, r: dict) -> list:
    """A contender's row of the steps table: its timing and first and third losses, or why
    it did not run."""
    if "status" in r:
        return [name, r["status"], "", "", "", "", ""]
    losses = r.get("losses") or []
    return [name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["vs_graphdist_1"],
            "" if r.get("first_call_s") is None else f"{r['first_call_s']:.2f}",
            *(f"{losses[i]:.5f}" if len(losses) > i else "" for i in (0, 2))]


DEFAULT = "graphdist Mirrored x4 (default: per-device)"


def plot(payload):
    """ms per step of every contender (graphdist's default outlined), and the conv ops
    alone in GFLOP/s against the sgemm probe (the bound a conv lowered to matmuls meets)."""
    from bench.plots import GRAPHDIST, bars, figure, grouped, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    convs, peak = payload.get("convs") or [], payload.get("sgemm_gflops")
    fig, axes = figure(f"tutorial CNN, 28x28x1, global batch {CNN_BATCH}, Adam", width=11,
                       height=rows_height(len(medians)), ncols=2 if convs else 1)
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins, highlight=[DEFAULT])
    if convs:
        half = len(convs) // 2                      # per-replica batch first, then global
        series = {}
        for k, c in enumerate(convs):
            batch = CNN_BATCH // 4 if k < half else CNN_BATCH
            series.setdefault(f"batch {batch}", {})[f"{c['layer']} {c['op']}"] = c["gflops"]
        grouped(axes[1], series, "GFLOP/s of the conv op alone (best of 20)", "{:.0f}",
                colors=dict(zip(series, (GRAPHDIST, "#9ecae1"))))
        if peak:
            axes[1].axvline(peak, color="#ff7f0e", linestyle="--", linewidth=1,
                            label=f"sgemm 1024^3: {peak:.0f}")
            axes[1].legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0),
                           ncol=3, frameon=False)
    return fig


if __name__ == "__main__":
    main()
