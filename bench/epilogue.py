"""The tutorial CNN step (bench/cnn.py, batch 256, Adam) with the epilogues stage
(passes/epilogue.py: bias + relu in each conv's and dense layer's output pass, relu's
gradient moved before the pool's and fused with the bias gradient's sum) on and off,
on one device and on 4 logical devices, timed interleaved in one run; then the
one-device step's per-op profile (`Function.profile`) in both forms, grouped as the
docs' CNN table groups TF's ops.

Then the GPT-2-style step (bench/gpt2.py: x @ w + b and tanh gelu on 3-D inputs) and the
MLP (bench/mirrored_mlp.py) the same way: the stage must not slow them down.

For the CNN also what the 4-replica step spends beyond the one-device one: both steps
profiled alternately, every replica's ops summed per group (two profiles from two runs
differ by this VM's load more than by the replicas), and each convolution op at 256 images
in one call against four calls of 64 (a replica's share), interleaved.

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
from graphdist.device.backends import backend_for
from graphdist.ops.conv import conv2d_backprop_filter_p, conv2d_backprop_input_p
from graphdist.ops.epilogue import conv2d_bias_act_p
from graphdist.runtime import kernel_table

GROUPS = {
    "conv2d": "conv forward", "conv2d_bias_act": "conv forward",
    "conv2d_backprop_filter": "conv filter grad", "conv2d_backprop_input": "conv input grad",
    "max_pool2d": "max pool", "max_pool2d_grad": "max pool grad",
    "add": "bias add, relu, their grads", "relu": "bias add, relu, their grads",
    "relu_grad": "bias add, relu, their grads", "reduce_sum": "bias add, relu, their grads",
    "relu_grad_bias_sum": "bias add, relu, their grads",
    "matmul": "dense (matmul)", "matmul_bias_act": "dense (matmul)",
    "adam_multi_update": "Adam", "host_reduce_update": "all-reduce + Adam",
    "host_all_reduce": "all-reduce (loss)",
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


def _group_ms(step, data) -> dict:
    """ms per op group in one profiled step (every replica's ops summed). A collective is
    drawn on every device's lane: counted once (as graphdist.benchmark does), not once per
    replica (which made the 4-replica all-reduce + Adam look 4x its 0.6 ms)."""
    one: dict = {}
    seen = set()
    for e in step.profile(data)["traceEvents"]:
        once = (e.get("args", {}).get("node"), e.get("ts"))
        if e.get("ph") == "X" and once not in seen:
            seen.add(once)
            group = GROUPS.get(e["name"], "other")
            one[group] = one.get(group, 0.0) + e["dur"] / 1e3
    return one


def _profiled(forms: dict, profiles: int) -> tuple[dict, dict]:
    """(least, mean) ms per op group of each form ({name: (step, data)}) over `profiles`
    profiled steps, the forms alternating (on this shared VM a neighbour's burst inflates
    a few steps' GEMMs tenfold; the least is the steadier figure)."""
    seen: dict = {name: {} for name in forms}
    for step, data in forms.values():
        for _ in range(2):
            step.profile(data)
    for _ in range(profiles):
        for name, (step, data) in forms.items():
            for group, ms in _group_ms(step, data).items():
                seen[name].setdefault(group, []).append(ms)
    return ({n: {g: min(v) for g, v in seen[n].items()} for n in seen},
            {n: {g: sum(v) / len(v) for g, v in seen[n].items()} for n in seen})


def profile_rows(made: dict, profiles: int) -> list:
    """Per op group, ms per one-device step with the stage off and on: the least over
    `profiles` profiled steps of each form, alternating, and the mean beside it."""
    least, mean = _profiled({on: made[1][on][1:] for on in (False, True)}, profiles)
    groups = sorted(set(least[True]) | set(least[False]),
                    key=lambda g: -least[False].get(g, 0.0))
    rows = [[g, least[False].get(g, 0.0), least[True].get(g, 0.0), mean[False].get(g, 0.0),
             mean[True].get(g, 0.0)] for g in groups]
    rows.append(["sum", *(sum(r[k] for r in rows) for k in range(1, 5))])
    return rows


def replica_profile_rows(made: dict, profiles: int) -> list:
    """Per op group, ms per step with the stage on: one device against 4 replicas (their
    ops summed), profiled alternately, least and mean, and the ratio of the leasts."""
    least, mean = _profiled({r: made[r][True][1:] for r in (1, 4)}, profiles)
    groups = sorted(set(least[1]) | set(least[4]), key=lambda g: -least[4].get(g, 0.0))
    rows = [[g, least[1].get(g, 0.0), least[4].get(g, 0.0), mean[1].get(g, 0.0),
             mean[4].get(g, 0.0)] for g in groups]
    rows.append(["sum", *(sum(r[k] for r in rows) for k in range(1, 5))])
    return [[*r, r[2] / r[1] if r[1] else float("nan")] for r in rows]


# the tutorial CNN's convolution layers: (input (H, W, C), output channels), 3x3 VALID
CONV_LAYERS = {"first": ((28, 28, 1), 32), "second": ((13, 13, 32), 64)}
WINDOW = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}
RELU_EPILOGUE = {"act": "relu", "has_bias": True, "keep": False,
                 "members": ("conv2d", "add", "relu")}


def _conv_forms() -> dict:
    """The CNN's convolution ops as its CPU programs run them: out-forms by name."""
    import graphdist.runtime.adapters  # noqa: F401  (registers the CPU kernels)

    cpu = backend_for("cpu:0")
    return {name: kernel_table.out_impl(cpu, op) for name, op in (
        ("forward + bias + relu", conv2d_bias_act_p), ("filter grad", conv2d_backprop_filter_p),
        ("input grad", conv2d_backprop_input_p))}


def _conv_call(name: str, form, hwc: tuple, o: int, images: int, rng):
    """One call of the op `name` on `images` images of the layer, its arrays made once."""
    x = rng.random((images, *hwc), dtype=np.float32)
    f = rng.standard_normal((3, 3, hwc[2], o)).astype(np.float32)
    dy = rng.standard_normal((images, hwc[0] - 2, hwc[1] - 2, o)).astype(np.float32)
    if name == "filter grad":
        dw = np.empty_like(f)
        return lambda: form(dw, x, dy, filter_size=(3, 3), **WINDOW)
    if name == "input grad":
        dx = np.empty_like(x)
        return lambda: form(dx, dy, f, input_size=hwc[:2], **WINDOW)
    y, b = np.empty_like(dy), rng.standard_normal(o).astype(np.float32)
    return lambda: form((y,), x, f, b, **WINDOW, **RELU_EPILOGUE)


def conv_split_rows(repeat: int, batch: int = 256, replicas: int = 4) -> list:
    """Each convolution op of the CNN (the first layer has no input gradient in the step)
    on `batch` images in one call against `replicas` calls on batch / replicas images,
    interleaved: ms (median, min) and the ratio of the medians."""
    rng, rows = np.random.default_rng(0), []
    for layer, (hwc, o) in CONV_LAYERS.items():
        for name, form in _conv_forms().items():
            if name == "input grad" and hwc[2] == 1:
                continue
            whole = _conv_call(name, form, hwc, o, batch, rng)
            shares = [_conv_call(name, form, hwc, o, batch // replicas, rng)
                      for _ in range(replicas)]
            t = interleaved({"whole": whole, "shares": lambda s=shares: [f() for f in s]},
                            repeat, label=f"{layer} layer {name}")
            rows.append([layer, name, t["whole"]["median_s"] * 1e3,
                         t["shares"]["median_s"] * 1e3, t["whole"]["min_s"] * 1e3,
                         t["shares"]["min_s"] * 1e3,
                         t["shares"]["median_s"] / t["whole"]["median_s"]])
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
    replicas = replica_profile_rows(made, args.profiles)
    replicas_text = table(
        f"the CNN step with the stage on, 1 device vs 4 replicas (summed) per op group, ms "
        f"(least and mean of {args.profiles} profiled steps, alternating)",
        ["op group", "x1 (least)", "x4 (least)", "x1 (mean)", "x4 (mean)", "x4 / x1 (least)"],
        replicas)
    split = conv_split_rows(args.repeat)
    split_text = table(f"each conv op on 256 images in one call vs 4 calls of 64, ms (median "
                       f"and min of {args.repeat}, interleaved)",
                       ["layer", "op", "256 median", "4 x 64 median", "256 min", "4 x 64 min",
                        "4 x 64 / 256 (median)"], split)
    save("epilogue", {"steps": [dict(zip(("model", "devices", "epilogues", "median_ms", "min_ms",
                                          "vs_off"), r)) for r in rows],
                      "profile": [dict(zip(("group", "off_least_ms", "on_least_ms",
                                           "off_mean_ms", "on_mean_ms"), r)) for r in prof],
                      "replica_profile": [dict(zip(("group", "x1_least_ms", "x4_least_ms",
                                                    "x1_mean_ms", "x4_mean_ms", "x4_vs_x1"), r))
                                          for r in replicas],
                      "conv_split": [dict(zip(("layer", "op", "whole_median_ms",
                                               "shares_median_ms", "whole_min_ms",
                                               "shares_min_ms", "shares_vs_whole"), r))
                                     for r in split],
                      "table": "\n\n".join((text, prof_text, replicas_text, split_text))})
    return {"steps": rows, "profile": prof, "replica_profile": replicas, "conv_split": split}


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
