"""The tutorial CNN step (bench/cnn.py, batch 256, Adam) with the epilogues stage
(passes/epilogue.py: bias + relu in each conv's and dense layer's output pass, relu's
gradient moved before the pool's and fused with the bias gradient's sum) on and off,
on one device and on 4 logical devices, timed interleaved in one run; then the
one-device step's per-op profile (`Function.profile`) in both forms, grouped as the
docs' CNN table groups TF's ops.

Then the GPT-2-style step (bench/gpt2.py: x @ w + b and tanh gelu on 3-D inputs) and the
MLP (bench/mirrored_mlp.py) the same way: the stage must not slow them down.

    python -m bench.epilogue [--repeat N] [--profiles N] [--models cnn gpt2 mlp]
"""

from __future__ import annotations

import argparse

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table
from bench.models import make_cnn_step, make_gpt2_step, make_step
from bench.peers.common import cnn_data, data
from bench.peers.gpt_common import gpt2_data
from graphdist import pipeline

GROUPS = {
    "conv2d": "conv forward", "conv2d_bias_act": "conv forward",
    "conv2d_backprop_filter": "conv filter grad", "conv2d_backprop_input": "conv input grad",
    "max_pool2d": "max pool", "max_pool2d_grad": "max pool grad",
    "add": "bias add, relu, their grads", "relu": "bias add, relu, their grads",
    "relu_grad": "bias add, relu, their grads", "reduce_sum": "bias add, relu, their grads",
    "relu_grad_bias_sum": "bias add, relu, their grads",
    "matmul": "dense (matmul)", "matmul_bias_act": "dense (matmul)",
    "adam_multi_update": "Adam",
}


def _strategy(replicas: int):
    return gd.OneDeviceStrategy("cpu:0") if replicas == 1 else \
        gd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


MODELS = {"cnn": (make_cnn_step, cnn_data), "gpt2": (make_gpt2_step, gpt2_data),
          "mlp": (make_step, data)}


def build(replicas: int, epilogues: bool, batch, make=make_cnn_step):
    """A compiled step (`make`, default the CNN's) with the epilogues stage on or off
    (everything else as usual)."""
    stage = pipeline.epilogues
    if not epilogues:
        pipeline.epilogues = lambda: []
    try:
        strategy = _strategy(replicas)
        step, _ = make(strategy)
        data = batch if replicas == 1 else \
            next(iter(strategy.experimental_distribute_dataset([batch])))
        step(data)
    finally:
        pipeline.epilogues = stage
    return lambda: step(data), step, data


def step_rows(repeat: int, model: str = "cnn") -> tuple[list, dict]:
    make, make_data = MODELS[model]
    batch = make_data()
    rows, made = [], {}
    for replicas in (1, 4):
        forms = {on: build(replicas, on, batch, make) for on in (True, False)}
        made[replicas] = forms
        t = interleaved({"on": forms[True][0], "off": forms[False][0]}, repeat,
                        label=f"{model} x{replicas} epilogues on/off")
        for name in ("off", "on"):
            rows.append([model, f"x{replicas}" if replicas > 1 else "1 device", name,
                         t[name]["median_s"] * 1e3, t[name]["min_s"] * 1e3,
                         t[name]["median_s"] / t["off"]["median_s"]])
    return rows, made


def profile_rows(made: dict, profiles: int) -> list:
    """Per op group, ms per step: the least over `profiles` profiled steps of each form,
    alternating (on this shared VM a neighbour's burst inflates a few steps' GEMMs
    tenfold; the least is the steadier figure), and the mean beside it."""
    seen = {True: {}, False: {}}
    for on in (True, False):
        _, step, data = made[1][on]
        for _ in range(2):
            step.profile(data)
    for _ in range(profiles):
        for on in (True, False):
            _, step, data = made[1][on]
            one: dict = {}
            for e in step.profile(data)["traceEvents"]:
                if e.get("ph") == "X":
                    group = GROUPS.get(e["name"], "other")
                    one[group] = one.get(group, 0.0) + e["dur"] / 1e3
            for group, ms in one.items():
                seen[on].setdefault(group, []).append(ms)
    least = {on: {k: min(v) for k, v in seen[on].items()} for on in seen}
    mean = {on: {k: sum(v) / len(v) for k, v in seen[on].items()} for on in seen}
    groups = sorted(set(least[True]) | set(least[False]),
                    key=lambda g: -least[False].get(g, 0.0))
    rows = [[g, least[False].get(g, 0.0), least[True].get(g, 0.0), mean[False].get(g, 0.0),
             mean[True].get(g, 0.0)] for g in groups]
    rows.append(["sum", *(sum(r[k] for r in rows) for k in range(1, 5))])
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--profiles", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["cnn"], choices=sorted(MODELS))
    args = ap.parse_args(argv)
    rows, made = [], None
    for model in args.models:
        more, built = step_rows(args.repeat, model)
        rows += more
        made = built if model == "cnn" else made
    text = table(f"steps, epilogues stage on vs off (median and min of {args.repeat}, "
                 f"interleaved)", ["model", "devices", "epilogues", "median ms", "min ms",
                                   "vs off (median)"], rows)
    print(text)
    if made is None:
        save("epilogue", {"steps": rows, "table": text})
        return {"steps": rows}
    prof = profile_rows(made, args.profiles)
    prof_text = table(f"one-device step per op group, ms (least and mean of {args.profiles} "
                      f"profiled steps)", ["op group", "off (least)", "on (least)",
                                           "off (mean)", "on (mean)"], prof)
    fused = [line.strip() for line in made[1][True][1].replicated_graph.summary().splitlines()
             if line.startswith("  ") and ": " in line and " x" in line]
    print("fused nodes of the one-device step: " + "; ".join(fused))
    save("epilogue", {"steps": [dict(zip(("model", "devices", "epilogues", "median_ms", "min_ms",
                                          "vs_off"), r)) for r in rows],
                      "profile": [dict(zip(("group", "off_least_ms", "on_least_ms",
                                           "off_mean_ms", "on_mean_ms"), r)) for r in prof],
                      "table": text + "\n\n" + prof_text})
    return {"steps": rows, "profile": prof}


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
