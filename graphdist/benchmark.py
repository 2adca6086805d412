"""gd.benchmark: time the user's own compiled step on several device counts, what
`graphdist bench MODULE:BUILDER` prints. Installed with the package; the project's
side-by-side suite against the peers stays in the source checkout's bench/."""

from __future__ import annotations

import statistics
import sys
import time

from graphdist import config
from graphdist.device.backends import backend_for
from graphdist.function import Function
from graphdist.progress import ProgressBar
from graphdist.runtime import warmup
from graphdist.runtime.profile import profile_report

WARMUP = 2        # calls after the first (compiling) one, neither timed nor reported


class BuilderError(TypeError):
    """A builder that does not return (gd.function, args) for the device count asked."""


def device_counts(devices) -> list[int]:
    """`devices` (an int, "1,2,4" or an iterable of ints) as a list of distinct counts >= 1."""
    items = devices.split(",") if isinstance(devices, str) else (
        [devices] if isinstance(devices, int) else list(devices))
    counts = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        try:
            n = int(text) if not isinstance(text, (bool, float)) else None
        except (TypeError, ValueError):
            n = None
        if n is None or n < 1:
            raise ValueError(f"device counts: expected integers >= 1 such as 1,2,4, got "
                             f"{item!r} in {devices!r}")
        if n in counts:
            raise ValueError(f"device counts: {n} is listed twice in {devices!r}")
        counts.append(n)
    if not counts:
        raise ValueError("device counts: expected at least one, such as 1,2,4")
    return counts


def benchmark(builder, devices=(1, 2, 4), steps: int = 20, mode: str | None = None, *,
              progress: bool = False, overlap: bool | None = None) -> list[dict]:
    """Time `builder(n)`'s step for each device count n: one dict per count.

    The builder takes n and returns `(f, args)`: a gd.function on a strategy over n devices
    and the arguments to call it with. Its first call (trace and compile) is reported as
    `first_call_s`; after WARMUP more calls, `steps` calls are timed one by one (`median_s`,
    `min_s`, `max_s`, `spread` = (max - min) / median, `steps_per_s`). One profiled call
    gives `compute_s` and `collective_s`: its node times summed by category over every
    device, and `collective_share`; and `exposed_s`, the collective time no compute covered
    (`gd.profile_report`). `mode` sets gd.config.set_device_concurrency for the run, and
    `overlap` gd.config.set_overlap (both restored after; `overlap` is then in each row).
    Every call is a real step: it updates the variables.

    Split the batch among the replicas, as below: a plain array reaches every replica
    whole, so each would process the whole global batch (n times the work per replica).

    >>> def build(n):
    ...     strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    ...     with strategy.scope():
    ...         w = gd.Variable(np.zeros((4, 2), np.float32))
    ...     step = gd.function(lambda x: strategy.run(lambda x: gd.reduce_sum(x @ w),
    ...                                               args=(x,)))
    ...     x = np.ones((8 * n, 4), np.float32)              # 8 rows per replica
    ...     return step, (next(iter(strategy.experimental_distribute_dataset([x]))),)
    >>> [r["devices"] for r in gd.benchmark(build, devices=(1, 2), steps=3)]
    [1, 2]
    """
    counts = device_counts(devices)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gd.benchmark: steps must be an integer >= 1, got {steps!r}")
    if mode is not None and mode not in config.DEVICE_CONCURRENCY:
        raise ValueError(f"gd.benchmark: mode must be one of {config.DEVICE_CONCURRENCY}, "
                         f"got {mode!r}")
    before, overlapped = config.device_concurrency(), config.overlap()
    if mode is not None:
        config.set_device_concurrency(mode)
    if overlap is not None:
        config.set_overlap(overlap)
    try:
        rows = [_measure(builder, n, steps, progress) for n in counts]
    finally:
        config.set_device_concurrency(before)
        config.set_overlap(overlapped)
    if overlap is not None:
        for row in rows:
            row["overlap"] = bool(overlap)
    return rows


def _built(builder, n: int):
    result = builder(n)
    name = f"{getattr(builder, '__name__', 'builder')}({n})"
    expected = "(f, args): a gd.function and the tuple of arguments to call it with"
    if isinstance(result, Function):
        raise BuilderError(f"{name} returned a gd.function alone; return {expected}")
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Function)
            and isinstance(result[1], (tuple, list))):
        got = (f"({', '.join(type(r).__name__ for r in result)})"
               if isinstance(result, tuple) else f"a {type(result).__name__}")
        raise BuilderError(f"{name} must return {expected}; got {got}")
    return result[0], tuple(result[1])


