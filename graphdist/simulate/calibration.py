"""The calibration of gd.simulate: per-op time models, the executor's per-node overhead and
the links of this host (a memory copy, the fused host all-reduce, 2 MPI workers), measured
once and kept as JSON in the user's cache."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from graphdist import flags
from graphdist.runtime import warmup
from graphdist.simulate.link import DEFAULT_MPI_LINK, Link


def default_calibration_path() -> Path:
    """$GRAPHDIST_CALIBRATION, else ~/.cache/graphdist/calibration.json."""
    if flags.CALIBRATION:
        return Path(flags.CALIBRATION)
    return Path.home() / ".cache" / "graphdist" / "calibration.json"


def machine() -> dict:
    return {"node": platform.node(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__}


def _op_time(fn, repeat: int) -> float:
    """The least of `repeat` calls or more, sampled for at least 4 ms per repeat: on a
    shared machine a median carries other programs' bursts, and a burst (or a CPU quota's
    pause) can cover a few back-to-back calls of a small op; the step times the model is
    scaled to and checked against are bests too."""
    return best_time(fn, repeat, 0.004 * repeat)


def best_time(fn, repeat: int, min_seconds: float = 0.0) -> float:
    """The least of at least `repeat` timed calls (more until `min_seconds` have passed, at
    most 50x) after one untimed: the cost with nothing else running on a shared machine.
    The untimed call may start kernels loading in the background: they are waited for, so
    the times are the kernels', not their numpy forms'."""
    fn()
    warmup.wait()
    best, start, k = math.inf, time.perf_counter(), 0
    while k < repeat or (time.perf_counter() - start < min_seconds and k < 50 * repeat):
        t0 = time.perf_counter()
        fn()
        best, k = min(best, time.perf_counter() - t0), k + 1
    return best


GEMM_DIMS = (1, 4, 16, 64, 256)


def _probes(rng) -> dict:
    """Every op the calibration times, {(group, x): fn}, x its work: FLOPs of square
    matmuls; the smallest side d of (d x 1024) @ (1024 x 1024) GEMMs ("gemm": BLAS runs
    thin products well below its peak, and d = 1, a matrix-vector product, is bound by
    reading the 4 MB matrix); bytes touched by elementwise adds (into the step's own
    buffers, reused every step) and reductions, in cache and past it; bytes copied into a
    new buffer (as copy_to does); replica bytes of the fused host all-reduce."""
    from graphdist.runtime.kernel_table import host_all_reduce_cpu

    probes = {}
    for m in (64, 128, 256):
        a, b = rng.standard_normal((2, m, m)).astype(np.float32)
        probes["matmul", 2.0 * m**3] = lambda a=a, b=b: a @ b
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    for d in GEMM_DIMS:
        x = rng.standard_normal((d, 1024)).astype(np.float32)
        probes["gemm", d] = lambda x=x: x @ w
    for size in (2**12, 2**16, 2**20, 2**22):        # the last touches 48 MB: past L3
        x, o = np.ones(size, np.float32), np.empty(size, np.float32)
        probes["elementwise", 3.0 * x.nbytes] = lambda x=x, o=o: np.add(x, x, out=o)
        probes["reduce", 1.02 * x.nbytes] = lambda x=x: np.sum(x.reshape(-1, 64), axis=1)
    for size in (2**16, 2**20, 2**24):
        probes["copy", float(size)] = np.ones(size // 4, np.float32).copy
    for n in (2, 4):
        for size in (2**14, 2**17, 2**20):
            bufs = [np.ones(size, np.float32) for _ in range(n)]
            outs = tuple(np.empty_like(b) for b in bufs)
            probes["host", float(n * bufs[0].nbytes)] = (
                lambda b=bufs, o=outs: host_all_reduce_cpu(o, *b, op="sum"))
    return probes


def _interleaved(fns: dict, repeat: int, min_seconds: float) -> dict:
    """{key: the least time of fn}, every fn timed once per round, round after round (at
    least `repeat`, more until `min_seconds` have passed): on a shared machine a burst of
    other work, or a CPU quota's pause, then slows one sample of each, not all of one."""
    best = dict.fromkeys(fns, math.inf)
    for fn in fns.values():
        fn()
    start, k = time.perf_counter(), 0
    while k < repeat or (time.perf_counter() - start < min_seconds and k < 50 * repeat):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
        k += 1
    return best


def _fit(xs: list[float], ts: list[float]) -> dict:
    """t = a + x * per_unit by least squares, both kept >= 0."""
    per = max(float(np.polyfit(xs, ts, 1)[0]), 1e-18)
    a = max(statistics.median(t - x * per for x, t in zip(xs, ts)), 0.0)
    return {"a": a, "per_unit": per}


def _node_overhead(repeat: int) -> float:
    """The executor's cost per node: a chain of 40 tiny adds against a chain of 1."""
    from graphdist.function import function

    def chain(k):
        def f(x):
            for _ in range(k):
                x = x + 1.0
            return x
        return function(f)

    x = np.zeros(4, np.float32)
    short, long_ = chain(1), chain(41)
    return max((_op_time(lambda: long_(x), repeat)
                - _op_time(lambda: short(x), repeat)) / 40, 0.0)


def mpiexec() -> str | None:
    """The mpiexec beside this Python (a venv's mpich), else on PATH; None without mpi4py."""
    import shutil
    import sys

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


MPI_PROBE_BYTES = (2**12, 2**16, 2**20, 2**23)


