"""Shared benchmark helpers: timing (median of many runs), a table printer, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


PROGRESS_AFTER_S = 1.0      # a timing loop shorter than this draws no bar at all


def progress(label: str, total: int):
    """tick(done) for a long timing loop: a one-line bar on stderr (label, done/total,
    elapsed) once the loop has run PROGRESS_AFTER_S, redrawn at most 5 times a second
    between timed calls, and only when stderr is a terminal, so logs and captured output
    stay clean (tick does nothing there)."""
    stream = sys.stderr
    if not total or not getattr(stream, "isatty", lambda: False)():
        return lambda done: None
    from graphdist.progress import ProgressBar

    bar = ProgressBar(total, stream=stream, unit="calls")
    last = [None]                                   # when the bar was last drawn

    def tick(done: int) -> None:
        now = time.perf_counter()
        if last[0] is None and now - bar.start < PROGRESS_AFTER_S:
            return
        if done == total or last[0] is None or now - last[0] >= 0.2:
            last[0] = now
            bar.update(done, f"{label}  {now - bar.start:.0f} s")
    return tick


def _label(fns) -> str:
    """The contenders' names, shortened to fit a terminal line beside the bar."""
    text = ", ".join(map(str, fns))
    return text if len(text) <= 60 else text[:57] + "..."


def settle() -> None:
    """Wait for the Numba kernels a graphdist step's first calls left loading in the
    background (runtime/warmup.py): the samples then time the kernels, as a long run would
    see them, not the numpy forms the first calls ran."""
    if "graphdist" in sys.modules:
        from graphdist.runtime import warmup

        warmup.wait()


def timeit(fn, repeat: int = 30, warmup: int = 3, number: int = 1, label: str = "") -> dict:
    """Median / min / p90 seconds per call of fn() over `repeat` samples."""
    name = getattr(fn, "__name__", "<lambda>")
    tick = progress(label or (name if name != "<lambda>" else "timeit"), warmup + repeat)
    for k in range(warmup):
        fn()
        tick(k + 1)
    settle()
    samples = []
    for k in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
        tick(warmup + k + 1)
    samples.sort()
    return {"median_s": statistics.median(samples), "min_s": samples[0],
            "p90_s": samples[int(0.9 * (len(samples) - 1))], "repeat": repeat}


def interleaved(fns: dict, repeat: int = 30, warmup: int = 3, label: str = "") -> dict:
    """Time several contenders side by side, alternating them so drift hits all equally.
    On a terminal a progress bar (`label`, default the contenders' names) counts the calls."""
    tick = progress(label or _label(fns), (warmup + repeat) * len(fns))
    done = 0
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            done += 1
            tick(done)
    settle()
    samples = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
            done += 1
            tick(done)
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


RUNS = RESULTS / "runs"     # where a run's results go by default (git-ignored)


def set_output(save: bool = False, out=None) -> None:
    """Where save() writes: `out` (a directory), the committed results/ (`save`, what
    `python -m bench --save` asks for), else a new timestamped file under results/runs/.
    Standalone `python -m bench.NAME` runs read $BENCH_OUT and $BENCH_SAVE=1 instead."""
    if out is None:
        os.environ.pop("BENCH_OUT", None)
    else:
        os.environ["BENCH_OUT"] = str(out)
    os.environ["BENCH_SAVE"] = "1" if save else "0"


