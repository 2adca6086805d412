"""gd.simulate: predict a step's time and scaling efficiency on device counts this machine
cannot run, from its logical graph, per-op costs calibrated here and a link model.
Holds the link parser, the textbook collective costs per lowering, the calibration (a JSON
file in the user's cache) and the predictor; the real lowerings are in passes/collectives.py.

Scaling modes. Weak (the default): the builder decides the per-replica batch; the simulator
takes it to be the same for every device count (it checks that 1 and 2 devices agree).
Strong: the global batch (the builder's batch on 1 device) stays fixed and each of N
replicas gets global/N examples: the builder's step is traced again on its arguments cut
to that batch, and the calibrated per-op model prices the smaller shapes (rates by size:
on the machine of docs/benchmarks.md a GEMM whose smallest side is 4 costs 5x more per
FLOP than one whose smallest side is 256). Either way one replica's logical graph is replicated analytically, so
1,024 devices are never built.

Multi-worker ("mpi", MultiWorkerMirroredStrategy): each worker sums its local replicas,
then MPI all-reduces between the workers over a link calibrated between 2 MPI processes of
this host (when mpi4py and mpiexec are here); the executor calls MPI inline, so nothing
overlaps it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphdist import flags
from graphdist.ir import Var
from graphdist.runtime import warmup

# ---------------------------------------------------------------- the link model


@dataclass(frozen=True)
class Link:
    """One point-to-point link: a message of S bytes takes latency + S / bandwidth seconds."""

    latency: float        # seconds
    bandwidth: float      # bytes per second

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


DEFAULT_LINK = Link(5e-6, 25e9)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}    # exact: 5us == 5e-6
_RATE_UNITS = {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
               "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
               "Kb/s": 125.0, "Mb/s": 125e3, "Gb/s": 125e6, "Tb/s": 125e9}   # bits


def _quantity(key: str, text: str, units: dict) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*", text)
    if m is None or m.group(2) not in units:
        raise ValueError(f"--link: {key}={text!r}: expected a number and one of the units "
                         f"{', '.join(units)} (e.g. latency=5us,bandwidth=25GB/s)")
    if units is _TIME_UNITS:
        return float(m.group(1)) / _PER_SECOND[m.group(2)]
    return float(m.group(1)) * units[m.group(2)]


def parse_link(text: str) -> Link:
    """'latency=5us,bandwidth=25GB/s' as a Link (either key may be left out: the default's).

    >>> parse_link("latency=2us,bandwidth=100Gb/s")
    Link(latency=2e-06, bandwidth=12500000000.0)
    """
    values = {"latency": DEFAULT_LINK.latency, "bandwidth": DEFAULT_LINK.bandwidth}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in values:
            raise ValueError(f"--link: {part!r}: expected latency=TIME or bandwidth=RATE, "
                             "comma-separated (e.g. latency=5us,bandwidth=25GB/s)")
        values[key] = _quantity(key, value, _TIME_UNITS if key == "latency" else _RATE_UNITS)
    if values["bandwidth"] <= 0:
        raise ValueError(f"--link: bandwidth must be positive, got {text!r}")
    return Link(values["latency"], values["bandwidth"])


# ---------------------------------------------------------------- collective costs
# All-reduce of S bytes on n devices, every device with one link of latency a and bandwidth
# B (the alpha-beta model; Hockney 1994). Devices work in parallel: the cost is the
# critical path. Reduction arithmetic is not counted (it is memory-bound and overlaps).


def ring_cost(n: int, nbytes: float, link: Link) -> float:
    """Reduce-scatter + all-gather around the ring: 2(n-1) steps, each moving S/n bytes
    per link: 2(n-1)/n * S/B + 2(n-1) * a (Patarasuk & Yuan 2009, Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def one_device_cost(n: int, nbytes: float, link: Link) -> float:
    """Gather to one device and copy back: the root's link carries n-1 messages of S in and
    n-1 out, one after another: 2(n-1) * (a + S/B)."""
    return 2 * (n - 1) * link.time(nbytes) if n > 1 else 0.0


def hierarchical_cost(n: int, nbytes: float, link: Link, num_groups: int = 2) -> float:
    """As the "hierarchical" lowering: groups of m = ceil(n/g) devices sum onto their
    leader ((m-1) messages into it), the g leaders exchange partials ((g-1) messages into
    each), and each leader copies the result back ((m-1) out): (2(m-1) + g-1) * (a + S/B).
    num_groups=round(sqrt(n)) gives the O(sqrt n) two-level scheme."""
    if n <= 1:
        return 0.0
    g = max(1, min(num_groups, n))
    m = math.ceil(n / g)
    return (2 * (m - 1) + (g - 1)) * link.time(nbytes)


def host_cost(n: int, nbytes: float, link: Link) -> float:
    """One fused pass over n host buffers (HostAllReduce on logical CPU devices): reads n
    buffers and writes n results: a + n * S / B, with B the calibrated host rate."""
    return link.latency + n * nbytes / link.bandwidth if n > 1 else 0.0


def all_gather_cost(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather of n pieces of S bytes: (n-1) * (a + S/B) (Thakur et al. 2005)."""
    return (n - 1) * link.time(nbytes) if n > 1 else 0.0


def broadcast_cost(n: int, nbytes: float, link: Link) -> float:
    """Binomial-tree broadcast: ceil(log2 n) * (a + S/B)."""
    return math.ceil(math.log2(n)) * link.time(nbytes) if n > 1 else 0.0


def mpi_cost(n: int, nbytes: float, link: Link, devices_per_worker: int = 1,
             local: Link | None = None) -> float:
    """What a MultiWorkerMirroredStrategy all-reduce runs (the "mpi" lowering, one node):
    each worker copies its first replica's S bytes into the result, adds its other k-1
    replicas, all-reduces the sum with MPI between the W = ceil(n/k) workers (a ring, as
    MPICH's large-message all-reduce: ring_cost(W, S, link)), divides for the mean and
    copies the result to its other replicas: local passes touching (5k-1) S bytes, priced
    by `local` (this host's elementwise rate; None: free)."""
    if n <= 1:
        return 0.0
    k = max(1, devices_per_worker)
    local = local or Link(0.0, math.inf)
    return ring_cost(math.ceil(n / k), nbytes, link) + local.time((5 * k - 1) * nbytes)


# NCCL runs rings for large messages: priced as the ring
COSTS = {"ring": ring_cost, "one_device": one_device_cost, "hierarchical": hierarchical_cost,
         "host": host_cost, "nccl": ring_cost, "mpi": mpi_cost}
# lowerings the executor runs inline, in the program's own thread: nothing overlaps them
BLOCKING = {"mpi"}
# the link between workers when MPI cannot be measured here (no mpi4py or mpiexec):
# shared memory between processes of one host, roughly
DEFAULT_MPI_LINK = Link(5e-6, 5e9)


def shared_host_cost(lowering: str, n: int, nbytes: float, link: Link,
                     num_groups: int = 2, add: Link | None = None) -> float:
    """The same all-reduce among n logical devices of one host: nothing runs in parallel,
    so every copy and add of the lowering is paid: ring n*2(n-1) copies and n(n-1) adds of
    S/n, one_device 2(n-1) copies and n-1 adds of S, hierarchical 2(n-g) + g(g-1) copies
    and n-g + g(g-1) adds of S; host one fused pass. `add`: the time of an add reading two
    buffers of S bytes and writing one (priced as 3S bytes); None: adds are free."""
    if n <= 1:
        return 0.0
    add = add or Link(0.0, math.inf)
    if lowering == "ring":
        return (2 * (n - 1) * nbytes / link.bandwidth + 2 * n * (n - 1) * link.latency
                + n * (n - 1) * add.time(3 * nbytes / n))
    if lowering == "hierarchical":
        g = max(1, min(num_groups, n))
        return ((2 * (n - g) + g * (g - 1)) * link.time(nbytes)
                + (n - g + g * (g - 1)) * add.time(3 * nbytes))
    if lowering == "host":
        return host_cost(n, nbytes, link)
    return one_device_cost(n, nbytes, link) + (n - 1) * add.time(3 * nbytes)


# ---------------------------------------------------------------- calibration


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
    code = f"from graphdist.simulate import _mpi_probe; _mpi_probe({int(repeat)})"
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


_MATMUL = ("matmul", "conv", "einsum", "dot")


def op_kind(name: str) -> str:
    if any(k in name for k in _MATMUL):
        return "matmul"
    return "reduce" if name.startswith(("reduce", "sum", "mean", "softmax", "max")) \
        else "elementwise"


def per_unit(model: dict, size: float | None) -> float:
    """Seconds per unit of work (a FLOP, a byte touched) of an op of this `size` (a GEMM's
    smallest side, an elementwise op's bytes touched): the calibrated rates by size,
    interpolated in log(size) and held flat past the ends (None: the overall fit). A
    thin GEMM runs below the BLAS peak; a pass over buffers past the cache runs at the
    memory's rate."""
    table = model.get("by_size")
    if not table or size is None:
        return model["per_unit"]
    sizes = [math.log(r["size"]) for r in table]
    return float(np.interp(math.log(max(size, 1)), sizes, [r["per_unit"] for r in table]))


def _smallest_side(eqn) -> int | None:
    """min(M, K, N) of a 2-D matmul (batched: of its last two axes); None for others."""
    shapes = [v.ty.shape for v in eqn.inputs]
    if eqn.op.name != "matmul" or len(shapes) != 2 or min(map(len, shapes)) < 2:
        return None
    (m, k), n = shapes[0][-2:], shapes[1][-1]
    return min(m, k, n)


def eqn_seconds(eqn, cal: dict) -> float:
    """The calibrated model's time of one eqn: per-node overhead + a + work / rate."""
    flops, nbytes = eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                                dict(eqn.params))
    kind = op_kind(eqn.op.name)
    model = cal["ops"][kind]
    if kind == "matmul":
        return (cal["node_overhead_s"] + model["a"]
                + flops * per_unit(model, _smallest_side(eqn)))
    return cal["node_overhead_s"] + model["a"] + nbytes * per_unit(model, nbytes)


# ---------------------------------------------------------------- scheduling, collectives


def _payload(eqn) -> int:
    return sum(v.ty.nbytes for v in eqn.inputs if isinstance(v, Var))


def _step_time(items, serial: bool) -> float:
    """List-schedule the eqns: compute in program order on the device, collectives on the
    link as soon as their inputs are ready (a bucket whose gradients are ready early
    overlaps the compute that follows), each eqn after the values it reads. `serial`
    (logical devices of one host, or a lowering the executor runs inline): nothing
    overlaps."""
    if serial:
        return sum(t for _, t, _ in items)
    ready, clock, wire = {}, 0.0, 0.0
    for eqn, t, comm in items:
        deps = max((ready.get(v, 0.0) for v in eqn.inputs if isinstance(v, Var)), default=0.0)
        start = max(wire if comm else clock, deps)
        if comm:
            wire = start + t
        else:
            clock = start + t
        for v in eqn.outputs:
            ready[v] = start + t
    return max(clock, wire)


@dataclass(frozen=True)
class _Costs:
    """How one prediction prices its collectives."""

    lowering: str
    link: Link
    shared_host: bool
    num_groups: int | None
    add: Link                 # one elementwise pass on this host, per byte touched
    devices_per_worker: int = 1
    link_from: str = "default"          # where `link` came from, for the table's header
    lowering_from: str = "given"        # where `lowering` came from

    def assumed(self) -> dict:
        """The keys every row of simulate() gets: what its collectives were priced with."""
        groups = (self.num_groups or "sqrt(n)") if self.lowering == "hierarchical" else None
        return {"lowering": self.lowering, "lowering_from": self.lowering_from,
                **({"num_groups": groups} if groups is not None else {}),
                "link_latency_s": self.link.latency, "link_bandwidth_Bps": self.link.bandwidth,
                "link_from": self.link_from}


def _collective_seconds(eqn, n: int, c: _Costs) -> float:
    nbytes = _payload(eqn)
    groups = c.num_groups or max(1, round(math.sqrt(n)))
    if eqn.op.name == "all_gather":
        return all_gather_cost(n, nbytes, c.link)
    if eqn.op.name == "broadcast":
        return broadcast_cost(n, nbytes, c.link)
    if c.lowering == "mpi":
        return mpi_cost(n, nbytes, c.link, c.devices_per_worker, c.add)
    if c.shared_host:
        return shared_host_cost(c.lowering, n, nbytes, c.link, groups, c.add)
    if c.lowering == "hierarchical":
        return hierarchical_cost(n, nbytes, c.link, groups)
    return COSTS[c.lowering](n, nbytes, c.link)


def _lowering_of(f) -> str:
    names = {e.op.name for e in f.replicated_graph.eqns}
    for node, lowering in (("host_all_reduce", "host"), ("host_reduce_update", "host"),
                           ("nccl_all_reduce", "nccl"), ("mpi_all_reduce", "mpi")):
        if node in names:
            return lowering
    return "ring"


def _compute_flops(g) -> int:
    return sum(e.op.cost([v.ty for v in e.inputs], [v.ty for v in e.outputs],
                         dict(e.params))[0] for e in g.eqns if not e.op.collective)


# ---------------------------------------------------------------- strong scaling


def batch_of(args) -> int | None:
    """The (per-replica) batch of a step's arguments: the leading axis of the first array
    among them (of replica 0's value for per-replica arguments)."""
    from graphdist.pytree import flatten

    arrays = [x for x in flatten(args)[0] if getattr(x, "ndim", 0) >= 1]
    return int(arrays[0].shape[0]) if arrays else None


def _cut(args, old: int, new: int):
    """The arguments with every array whose leading axis is `old` cut to its first `new`."""
    from graphdist.pytree import flatten, unflatten

    leaves, _, tree = flatten(args)
    return unflatten(tree, [x[:new] if getattr(x, "ndim", 0) >= 1 and x.shape[0] == old
                            else x for x in leaves])


def per_replica_batch(global_batch: int, n: int) -> int:
    """global_batch / n, which must be a whole number of examples, at least 1."""
    if global_batch < n:
        raise ValueError(f"simulate (strong scaling): a global batch of {global_batch} "
                         f"examples on {n} devices leaves each replica "
                         f"{global_batch / n:.3g} examples, fewer than 1; use at most "
                         f"{global_batch} devices or a larger global batch")
    if global_batch % n:
        raise ValueError(f"simulate (strong scaling): the global batch of {global_batch} "
                         f"examples does not split evenly among {n} devices "
                         f"({global_batch} / {n} = {global_batch / n:.3g} per replica); "
                         "choose device counts that divide it")
    return global_batch // n


def _strong_graphs(devices, args1, g1, f2, args2, g2) -> tuple[dict, int]:
    """{per-replica batch: logical graph traced at it}, for global/n with each n in
    `devices` (and 1), and the global batch (the builder's batch on 1 device). The builder's
    2-device step is traced again on its arguments cut to the smaller batch."""
    total, per2 = batch_of(args1), batch_of(args2)
    if total is None or per2 is None:
        raise ValueError("simulate (strong scaling): the builder's step takes no array "
                         "argument with a batch axis to split among the replicas")
    graphs = {}
    for n in sorted({1, *devices}):
        b = per_replica_batch(total, n)
        if b == per2:
            graphs[b] = g2
        elif b < per2:
            graphs[b] = f2.get_graph(*_cut(args2, per2, b))
        elif n == 1:
            graphs[b] = g1
        else:
            raise ValueError(f"simulate (strong scaling): the builder gives each of 2 "
                             f"replicas {per2} examples, fewer than the {b} that {n} "
                             f"devices need of a global batch of {total}; build n=2 with "
                             "the global batch split in 2 (or per replica)")
    return graphs, total


# ---------------------------------------------------------------- the predictor


def _resolve(cross_device_ops, f2, link, cal: dict, shared_host: bool, num_groups,
             devices_per_worker: int) -> _Costs:
    """The lowering, link and knobs a prediction prices its collectives with, and where
    each came from (the table says so: a prediction is only as good as what it assumed)."""
    lowering_from = "given"
    if isinstance(cross_device_ops, str):
        lowering = cross_device_ops
    elif getattr(cross_device_ops, "lowering", None):
        lowering = cross_device_ops.lowering
        lowering_from = f"given: {type(cross_device_ops).__name__}"
    else:
        lowering = _lowering_of(f2)
        lowering_from = f"the builder's step lowers to {lowering}"
    if lowering == "host" and not shared_host and cross_device_ops is None:
        lowering = "ring"        # the host's fused pass has no meaning across machines
        lowering_from = ("the builder's step uses the host's fused all-reduce, which only "
                         "joins devices of one process; priced as ring across machines")
    if lowering not in COSTS:
        raise ValueError(f"simulate: no cost model for cross-device ops {lowering!r} "
                         f"(have: {', '.join(sorted(COSTS))})")
    if lowering == "mpi" and shared_host:
        raise ValueError("simulate: the mpi lowering runs one process per worker, not "
                         "logical devices of one process; drop shared_host (local replicas "
                         "per worker: devices_per_worker)")
    link_from = "given" if link is not None else "default"
    if link is None and shared_host:      # each copy is a node: its overhead too
        kind = "host" if lowering == "host" else "copy"
        base = host_link(cal, kind)
        link = Link(base.latency + cal["node_overhead_s"], base.bandwidth)
        link_from = (f"this host's {'fused all-reduce' if kind == 'host' else 'memory copy'}"
                     ", calibrated, plus the executor's per-node overhead")
    if link is None and lowering == "mpi":
        link = host_link(cal, "mpi")      # between workers of this host, as calibrated
        link_from = ("calibrated between 2 MPI processes of this host"
                     if cal["links"]["mpi"].get("measured", True) else
                     "assumed for processes of one host: MPI could not be measured here")
    if cross_device_ops is not None and not isinstance(cross_device_ops, str):
        num_groups = num_groups or cross_device_ops.options().get("num_groups")
    link = parse_link(link) if isinstance(link, str) else (link or DEFAULT_LINK)
    ew = cal["ops"]["elementwise"]        # the adds of a copy-based lowering on one host
    add = Link(cal["node_overhead_s"] + ew["a"], 1 / ew["per_unit"])
    return _Costs(lowering, link, shared_host, num_groups, add, max(1, devices_per_worker),
                  link_from, lowering_from)


def _row(n: int, g, model: dict, costs: _Costs) -> dict:
    """One device count's prediction on logical graph g (`model`: compute eqn -> seconds)."""
    replicas_here = n if costs.shared_host else (
        min(n, costs.devices_per_worker) if costs.lowering == "mpi" else 1)
    items = [(e, model[e] * replicas_here, False) if e in model else
             (e, _collective_seconds(e, n, costs), True) for e in g.eqns]
    step = _step_time(items, costs.shared_host or costs.lowering in BLOCKING)
    return {"devices": n, "step_s": step,
            "compute_s": sum(t for _, t, c in items if not c),
            "comm_s": sum(t for _, t, c in items if c), **costs.assumed()}


def _seconds_text(seconds: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _rate_text(per_second: float) -> str:
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if per_second >= size:
            return f"{per_second / size:.3g} {unit}"
    return f"{per_second:.3g} B/s"


def assumptions(row: dict) -> str:
    """The line saying what a row of simulate() assumed: the link and the lowering, and
    where each came from (default, given, calibrated, the builder's step)."""
    lowering = row["lowering"]
    if "num_groups" in row:
        lowering += f", {row['num_groups']} groups"
    return (f"link: latency {_seconds_text(row['link_latency_s'])}, bandwidth "
            f"{_rate_text(row['link_bandwidth_Bps'])} ({row['link_from']}); "
            f"lowering: {lowering} ({row['lowering_from']})")


def format_table(rows: list[dict]) -> str:
    """simulate()'s rows as the table `graphdist simulate` prints, under the line saying
    which link and lowering priced the collectives."""
    lines = [assumptions(rows[0]) if rows else "",
             f"{'devices':>8} {'step ms':>10} {'compute ms':>11} {'comm ms':>10} "
             f"{'efficiency':>10}"]
    lines += [f"{r['devices']:>8} {r['step_s'] * 1e3:>10.3f} {r['compute_s'] * 1e3:>11.3f} "
              f"{r['comm_s'] * 1e3:>10.3f} {r['efficiency']:>10.3f}" for r in rows]
    return "\n".join(lines)


def simulate(builder, devices, link=None, cross_device_ops=None, *, scaling: str = "weak",
             calibration=None, recalibrate: bool = False, measure: bool = True,
             shared_host: bool = False, num_groups: int | None = None,
             devices_per_worker: int = 1, repeat: int = 5, min_seconds: float = 1.0,
             compute_s: float | None = None) -> list[dict]:
    """Predict the builder's step on each device count; one dict per count with keys
    `devices`, `step_s`, `compute_s`, `comm_s`, `efficiency`, and what it assumed:
    `lowering` (with `num_groups` for hierarchical), `link_latency_s`, `link_bandwidth_Bps`,
    and `lowering_from` / `link_from`, where each came from (`format_table` prints them).

    builder(n) -> (f, args) as for `graphdist bench`; it runs at n=1 (measured: the best
    of `repeat` steps, sampled for at least `min_seconds`, scales the calibrated per-op
    model to this step; with measure=False the model alone prices the graph) and is traced
    at n=2 (its logical graph gives the collectives and their payloads). `compute_s`: the
    1-device step time measured elsewhere (then it is not run). `link`: a Link or
    'latency=5us,bandwidth=25GB/s' (default 25 GB/s, 5 us; for the mpi lowering, the MPI
    link calibrated between 2 workers of this host). `cross_device_ops`: a lowering name
    (ring, hierarchical, one_device, host, nccl, mpi) or CrossDeviceOps; default: the
    builder's own.

    `scaling`: "weak" (each replica keeps the builder's per-replica batch; efficiency =
    T1 / TN) or "strong" (the builder's batch on 1 device is the global batch, split
    among the N replicas, which must leave each a whole number of examples, at least 1;
    efficiency = T1 / (N * TN)). `shared_host=True` models logical devices of this one
    host (replicas and copies run one after another). `devices_per_worker` (mpi): local
    replicas per worker process, which run one after another and sum before MPI.

        >>> gd.simulate(build, [1, 8, 1024], link="latency=5us,bandwidth=25GB/s")
        ... # doctest: +SKIP
    """
    devices = [int(n) for n in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"simulate: device counts must be integers >= 1, got {devices}")
    if scaling not in ("weak", "strong"):
        raise ValueError(f"simulate: scaling must be 'weak' or 'strong', got {scaling!r}")
    cal = load_calibration(calibration, recalibrate)
    f1, args1 = builder(1)
    g1 = f1.get_graph(*args1)
    f2, args2 = builder(2)
    g2 = f2.get_graph(*args2)
    if scaling == "strong":
        graphs, total = _strong_graphs(devices, args1, g1, f2, args2, g2)
        graph_of = {n: graphs[total // n] for n in {1, *devices}}
    else:
        flops1, flops2 = _compute_flops(g1), _compute_flops(g2)
        if abs(flops1 - flops2) > 0.05 * max(flops1, flops2, 1):
            raise ValueError(f"simulate models weak scaling by default (the same "
                             f"per-replica batch at every device count), but the builder's "
                             f"step does {flops1:,} FLOPs per replica on 1 device and "
                             f"{flops2:,} on 2; give each replica the same batch (global "
                             "batch = per-replica batch * n), or pass scaling='strong' "
                             "(--scaling strong) for a fixed global batch")
        graph_of = dict.fromkeys({1, *devices}, g2)
    costs = _resolve(cross_device_ops, f2, link, cal, shared_host, num_groups,
                     devices_per_worker)
    scale = 1.0
    if compute_s is not None or measure:
        # the best of `repeat` steps: what the step costs when nothing else runs
        measured = compute_s if compute_s is not None else best_time(
            lambda: f1(*args1), repeat, min_seconds)
        # scaled on the 1-device graph: what only n > 1 runs (packing the gradient buckets)
        # keeps its modelled cost
        one = sum(eqn_seconds(e, cal) for e in g1.eqns if not e.op.collective)
        scale = measured / max(one, 1e-12)
    models = {id(g): {e: eqn_seconds(e, cal) * scale for e in g.eqns if not e.op.collective}
              for g in graph_of.values()}
    out = [_row(n, graph_of[n], models[id(graph_of[n])], costs) for n in devices]
    base = sum(models[id(graph_of[1])].values())        # T1: one device, no collectives
    for row in out:
        n = row["devices"] if scaling == "strong" else 1
        row["efficiency"] = base / (n * row["step_s"]) if row["step_s"] else 1.0
    return out
