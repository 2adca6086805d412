"""The GPT-2-style training step of issue 29, beside bench/gpt.py's GPT: vocabulary 128,
context 64, width 128, 2 pre-LN blocks of 4-head causal attention with a fused qkv projection
and an additive -1e9 mask, GELU in its tanh form (approximate=True, as GPT-2 and BERT use
it), batch 32, Adam (bench/peers/gpt_common.py GPT2_MODEL; graphdist's step is
bench/models.py make_gpt2_step, written as GPT-2's code writes it).

Side by side in one run:
1. gelu on 2048 x 512 float32 values: the tanh form's kernel and gradient against the exact
   form's, and against what ran before (the op's float64 reference); a gelu returned by a
   step (its kernel into a fresh array; before: the reference).
2. The GPT-2-style step: graphdist on 1 device and on 4 logical CPU devices, with the tanh
   form on its kernels (after) and on the op's reference (before, the entry swapped for the
   run), the same model with its dense layers reshaped to 2-D GEMMs by hand (as gd.nn.Dense
   does), bench/gpt.py's GPT (exact GELU, vocabulary 103) on 1 device, graphdist's 1-device
   and 4-replica steps in fresh processes (first call; 4 replicas also on an empty Numba
   cache); then the peers, each
   in its own process of the benchmark environment's Python (bench/peers/*_gpt2.py): JAX jit,
   TF tf.function and PyTorch eager on 1 device, JAX pmap and TF MirroredStrategy on 4. All
   start from the same weights and batch: their losses after one and three steps must agree
   with graphdist's to float32 rounding (the table's last column), and their parameter
   counts are their own variables'. A peer that is not installed gets a row saying so.
3. The one-device step per op group: graphdist's profile next to PyTorch's.
Target: graphdist at most the best peer's time on 1 device and on 4 replicas: the table's
footer sets graphdist's fresh-process rows (as the peers run) and its interleaved rows
against the fastest peer at each device count.

The run drops the environment's OpenBLAS pin (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE) by
running itself again without it, as on a user's machine, and says so; the peers start
without it too.

    python -m bench.gpt2 [--no-peers] [--repeat N]
    python -m bench.gpt2 --replicas 30 --repeat 40   # 4 replicas' extra time, by op group
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import graphdist as gd
from bench.common import (add_peer_arguments, fresh_process_rows, interleaved, peer_python,
                          run_peer, save, table, unpinned_rerun, versus_best_peer,
                          versus_text)
from bench.gpt import op_groups_table, op_profile
from bench.models import make_gpt2_step, make_gpt_step
from bench.peers.gpt_common import GPT2_MODEL, gpt2_data, gpt2_init, gpt_data, parameter_count

SHAPE = (2048, 512)
PEERS = [("bench.peers.jax_gpt2", 1), ("bench.peers.tf_gpt2", 1),
         ("bench.peers.torch_gpt2", 1), ("bench.peers.jax_gpt2", 4),
         ("bench.peers.tf_gpt2", 4)]
ONE = "graphdist 1 device"
DEFAULT = "graphdist Mirrored x4 (default: per-device)"
LOSS_RTOL = 1e-3        # float32 rounding, and Adam's epsilon placed as each framework does


def _reference_gelu_entries():
    """The gelu and gelu_grad entries as they stood before issue 29: the tanh form on the
    op's float64 reference, the exact form on its kernel."""
    from graphdist.ops import OPS
    from graphdist.runtime import kernel_table

    entries = {}
    for name in ("gelu", "gelu_grad"):
        listed = kernel_table.entry("cpu", name)

        def before(out, *args, approximate, _listed=listed, _op=OPS[name]):
            if approximate:
                _op.out_impl(np, out, *args, approximate=True)
            else:
                _listed.out(out, *args, approximate=False)

        entries[name] = (listed, listed.replace(out=before, numpy_out=None, exact=False))
    return entries


def _built_with(entries, make, strategy, batch):
    """(make(strategy)'s step, its first loss): the step lowered (its first call) with these
    gelu entries in place."""
    from graphdist.runtime import kernel_table

    for listed, swapped in entries.values():
        kernel_table.register(swapped, replace=True)
    try:
        step, _ = make(strategy)
        first = float(step(batch))
    finally:
        for listed, _ in entries.values():
            kernel_table.register(listed, replace=True)
    return step, first


