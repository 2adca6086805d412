"""Elementwise fusion (issue 29 item 2; passes/fuse_elementwise.py) on and off, side by side
in one process:

1. whole steps: the GPT-2-style step (bench/gpt2.py's model: tanh GELU, additive mask) on 1
   device and on 4 logical CPU devices, and the benchmark MLP (784-1024-1024-10, Adam) on 1
   and 4, each built twice from the same weights, with the fuse_elementwise stage and
   without it, timed interleaved; their losses must agree bit for bit (the fused kernels
   are exact);
2. each fused node of the one-device GPT-2 step (and a few chains as a user writes them):
   its members replayed as their own program, fused (one generated loop) and unfused (one
   ufunc or kernel per member), timed interleaved;
3. fusion inside control-flow bodies: training steps whose layers run in a loop body (a
   stack of dense residual layers in gd.fori_loop, gd.nn.LSTM on gd.scan) with the
   epilogues and fuse_elementwise stages and without both, interleaved, same bits.

The run drops the environment's OpenBLAS pin, as bench/gpt2.py does.

    python -m bench.fuse_elementwise [--repeat N] [--nodes-only | --bodies-only]
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table, unpinned_rerun
from bench.models import make_gpt2_step, make_step
from bench.peers.common import data
from bench.peers.gpt_common import gpt2_data
from graphdist import pipeline
from graphdist.ir import Lit, Var
from graphdist.ops.core import bind
from graphdist.ops.fused import fused_elementwise_p
from graphdist.runtime import warmup


@contextlib.contextmanager
def unfused():
    """Programs compiled inside have no fuse_elementwise stage."""
    keep = pipeline.elementwise_fusion
    pipeline.elementwise_fusion = lambda: []
    try:
        yield
    finally:
        pipeline.elementwise_fusion = keep


def _built(make, strategy, batch, fused: bool):
    with contextlib.nullcontext() if fused else unfused():
        step, _ = make(strategy)
        losses = [float(step(batch))]
    warmup.wait()
    losses += [float(step(batch)) for _ in range(2)]
    return step, losses


def steps_part(repeat: int) -> dict:
    four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    one = gd.OneDeviceStrategy("cpu:0")
    gpt, mlp = gpt2_data(), data()
    cases = {"GPT-2-style step, 1 device": (make_gpt2_step, one, gpt),
             "GPT-2-style step, Mirrored x4": (make_gpt2_step, four, next(iter(
                 four.experimental_distribute_dataset([gpt])))),
             "MLP step, 1 device": (make_step, one, mlp),
             "MLP step, Mirrored x4": (make_step, four, next(iter(
                 four.experimental_distribute_dataset([mlp]))))}
    fns, out = {}, {}
    for name, (make, strategy, batch) in cases.items():
        runs = {}
        for fused in (True, False):
            step, losses = _built(make, strategy, batch, fused)
            nodes = sum(e.op is fused_elementwise_p for e in step.replicated_graph.eqns)
            runs[fused] = (losses, nodes)
            fns[(name, fused)] = lambda s=step, b=batch: s(b)
        out[name] = {"losses_fused": runs[True][0], "losses_unfused": runs[False][0],
                     "fused_nodes": runs[True][1], "same_losses": runs[True][0] == runs[False][0]}
    times = interleaved(fns, repeat=repeat, label="fused / unfused steps")
    for name in cases:
        on, off = times[(name, True)]["median_s"], times[(name, False)]["median_s"]
        out[name].update(fused_ms=on * 1e3, unfused_ms=off * 1e3, ratio=on / off,
                         min_ratio=times[(name, True)]["min_s"] / times[(name, False)]["min_s"])
    return out


def _replay(body):
    """A function running the members of `body` one by one through bind (a program the
    fuse_elementwise stage fuses again, or not)."""
    def fn(*xs):
        env = dict(zip(body.inputs, xs))
        for e in body.eqns:
            args = [np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]
                    for v in e.inputs]
            env[e.outputs[0]] = bind(e.op, *args, **dict(e.params))
        return tuple(env[v] for v in body.outputs if isinstance(v, Var))
    return fn


CHAINS = {   # as users write them, on (4096, 512) float32 values
    "relu(x * s + b) (bias row)": (lambda x, y, b: gd.relu(x * 2.0 + b), 3),
    "residual: x + y * 0.5 - b": (lambda x, y, b: x + y * 0.5 - b, 3),
    "leaky relu: where(x > 0, x, 0.1 x)": (lambda x, y, b: gd.where(x > 0, x, x * 0.1), 3),
    "gelu_grad(y, x) * 0.5 + y": (lambda x, y, b: bind(
        gd.ops.special.gelu_grad_p, y, x, approximate=True) * 0.5 + y, 3),
}


def nodes_part(repeat: int) -> dict:
    step, _ = make_gpt2_step(gd.OneDeviceStrategy("cpu:0"))
    step(gpt2_data())
    rng = np.random.default_rng(0)
    bodies = {}
    for k, e in enumerate(x for x in step.replicated_graph.eqns if x.op is fused_elementwise_p):
        body = dict(e.params)["body"]
        label = f"GPT-2 node {k}: {'+'.join(m.op.name for m in body.eqns)} {body.outputs[0].ty}"
        args = [rng.standard_normal(v.ty.shape).astype(v.ty.dtype) for v in body.inputs]
        bodies[label] = (_replay(body), args)
    x, y = (rng.standard_normal((4096, 512)).astype(np.float32) for _ in range(2))
    b = rng.standard_normal(512).astype(np.float32)
    for name, (fn, _) in CHAINS.items():
        bodies[name] = (fn, [x, y, b])
    groups = ({k: v for k, v in bodies.items() if k.startswith("GPT-2")},
              {k: v for k, v in bodies.items() if not k.startswith("GPT-2")})
    times = {}
    for group in groups:      # apart: the 8 MiB chains would evict the GPT-2 nodes' inputs
        fns = {}
        for name, (fn, args) in group.items():
            for fused in (True, False):
                with contextlib.nullcontext() if fused else unfused():
                    f = gd.function(fn)
                    f(*args)
                fns[(name, fused)] = lambda f=f, a=args: f(*a)
        warmup.wait()
        times.update(interleaved(fns, repeat=repeat, label="fused / unfused nodes"))
    return {name: {"fused_ms": times[(name, True)]["median_s"] * 1e3,
                   "unfused_ms": times[(name, False)]["median_s"] * 1e3,
                   "ratio": times[(name, True)]["median_s"] / times[(name, False)]["median_s"],
                   "min_ratio": times[(name, True)]["min_s"] / times[(name, False)]["min_s"]}
            for name in bodies}


@contextlib.contextmanager
def no_fusion():
    """Programs compiled inside have neither the epilogues nor the fuse_elementwise stage."""
    keep = pipeline.epilogues
    pipeline.epilogues = lambda: []
    try:
        with unfused():
            yield
    finally:
        pipeline.epilogues = keep


def _residual_stack_step(layers: int = 8, batch: int = 256, width: int = 512):
    """A training step of `layers` dense residual layers run by gd.fori_loop (one weight
    matrix shared by every iteration), SGD."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    w = gd.Variable((rng.standard_normal((width, width)) * 0.02).astype(np.float32))
    b = gd.Variable(np.zeros(width, np.float32))
    opt = gd.optimizers.SGD(1e-3)

    @gd.function
    def step(x):
        with gd.GradientTape() as tape:
            h = gd.fori_loop(0, layers, lambda i, h: gd.relu(h @ w + b) * 0.5 + h, x)
            loss = gd.reduce_mean(h * h)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        return loss
    return lambda: step(x)