def _mpi_probe(repeat: int = 20) -> None:
    """Run under `mpiexec -n 2`: the all-reduce a multi-worker step calls (the process
    group's, in place) per size, every sample after a barrier and timed by the slower
    rank, the least of `repeat` (two ranks polling on a shared machine wait out a whole
    time slice whenever a third program runs); rank 0 prints `RESULT {"bytes": [...],
    "seconds": [...]}`."""
    from graphdist.device.mpi import world

    group = world()
    sizes, best = [], []
    for nbytes in MPI_PROBE_BYTES:
        buf = np.ones(nbytes // 4, np.float32)
        samples = []
        for k in range(repeat + 2):
            group.comm.Barrier()
            t0 = time.perf_counter()
            group.allreduce(buf)
            if k >= 2:
                samples.append(group.comm.allreduce(time.perf_counter() - t0,
                                                    op=group.MPI.MAX))
        sizes.append(nbytes)
        best.append(min(samples))
    if group.rank == 0:
        print("RESULT " + json.dumps({"bytes": sizes, "seconds": best}), flush=True)


def calibrate_mpi(repeat: int = 20) -> dict:
    """The link between 2 MPI workers of this host, from `_mpi_probe` run under `mpiexec
    -n 2` (t = a + S * per fitted; the ring on 2 workers is 2 latencies + S / B, so latency
    = a / 2, bandwidth = 1 / per); DEFAULT_MPI_LINK, marked measured=False, when mpi4py or
    mpiexec is missing or the probe fails."""
    import subprocess
    import sys

    default = {"latency": DEFAULT_MPI_LINK.latency, "bandwidth": DEFAULT_MPI_LINK.bandwidth,
               "measured": False}
    mpi = mpiexec()
    if mpi is None:
        return default
    code = f"from graphdist.simulate.calibration import _mpi_probe; _mpi_probe({int(repeat)})"
    try:
        done = subprocess.run([mpi, "-n", "2", sys.executable, "-c", code], check=False,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return default
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return default
    got = json.loads(lines[-1][7:])
    fit = _fit([float(b) for b in got["bytes"]], got["seconds"])
    return {"latency": fit["a"] / 2, "bandwidth": 1 / fit["per_unit"], "measured": True,
            "workers": 2, "probe": got}


def calibrate(path=None, repeat: int = 5, mpi: bool | None = None) -> dict:
    """Measure this machine and write the calibration JSON to `path` (default
    default_calibration_path()): time models per op kind (t = a + FLOPs / peak for
    matmuls, with the GEMM rate by smallest side; a + bytes / bandwidth for elementwise
    ops and reductions), the executor's per-node overhead, the links of logical CPU
    devices (a memory copy; the fused host all-reduce per replica byte) and the link
    between 2 MPI workers of this host (`mpi`: None measures it when mpi4py and mpiexec
    are here, False writes DEFAULT_MPI_LINK). The ops run with the BLAS threads a
    one-device step of this process uses (its share of the cores: all of them, or one
    per worker process pinned to a core), as the step the model is scaled to does.

        >>> from graphdist.simulate import calibrate
        >>> cal = calibrate("/tmp/cal.json")   # doctest: +SKIP
    """
    from graphdist.device import threads

    blas = threads.share(1)       # what a one-device step runs its GEMMs with
    threads.set_blas_threads(blas)
    times = _interleaved(_probes(np.random.default_rng(0)), repeat, 0.1 * repeat)

    def points(group: str) -> tuple[list, list]:
        pairs = sorted((x, t) for (g, x), t in times.items() if g == group)
        return [x for x, _ in pairs], [t for _, t in pairs]

    kinds = {"matmul": _fit(*points("matmul"))}           # per FLOP
    a = kinds["matmul"]["a"]
    kinds["matmul"]["by_size"] = [{"size": d, "per_unit": max(t - a, t / 2) / (2 * d * 2**20)}
                                  for d, t in zip(*points("gemm"))]
    for kind in ("elementwise", "reduce"):                # per byte touched
        xs, ts = points(kind)
        kinds[kind] = _fit(xs[:3], ts[:3])                # in cache
        kinds[kind]["by_size"] = [{"size": x, "per_unit": max(t - kinds[kind]["a"], 1e-15) / x}
                                  for x, t in zip(xs, ts)]
    copy, host = _fit(*points("copy")), _fit(*points("host"))
    cal = {"version": CALIBRATION_VERSION, "machine": machine(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "blas_threads": blas, "ops": kinds,
           "node_overhead_s": _node_overhead(repeat),
           "links": {"copy": {"latency": copy["a"], "bandwidth": 1 / copy["per_unit"]},
                     "host": {"latency": host["a"], "bandwidth": 1 / host["per_unit"]},
                     "mpi": calibrate_mpi(repeat=4 * repeat) if mpi is not False else
                     {"latency": DEFAULT_MPI_LINK.latency,
                      "bandwidth": DEFAULT_MPI_LINK.bandwidth, "measured": False}}}
    path = Path(path) if path is not None else default_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal, indent=2))
    return cal


CALIBRATION_VERSION = 2      # 2: rates by size (GEMM side, bytes touched), the MPI link


def load_calibration(path=None, recalibrate: bool = False) -> dict:
    """The calibration at `path`, measured and written first when it is missing, was made
    on another machine, or `recalibrate` asks for it."""
    path = Path(path) if path is not None else default_calibration_path()
    if not recalibrate and path.exists():
        try:
            cal = json.loads(path.read_text())
            if cal.get("version") == CALIBRATION_VERSION and cal.get("machine") == machine():
                return cal
        except (OSError, ValueError):
            pass
    return calibrate(path)


def host_link(cal: dict, kind: str = "host") -> Link:
    """A link of this host, from the calibration: "host" (the fused host all-reduce, per
    replica byte), "copy" (one memory copy between logical CPU devices) or "mpi" (between
    MPI worker processes)."""
    link = cal["links"][kind]
    return Link(link["latency"], link["bandwidth"])
