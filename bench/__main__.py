"""Run every benchmark: `python -m bench` (each prints a table and saves JSON in results/)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["overhead", "trace_time", "mlp_step", "adam_fused", "allreduce", "reduce_update",
              "mirrored_mlp",
              "gpu"]


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or BENCHMARKS
    for name in names:
        print(f"==== bench.{name}")
        module = importlib.import_module(f"bench.{name}")
        module.main(*([[]] if name in ("mirrored_mlp", "gpu") else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