def _elementwise_loop(steps: int = 20, n: int = 1 << 19):
    """20 explicit Euler steps of an elementwise update on 512K values (a cellular or
    particle model as a user writes one): x <- x + 0.01 * (relu(x) * a - x * b + c)."""
    rng = np.random.default_rng(1)
    x, a, b, c = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
    f = gd.function(lambda x, a, b, c: gd.fori_loop(
        0, steps, lambda i, x: x + 0.01 * (gd.relu(x) * a - x * b + c), x))
    return lambda: f(x, a, b, c)[:4]


def _lstm_step():
    from bench.lstm import BATCH, STEPS, WIDTH, train_step

    rng = np.random.default_rng(0)
    return train_step(["cpu:0"], rng.standard_normal((BATCH, STEPS, WIDTH)).astype(np.float32),
                      rng.standard_normal((BATCH, WIDTH)).astype(np.float32), seed=0)


def bodies_part(repeat: int) -> dict:
    cases = {"8 dense residual layers in gd.fori_loop (256x512), train step":
             _residual_stack_step,
             "gd.nn.LSTM on gd.scan (bench.lstm), train step": _lstm_step,
             "20 elementwise Euler steps in gd.fori_loop (512K values)": _elementwise_loop}
    fns, out = {}, {}
    for name, make in cases.items():
        losses = {}
        for fused in (True, False):
            with contextlib.nullcontext() if fused else no_fusion():
                run = make()
                first = np.asarray(run(), np.float64).tolist()
            warmup.wait()
            losses[fused] = [first, np.asarray(run(), np.float64).tolist()]
            fns[(name, fused)] = run
        out[name] = {"same_losses": losses[True] == losses[False]}
    times = interleaved(fns, repeat=repeat, label="fused / unfused bodies")
    for name in cases:
        on, off = times[(name, True)], times[(name, False)]
        out[name].update(fused_ms=on["median_s"] * 1e3, unfused_ms=off["median_s"] * 1e3,
                         ratio=on["median_s"] / off["median_s"],
                         min_ratio=on["min_s"] / off["min_s"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--nodes-only", action="store_true", help="part 2 only")
    ap.add_argument("--bodies-only", action="store_true",
                    help="part 3 only (saved as results/fuse_elementwise-bodies.json)")
    args = ap.parse_args(argv)
    if unpinned_rerun("bench.fuse_elementwise", argv):
        return {}
    if args.bodies_only:
        return _bodies(args.repeat, tag="bodies")
    steps = {} if args.nodes_only else steps_part(args.repeat)
    print(table("Steps with elementwise fusion on and off (interleaved, median ms)",
                ["step", "fused nodes", "on", "off", "on/off", "(min)", "same losses"],
                [[k, v["fused_nodes"], f"{v['fused_ms']:.2f}", f"{v['unfused_ms']:.2f}",
                  f"{v['ratio']:.3f}", f"{v['min_ratio']:.3f}", v["same_losses"]]
                 for k, v in steps.items()]))
    nodes = nodes_part(args.repeat * 4)
    print(table("Each fused node against its members (interleaved, median ms)",
                ["node", "fused", "members", "fused/members", "(min)"],
                [[k, f"{v['fused_ms']:.3f}", f"{v['unfused_ms']:.3f}", f"{v['ratio']:.2f}",
                  f"{v['min_ratio']:.2f}"] for k, v in nodes.items()]))
    payload = {"steps": steps, "nodes": nodes, "repeat": args.repeat}
    if not args.nodes_only:
        payload["bodies"] = _bodies(args.repeat, tag=None, save_it=False)
    save("fuse_elementwise", payload)
    return payload


def _bodies(repeat: int, tag, save_it: bool = True) -> dict:
    bodies = bodies_part(repeat)
    print(table("Fusion inside control-flow bodies on and off (epilogues + fuse_elementwise; "
                "interleaved, median ms)",
                ["step", "on", "off", "on/off", "(min)", "same losses"],
                [[k, f"{v['fused_ms']:.2f}", f"{v['unfused_ms']:.2f}", f"{v['ratio']:.3f}",
                  f"{v['min_ratio']:.3f}", v["same_losses"]] for k, v in bodies.items()]))
    if save_it:
        save("fuse_elementwise", {"bodies": bodies, "repeat": repeat}, tag=tag)
    return bodies


if __name__ == "__main__":
    main()
