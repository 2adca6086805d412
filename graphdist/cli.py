"""The `graphdist` command: demo, devices, show, bench, launch, simulate and check."""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _demo(args) -> int:
    import numpy as np

    import graphdist as gd
    from graphdist.examples import cnn_digits, gpt_chars, mlp_digits
    from graphdist.progress import ProgressBar

    workers = mlp_digits.launched_workers()
    if workers > 1 and os.environ.get("PMI_RANK", "0") != "0":     # the chief reports
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    kind = "gpu" if args.gpu else "cpu"      # the --gpu flag, as the user gave it
    if not gd.devices(kind):                  # cpu:0 always exists: only --gpu gets here
        print("graphdist demo --gpu: no GPU here (needs CuPy and a CUDA device)")
        return 1
    example, what = {"mlp": (mlp_digits, "a 64-128-10 MLP on the UCI digits"),
                     "cnn": (cnn_digits, "a CNN (conv 32, pool, conv 64, pool, dense 64, "
                                         "dense 10) on the UCI digits"),
                     "gpt": (gpt_chars, "a character-level GPT (2 layers, 4 heads, width "
                                        "128, context 64) on Python's reference docs")
                     }[args.model]
    where = f"{workers} workers x " if workers > 1 else ""
    print(f"graphdist demo: {what}, {where}{args.devices} {kind} device(s), {args.steps} steps")
    bar = ProgressBar(args.steps)
    result = example.train(args.devices, args.steps, kind=kind,
                           on_step=lambda i, n, loss: bar.update(i, f"loss {loss:.4f}"))
    if args.model == "gpt":
        print(f"final loss {result['loss']:.4f}   held-out loss "
              f"{result['held_out_loss']:.3f} nats/char (bigram baseline "
              f"{result['bigram_loss']:.3f})")
        print("sampled: " + repr(gpt_chars.sample(result["model"], result["data"], "The ",
                                                  length=120)))
    else:
        print(f"final loss {result['loss']:.4f}   held-out accuracy {result['accuracy']:.1%}")
    if args.devices > 1 or workers > 1:
        reference = example.train(1, args.steps, kind=kind, workers=False, **(
            {"evaluate": False} if args.model == "gpt" else {}))
        diff = max(float(np.max(np.abs(a - b))) for a, b in
                   zip(result["params"], reference["params"]))
        print(f"max |parameter difference| vs one device: {diff:.2e}")
    step = result["train_step"]
    print("\nThe compiled training step (logical graph):")
    print(step.graph)
    print("\n" + step.replicated_graph.summary())
    if args.html:
        path = step.replicated_graph.to_html(args.html)
        print(f"\nwrote the replicated graph to {path} (open it in a browser)")
    return 0


def _devices(args) -> int:
    from graphdist.device.backends import backend_of_kind
    from graphdist.device.names import device_kind, devices

    from graphdist.device import threads

    for d in devices():
        print(backend_of_kind(device_kind(d)).describe(d))
    print("(any cpu:N is a valid logical CPU device)")
    print(f"host: {threads.cores()} core(s) for this process; BLAS: {threads.blas_kernels()}")
    return 0


