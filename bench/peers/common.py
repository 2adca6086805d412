"""What every peer script shares: the model sizes, data, and a JSON timing line."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

SIZES = (784, 1024, 1024, 10)
BATCH = 512
LR = 1e-3


def data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    return x, y


def init(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        params += [(rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32),
                   np.zeros(b, np.float32)]
    return params


def time_steps(step, sync=lambda r: r, warmup: int = 5, repeat: int = 20) -> dict:
    """Median and min of `repeat` steps after `warmup`; `first_call_s` is the first step,
    which traces and compiles (run it in a fresh process to include every cost)."""
    t0 = time.perf_counter()
    sync(step())
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        sync(step())
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sync(step())
        samples.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "repeat": repeat,
            "first_call_s": first}


def report(result: dict) -> None:
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
