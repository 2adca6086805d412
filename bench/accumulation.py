"""Gradient accumulation's cost (issue 25) on bench/zero.py's MLP (784-1024-1024-10, Adam,
global batch 512, 4 logical CPU devices), every contender interleaved in one process:

- compute alone: forward + backward, the gradients written to per-replica variables (no
  accumulate, no update, no collective);
- micro-step: k = 10^6, so every timed call adds to the accumulators (target: within 5% of
  compute alone), fused (matmul_accumulate: one GEMM with beta=1 into each weight's
  accumulator, passes/accumulate.py) and unfused (the pass switched off while the step
  compiles: the product, then a read-add-write pass, as before the pass existed);
- first micro-step and applying step of k = 2 (their calls alternate): the first writes
  the accumulators (beta=0), the applying call adds the last micro-gradient the same way,
  all-reduces and updates; against compute alone and the plain step (k = 1).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.accumulation [--repeat 30]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from bench.common import save, settle, table
from bench.peers.common import BATCH
from bench.zero import N, make_with_optimizer
from graphdist import pipeline


def make(accumulation: int = 1, update: bool = True):
    """(step, batch, optimizer) of bench/zero.py's MLP on N logical devices at stage 0;
    update=False: compute alone, the gradients written to per-replica variables."""
    return make_with_optimizer(0, accumulation, update)


@contextlib.contextmanager
def unfused():
    """Steps compiled inside run the accumulate as before passes/accumulate.py."""
    kept = pipeline.fuse_accumulate
    pipeline.fuse_accumulate = lambda g: g
    try:
        yield
    finally:
        pipeline.fuse_accumulate = kept


def in_phase(step, batch, opt, phase: str):
    """A contender that runs `step` only where its optimizer's window is at `phase`."""
    def run():
        assert opt.switch_state()[1] == phase, (phase, opt.switch_state())
        step(*batch)
    return run


def rounds(fns: dict, repeat: int) -> dict:
    """Every contender once per round, in order; each contender's median and min time, and
    the median over rounds of its time over compute alone's and over the plain step's in
    the same round (a round's contenders share the machine's load, which on a shared VM
    moves more from round to round than between them)."""
    settle()
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    out = {}
    for name, times in samples.items():
        out[name] = {"median_s": statistics.median(times), "min_s": min(times),
                     "repeat": repeat}
        for ref, key in (("compute alone", "vs compute alone"),
                         ("plain step (k=1)", "vs plain step")):
            out[name][key] = statistics.median(t / r for t, r in zip(times, samples[ref]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    plain = make()
    compute = make(update=False)
    micro = make(10**6)
    with unfused():
        old_micro = make(10**6)
        for _ in range(2):            # compile its first and its adding programs now
            old_micro[0](*old_micro[1])
    pair = make(2)
    fns = {"plain step (k=1)": lambda: plain[0](*plain[1]),
           "compute alone": lambda: compute[0](*compute[1]),
           "micro-step, fused": lambda: micro[0](*micro[1]),
           "micro-step, unfused (before)": lambda: old_micro[0](*old_micro[1]),
           "first micro-step (k=2)": in_phase(*pair, "first"),
           "applying step (k=2)": in_phase(*pair, "apply")}
    for name, fn in fns.items():      # compile and load every program; pair ends a window
        for _ in range(4 if "(k=2)" in name else 3):
            (lambda: pair[0](*pair[1]) if "(k=2)" in name else fn())()
    settle()
    assert "matmul_accumulate" in str(micro[0].graph), "the micro-step is not fused"
    assert "matmul_accumulate" not in str(old_micro[0].graph)
    timed = rounds(fns, args.repeat)
    rows = [[name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["vs compute alone"],
             r["vs plain step"]] for name, r in timed.items()]
    text = table(f"gradient accumulation, MLP Adam, global batch {BATCH} on {N} logical CPU "
                 f"devices ({args.repeat} interleaved rounds; ratios: the median of each "
                 "round's ratio; target: micro-step within 5% of compute alone)",
                 ["step", "median ms", "min ms", "vs compute alone", "vs plain step"], rows)
    save("accumulation", {"results": timed, "table": text})
    return timed


if __name__ == "__main__":
    main()
