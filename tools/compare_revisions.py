"""The MLP, CNN and GPT training steps of bench/models.py timed on an earlier revision and
on the working tree, alternately in fresh processes, so a refactor's cost shows as a ratio
from one run (absolute times drift between runs; the ratio is what to trust).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tools/compare_revisions.py REV

Each revision runs as the wheel lays the package out (kernels/ and examples/ inside
graphdist/), put first on PYTHONPATH: nothing is installed. The steps: the 784-1024-1024-10
MLP with Adam on 4 logical devices (batch 256), the tutorial CNN and the character GPT on
one device and on the 4 logical devices (each replica a quarter of the batch), each the
median of its timed calls after warm-up and the kernels' loading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TIMER = r"""
import json, time
import numpy as np
import graphdist as gd
from graphdist.runtime import warmup
from bench.models import make_cnn_step, make_gpt_step, make_step
from bench.peers.common import cnn_data
from bench.peers.gpt_common import CONTEXT, VOCAB

def median_ms(fn, n):
    for _ in range(5):
        fn()
    warmup.wait()
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3

rng = np.random.default_rng(0)
x = rng.standard_normal((256, 784)).astype(np.float32)
y = rng.integers(0, 10, 256).astype(np.int32)
four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
mlp, _ = make_step(four)
batch = next(iter(four.experimental_distribute_dataset([(x, y)])))
one = gd.OneDeviceStrategy("cpu:0")
cnn, _ = make_cnn_step(one)
cnn_batch = cnn_data()
gpt, _ = make_gpt_step(one)
ids = rng.integers(0, VOCAB, (32, CONTEXT + 1)).astype(np.int32)
gpt_batch = (ids[:, :-1], ids[:, 1:])
cnn4, _ = make_cnn_step(four)
cnn4_batch = next(iter(four.experimental_distribute_dataset([cnn_batch])))
gpt4, _ = make_gpt_step(four)
gpt4_batch = next(iter(four.experimental_distribute_dataset([gpt_batch])))
print(json.dumps({"MLP x4 (Adam)": median_ms(lambda: mlp(batch), 30),
                  "CNN x1": median_ms(lambda: cnn(cnn_batch), 15),
                  "GPT x1": median_ms(lambda: gpt(gpt_batch), 15),
                  "CNN x4": median_ms(lambda: cnn4(cnn4_batch), 15),
                  "GPT x4": median_ms(lambda: gpt4(gpt4_batch), 15)}))
"""


def layout(source: Path, into: Path) -> Path:
    """The package as the wheel lays it out, plus bench/, under `into`."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source / "graphdist", into / "graphdist", ignore=skip)
    shutil.copytree(source / "kernels", into / "graphdist" / "kernels", ignore=skip)
    shutil.copytree(source / "examples", into / "graphdist" / "examples", ignore=skip)
    shutil.copytree(source / "bench", into / "bench", ignore=skip)
    return into


def checkout(rev: str, into: Path) -> Path:
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    return into


def time_steps(path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    done = subprocess.run([sys.executable, "-c", TIMER], cwd=path, env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"timing {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        before = layout(checkout(args.rev, tmp / "src"), tmp / "before")
        after = layout(ROOT, tmp / "after")
        for path in (before, after):    # compiles each copy's Numba kernels into its cache
            time_steps(path)
        runs = {"before": [], "after": []}
        for _ in range(args.rounds):
            runs["before"].append(time_steps(before))
            runs["after"].append(time_steps(after))
    print(f"{'step':<16}{'before ms':>22}{'after ms':>22}{'after/before':>14}")   # of the rounds' medians
    for step in runs["before"][0]:
        b = [r[step] for r in runs["before"]]
        a = [r[step] for r in runs["after"]]
        ratio = statistics.median(a) / statistics.median(b)
        print(f"{step:<16}{' / '.join(f'{t:.1f}' for t in b):>22}"
              f"{' / '.join(f'{t:.1f}' for t in a):>22}{ratio:>14.3f}")
    return {"rev": args.rev, **runs}


if __name__ == "__main__":
    main()