def gelu_part(repeat: int) -> tuple[dict, str]:
    from graphdist.kernels.gelu import gelu_cpu, gelu_grad_cpu
    from graphdist.ops import OPS

    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    ct = rng.standard_normal(SHAPE).astype(np.float32)
    out = np.empty_like(x)
    returned = gd.function(lambda x: gd.nn.gelu(x, approximate=True))
    reference = gd.function(lambda x: gd.nn.gelu(x, approximate=True))

    def returned_before():
        """The step as it ran before: a returned gelu on the op's reference impl, which is
        what a program without fused kernels runs (gd.function keys on that setting)."""
        gd.config.set_fused_kernels(False)
        try:
            return reference(x)
        finally:
            gd.config.set_fused_kernels(True)

    returned(x)
    returned_before()
    t = interleaved({
        "exact form, kernel": lambda: gelu_cpu(x, out, False),
        "tanh form, kernel (after)": lambda: gelu_cpu(x, out, True),
        "tanh form, float64 reference (before)":
            lambda: OPS["gelu"].out_impl(np, out, x, approximate=True),
        "exact form gradient, kernel": lambda: gelu_grad_cpu(ct, x, out, False),
        "tanh form gradient, kernel (after)": lambda: gelu_grad_cpu(ct, x, out, True),
        "tanh form gradient, float64 reference (before)":
            lambda: OPS["gelu_grad"].out_impl(np, out, ct, x, approximate=True),
        "returned by a step: its kernel, fresh array (after)": lambda: returned(x),
        "returned by a step: the reference (before)": returned_before,
    }, repeat=repeat, label="gelu")
    exact = {True: t["exact form, kernel"]["median_s"],
             False: t["exact form gradient, kernel"]["median_s"]}
    rows = [[k, v["median_s"] * 1e3, v["min_s"] * 1e3,
             v["median_s"] / exact["gradient" not in k]] for k, v in t.items()]
    text = table(f"gelu of {SHAPE[0]} x {SHAPE[1]} float32 (median of {repeat}, interleaved); "
                 "target: the tanh form within 1.5x of the exact form",
                 ["contender", "median ms", "min ms", "vs exact form's kernel"], rows)
    return t, text


def graphdist_part(repeat: int) -> dict:
    """graphdist's GPT-2-style steps (and bench/gpt.py's GPT) timed side by side in this
    process, each with its losses in its first three steps."""
    batch = gpt2_data()
    one = gd.OneDeviceStrategy("cpu:0")
    four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch4 = next(iter(four.experimental_distribute_dataset([batch])))
    before = _reference_gelu_entries()
    builds = {ONE: ({}, make_gpt2_step, one, batch),
              f"{ONE}, tanh gelu on the op's reference (before issue 29)":
                  (before, make_gpt2_step, one, batch),
              DEFAULT: ({}, make_gpt2_step, four, batch4),
              "graphdist Mirrored x4, tanh gelu on the reference (before)":
                  (before, make_gpt2_step, four, batch4),
              f"{ONE}, dense layers reshaped to 2-D by hand (as gd.nn.Dense)":
                  ({}, lambda s: make_gpt2_step(s, flat=True), one, batch),
              f"{ONE}: bench/gpt.py's GPT (exact gelu, vocab 103; not this model)":
                  ({}, make_gpt_step, one, gpt_data())}
    steps, losses = {}, {}
    for name, (entries, make, strategy, b) in builds.items():
        step, first = _built_with(entries, make, strategy, b)
        steps[name] = (step, b)
        losses[name] = [first] + [float(step(b)) for _ in range(2)]
    t = interleaved({k: (lambda s=s, b=b: s(b)) for k, (s, b) in steps.items()},
                    repeat=repeat, label="GPT-2-style step")
    count = parameter_count(p.shape for p in gpt2_init().values())
    for k in t:
        t[k]["losses"] = losses[k]
        if "bench/gpt.py" not in k:
            t[k]["parameters"] = count
    return t


def loss_off(losses: list, ref: list) -> float | None:
    """The largest relative difference of the first and third losses from graphdist's."""
    pairs = [(losses[i], ref[i]) for i in (0, 2) if len(losses) > i]
    return max((abs(a - b) / abs(b) for a, b in pairs), default=None)


