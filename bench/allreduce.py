"""All-reduce (sum) of 4 x 16 MiB float32 buffers over 4 logical CPU devices, through the real
path: a gd.function whose replica fn returns `all_reduce("sum", x)` on PerReplica inputs, so
replication, lowering and the multi-device executor all run. Every cross-device op is timed
side by side with a one-pass Numba sum-and-broadcast (in place, on copies of the buffers)
and numpy's sum. Algorithmic bandwidth = bytes of one buffer / time.

Then the peers, each in its own processes, right after: JAX `pmap(psum)` over 4 XLA host
devices (bench/peers/jax_psum.py, the best of 3 runs), and MPI on 2 and 4 ranks of one
buffer each: bare mpi4py `comm.Allreduce` in place and into a new array, interleaved with
graphdist's MultiWorkerMirroredStrategy all-reduce in the same ranks
(bench/multi_worker_rank.py, as bench/multi_worker.py runs it). More ranks than cores (4 on
a 2-core machine) oversubscribe it; the table says so.

    python -m bench.allreduce [--mib 16] [--devices 4] [--repeat 20]
    python -m bench.allreduce --mpi-only [--mib 16]     # 2 MPI ranks only (issue 29)

The MPI ranks run with the environment's OpenBLAS pin (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE)
removed, as on a user's machine; the table says so.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from graphdist.kernels.reduce import all_reduce_cpu, all_reduce_ref

import graphdist as gd
from bench.common import interleaved, peer_python, run_peer, save, table
from graphdist.distribute import cross_device_ops as cdo
from graphdist.runtime import kernel_table

ONE_PASS = "numba one-pass sum+broadcast"
ONE_PASS_OUTS = "numba one-pass into separate outputs"
NUMPY = "numpy np.sum(bufs, axis=0)"
HEAD_ROWS = ("HierarchicalCopyAllReduce(2)", "HostAllReduce")   # also timed without the
# result's return copy: these replicas return r[:1], so only the collective itself runs


def contenders_through_executor(bufs, devices):
    ops = {"default strategy (HostAllReduce, per-device)": None,
           "ReductionToOneDevice": cdo.ReductionToOneDevice(),
           "RingAllReduce": cdo.RingAllReduce(),
           "RingAllReduce(num_chunks=4)": cdo.RingAllReduce(num_chunks=4),
           "HierarchicalCopyAllReduce(2)": cdo.HierarchicalCopyAllReduce(2),
           "HostAllReduce": cdo.HostAllReduce()}
    out = {}
    for name, ops_object in ops.items():
        strategy = gd.MirroredStrategy(devices, cross_device_ops=ops_object)
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx: bufs[ctx.replica_id_in_sync_group])

        @gd.function
        def step(x, strategy=strategy):
            return strategy.run(lambda v: gd.get_replica_context().all_reduce("sum", v),
                                args=(x,))

        @gd.function
        def step_head(x, strategy=strategy):   # the same, returning only r[:1]
            return strategy.run(lambda v: gd.get_replica_context().all_reduce("sum", v)[:1],
                                args=(x,))

        got = step(x)                       # compile, and check before timing
        want = all_reduce_ref(bufs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if name in ("ReductionToOneDevice", "HostAllReduce") or ops_object is None:
            np.testing.assert_array_equal(got, want)
        for head in step_head(x).values:
            np.testing.assert_array_equal(head, got[:1])
        out[f"graphdist {name}"] = (lambda s=step, x=x: s(x))
        if name in HEAD_ROWS:
            out[f"graphdist {name}, returns r[:1]"] = (lambda s=step_head, x=x: s(x))
    return out


def merged_contender(bufs, devices) -> dict:
    """The default strategy's all-reduce with the replicas merged (opt-in): a sum over the
    stacked replica axis."""
    gd.config.set_device_concurrency("merged")
    try:
        strategy = gd.MirroredStrategy(devices)
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx: bufs[ctx.replica_id_in_sync_group])
        step = gd.function(lambda x: strategy.run(
            lambda v: gd.get_replica_context().all_reduce("sum", v), args=(x,)))
        np.testing.assert_allclose(step(x), all_reduce_ref(bufs), rtol=1e-5, atol=1e-5)
        assert step.replicated_graph.merged
    finally:
        gd.config.set_device_concurrency("auto")
    return {"graphdist default strategy, merged (opt-in)": lambda: step(x)}


IN_STEP = "graphdist HostAllReduce node inside a step (in place)"


def node_time_in_step(bufs, devices, repeat: int) -> dict:
    """The host_all_reduce node's own time (from f.profile) when its inputs are made inside
    the step, as gradient buckets are: it then writes over them, one pass like the
    reference. Arguments the caller passes in are never overwritten, so the rows above pay
    for separate result buffers."""
    strategy = gd.MirroredStrategy(devices, cross_device_ops=gd.HostAllReduce())
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: bufs[ctx.replica_id_in_sync_group])
    ctx_all_reduce = (lambda x: gd.get_replica_context().all_reduce("sum", x * 1.0))
    step = gd.function(lambda v: strategy.run(ctx_all_reduce, args=(v,)))
    step(values)
    samples = []
    for _ in range(repeat):
        trace = step.profile(values)
        samples += [e["dur"] / 1e6 for e in trace["traceEvents"]
                    if e.get("name") == "host_all_reduce"]
    samples.sort()
    return {"median_s": samples[len(samples) // 2], "min_s": samples[0], "repeat": repeat}


def jax_row(mib: int, n: int, repeat: int, rounds: int = 3) -> dict:
    """{name: timing} of JAX's psum over n XLA host devices, the best of `rounds` fresh
    processes' medians: its n device threads meet at every psum, so on a shared 2-core
    machine one burst of other work can slow a whole run 3-4x (medians of 3 to 16 ms
    measured back to back). {} without a peer Python."""
    python = peer_python()
    runs = [r for _ in range(rounds if python else 0)
            if (r := run_peer(python, "bench.peers.jax_psum", "--mib", str(mib), "--devices",
                              str(n), "--repeat", str(repeat)))]
    if not runs:
        return {}
    best = min(runs, key=lambda r: r["median_s"])
    return {best["peer"]: {**best, "round_medians_s": [r["median_s"] for r in runs],
                           "runs_on": f"{n} XLA host devices, 1 process"}}


def mpi_rows(mib: int, repeat: int, ranks=(2, 4)) -> dict:
    """{name: timing} of bare mpi4py and graphdist's MultiWorkerMirroredStrategy all-reduce
    on each number of ranks (one buffer per rank; the slower rank's time per sample); {}
    without mpi4py and mpiexec."""
    from bench.multi_worker import RANK, mpiexec, run
    from bench.multi_worker_rank import BARE, BARE_OUT, BARE_SAME, STEP, STEP_BUCKET

    mpi = mpiexec()
    if mpi is None:
        print("bench.allreduce: no MPI rows (needs the mpi extra: mpi4py and mpich)",
              file=sys.stderr)
        return {}
    short = {STEP: "graphdist MultiWorkerMirrored all_reduce",
             STEP_BUCKET: "graphdist MultiWorkerMirrored, result kept in the step (r[:1])",
             BARE: "mpi4py Allreduce(IN_PLACE, buf)",
             BARE_OUT: "mpi4py Allreduce(x, out), a new out each call",
             BARE_SAME: "mpi4py copy x + Allreduce(IN_PLACE), one buffer (the step's work)"}
    out = {}
    for k in ranks:
        r = run([mpi, "-n", str(k), *RANK, "allreduce", "--mib", str(mib),
                 "--repeat", str(repeat)], unpinned_env())
        over = f", oversubscribed ({os.cpu_count()} cores)" if k > os.cpu_count() else ""
        for name in short if r else ():
            v = {key: x for key, x in r["results"][name].items() if key != "samples_s"}
            out[f"{short[name]}, {k} ranks"] = {**v, "runs_on": f"{k} MPI ranks{over}"}
    return out


OPENBLAS_PIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def unpinned_env() -> dict:
    """This environment without its OpenBLAS pin (a user's machine sets neither)."""
    return {k: v for k, v in os.environ.items() if k not in OPENBLAS_PIN}


PAIR_STEP = "graphdist all_reduce, result kept in the step (r[:1])"
PAIR_BARE = "mpi4py Allreduce(x, out), the same out each call"
PAIR_COPY = "before: copyto(out, x), then the group's all-reduce in place (kept in the step)"
PAIR_RETURNED = "graphdist all_reduce, result returned"
PAIR_COPIES = "before: x copied, the group's all-reduce in place, copied out (returned)"
PAIR_BARE_NEW = "mpi4py Allreduce(x, out), a new out each call"
PAIR_POLLED = ("mpi4py Iallreduce(x, out) + Test() until done, the same out (how graphdist "
               "waits: it watches for failures meanwhile)")
PAIR_AGAINST = {PAIR_STEP: PAIR_BARE, PAIR_COPY: PAIR_BARE, PAIR_RETURNED: PAIR_BARE_NEW,
                PAIR_COPIES: PAIR_BARE_NEW, PAIR_POLLED: PAIR_BARE}


def pair_rank(mib: int, repeat: int) -> None:
    """One rank of `mpi_only` (under mpiexec -n 2): each contender reads x and writes a 16
    MiB result, so together they overflow the 32 MiB L3 and one leaves the next a cold
    cache; their order is shuffled every round (the same on every rank)."""
    import random
    import time

    from mpi4py import MPI

    from bench.peers.common import report

    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    comm = MPI.COMM_WORLD
    x = np.random.default_rng(comm.rank).standard_normal(mib * 2**18).astype(np.float32)
    out, old = np.empty_like(x), np.empty_like(x)
    reduce = (lambda keep: gd.function(lambda x: strategy.run(
        lambda v: keep(gd.get_replica_context().all_reduce("sum", v)), args=(x,))))
    kept, returned = reduce(lambda r: r[:1]), reduce(lambda r: r)
    want = np.empty_like(x)
    comm.Allreduce(x, want)
    first = (lambda r: getattr(r, "values", (r,))[0])      # one replica's value
    np.testing.assert_array_equal(first(returned(x)), want)
    np.testing.assert_array_equal(first(kept(x)), want[:1])

    group = strategy.cross_device_ops.group

    def copy_then_in_place():          # what the step's out= form did before issue 29
        np.copyto(old, x)
        group.allreduce(old)

    def copies():                      # ... and its impl, for a returned result
        acc = x.copy()
        group.allreduce(acc)
        return acc.copy()

    def bare_new():
        comm.Allreduce(x, np.empty_like(x))

    def polled():
        request = comm.Iallreduce(x, out, op=MPI.SUM)
        while not request.Test():
            pass

    fns = {PAIR_STEP: lambda: kept(x), PAIR_BARE: lambda: comm.Allreduce(x, out),
           PAIR_COPY: copy_then_in_place, PAIR_RETURNED: lambda: returned(x),
           PAIR_BARE_NEW: bare_new, PAIR_POLLED: polled, PAIR_COPIES: copies}
    samples = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(29).shuffle
    for k in range(3 + repeat):
        shuffle(order)
        for name in order:
            comm.Barrier()
            t0 = time.perf_counter()
            fns[name]()
            if k >= 3:
                samples[name].append(time.perf_counter() - t0)
    every = comm.allgather(samples)           # per sample, the slower rank's time
    if comm.rank == 0:
        slower = {k: [max(s[k][i] for s in every) for i in range(repeat)] for k in fns}
        report({k: {"median_s": float(np.median(v)), "min_s": min(v), "repeat": repeat}
                for k, v in slower.items()})


def mpi_only(mib: int, repeat: int) -> dict:
    """Issue 29: graphdist's 2-worker all-reduce against bare comm.Allreduce(x, out) of the
    same buffers, side by side in one run (target: within 10%)."""
    from graphdist.device.threads import ENV_SET

    from bench.multi_worker import mpiexec, run

    mpi = mpiexec()
    if mpi is None:
        print("bench.allreduce: no MPI (needs the mpi extra: mpi4py and mpich)",
              file=sys.stderr)
        return {}
    t = run([mpi, "-n", "2", sys.executable, "-m", "bench.allreduce", "--pair-rank",
             "--mib", str(mib), "--repeat", str(repeat)], unpinned_env())
    if not t:
        return {}
    rows = [[k, v["median_s"] * 1e3, v["min_s"] * 1e3,
             v["median_s"] / t[PAIR_AGAINST[k]]["median_s"] if k in PAIR_AGAINST else "",
             v["min_s"] / t[PAIR_AGAINST[k]]["min_s"] if k in PAIR_AGAINST else ""]
            for k, v in t.items()]
    pin = ", ".join(f"{k}={os.environ[k]}" for k in OPENBLAS_PIN
                    if k in os.environ and k not in ENV_SET)
    text = table(f"all-reduce sum of {mib} MiB float32, 2 MPI ranks x 1 device (median of "
                 f"{repeat}, order shuffled each round, the slower rank per sample; the ranks "
                 f"ran without the environment's OpenBLAS pin{' (' + pin + ')' if pin else ''}"
                 ": OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, as on a user's machine). "
                 "Ratio: against bare Allreduce(x, out) of the same kind; target <= 1.10",
                 ["contender", "median ms", "min ms", "ratio (median)", "ratio (min)"], rows)
    save("allreduce", {"mib": mib, "devices": "no", "mpi_only": True, "results": t,
                       "table": text})
    return t


def main(mib: int = 16, n: int = 4, repeat: int = 30) -> dict:
    size = mib * 2**20 // 4
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    devices = [f"cpu:{i}" for i in range(n)]
    private = [b.copy() for b in bufs]      # the in-place one-pass overwrites its buffers
    outs = tuple(np.empty_like(b) for b in bufs)
    fused = kernel_table.host_all_reduce_cpu
    contenders = {
        ONE_PASS: lambda: all_reduce_cpu(private),
        NUMPY: lambda: np.sum(bufs, axis=0),
        ONE_PASS_OUTS: lambda: all_reduce_cpu(bufs, outs=outs),
        "host_all_reduce kernel alone": lambda: fused(outs, *bufs, op="sum"),
        **contenders_through_executor(bufs, devices),
        **merged_contender(bufs, devices),
    }
    t = interleaved(contenders, repeat=repeat, warmup=3)
    t[IN_STEP] = node_time_in_step(bufs, devices, repeat)
    for v in t.values():
        v["runs_on"] = f"{n} logical devices, 1 process"
    t.update(jax_row(mib, n, repeat))
    t.update(mpi_rows(mib, repeat))
    nbytes = bufs[0].nbytes
    base = nbytes / t[ONE_PASS]["median_s"]
    same_work = nbytes / t[ONE_PASS_OUTS]["median_s"]
    rows = []
    for k, v in t.items():
        v["GB_per_s"] = nbytes / v["median_s"] / 1e9
        rows.append([k, v["runs_on"], v["median_s"] * 1e3, v["min_s"] * 1e3, v["GB_per_s"],
                     nbytes / v["median_s"] / base, nbytes / v["median_s"] / same_work])
    text = table(f"all-reduce sum of {mib} MiB float32 buffers: {n} over {n} logical CPU "
                 f"devices, then the peers (median of {repeat}; JAX: the best of 3 runs; target: "
                 "the default >= 0.9x one-pass)",
                 ["contender", "runs on", "median ms", "min ms", "GB/s", "vs one-pass",
                  "vs one-pass into outs"], rows)
    save("allreduce", {"mib": mib, "devices": n, "results": t, "table": text})
    return t


def plot(payload: dict):
    """Algorithmic GB/s per contender, the one-pass references in orange."""
    from bench.plots import bars, figure

    fig, (ax,) = figure(f"All-reduce (sum) of {payload['mib']} MiB float32 buffers: "
                        f"{payload['devices']} logical devices, JAX, MPI", width=9.0,
                        height=10.0)
    bars(ax, {name: payload["mib"] * 2**20 / r["median_s"] / 1e9
              for name, r in payload["results"].items()},
         "algorithmic GB/s (bytes of one buffer / time)")
    return fig


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--mpi-only", action="store_true",
                        help="only graphdist's 2-worker all-reduce against bare mpi4py")
    parser.add_argument("--pair-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pair_rank:
        pair_rank(args.mib, args.repeat)
    elif args.mpi_only:
        mpi_only(args.mib, args.repeat)
    else:
        main(args.mib, args.devices, args.repeat)