def _load(spec: str, command: str = "show", what: str = "FUNCTION"):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"graphdist {command}: expected MODULE:{what}, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    importlib.invalidate_caches()       # a file written since the last import is found too
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name + ".").startswith(e.name + "."):
            raise                                  # the module itself imports a missing one
        raise SystemExit(f"graphdist {command}: no module {module_name!r} (from {spec!r}); run "
                         "from the folder that holds it, or put it on PYTHONPATH") from None
    if not hasattr(module, attr):
        raise SystemExit(f"graphdist {command}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _find_graph(value, function_type, depth: int = 3):
    """The first gd.function or gd.Graph in `value` (itself, or inside dicts, lists, tuples)."""
    if isinstance(value, function_type) or hasattr(value, "eqns"):
        return value
    if depth and isinstance(value, dict):
        value = list(value.values())
    if depth and isinstance(value, (list, tuple)):
        for item in value:
            found = _find_graph(item, function_type, depth - 1)
            if found is not None:
                return found
    return None


def _show(args) -> int:
    """MODULE:FUNCTION names a traced gd.function, or a callable taking the device count
    and returning one (or a gd.Graph); shows its replicated graph when devices > 1."""
    from graphdist.function import Function

    target = _load(args.target)
    if not isinstance(target, Function) and not hasattr(target, "eqns"):
        result = target(args.devices)             # a builder taking the device count
        target = _find_graph(result, Function)    # never print what it returned
        if target is None:
            print(f"graphdist show: {args.target}({args.devices}) returned a "
                  f"{type(result).__name__} holding no gd.function or gd.Graph; name a "
                  "gd.function, a gd.Graph, or a function of the device count returning one "
                  "(alone or in a dict, list or tuple)", file=sys.stderr)
            return 2
    graph = target
    if isinstance(target, Function):
        if target.trace_count == 0:
            print(f"graphdist show: {args.target} is a gd.function that has not been traced "
                  "yet (nothing to show before its first call); name a function that builds "
                  "and calls it instead, taking the device count", file=sys.stderr)
            return 2
        placed = target.replicated_graph
        replicas = len(placed.devices) or 1
        if args.devices > 1 and replicas != args.devices:
            print(f"graphdist show: {args.target} was traced for {replicas} device(s), not "
                  f"{args.devices}", file=sys.stderr)
            return 2
        graph = placed if args.devices > 1 else target.graph
        if args.stages or args.stage:
            return _print_stages(target, args.stage)
    elif args.stages or args.stage:
        print(f"graphdist show: {args.target} gave a graph, not a gd.function: it has no "
              "compile stages to show", file=sys.stderr)
        return 2
    print(graph)
    if args.summary:
        print("\n" + graph.summary())
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(graph.to_dot())
        print(f"wrote {args.dot}")
    if args.html:
        print(f"wrote {graph.to_html(args.html)}")
    return 0


def _print_stages(f, only: str | None) -> int:
    """Every stage of the compile pipeline, or the one named, as text."""
    stages = f._latest().plan.stages
    names = [s.name for s in stages]
    if only is not None and only not in names:
        print(f"graphdist show: no stage {only!r}; the stages are {', '.join(names)}",
              file=sys.stderr)
        return 2
    for s in stages:
        if only is None or s.name == only:
            print(f"==== after {s.name}: {len(s.graph.eqns)} eqns, "
                  f"{s.seconds * 1e3:.1f} ms ====")
            print(s.graph)
            print()
    return 0


def _bench(args) -> int:
    """Times MODULE:BUILDER's step per device count (graphdist/benchmark.py); --suite and
    --list run the project's own suite instead."""
    import json

    from graphdist.benchmark import (BuilderError, benchmark, format_overlap_table,
                                     format_table)

    if args.suite is not None or args.list:
        return _suite(args)
    if args.target is None:
        args.print_help(sys.stderr)
        return 2
    if ":" not in args.target:
        print(f"graphdist bench: expected MODULE:BUILDER, got {args.target!r} (the project's "
              "own benchmarks run with graphdist bench --suite [NAME ...])", file=sys.stderr)
        return 2
    settings = (True, False) if args.overlap else (None,)
    try:
        builder = _load(args.target, "bench", "BUILDER")
        rows = [row for on in settings for row in benchmark(
            builder, args.devices, args.steps, args.mode, progress=True, overlap=on)]
    except BuilderError as e:
        print(f"graphdist bench: {e}", file=sys.stderr)
        return 2
    if args.overlap:
        rows.sort(key=lambda r: (r["devices"], not r["overlap"]))
        print(json.dumps(rows, indent=2) if args.json else format_overlap_table(rows, (
            f"graphdist bench {args.target} --overlap: {args.steps} timed calls per device "
            "count and setting (gd.config.set_overlap); compute, collective and exposed "
            "(collective time no compute covered): one profiled call (gd.profile_report)")))
        return 0
    print(json.dumps(rows, indent=2) if args.json else format_table(rows, (
        f"graphdist bench {args.target}: {args.steps} timed calls per device count after the "
        f"first and 2 warm-up calls, mode {rows[0]['mode']}\ncompute and collective: one "
        "profiled call, its node times summed over its devices")))
    return 0


def _suite(args) -> int:
    """The project's suite lives in the checkout's bench/ (not installed): found from the
    current directory, as `python -m bench` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    runner = None
    if os.path.isfile(os.path.join("bench", "__main__.py")):
        try:
            runner = importlib.import_module("bench.__main__")
        except ModuleNotFoundError as e:
            if e.name not in (None, "bench", "bench.__main__"):
                raise                             # the suite needs a module it lacks
    if not hasattr(runner, "BENCHMARKS"):
        print("graphdist bench --suite/--list: no bench/ package here; the project's suite "
              "runs from the root of a graphdist source checkout (graphdist bench "
              "MODULE:BUILDER times your own step from anywhere)", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(runner.BENCHMARKS))
        return 0
    names = ([args.target] if args.target else []) + args.suite
    rest = names + (["--out", args.out] if args.out else []) + (["--save"] if args.save else [])
    return int(runner.main(rest) or 0)


def _launch(args) -> int:
    """One worker process per MPI rank, started and served by graphdist's own process
    manager (graphdist/device/launcher.py: no port open beyond the loopback interface,
    unlike MPICH's mpiexec). The script's own options pass through untouched; the exit
    status is non-zero when any worker fails, with one line per rank saying how it ended.
    `--restarts R` runs the job again after a failure."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        print("graphdist launch: mpi4py is not installed; install the mpi extra: pip "
              "install 'graphdist[mpi]' (mpi4py and mpich)", file=sys.stderr)
        return 2
    if args.module is not None:
        if not args.module:
            print("graphdist launch: -m needs a module name", file=sys.stderr)
            return 2
        target = ["-m", *args.module]
    elif args.script is None:
        print("graphdist launch: give a script (or -m MODULE) to run", file=sys.stderr)
        return 2
    elif not os.path.exists(args.script):
        print(f"graphdist launch: no such script: {args.script}", file=sys.stderr)
        return 2
    else:
        target = [args.script, *args.script_args]
    from graphdist.device.launcher import LOOPBACK

    env = {**os.environ, **LOOPBACK}
    if args.devices_per_worker:
        env["GRAPHDIST_DEVICES_PER_WORKER"] = str(args.devices_per_worker)
    command = [sys.executable, *target]
    try:
        for attempt in range(args.restarts + 1):
            status = _launch_once(command, {**env, "GRAPHDIST_RESTART": str(attempt)}, args.n)
            if status == 0:
                return 0
            if attempt < args.restarts:
                print(f"graphdist launch: restarting the job (attempt {attempt + 1} of "
                      f"{args.restarts})", file=sys.stderr)
        return status
    except KeyboardInterrupt:
        return 130


def _launch_once(command: list, env: dict, workers: int) -> int:
    """One run of the job; on failure, which worker failed first and how (a signal by
    name), then one line per rank: its exit status and the first line of its error, from
    the report each worker writes as it leaves, or what the launcher saw of it."""
    import json
    import tempfile

    from graphdist.device.launcher import Job

    with tempfile.TemporaryDirectory(prefix="graphdist-launch-") as folder:
        job = Job(command, workers, env, folder)
        status = job.wait()
        if status == 0:
            return 0
        reports = {}
        for rank in range(workers):
            try:
                with open(os.path.join(folder, f"rank{rank}.json")) as f:
                    reports[rank] = json.load(f)
            except (OSError, ValueError):
                pass
        first = job.first_failed(reports)
        how = first.ended if first.rank not in reports else \
            f"exit {reports[first.rank]['status']}"
        print(f"graphdist launch: worker {first.rank} (pid {first.pid}) failed first "
              f"({how}); the job exits with status {status}", file=sys.stderr)
        for line in job.lines(reports):
            print(f"graphdist launch: {line}", file=sys.stderr)
    return status


def _lowering_names() -> tuple:
    """The registered collective lowerings (passes/collectives), each with a cost model."""
    from graphdist.passes.collectives import LOWERINGS

    return tuple(LOWERINGS)


def _simulate(args) -> int:
    """Predicted step time per device count of a builder's step (graphdist/simulate/)."""
    import json

    from graphdist.simulate import format_table, simulate

    if args.preset == "list":
        from graphdist.simulate.presets import describe

        print(describe())
        return 0
    if args.memory or args.params is not None:
        return _simulate_memory(args)
    if args.target is None:
        print("graphdist simulate: give MODULE:BUILDER (or --memory --params N, or --preset "
              "list)", file=sys.stderr)
        return 2
    try:
        counts = [int(n) for n in args.devices.split(",") if n.strip()]
        rows = simulate(_load(args.target), counts, link=args.link,
                        cross_device_ops=args.cross_device_ops, calibration=args.calibration,
                        recalibrate=args.calibrate, shared_host=args.shared_host,
                        scaling=args.scaling, preset=args.preset, overlap=not args.no_overlap)
    except ValueError as e:
        print(f"graphdist simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    print(format_table(rows))
    return 0


def _simulate_memory(args) -> int:
    """Per-replica memory at each --zero-stage (graphdist/simulate/memory.py): of the
    builder's step, or of a model of --params parameters (the ZeRO paper's arithmetic)."""
    import json

    from graphdist.simulate.memory import builder_rows, format_memory, paper_rows

    try:
        counts = [int(n) for n in args.devices.split(",") if n.strip()]
        stages = [int(s) for s in args.zero_stage.split(",") if s.strip()]
        if args.params is not None:
            per_param = [float(b) for b in args.bytes_per_param.split(",")]
            if len(per_param) != 3:
                raise ValueError(f"--bytes-per-param takes 3 numbers (parameters, gradients, "
                                 f"optimizer state), got {args.bytes_per_param!r}")
            rows = paper_rows(float(args.params), counts, stages, per_param)
        elif args.target is None:
            raise ValueError("--memory needs MODULE:BUILDER or --params N")
        else:
            rows = builder_rows(_load(args.target), counts, stages)
    except ValueError as e:
        print(f"graphdist simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows) if args.json else format_memory(rows))
    return 0


def _check(args) -> int:
    """N devices against one for MODULE:BUILDER's step (graphdist/equivalence.py): exit 0
    when every count is equivalent, 1 when one is not, 2 when the builder cannot be used."""
    from graphdist.equivalence import EquivalenceError, check_equivalence

    try:
        report = check_equivalence(_load(args.target, "check", "BUILDER"), args.devices,
                                   args.steps, rtol=args.rtol, atol=args.atol,
                                   float64=args.float64)
    except (EquivalenceError, ValueError) as e:
        print(f"graphdist check: {e}", file=sys.stderr)
        return 2
    report.title = f"graphdist check {args.target}"
    if os.environ.get("PMI_RANK", "0") == "0":     # under graphdist launch: the chief says
        print(report)
    return 0 if report.equivalent else 1


MERGED_HELP = ("opt-in: run logical CPU replicas merged into one batched program (the "
               "default runs, and shows, one copy per device with its collectives)")


def _positive(text: str) -> int:
    """argparse type of --steps and --devices: an int >= 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _device_counts(text: str) -> list[int]:
    """argparse type of bench's --devices: "1,2,4" as [1, 2, 4]."""
    from graphdist.benchmark import device_counts

    try:
        return device_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="graphdist", description="compiled graph capture "
                                     "for synchronous data-parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a bundled model end to end")
    demo.add_argument("--model", choices=("mlp", "cnn", "gpt"), default="mlp",
                      help="the digits MLP (default), the tutorial-shaped digits CNN, or a "
                           "character-level GPT on Python's documentation")
    demo.add_argument("--devices", type=_positive, default=1,
                      help="logical devices (replicas); CPU devices unless --gpu")
    demo.add_argument("--gpu", action="store_true",
                      help="train on GPUs (logical ones when --devices exceeds the GPUs)")
    demo.add_argument("--steps", type=_positive, default=300)
    demo.add_argument("--html", default="graphdist_demo.html",
                      help="where to write the replicated graph as HTML ('' to skip)")
    demo.add_argument("--merged", action="store_true", help=MERGED_HELP)
    sub.add_parser("devices", help="list the devices graphdist can use")
    show = sub.add_parser("show", help="print (and export) the graph of MODULE:FUNCTION")
    show.add_argument("target")
    show.add_argument("--devices", type=_positive, default=1)
    show.add_argument("--html", default=None)
    show.add_argument("--dot", default=None)
    show.add_argument("--summary", action="store_true", help="also print graph.summary()")
    show.add_argument("--merged", action="store_true", help=MERGED_HELP)
    show.add_argument("--stages", action="store_true",
                      help="print the graph after every stage of the compile pipeline")
    show.add_argument("--stage", default=None, metavar="NAME",
                      help="print the graph after one stage (see --stages for the names)")
    bench = sub.add_parser("bench", help="time your own step (MODULE:BUILDER) per device "
                           "count, or run the project's suite (--suite, from a checkout)")
    bench.add_argument("target", nargs="?", metavar="MODULE:BUILDER",
                       help="a function of the device count n returning (f, args): a "
                            "gd.function on n devices and the arguments to call it with")
    bench.add_argument("--devices", type=_device_counts, default=[1, 2, 4], metavar="1,2,4",
                       help="device counts to time (default 1,2,4)")
    bench.add_argument("--steps", type=_positive, default=20,
                       help="timed calls per device count, after the first (compiling) call "
                            "and 2 warm-up calls (default 20)")
    bench.add_argument("--mode", choices=("auto", "sequential", "threads", "merged"),
                       default=None, help="gd.config.set_device_concurrency for the run")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--overlap", action="store_true",
                       help="time each device count with overlap on and off "
                            "(gd.config.set_overlap): compute, collective and exposed "
                            "collective time per step")
    bench.add_argument("--suite", nargs="*", default=None, metavar="NAME",
                       help="run the project's benchmarks in bench/ instead (default: all; "
                            "from a source checkout; see python -m bench --help)")
    bench.add_argument("--list", action="store_true", help="name the suite's benchmarks")
    bench.add_argument("--out", default=None, metavar="DIR",
                       help="--suite: write NAME.json into DIR")
    bench.add_argument("--save", action="store_true",
                       help="--suite: overwrite the committed results in bench/results/")
    bench.set_defaults(print_help=bench.print_help)
    launch = sub.add_parser("launch", help="run a script as W worker processes under MPI "
                            "(for gd.MultiWorkerMirroredStrategy)")
    launch.add_argument("-n", type=_positive, required=True, metavar="W",
                        help="worker processes (MPI ranks)")
    launch.add_argument("--devices-per-worker", type=_positive, default=None, metavar="K",
                        help="logical CPU devices each worker's strategy uses by default")
    launch.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                        help="run a module as python -m does (graphdist launch -n 2 -m "
                             "graphdist demo), its arguments passed through")
    launch.add_argument("script", nargs="?")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                        help="the script's own arguments, passed through untouched")
    launch.add_argument("--restarts", type=int, default=0, metavar="R",
                        help="after a failure, run the whole job again up to R times "
                             "(GRAPHDIST_RESTART holds the attempt, 0 first)")
    simulate = sub.add_parser("simulate", help="predict the step time of MODULE:BUILDER on "
                              "device counts past this machine (calibrated op costs + a link)")
    simulate.add_argument("target", metavar="MODULE:BUILDER", nargs="?")
    simulate.add_argument("--devices", default="1,2,4,64,1024", help="comma-separated counts")
    simulate.add_argument("--link", default=None, help="latency=5us,bandwidth=25GB/s "
                          "(default; with --shared-host: the calibrated host copy)")
    simulate.add_argument("--cross-device-ops", default=None, metavar="NAME",
                          choices=_lowering_names(),
                          help=f"{', '.join(_lowering_names())} (default: the builder's; its "
                               "host all-reduce becomes ring; mpi without --link: the MPI "
                               "link calibrated on this host)")
    simulate.add_argument("--calibrate", action="store_true",
                          help="measure this machine again and rewrite the calibration file")
    simulate.add_argument("--calibration", default=None, metavar="PATH",
                          help="the calibration file (default $GRAPHDIST_CALIBRATION or "
                               "~/.cache/graphdist/calibration.json)")
    simulate.add_argument("--scaling", choices=("weak", "strong"), default="weak",
                          help="weak: each replica keeps the builder's per-replica batch "
                               "(default); strong: the builder's batch on 1 device is the "
                               "global batch, split among the devices")
    simulate.add_argument("--shared-host", action="store_true",
                          help="devices are logical devices of this host (run one by one)")
    simulate.add_argument("--preset", default=None, metavar="NAME",
                          help="price the step on a described GPU cluster (roofline per op, "
                               "hierarchical all-reduce) instead of this machine; --preset "
                               "list names them")
    simulate.add_argument("--no-overlap", action="store_true",
                          help="model every all-reduce after the compute before it (default: "
                               "each bucket's from its last gradient, beside the backward)")
    simulate.add_argument("--json", action="store_true")
    simulate.add_argument("--memory", action="store_true",
                          help="per-replica bytes of parameters, gradients, optimizer slots "
                               "and activations at each --zero-stage instead of step time")
    simulate.add_argument("--zero-stage", default="0,1,2", metavar="STAGES",
                          help="with --memory: comma-separated ZeRO stages (default 0,1,2)")
    simulate.add_argument("--params", type=float, default=None, metavar="N",
                          help="with --memory, instead of a builder: a model of N parameters "
                               "(7.5e9, say), priced by --bytes-per-param")
    simulate.add_argument("--bytes-per-param", default="2,2,12", metavar="P,G,K",
                          help="with --params: bytes per parameter of parameters, gradients "
                               "and optimizer state (default 2,2,12: mixed-precision Adam)")
    check = sub.add_parser("check", help="does MODULE:BUILDER's step on N devices match one "
                           "device? where and why not (exit 1 when not)")
    check.add_argument("target", metavar="MODULE:BUILDER",
                       help="a function of the device count n (and dtype=, for --float64) "
                            "returning (f, args) from the same initial values and global "
                            "batch for every n")
    check.add_argument("--devices", type=_device_counts, default=[1, 2, 4], metavar="1,2,4",
                       help="device counts; each is compared with 1 (default 1,2,4)")
    check.add_argument("--steps", type=_positive, default=3,
                       help="steps compared one by one (default 3)")
    check.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    check.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (1e-6)")
    check.add_argument("--float64", action="store_true",
                       help="check a count that differs again in float64 (the builder's "
                            "dtype=): equivalent there means float32 rounding, not a bug")
    args = parser.parse_args(argv)
    handlers = {"demo": _demo, "devices": _devices, "show": _show, "bench": _bench,
                "launch": _launch, "simulate": _simulate, "check": _check}
    from graphdist import config

    before = config.device_concurrency()
    if getattr(args, "merged", False):
        config.set_device_concurrency("merged")
    try:
        return handlers[args.command](args)
    except BrokenPipeError:          # `graphdist show ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        config.set_device_concurrency(before)


if __name__ == "__main__":
    sys.exit(main())