def steps_table(entry: dict, repeat: int) -> str:
    """Every contender's timing, parameter count and losses, or why it did not run; the
    title says whether every loss agrees with graphdist's one-device step (the same model,
    weights, batch and optimizer), and the footer how graphdist stands against the fastest
    peer on 1 device and on 4."""
    ref = entry[ONE]["losses"]
    rows, off_model = [], []
    for name, r in entry.items():
        if "status" in r:
            rows.append([name, r["status"], "", "", "", "", "", "", ""])
            continue
        losses = r.get("losses") or []
        off = None if "bench/gpt.py" in name else loss_off(losses, ref)
        if off is not None and off > LOSS_RTOL:
            off_model.append(name)
        rows.append([name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["vs_graphdist_1"],
                     "" if r.get("first_call_s") is None else f"{r['first_call_s']:.2f}",
                     r.get("parameters", ""),
                     f"{losses[0]:.5f}" if losses else "",
                     f"{losses[2]:.5f}" if len(losses) > 2 else "",
                     "" if off is None else f"{off:.0e}"])
    verdict = (f"losses after 1 and 3 steps agree within {LOSS_RTOL:g}" if not off_model else
               f"NOT THE SAME MODEL: {', '.join(off_model)} (losses off by > {LOSS_RTOL:g})")
    if off_model:
        print(f"bench.gpt2: {verdict}", file=sys.stderr)
    text = table(f"GPT-2-style step, batch 32 x 64 tokens, Adam (median of {repeat}, "
                 f"graphdist's rows interleaved, the peers each in its own process; "
                 f"{verdict})",
                 ["contender", "median ms", "min ms", "vs graphdist 1 dev", "first call s",
                  "parameters", "loss 1", "loss 3", "loss rel diff"], rows)
    versus = versus_text(versus_best_peer(entry))
    if versus:
        print(versus + "\n")
    return text + ("\n" + versus if versus else "")


# what the 4-replica step spends beyond the one-device one, by kind of node
REPLICA_GROUPS = {
    "matmul": "GEMMs (matmul, matmul + bias + act)",
    "matmul_bias_act": "GEMMs (matmul, matmul + bias + act)",
    "adam_multi_update": "Adam (x4: fused with the all-reduce)",
    "host_reduce_update": "Adam (x4: fused with the all-reduce)",
    "host_all_reduce": "loss all-reduce and its wait",
    "collective_wait": "loss all-reduce and its wait",
    "layer_norm": "row kernels (layer norm, softmax, gelu grad)",
    "layer_norm_grad": "row kernels (layer norm, softmax, gelu grad)",
    "softmax": "row kernels (layer norm, softmax, gelu grad)",
    "softmax_grad": "row kernels (layer norm, softmax, gelu grad)",
    "gelu_grad": "row kernels (layer norm, softmax, gelu grad)",
}
SMALL_OPS = "small ops (reshape copies, concat, adds, sums, fused loops, ...)"


def _node_times(step, data) -> tuple[list, list, float]:
    """(op names, ms per node, ms from the first node's start to the last one's end) of one
    profiled step; a collective drawn on every replica's lane counts once."""
    seen, events = set(), []
    for e in step.profile(data)["traceEvents"]:
        once = (e.get("args", {}).get("node"), e.get("ts"))
        if e.get("ph") == "X" and once not in seen:
            seen.add(once)
            events.append(e)
    events.sort(key=lambda e: e["ts"])
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3
    return [e["name"] for e in events], [e["dur"] / 1e3 for e in events], span


