"""gd.simulate: predict a step's time and scaling efficiency on device counts this machine
cannot run, from its logical graph, per-op costs calibrated here and a link model.
The package: link.py (the link model and its parser), costs.py (an eqn's calibrated time; a
collective's cost comes from its lowering in the registry of passes/collectives, which
keeps each lowering's cost model beside its emission), calibration.py (the measurements,
a JSON file in the user's cache), predict.py (the predictor) and presets.py (GPU clusters
the step can be priced on instead of this machine: `--preset NAME`).

Overlap: each gradient bucket's all-reduce starts once its last gradient exists and runs
beside the backward pass that follows (predict.overlap_order; the buckets are the step's
own, distribute/buckets.py); `overlap=False` (`--no-overlap`) serializes them.

Scaling modes. Weak (the default): the builder decides the per-replica batch; the simulator
takes it to be the same for every device count (it checks that 1 and 2 devices agree).
Strong: the global batch (the builder's batch on 1 device) stays fixed and each of N
replicas gets global/N examples: the builder's step is traced again on its arguments cut
to that batch, and the calibrated per-op model prices the smaller shapes (rates by size:
on the machine of docs/benchmarks.md a GEMM whose smallest side is 4 costs 5x more per
FLOP than one whose smallest side is 256). Either way one replica's logical graph is
replicated analytically, so 1,024 devices are never built.

Multi-worker ("mpi", MultiWorkerMirroredStrategy): each worker sums its local replicas,
then MPI all-reduces between the workers over a link calibrated between 2 MPI processes of
this host (when mpi4py and mpiexec are here); the executor calls MPI inline, so nothing
overlaps it.
"""

from __future__ import annotations

from graphdist.simulate.calibration import (CALIBRATION_VERSION, GEMM_DIMS, MPI_PROBE_BYTES,
                                            _mpi_probe, best_time, calibrate, calibrate_mpi,
                                            default_calibration_path, host_link,
                                            load_calibration, machine, mpiexec)
from graphdist.simulate.costs import (COSTS, all_gather_cost, broadcast_cost,
                                      collective_seconds, eqn_seconds, hierarchical_cost,
                                      host_cost, mpi_cost, one_device_cost, op_kind, per_unit,
                                      ring_cost, shared_host_cost)
from graphdist.simulate.link import DEFAULT_LINK, DEFAULT_MPI_LINK, Link, parse_link
from graphdist.simulate.predict import (_step_time, assumptions, batch_of, format_table,
                                        fused_bytes, overlap_order, per_replica_batch,
                                        roofline_seconds, simulate)
from graphdist.simulate.presets import PRESETS, Cluster, hierarchical_all_reduce

__all__ = ["CALIBRATION_VERSION", "COSTS", "DEFAULT_LINK", "DEFAULT_MPI_LINK", "GEMM_DIMS",
           "Link", "MPI_PROBE_BYTES", "_mpi_probe", "_step_time", "all_gather_cost",
           "assumptions", "batch_of", "best_time", "broadcast_cost", "calibrate",
           "calibrate_mpi", "collective_seconds", "default_calibration_path", "eqn_seconds",
           "PRESETS", "Cluster", "format_table", "fused_bytes", "hierarchical_all_reduce",
           "hierarchical_cost", "overlap_order", "roofline_seconds", "host_cost", "host_link", "load_calibration",
           "machine", "mpi_cost", "mpiexec", "one_device_cost", "op_kind", "parse_link",
           "per_replica_batch", "per_unit", "ring_cost", "shared_host_cost", "simulate"]
