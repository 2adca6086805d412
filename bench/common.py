"""Shared benchmark helpers: timing (median of many runs), a table printer, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, repeat: int = 30, warmup: int = 3, number: int = 1) -> dict:
    """Median / min / p90 seconds per call of fn() over `repeat` samples."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    samples.sort()
    return {"median_s": statistics.median(samples), "min_s": samples[0],
            "p90_s": samples[int(0.9 * (len(samples) - 1))], "repeat": repeat}


def interleaved(fns: dict, repeat: int = 30, warmup: int = 3) -> dict:
    """Time several contenders side by side, alternating them so drift hits all equally."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "repeat": repeat}
            for k, v in samples.items()}


def machine() -> dict:
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
                f"x{i.get('num_threads')}" for i in threadpool_info()
                if i.get("user_api") == "blas"]
    except ImportError:
        blas = []
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "blas": blas,
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text + "\n")
    return text


def _cell(c) -> str:
    if isinstance(c, float):
        return f"{c:.4g}"
    return str(c)


def save(name: str, payload: dict) -> Path:
    """Write results/NAME.json (NAME-TAG.json when $BENCH_TAG is set, e.g. "avx512")."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("BENCH_TAG")
    path = RESULTS / f"{name}{'-' + tag if tag else ''}.json"
    payload = {"benchmark": name, "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"saved {path}")
    return path
