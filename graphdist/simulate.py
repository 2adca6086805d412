"""gd.simulate: predict a step's time and scaling efficiency on device counts this machine
cannot run, from its logical graph, per-op costs calibrated here and a link model.
Holds the link parser, the textbook collective costs per lowering, the calibration (a JSON
file in the user's cache) and the predictor; the real lowerings are in passes/collectives.py.

Scaling mode: weak scaling. The builder decides the per-replica batch; the simulator takes
it to be the same for every device count (it checks that 1 and 2 devices agree) and
replicates one replica's logical graph analytically, so 1,024 devices are never built.
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


# NCCL and MPI run rings for large messages: priced as the ring
COSTS = {"ring": ring_cost, "one_device": one_device_cost, "hierarchical": hierarchical_cost,
         "host": host_cost, "nccl": ring_cost, "mpi": ring_cost}


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


def _median_time(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def best_time(fn, repeat: int, min_seconds: float = 0.0) -> float:
    """The least of at least `repeat` timed calls (more until `min_seconds` have passed, at
    most 50x) after one untimed: the cost with nothing else running on a shared machine."""
    fn()
    best, start, k = math.inf, time.perf_counter(), 0
    while k < repeat or (time.perf_counter() - start < min_seconds and k < 50 * repeat):
        t0 = time.perf_counter()
        fn()
        best, k = min(best, time.perf_counter() - t0), k + 1
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
    return max((_median_time(lambda: long_(x), repeat)
                - _median_time(lambda: short(x), repeat)) / 40, 0.0)


def calibrate(path=None, repeat: int = 5) -> dict:
    """Measure this machine and write the calibration JSON to `path` (default
    default_calibration_path()): time models per op kind (t = a + FLOPs / peak for
    matmuls, a + bytes / bandwidth for elementwise ops and reductions), the executor's
    per-node overhead, and the links of logical CPU devices (a memory copy; the fused host
    all-reduce per replica byte).

        >>> from graphdist.simulate import calibrate
        >>> cal = calibrate("/tmp/cal.json")   # doctest: +SKIP
    """
    from graphdist.runtime.kernel_table import host_all_reduce_cpu

    rng = np.random.default_rng(0)
    kinds, xs, ts = {}, [], []
    for m in (64, 128, 256):
        a, b = rng.standard_normal((2, m, m)).astype(np.float32)
        xs.append(2.0 * m**3)
        ts.append(_median_time(lambda a=a, b=b: a @ b, repeat))
    kinds["matmul"] = _fit(xs, ts)            # per FLOP
    for kind, fn in (("elementwise", lambda x, o: np.add(x, x)),
                     ("reduce", lambda x, o: np.sum(x.reshape(-1, 64), axis=1))):
        xs, ts = [], []
        for size in (2**12, 2**16, 2**20):
            x, o = np.ones(size, np.float32), np.empty(size, np.float32)
            xs.append(3.0 * x.nbytes if kind == "elementwise" else x.nbytes * 1.02)
            ts.append(_median_time(lambda x=x, o=o, fn=fn: fn(x, o), repeat))
        kinds[kind] = _fit(xs, ts)            # per byte touched
    xs, ts = [], []
    for size in (2**16, 2**20, 2**24):       # into a new buffer, as copy_to does
        x = np.ones(size // 4, np.float32)
        xs.append(float(size))
        ts.append(_median_time(lambda x=x: x.copy(), repeat))
    copy = _fit(xs, ts)
    xs, ts = [], []
    for n in (2, 4):
        for size in (2**14, 2**17, 2**20):
            bufs = [np.ones(size, np.float32) for _ in range(n)]
            outs = tuple(np.empty_like(b) for b in bufs)
            xs.append(float(n * bufs[0].nbytes))
            ts.append(_median_time(lambda b=bufs, o=outs: host_all_reduce_cpu(o, *b, op="sum"),
                                   repeat))
    host = _fit(xs, ts)
    cal = {"version": 1, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "ops": kinds, "node_overhead_s": _node_overhead(repeat),
           "links": {"copy": {"latency": copy["a"], "bandwidth": 1 / copy["per_unit"]},
                     "host": {"latency": host["a"], "bandwidth": 1 / host["per_unit"]}}}
    path = Path(path) if path is not None else default_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal, indent=2))
    return cal


def load_calibration(path=None, recalibrate: bool = False) -> dict:
    """The calibration at `path`, measured and written first when it is missing, was made
    on another machine, or `recalibrate` asks for it."""
    path = Path(path) if path is not None else default_calibration_path()
    if not recalibrate and path.exists():
        try:
            cal = json.loads(path.read_text())
            if cal.get("version") == 1 and cal.get("machine") == machine():
                return cal
        except (OSError, ValueError):
            pass
    return calibrate(path)


def host_link(cal: dict, kind: str = "host") -> Link:
    """The link between logical CPU devices of this host, from the calibration: "host"
    (the fused host all-reduce, per replica byte) or "copy" (one memory copy)."""
    return Link(**cal["links"][kind])


_MATMUL = ("matmul", "conv", "einsum", "dot")


def op_kind(name: str) -> str:
    if any(k in name for k in _MATMUL):
        return "matmul"
    return "reduce" if name.startswith(("reduce", "sum", "mean", "softmax", "max")) \
        else "elementwise"


def eqn_seconds(eqn, cal: dict) -> float:
    """The calibrated model's time of one eqn: per-node overhead + a + work / rate."""
    flops, nbytes = eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                                dict(eqn.params))
    kind = op_kind(eqn.op.name)
    model = cal["ops"][kind]
    work = flops if kind == "matmul" else nbytes
    return cal["node_overhead_s"] + model["a"] + work * model["per_unit"]


