"""The GPT-2-style training step of issue 29, beside bench/gpt.py's GPT: vocabulary 128,
context 64, width 128, 2 pre-LN blocks of 4-head causal attention with an additive mask,
GELU in its tanh form (approximate=True, as GPT-2 and BERT use it), batch 32, Adam
(bench/models.py: make_gpt2_step, written as GPT-2's code writes it).

Side by side in one run:
1. gelu on 2048 x 512 float32 values: the tanh form's kernel and gradient against the exact
   form's, and against what ran before (the op's float64 reference); a gelu returned by a
   step (its kernel into a fresh array; before: the reference).
2. The GPT-2-style step on 1 device and on 4 logical CPU devices, with the tanh form on its
   kernels (after) and on the op's reference (before, the entry swapped for the run), the
   same model with its dense layers reshaped to 2-D GEMMs by hand (as gd.nn.Dense does; a
   3-D x @ w has run so since issue 29, so the two should match), and bench/gpt.py's GPT
   (exact GELU, vocabulary 103) on 1 device.

The peers (TF, PyTorch, JAX: bench/peers/) have no GPT-2-style script yet; bench/gpt.py
runs them on the GPT. The run drops the environment's OpenBLAS pin (OPENBLAS_CORETYPE,
OPENBLAS_L2_SIZE) by running itself again without it, as on a user's machine, and says so.

    python -m bench.gpt2 [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import graphdist as gd
from bench.common import ROOT, interleaved, save, table
from bench.models import gpt2_data, make_gpt2_step, make_gpt_step

OPENBLAS_PIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
SHAPE = (2048, 512)


def unpinned_rerun(argv) -> bool:
    """Run this benchmark again in a new process without the environment's OpenBLAS pin
    (OpenBLAS reads it when it loads, so this process cannot drop it), saying so; False
    when there is no pin to drop (then run here)."""
    import subprocess

    from graphdist.device.threads import ENV_SET

    pinned = {k: os.environ[k] for k in OPENBLAS_PIN
              if k in os.environ and ENV_SET.get(k) != os.environ[k]}
    if not pinned:
        return False
    print(f"bench.gpt2: running again without the environment's OpenBLAS pin "
          f"({', '.join(f'{k}={v}' for k, v in pinned.items())}), as on a user's machine",
          file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_PIN}
    subprocess.run([sys.executable, "-m", "bench.gpt2", *argv], env=env, cwd=ROOT, check=True)
    return True


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
    """make(strategy)'s step, lowered (its first call) with these gelu entries in place."""
    from graphdist.runtime import kernel_table

    for listed, swapped in entries.values():
        kernel_table.register(swapped, replace=True)
    try:
        step, _ = make(strategy)
        step(batch)
    finally:
        for listed, _ in entries.values():
            kernel_table.register(listed, replace=True)
    return step


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


def step_part(repeat: int) -> tuple[dict, str]:
    batch = gpt2_data()
    one = gd.OneDeviceStrategy("cpu:0")
    four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch4 = next(iter(four.experimental_distribute_dataset([batch])))
    before = _reference_gelu_entries()
    steps = {"GPT-2-style, 1 device (after)": (_built_with({}, make_gpt2_step, one, batch),
                                                batch),
             "GPT-2-style, 1 device (before: tanh gelu on the reference)":
                 (_built_with(before, make_gpt2_step, one, batch), batch),
             "GPT-2-style, Mirrored x4 (after)":
                 (_built_with({}, make_gpt2_step, four, batch4), batch4),
             "GPT-2-style, Mirrored x4 (before)":
                 (_built_with(before, make_gpt2_step, four, batch4), batch4)}
    steps["GPT-2-style, 1 device, dense layers reshaped to 2-D by hand (as gd.nn.Dense)"] = (
        _built_with({}, lambda s: make_gpt2_step(s, flat=True), one, batch), batch)
    from bench.peers.gpt_common import gpt_data

    gpt_batch = gpt_data()
    steps["bench/gpt.py's GPT (exact gelu, vocab 103), 1 device"] = (
        _built_with({}, make_gpt_step, one, gpt_batch), gpt_batch)
    losses = {k: [float(s(b)) for _ in range(2)] for k, (s, b) in steps.items()}
    t = interleaved({k: (lambda s=s, b=b: s(b)) for k, (s, b) in steps.items()},
                    repeat=repeat, label="GPT-2-style step")
    rows = [[k, v["median_s"] * 1e3, v["min_s"] * 1e3, f"{losses[k][0]:.4f}"]
            for k, v in t.items()]
    text = table(f"GPT-2-style step, batch 32 x 64 tokens, Adam (median of {repeat}, "
                 "interleaved; no peers: bench/peers has no GPT-2-style script)",
                 ["contender", "median ms", "min ms", "loss at step 2"], rows)
    for k in t:
        t[k]["losses"] = losses[k]
    return t, text


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    if unpinned_rerun(argv):
        return {}
    gelu, gelu_text = gelu_part(max(args.repeat, 20))
    steps, steps_text = step_part(args.repeat)
    save("gpt2", {"gelu": gelu, "results": steps, "table": gelu_text + "\n\n" + steps_text})
    return steps


if __name__ == "__main__":
    main()
