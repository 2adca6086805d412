"""The peers' compile time of bench/trace_time.py's chain: N ops = N/2 x (4x4 matmul, tanh).

    python -m bench.peers.trace_chain --framework jax --ops 5000 [--repeat 3]

What each framework's number covers:
  jax           jax.jit(fn).lower(x, w): tracing to a jaxpr and lowering to StableHLO
  jax_compile   the same plus .compile() (XLA's optimisation passes and CPU codegen)
  torch_fx      torch.fx.symbolic_trace of an nn.Module whose forward is the chain (the
                GraphModule it returns includes its generated Python forward)
  tf            tf.function(fn).get_concrete_function(specs): tracing into a FuncGraph
Each run first warms imports and caches with a 10-op chain, then times a fresh function
object `repeat` times (best of). Prints one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.peers.common import report

FRAMEWORKS = ("jax", "jax_compile", "torch_fx", "tf")


def _inputs():
    return np.ones((4, 4), np.float32), np.eye(4, dtype=np.float32) * 0.5


def jax_timer(n_ops: int, compile_too: bool):
    import jax
    import jax.numpy as jnp

    x, w = map(jnp.asarray, _inputs())

    def once() -> tuple[float, int]:
        def fn(x, w):
            for _ in range(n_ops // 2):
                x = jnp.tanh(x @ w)
            return x
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(x, w)
        if compile_too:
            lowered.compile()
        seconds = time.perf_counter() - t0
        return seconds, len(lowered.as_text().splitlines())
    return once


def torch_fx_timer(n_ops: int):
    import torch
    import torch.fx

    class Chain(torch.nn.Module):
        def forward(self, x, w):
            for _ in range(n_ops // 2):
                x = torch.tanh(x @ w)
            return x

    def once() -> tuple[float, int]:
        module = Chain()
        t0 = time.perf_counter()
        traced = torch.fx.symbolic_trace(module)
        seconds = time.perf_counter() - t0
        return seconds, len(traced.graph.nodes)
    return once


def tf_timer(n_ops: int):
    import tensorflow as tf

    spec = tf.TensorSpec((4, 4), tf.float32)

    def once() -> tuple[float, int]:
        def fn(x, w):
            for _ in range(n_ops // 2):
                x = tf.tanh(x @ w)
            return x
        t0 = time.perf_counter()
        concrete = tf.function(fn).get_concrete_function(spec, spec)
        seconds = time.perf_counter() - t0
        return seconds, len(concrete.graph.get_operations())
    return once


def timer(framework: str, n_ops: int):
    if framework in ("jax", "jax_compile"):
        return jax_timer(n_ops, framework == "jax_compile")
    if framework == "torch_fx":
        return torch_fx_timer(n_ops)
    if framework == "tf":
        return tf_timer(n_ops)
    raise SystemExit(f"trace_chain: unknown --framework {framework!r}; choose from "
                     f"{FRAMEWORKS}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", required=True, choices=FRAMEWORKS)
    ap.add_argument("--ops", type=int, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.ops < 2 or args.ops % 2:
        raise SystemExit(f"trace_chain: --ops must be even and >= 2, got {args.ops}")
    timer(args.framework, 10)()                 # imports, first-use caches
    once = timer(args.framework, args.ops)
    runs = [once() for _ in range(args.repeat)]
    report({"framework": args.framework, "ops": args.ops, "seconds": min(r[0] for r in runs),
            "all_seconds": [r[0] for r in runs], "nodes": runs[0][1]})


if __name__ == "__main__":
    main()