def result_path(name: str, tag: str | None = None) -> Path:
    """results/NAME.json (NAME-TAG.json with a `tag` or $BENCH_TAG, e.g. "avx512") with
    $BENCH_SAVE=1; NAME.json in $BENCH_OUT; else results/runs/NAME-<date-time>.json."""
    tag = tag or os.environ.get("BENCH_TAG")
    stem = f"{name}{'-' + tag if tag else ''}"
    if os.environ.get("BENCH_OUT"):
        return Path(os.environ["BENCH_OUT"]) / f"{stem}.json"
    if os.environ.get("BENCH_SAVE") == "1":
        return RESULTS / f"{stem}.json"
    return RUNS / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def save(name: str, payload: dict, tag: str | None = None) -> Path:
    """Write the results of bench.NAME as JSON where result_path() says (a `tag` names a
    variant: results/NAME-TAG.json); a default (timestamped) run never replaces an earlier
    file, and only --save / $BENCH_SAVE=1 touches the committed ones."""
    path = result_path(name, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    text = json.dumps(payload, indent=2, default=float)
    if path.parent == RUNS:
        base, k = path, 1
        while True:                         # two runs in the same second: NAME-...-2.json
            try:
                with open(path, "x") as f:
                    f.write(text)
                break
            except FileExistsError:
                k += 1
                path = base.with_name(f"{base.stem}-{k}.json")
    else:
        path.write_text(text)
    print(f"saved {path}")
    from bench.plots import render

    render(name, payload, path)
    return path


# ---------------------------------------------------------------- the peers
# They run in subprocesses of the benchmark environment's Python (`.venv-bench/bin/python`
# or $GRAPHDIST_PEER_PYTHON); graphdist never depends on them.

ROOT = Path(__file__).resolve().parent.parent


def peer_python() -> str | None:
    explicit = os.environ.get("GRAPHDIST_PEER_PYTHON")
    if explicit:
        return explicit
    local = ROOT / ".venv-bench" / "bin" / "python"
    return str(local) if local.exists() else None


def run_peer(python: str, module: str, *args, timeout: float = 600,
             env_extra: dict | None = None) -> dict | None:
    """The `RESULT {json}` line of `python -m module args` (with `env_extra` added to the
    environment); None if it fails or runs past `timeout` seconds."""
    from graphdist.device.threads import ENV_SET

    env = {k: v for k, v in os.environ.items() if k not in ENV_SET}  # peers get the user's env
    env.update(env_extra or {})
    try:
        done = subprocess.run([python, "-m", module, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"peer {module} {args} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
    return None


def run_peers(own: str, peers, base: float, no_peers: bool = False, *args) -> dict:
    """{name: result} of graphdist's own script `own` on 4 devices in a fresh process (for
    its first call), once more on an empty Numba cache (every kernel compiles), and of each (module, devices) in `peers` where a peer Python exists;
    `vs_graphdist_1` is each median over `base`."""
    import tempfile

    python = None if no_peers else peer_python()
    runs = [(sys.executable, own, 4, False), (sys.executable, own, 4, True)]
    runs += [(python, m, d, False) for m, d in peers if python]
    out = {}
    for interpreter, module, devices, cold in runs:
        with tempfile.TemporaryDirectory() as empty:
            r = run_peer(interpreter, module, "--devices", str(devices), *args,
                         env_extra={"NUMBA_CACHE_DIR": empty, COLD: "1"} if cold else None)
        if r:
            out[r["peer"]] = {**r, "vs_graphdist_1": r["median_s"] / base}
    return out


COLD = "BENCH_COLD_CACHE"    # set for a run of graphdist's own script on an empty Numba cache


# ---------------------------------------------------------------- as on a user's machine
OPENBLAS_PIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def unpinned_rerun(module: str, argv) -> bool:
    """Run `python -m module argv` again in a new process without the environment's OpenBLAS
    pin (OpenBLAS reads it when it loads, so this process cannot drop it), saying so on
    stderr; False when there is no pin to drop (then the caller runs here). Its peers then
    start without the pin too."""
    from graphdist.device.threads import ENV_SET

    pinned = {k: os.environ[k] for k in OPENBLAS_PIN
              if k in os.environ and ENV_SET.get(k) != os.environ[k]}
    if not pinned:
        return False
    print(f"{module}: running again without the environment's OpenBLAS pin "
          f"({', '.join(f'{k}={v}' for k, v in pinned.items())}), as on a user's machine",
          file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_PIN}
    subprocess.run([sys.executable, "-m", module, *argv], env=env, cwd=ROOT, check=True)
    return True


# What each peer script imports, by its name's prefix (bench/peers/tf_*.py: TensorFlow).
FRAMEWORKS = {"tf": "tensorflow", "torch": "torch", "jax": "jax"}


def missing_frameworks(python: str | None) -> dict:
    """{framework: why} for those that the peers' Python cannot import: every one when there
    is no benchmark environment (`make bench` builds .venv-bench)."""
    if python is None:
        return {f: "no benchmark environment (.venv-bench: `make bench`)"
                for f in FRAMEWORKS.values()}
    probe = ("import importlib.util as u; print(' '.join(m for m in "
             f"{tuple(FRAMEWORKS.values())!r} if u.find_spec(m) is None))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    missing = done.stdout.split() if done.returncode == 0 else list(FRAMEWORKS.values())
    return {f: f"{f} is not installed in {python}" for f in missing}


def add_peer_arguments(ap) -> None:
    """The options of a benchmark whose contenders run in fresh processes: `--no-peers`, and
    `--rounds` (every contender that many times, in turn)."""
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of every fresh-process contender, in turn (median of medians)")


def fresh_process_rows(own: str | None, peers, base: float, no_peers: bool = False,
                       rounds: int = 1) -> dict:
    """{name: result} of graphdist's own script `own` (bench/peers/graphdist_*.py) on 1
    device, on 4 devices and on 4 with an empty Numba cache (every kernel compiles), then of
    each (module, devices) in `peers` (bench/peers/ scripts run by the peers' Python), each
    in a fresh process, as the peers run. With `rounds` > 1 every contender runs once per
    round, in turn, so that the shared VM's slow spells (whole seconds 15% slower) hit them
    alike: a row's median is the median of its rounds' medians, its min the least, with
    each round's median listed. `vs_graphdist_1` is the median over `base`. A peer that did
    not run gets a row that says why instead: `--no-peers`, not installed, or failed (its
    error went to stderr)."""
    import tempfile

    python = None if no_peers else peer_python()
    missing = missing_frameworks(python)
    runs = [(sys.executable, own, 1, False), (sys.executable, own, 4, False),
            (sys.executable, own, 4, True)] if own else []
    status = {}
    for module, devices in peers:
        script = module.rsplit(".", 1)[-1]
        label = f"{script} --devices {devices}"
        framework = FRAMEWORKS[script.split("_", 1)[0]]
        if no_peers:
            status[label] = "not run (--no-peers)"
        elif framework in missing:
            status[label] = f"not installed: {missing[framework]}"
        else:
            runs.append((python, module, devices, False))
    got: dict = {run: [] for run in runs}
    for _ in range(rounds):
        for run in runs:
            interpreter, module, devices, cold = run
            with tempfile.TemporaryDirectory() as empty:
                r = run_peer(interpreter, module, "--devices", str(devices),
                             env_extra={"NUMBA_CACHE_DIR": empty, COLD: "1"} if cold else None)
            if r:
                got[run].append(r)
    out = {}
    for run, results in got.items():
        if not results:
            if run[0] is python:
                out[f"{run[1].rsplit('.', 1)[-1]} --devices {run[2]}"] = {
                    "status": "failed (its error is above, on stderr)"}
            continue
        medians = [r["median_s"] for r in results]
        row = {**results[0], "median_s": statistics.median(medians),
               "min_s": min(r["min_s"] for r in results),
               "first_call_s": statistics.median(r["first_call_s"] for r in results),
               "rounds": len(results), "round_medians_s": medians}
        out[row["peer"]] = {**row, "vs_graphdist_1": row["median_s"] / base}
    out.update({label: {"status": text} for label, text in status.items()})
    return out


# The rows of graphdist that the targets ("at most the best peer's time") set against the
# fastest peer: its steps in fresh processes, as the peers run and as issue 29 measured, and
# interleaved in the benchmark's own process (several steps built there, side by side).
TARGET_ROWS = {"fresh processes": {1: "graphdist 1 device (own process)",
                                   4: "graphdist Mirrored x4 (own process)"},
               "interleaved": {1: "graphdist 1 device",
                               4: "graphdist Mirrored x4 (default: per-device)"}}


def versus_best_peer(entry: dict, rows: dict = TARGET_ROWS) -> dict:
    """{label: {devices: ...}}: for each of graphdist's rows in `rows`, its median and min
    over the fastest peer's at that device count (the peers' rows carry "devices";
    graphdist's own-process rows are not peers); nothing where either did not run."""
    out = {}
    for label, ours in rows.items():
        for devices, name in ours.items():
            peers = {k: r for k, r in entry.items() if r.get("devices") == devices
                     and "median_s" in r and not k.startswith("graphdist")}
            if name not in entry or not peers:
                continue
            best = min(peers, key=lambda k: peers[k]["median_s"])
            out.setdefault(label, {})[devices] = {
                "graphdist": name, "best_peer": best,
                "median_ratio": entry[name]["median_s"] / peers[best]["median_s"],
                "min_ratio": entry[name]["min_s"] / peers[best]["min_s"]}
    return out


def versus_text(targets: dict) -> str:
    """One line per row of versus_best_peer (target: at most 1)."""
    return "\n".join(f"{label}, {d} device{'s' * (d > 1)}: {t['graphdist']} / "
                     f"{t['best_peer']} = {t['median_ratio']:.2f} (medians), "
                     f"{t['min_ratio']:.2f} (mins); target: at most 1"
                     for label, by_devices in targets.items() for d, t in by_devices.items())
