"""The GPT training step of examples/gpt_chars.py (vocab 103, context 64, width 128, 2
pre-norm blocks of 4-head causal attention and an exact-GELU MLP, batch 32 x 64 tokens, Adam
lr 1e-3, no clipping): graphdist on one device against PyTorch (eager), JAX (jit) and
TensorFlow (tf.function), and on 4 logical CPU devices (one copy per device, the default)
against JAX pmap and TF MirroredStrategy, in one run; merged replicas (opt-in) beside them.
Every contender starts from the same weights and data (bench/peers/gpt_common.py); the
table shows each one's loss in its first and third step (a different model or optimizer
shows there). Then the one-device step per op group: graphdist's profile next to PyTorch's.
Target: graphdist at least as fast as the fastest peer in each row.

    python -m bench.gpt [--no-peers] [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import graphdist as gd
from bench.common import peer_python, run_peer, run_peers, save, table, unpinned_rerun
from bench.models import graphdist_side_by_side, make_gpt_step
from bench.peers.gpt_common import BATCH, CONTEXT, gpt_data, op_group

PEERS = [("bench.peers.jax_gpt", 1), ("bench.peers.tf_gpt", 1), ("bench.peers.torch_gpt", 1),
         ("bench.peers.jax_gpt", 4), ("bench.peers.tf_gpt", 4)]


def op_profile(repeat: int = 7, make=make_gpt_step, data=gpt_data) -> tuple[dict, dict]:
    """graphdist's one-device step (`make`'s, on data()): ms per op group and per op (each
    op's median over `repeat` runs of f.profile after a warm-up: other work on the machine
    skews a mean)."""
    batch = data()
    step, _ = make(gd.OneDeviceStrategy("cpu:0"))
    for _ in range(3):
        step.profile(batch)                # the profiled program's first runs touch its pages
    runs: dict = {}
    for k in range(repeat):
        for e in step.profile(batch)["traceEvents"]:
            if e.get("ph") == "X":
                runs.setdefault(e["name"], [0.0] * repeat)[k] += e["dur"] / 1e3
    ops = {name: statistics.median(ms) for name, ms in runs.items()}
    groups: dict = {}
    for name, ms in ops.items():
        groups[op_group(name)] = groups.get(op_group(name), 0.0) + ms
    return groups, ops


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if unpinned_rerun("bench.gpt", argv):          # as on a user's machine, saying so
        return {}
    t, diff = graphdist_side_by_side(make_gpt_step, gpt_data(), args.repeat)
    base = t["graphdist 1 device"]["median_s"]
    ref = t["graphdist 1 device"]["losses"]
    entry = {name: {**r, "vs_graphdist_1": r["median_s"] / base} for name, r in t.items()}
    entry.update(run_peers("bench.peers.graphdist_gpt", PEERS, base, args.no_peers))
    rows = []
    for name, r in entry.items():
        losses = r.get("losses") or []
        off = max((abs(a - b) / abs(b) for a, b in zip(losses, ref)), default=None)
        assert off is None or off < 1e-3, f"{name}: losses {losses}, graphdist's {ref}"
        rows.append([name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["vs_graphdist_1"],
                     "" if r.get("first_call_s") is None else f"{r['first_call_s']:.2f}",
                     f"{losses[0]:.5f}" if losses else "", f"{losses[2]:.5f}" if losses else "",
                     "" if off is None else f"{off:.0e}"])
    text = table(f"GPT step, batch {BATCH} x {CONTEXT} tokens, Adam (median of {args.repeat}; "
                 f"max |param diff| 4 vs 1 device after 3 steps: {diff:.1e})",
                 ["contender", "median ms", "min ms", "vs graphdist 1 dev", "first call s",
                  "loss 1", "loss 3", "loss rel diff"], rows)
    groups, ops = op_profile()
    python = None if args.no_peers else peer_python()
    torch = run_peer(python, "bench.peers.torch_gpt", "--profile") if python else None
    theirs = torch["ops_s"] if torch else {}
    ops_text = op_groups_table(groups, ops, theirs)
    save("gpt", {"results": entry, "max_param_diff_after_3_steps": diff, "ops_ms": ops,
                 "op_groups_ms": groups, "torch_op_groups_ms": {k: v * 1e3 for k, v in
                                                                theirs.items()},
                 "table": text + "\n\n" + ops_text})
    return entry


def op_groups_table(groups: dict, ops: dict, theirs: dict) -> str:
    """graphdist's op groups (ms) beside PyTorch's (seconds, torch_gpt.py --profile), and
    graphdist's ops that fall in no group."""
    names = sorted(set(groups) | set(theirs), key=lambda k: -groups.get(k, 0.0))
    other = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])
                      if op_group(k) == "other" and v >= 0.1)
    return table(f"one-device step per op group, ms: graphdist's profile next to "
                 f"PyTorch's (torch.profiler, self CPU time; its autograd engine counts as "
                 f"other)\ngraphdist's other ops, ms: {other}",
                 ["op group", "graphdist ms", "PyTorch ms"],
                 [[k, groups.get(k, ""), theirs[k] * 1e3 if k in theirs else ""]
                  for k in names] +
                 [["total", sum(groups.values()), sum(theirs.values()) * 1e3 or ""]])


DEFAULT = "graphdist Mirrored x4 (default: per-device)"


def plot(payload):
    """ms per step of every contender (graphdist's default outlined), and the one-device
    step per op group: graphdist's profile next to PyTorch's, where the time goes."""
    from bench.plots import bars, figure, grouped, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    ours, theirs = payload.get("op_groups_ms") or {}, payload.get("torch_op_groups_ms") or {}
    fig, axes = figure(f"GPT step, batch {BATCH} x {CONTEXT} tokens, Adam", width=11,
                       height=rows_height(len(medians)), ncols=2 if ours else 1)
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins, highlight=[DEFAULT])
    if ours:
        order = sorted(set(ours) | set(theirs), key=lambda k: -ours.get(k, 0.0))
        series = {"graphdist": {k: ours.get(k) for k in order}}
        if theirs:
            series["PyTorch eager"] = {k: theirs.get(k) for k in order}
        grouped(axes[1], series, "ms per one-device step, by op group (profilers)", "{:.1f}")
    return fig


if __name__ == "__main__":
    main()