# ---------------------------------------------------------------- the predictor


def _payload(eqn) -> int:
    return sum(v.ty.nbytes for v in eqn.inputs if isinstance(v, Var))


def _step_time(items, shared_host: bool) -> float:
    """List-schedule the eqns: compute in program order on the device, collectives on the
    link as soon as their inputs are ready (a bucket whose gradients are ready early
    overlaps the compute that follows), each eqn after the values it reads. On a shared
    host nothing overlaps."""
    if shared_host:
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


def _collective_seconds(eqn, n: int, lowering: str, link: Link, shared_host: bool,
                        num_groups, add: Link | None = None) -> float:
    nbytes = _payload(eqn)
    groups = num_groups or max(1, round(math.sqrt(n)))
    if eqn.op.name == "all_gather":
        return all_gather_cost(n, nbytes, link)
    if eqn.op.name == "broadcast":
        return broadcast_cost(n, nbytes, link)
    if shared_host:
        return shared_host_cost(lowering, n, nbytes, link, groups, add)
    if lowering == "hierarchical":
        return hierarchical_cost(n, nbytes, link, groups)
    return COSTS[lowering](n, nbytes, link)


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


def simulate(builder, devices, link=None, cross_device_ops=None, *, calibration=None,
             recalibrate: bool = False, measure: bool = True, shared_host: bool = False,
             num_groups: int | None = None, repeat: int = 5,
             min_seconds: float = 1.0, compute_s: float | None = None) -> list[dict]:
    """Predict the builder's step on each device count; one dict per count with keys
    `devices`, `step_s`, `compute_s`, `comm_s`, `efficiency`.

    builder(n) -> (f, args) as for `graphdist bench`; it runs at n=1 (measured: the median
    of `repeat` steps, sampled for at least `min_seconds`, is the per-replica compute; with measure=False the calibrated per-op
    model prices the graph instead) and is traced at n=2 (its logical graph gives the
    collectives and their payloads). `compute_s`: the 1-device step time measured
    elsewhere (then it is not run). `link`: a Link or 'latency=5us,bandwidth=25GB/s'
    (default 25 GB/s, 5 us). `cross_device_ops`: a lowering name (ring, hierarchical,
    one_device, host, nccl, mpi) or CrossDeviceOps; default: the builder's own.
    `shared_host=True` models logical devices of this one host (replicas and copies run
    one after another). Efficiency = step_s(1) / step_s(n): per-device throughput against
    one device under weak scaling, at most 1.

        >>> gd.simulate(build, [1, 8, 1024], link="latency=5us,bandwidth=25GB/s")
        ... # doctest: +SKIP
    """
    devices = [int(n) for n in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"simulate: device counts must be integers >= 1, got {devices}")
    cal = load_calibration(calibration, recalibrate)
    f1, args1 = builder(1)
    g1 = f1.get_graph(*args1)
    f2, args2 = builder(2)
    g2 = f2.get_graph(*args2)
    flops1, flops2 = _compute_flops(g1), _compute_flops(g2)
    if abs(flops1 - flops2) > 0.05 * max(flops1, flops2, 1):
        raise ValueError(f"simulate models weak scaling (the same per-replica batch at every "
                         f"device count), but the builder's step does {flops1:,} FLOPs per "
                         f"replica on 1 device and {flops2:,} on 2; give each replica the "
                         "same batch (global batch = per-replica batch * n)")
    lowering = cross_device_ops if isinstance(cross_device_ops, str) else (
        getattr(cross_device_ops, "lowering", None) or _lowering_of(f2))
    if lowering == "host" and not shared_host and cross_device_ops is None:
        lowering = "ring"        # the host's fused pass has no meaning across machines
    if link is None and shared_host:      # each copy is a node: its overhead too
        base = host_link(cal, "host" if lowering == "host" else "copy")
        link = Link(base.latency + cal["node_overhead_s"], base.bandwidth)
    if lowering not in COSTS:
        raise ValueError(f"simulate: no cost model for cross-device ops {lowering!r} "
                         f"(have: {', '.join(sorted(COSTS))})")
    if cross_device_ops is not None and not isinstance(cross_device_ops, str):
        num_groups = num_groups or cross_device_ops.options().get("num_groups")
    link = parse_link(link) if isinstance(link, str) else (link or DEFAULT_LINK)
    model = [(e, eqn_seconds(e, cal)) for e in g2.eqns if not e.op.collective]
    scale = 1.0
    if compute_s is not None or measure:
        # the best of `repeat` steps: what the step costs when nothing else runs
        measured = compute_s if compute_s is not None else best_time(
            lambda: f1(*args1), repeat, min_seconds)
        # scaled on the 1-device graph: what only n > 1 runs (packing the gradient buckets)
        # keeps its modelled cost
        one = sum(eqn_seconds(e, cal) for e in g1.eqns if not e.op.collective)
        scale = measured / max(one, 1e-12)
    compute = {e: t * scale for e, t in model}
    ew = cal["ops"]["elementwise"]        # the adds of a copy-based lowering on one host
    add = Link(cal["node_overhead_s"] + ew["a"], 1 / ew["per_unit"])
    out = []
    for n in devices:
        items = [(e, compute[e] * (n if shared_host else 1), False) if e in compute else
                 (e, _collective_seconds(e, n, lowering, link, shared_host, num_groups,
                                         add), True)
                 for e in g2.eqns]
        step = _step_time(items, shared_host)
        out.append({"devices": n, "step_s": step,
                    "compute_s": sum(t for _, t, c in items if not c),
                    "comm_s": sum(t for _, t, c in items if c)})
    base = sum(compute.values())
    for row in out:
        row["efficiency"] = base / row["step_s"] if row["step_s"] else 1.0
    return out