def replicas_part(profiles: int, repeat: int) -> dict:
    """The one-device step against 4 replicas (8 sequences each) run in turn by one program
    (set_device_concurrency("sequential"): node times without the threads' contention):
    each node's least time over `profiles` profiled steps of each, the two alternating,
    summed per group of ops; the rest of the profiled span (between nodes: the program's
    own Python) as its own row; then the wall times, interleaved, of the one-device step,
    the 4 replicas in one program, and the 4 replicas a thread each (the default)."""
    batch = gpt2_data()
    steps = {}

    def made(replicas, mode="auto"):
        strategy = gd.OneDeviceStrategy("cpu:0") if replicas == 1 else \
            gd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
        gd.config.set_device_concurrency(mode)
        try:
            step, _ = make_gpt2_step(strategy)
            data = batch if replicas == 1 else \
                next(iter(strategy.experimental_distribute_dataset([batch])))
            step(data)
        finally:
            gd.config.set_device_concurrency("auto")
        return step, data

    steps = {1: made(1), 4: made(4, "sequential")}
    least, names, spans = {}, {}, {1: [], 4: []}
    for _ in range(profiles + 2):                   # the first two of each: warm-up
        for replicas, (step, data) in steps.items():
            names[replicas], ms, span = _node_times(step, data)
            least[replicas] = np.minimum(least.get(replicas, ms), ms)
            spans[replicas].append(span)
    groups: dict = {}
    for replicas in (1, 4):
        for name, ms in zip(names[replicas], least[replicas]):
            row = groups.setdefault(REPLICA_GROUPS.get(name, SMALL_OPS), {1: 0.0, 4: 0.0,
                                                                          "n1": 0, "n4": 0})
            row[replicas] += ms
            row[f"n{replicas}"] += 1
    between = {r: min(spans[r][2:]) - float(np.sum(least[r])) for r in (1, 4)}
    groups["between nodes (the program's Python; profiled)"] = {1: between[1], 4: between[4],
                                                               "n1": 0, "n4": 0}
    rows = [[g, v["n1"], v["n4"], v[1], v[4], v[4] - v[1]]
            for g, v in sorted(groups.items(), key=lambda kv: -(kv[1][4] - kv[1][1]))]
    rows.append(["sum", sum(r[1] for r in rows), sum(r[2] for r in rows),
                 *(sum(r[k] for r in rows) for k in (3, 4, 5))])
    default = made(4)
    t = interleaved({ONE: lambda: steps[1][0](steps[1][1]),
                     "graphdist Mirrored x4, one program": lambda: steps[4][0](steps[4][1]),
                     "graphdist Mirrored x4, a thread each (default)":
                         lambda: default[0](default[1])}, repeat,
                    label="gpt2 1 device vs 4 replicas")
    walls = {k: (v["median_s"] * 1e3, v["min_s"] * 1e3) for k, v in t.items()}
    table(f"GPT-2-style step, 1 device vs 4 replicas in one program (summed): ms per group, "
          f"each node's least of {profiles} profiled steps, alternating",
          ["group", "nodes x1", "nodes x4", "x1 ms", "x4 ms", "x4 - x1"], rows)
    wall = "wall, interleaved (median, min ms): " + "; ".join(
        f"{k} {a:.2f}, {b:.2f}" for k, (a, b) in walls.items())
    print(wall)
    return {"groups": rows, "wall_ms": walls}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    add_peer_arguments(ap)
    ap.add_argument("--replicas", type=int, default=0, metavar="PROFILES",
                    help="only what 4 replicas spend beyond 1 device, per group of ops, over "
                         "PROFILES profiled steps of each (printed, not saved)")
    args = ap.parse_args(argv)
    if unpinned_rerun("bench.gpt2", argv):
        return {}
    if args.replicas:
        return replicas_part(args.replicas, args.repeat)
    gelu, gelu_text = gelu_part(max(args.repeat, 20))
    t = graphdist_part(args.repeat)
    base = t[ONE]["median_s"]
    entry = {name: {**r, "vs_graphdist_1": r["median_s"] / base} for name, r in t.items()}
    entry.update(fresh_process_rows("bench.peers.graphdist_gpt2", PEERS, base, args.no_peers,
                                    args.rounds))
    steps_text = steps_table(entry, args.repeat)
    groups, ops = op_profile(make=make_gpt2_step, data=gpt2_data)
    ran = "PyTorch eager" in entry              # torch_gpt2.py ran (so torch is installed)
    torch = run_peer(peer_python(), "bench.peers.torch_gpt2", "--profile") if ran else None
    theirs = torch["ops_s"] if torch else {}
    ops_text = op_groups_table(groups, ops, theirs)
    save("gpt2", {"model": GPT2_MODEL.name, "gelu": gelu, "results": entry,
                  "versus_best_peer": versus_best_peer(entry),
                  "ops_ms": ops,
                  "op_groups_ms": groups,
                  "torch_op_groups_ms": {k: v * 1e3 for k, v in theirs.items()},
                  "openblas_pin": "dropped (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset)",
                  "table": "\n\n".join((gelu_text, steps_text, ops_text))})
    return entry


def plot(payload):
    """ms per step of every contender (graphdist's defaults outlined), the one-device step
    per op group beside PyTorch's, and the gelu kernels."""
    from bench.plots import bars, figure, grouped, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    ours, theirs = payload.get("op_groups_ms") or {}, payload.get("torch_op_groups_ms") or {}
    gelu_ms, _ = timings(payload.get("gelu", {}))
    panels = 1 + bool(ours) + bool(gelu_ms)
    fig, axes = figure("GPT-2-style step (tanh GELU, additive mask), batch 32 x 64 tokens, "
                       "Adam", width=5.5 * panels, height=rows_height(len(medians)),
                       ncols=panels)
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins,
         highlight=[ONE, DEFAULT])
    if ours:
        order = sorted(set(ours) | set(theirs), key=lambda k: -ours.get(k, 0.0))
        series = {"graphdist": {k: ours.get(k) for k in order}}
        if theirs:
            series["PyTorch eager"] = {k: theirs.get(k) for k in order}
        grouped(axes[1], series, "ms per one-device step, by op group (profilers)", "{:.1f}")
    if gelu_ms:
        bars(axes[-1], gelu_ms, f"gelu on {SHAPE[0]} x {SHAPE[1]} float32, ms (log)",
             log=True, colors={k: "#ff7f0e" if "before" in k else "#1f77b4" for k in gelu_ms})
    return fig


if __name__ == "__main__":
    main()