def _measure(builder, n: int, steps: int, progress: bool) -> dict:
    f, args = _built(builder, n)
    start = time.perf_counter()
    f(*args)
    placed = f.replicated_graph.devices
    syncs = [backend_for(d).synchronize for d in placed if backend_for(d).ordered]
    for sync in syncs:
        sync()
    first = time.perf_counter() - start
    warmup.wait()                   # time the step on its kernels, not on the numpy forms
    if (len(placed) or 1) != n:
        raise BuilderError(f"{getattr(builder, '__name__', 'builder')}({n}) built a step on "
                           f"{len(placed) or 1} device(s), not {n}: put its strategy on the n "
                           "devices the builder is given")
    total = WARMUP + steps
    bar = ProgressBar(total, stream=sys.stderr) if progress else None
    samples = []
    for i in range(total):
        t0 = time.perf_counter()
        f(*args)
        for sync in syncs:          # a GPU step's time is the GPU's, not its launches'
            sync()
        if i >= WARMUP:
            samples.append(time.perf_counter() - t0)
        if bar is not None and (bar.tty or i + 1 == total):   # logs get one line per count
            bar.update(i + 1, f"{n} device(s)")
    f.profile(*args)                # the first builds the instrumented program
    trace = f.profile(*args)
    by_category, seen = {"compute": 0.0, "collective": 0.0}, set()
    for event in trace["traceEvents"]:
        if event.get("cat") in by_category:
            once = (event["args"].get("node"), event["ts"])   # a collective is on each lane
            if event["cat"] == "collective" and once in seen:
                continue
            seen.add(once)
            by_category[event["cat"]] += event["dur"] * 1e-6
    compute, collective = by_category["compute"], by_category["collective"]
    report = profile_report(trace)
    median = statistics.median(samples)
    return {"devices": n, "mode": config.device_concurrency(), "steps": steps,
            "first_call_s": first, "median_s": median, "min_s": min(samples),
            "max_s": max(samples), "spread": (max(samples) - min(samples)) / median,
            "steps_per_s": 1.0 / median, "compute_s": compute, "collective_s": collective,
            "collective_share": collective / ((compute + collective) or 1.0),
            "exposed_s": report["exposed_s"], "exposed_fraction": report["exposed_fraction"]}


def format_overlap_table(rows: list[dict], title: str = "") -> str:
    """benchmark() rows with overlap on and off (`graphdist bench --overlap`): per device
    count, the step's median and the profiled step's compute, collective and exposed
    collective time (the collective time no compute covered)."""
    header = ["devices", "overlap", "median ms", "compute ms", "collective ms", "exposed ms",
              "exposed"]
    cells = [header] + [[str(r["devices"]), "on" if r["overlap"] else "off",
                         f"{r['median_s'] * 1e3:.3f}", f"{r['compute_s'] * 1e3:.3f}",
                         f"{r['collective_s'] * 1e3:.3f}", f"{r['exposed_s'] * 1e3:.3f}",
                         f"{r['exposed_fraction']:.0%}"] for r in rows]
    return _text_table(header, cells[1:], title)


def format_table(rows: list[dict], title: str = "") -> str:
    """The rows of benchmark() as a text table (times in ms, first call in s)."""
    header = ["devices", "first call s", "median ms", "min ms", "max ms", "spread",
              "steps/s", "compute ms", "collective ms", "collective"]
    cells = [header] + [[str(r["devices"]), f"{r['first_call_s']:.3f}",
                         f"{r['median_s'] * 1e3:.3f}", f"{r['min_s'] * 1e3:.3f}",
                         f"{r['max_s'] * 1e3:.3f}", f"{r['spread']:.0%}",
                         f"{r['steps_per_s']:.1f}", f"{r['compute_s'] * 1e3:.3f}",
                         f"{r['collective_s'] * 1e3:.3f}", f"{r['collective_share']:.0%}"]
                        for r in rows]
    return _text_table(header, cells[1:], title)


def _text_table(header: list, rows: list, title: str = "") -> str:
    """Right-aligned columns under a header and a rule, the title above."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [title] if title else []
    lines += ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
              "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
