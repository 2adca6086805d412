"""Run every benchmark: `python -m bench` (each prints a table and saves JSON: by default a
new file under results/runs/; `--save` replaces the committed results/NAME.json)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

BENCHMARKS = ["overhead", "trace_time", "mlp_step", "adam_fused", "allreduce", "reduce_update",
              "embedding", "mirrored_mlp", "cnn", "layer_norm", "gpt", "gpt2", "gpu", "run_steps", "multi_worker",
              "simulate", "zero", "published_scaling"]


def parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    """The options `python -m bench` and `graphdist bench` share."""
    p = argparse.ArgumentParser(prog=prog, description="run the benchmarks in bench/; each "
                                "prints a table and saves its results as JSON")
    p.add_argument("names", nargs="*", help=f"which ones (default: all of {BENCHMARKS})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, metavar="DIR",
                       help="write NAME.json into DIR (default: a new timestamped file "
                            "bench/results/runs/NAME-<date>-<time>.json)")
    where.add_argument("--save", action="store_true",
                       help="overwrite the committed results in bench/results/ (what the "
                            "docs quote); without it they are never touched")
    return p


def main(argv=None) -> int:
    from bench.common import set_output

    args = parser().parse_args(argv if argv is not None else sys.argv[1:])
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        print(f"python -m bench: unknown benchmark(s) {unknown}; choose from {BENCHMARKS}",
              file=sys.stderr)
        return 2
    set_output(save=args.save, out=args.out)
    for name in args.names or BENCHMARKS:
        print(f"==== bench.{name}")
        module = importlib.import_module(f"bench.{name}")
        # a benchmark with options of its own gets none from the suite's command line
        takes_argv = "argv" in inspect.signature(module.main).parameters
        module.main(*([[]] if takes_argv else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
