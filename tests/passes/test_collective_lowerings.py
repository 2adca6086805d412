"""Every collective on every lowering: all_reduce, reduce_scatter, all_gather and broadcast
on one_device, ring, hierarchical and host (logical CPU devices, through the real path:
strategy.run in a gd.function, replicate, lower, the multi-device executor), on mpi (2
worker processes under mpiexec) and on nccl (the lowered graph on GPU device names, run by
the ops' numpy references; and the CuPy stand-in of tests/gpu when it is importable),
against numpy formulas that add in each lowering's own order: bit for bit, float32 and
float64, sum and mean, sizes n does not divide and sizes smaller than n. Then the
registry: every lowering gives all four collectives and a cost, and nothing outside it
branches on a lowering's name."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from reference_sums import add_in_order, finish
from graphdist.cli import main
from graphdist.distribute import cross_device_ops as cdo
from graphdist.ir import ArrayType, Lit, Var
from graphdist.ir.builder import Builder
from graphdist.ops import OPS
from graphdist.ops.collectives import (all_gather, all_reduce, broadcast, reduce_scatter,
                                       shard_length, shard_offsets, shard_sizes)
from graphdist.passes.collectives import (COLLECTIVES, LOWERINGS, Lowering, Pricing,
                                          groups_of, lowering_for, register)
from graphdist.simulate import Link

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(), (2,), (7,), (3, 5), (1025,)]      # sizes 1, 2, 7, 15, 1025
REDUCE_OPS = ("sum", "mean")

# ---------------------------------------------------------------- references, in each order


def ref_device_order(xs, op):
    return finish(add_in_order([x.reshape(-1) for x in xs]), len(xs), op)


def ref_ring(xs, op):
    """Segment c (of n near-equal ones) summed in the order c+1, c+2, ..., c (mod n)."""
    n, flat = len(xs), [x.reshape(-1) for x in xs]
    out = np.empty_like(flat[0])
    at = shard_offsets(flat[0].size, n)
    for c in range(n):
        seg = slice(at[c], at[c + 1])
        out[seg] = finish(add_in_order([flat[(c + k) % n][seg] for k in range(1, n + 1)]),
                           n, op)
    return out


def ref_hierarchical(num_groups):
    def ref(xs, op):
        groups = groups_of(tuple(range(len(xs))), num_groups)
        partials = [add_in_order([xs[d].reshape(-1) for d in g]) for g in groups]
        return finish(add_in_order(partials), len(xs), op)
    return ref


CPU_LOWERINGS = {
    "one_device": (cdo.ReductionToOneDevice, ref_device_order),
    "one_device(cpu:1)": (lambda: cdo.ReductionToOneDevice("cpu:1"), ref_device_order),
    "ring": (cdo.RingAllReduce, ref_ring),
    "ring(num_chunks=3)": (lambda: cdo.RingAllReduce(num_chunks=3), ref_ring),
    "hierarchical": (cdo.HierarchicalCopyAllReduce, ref_hierarchical(2)),
    "hierarchical(3)": (lambda: cdo.HierarchicalCopyAllReduce(3), ref_hierarchical(3)),
    "host": (cdo.HostAllReduce, ref_device_order),
}


def _chunks(flat, n):
    at = shard_offsets(flat.size, n)
    return [flat[at[d]:at[d + 1]] for d in range(n)]


def _shards(flat, n):
    """Every replica's shard: its chunk, then zeros up to ceil(size / n) elements."""
    length = -(-flat.size // n)
    return [np.concatenate([c, np.zeros(length - c.size, flat.dtype)]) for c in _chunks(flat, n)]


def test_shards_are_contiguous_near_equal_chunks_the_first_ones_larger_padded():
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and shard_length(10, 4) == 3
    assert shard_sizes(2, 4) == [1, 1, 0, 0]          # fewer elements than replicas
    assert shard_sizes(0, 3) == [0, 0, 0]
    assert shard_offsets(7, 3) == [0, 3, 5, 7]
    for size in range(12):
        for n in range(1, 6):
            sizes = shard_sizes(size, n)
            assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
            assert sizes == [len(c) for c in np.array_split(np.arange(size), n)]
            assert shard_length(size, n) == max(sizes) == math.ceil(size / n)
    # the op's reference: replica r's chunk of the sum, padded with zeros
    xs = [np.arange(10.0), np.ones(10)]
    got = OPS["reduce_scatter"].impl(np, *xs, op="sum", n=2)
    np.testing.assert_array_equal(got[1], np.arange(5.0, 10.0) + 1)
    got = OPS["reduce_scatter"].impl(np, *[np.ones(5)] * 4, op="mean", n=4)
    assert [g.tolist() for g in got] == [[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    whole = OPS["all_gather"].impl(np, *got, n=4, total=5)
    assert all(w.tolist() == [1.0] * 5 for w in whole)


# ---------------------------------------------------------------- the real path, CPU


def _step(strategy, n, computed: bool = False):
    """A gd.function running all four collectives (both reductions) on every value (with
    `computed`, on a value the step computes rather than its argument)."""
    @gd.function
    def step(xs):
        def replica_fn(*vs):
            out = []
            for v in vs:
                v = v * 1.0 if computed else v
                size = math.prod(v.shape)
                for op in REDUCE_OPS:
                    shard = reduce_scatter(v, op, n)
                    out += [all_reduce(v, op), shard, all_gather(shard, n, total=size)]
                out += [broadcast(v, n - 1)]
                if v.shape:
                    out += [all_gather(v, n)]
            return out
        return strategy.run(replica_fn, args=tuple(xs))
    return step


def _values(value, n):
    values = value.values if isinstance(value, gd.PerReplica) else (value,) * n
    return [np.asarray(v) for v in values]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(CPU_LOWERINGS))
def test_every_collective_equals_numpy_in_the_lowerings_order(name, n, dtype):
    make, ref = CPU_LOWERINGS[name]
    if "cpu:1" in name and n < 2:
        pytest.skip("reduces to cpu:1: needs 2 devices")
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=make())
    rng = np.random.default_rng(n)
    per_shape = [[rng.standard_normal(s).astype(dtype) for _ in range(n)] for s in SHAPES]
    xs = [strategy.experimental_distribute_values_from_function(
        lambda ctx, vals=vals: vals[ctx.replica_id_in_sync_group]) for vals in per_shape]
    step = _step(strategy, n)
    first = [_values(v, n) for v in step(xs)]
    results = iter(first)
    for vals in per_shape:
        for op in REDUCE_OPS:
            total = ref(vals, op)
            reduced, shards, gathered = next(results), next(results), next(results)
            for d in range(n):
                np.testing.assert_array_equal(reduced[d], total.reshape(vals[0].shape),
                                              err_msg=f"{name} all_reduce {op}")
                assert shards[d].dtype == dtype and shards[d].shape == (
                    shard_length(total.size, n),)
                np.testing.assert_array_equal(shards[d], _shards(total, n)[d],
                                              err_msg=f"{name} reduce_scatter {op} {d}")
                np.testing.assert_array_equal(gathered[d], total,
                                              err_msg=f"{name} all_gather of shards")
            exact = np.sum(np.stack(vals).astype(np.float64), axis=0).reshape(-1)
            exact = exact / n if op == "mean" else exact
            tol = 1e-5 if dtype == np.float32 else 1e-12
            unpadded = [s[:k] for s, k in zip(shards, shard_sizes(total.size, n))]
            np.testing.assert_allclose(np.concatenate(unpadded), exact, rtol=tol, atol=tol)
        for got in next(results):
            np.testing.assert_array_equal(got, vals[n - 1])          # broadcast
        if vals[0].shape:
            for got in next(results):
                np.testing.assert_array_equal(got, np.concatenate(vals))   # all_gather
    again = [_values(v, n) for v in step(xs)]      # the same bits on a second run
    for a, b in zip(first, again):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_host_lowers_each_collective_to_one_fused_node(monkeypatch):
    monkeypatch.setitem(gd.config._state, "overlap", False)     # the inline nodes
    n = 3
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                   cross_device_ops=cdo.HostAllReduce())
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(10, ctx.replica_id_in_sync_group, np.float32))
    step = _step(strategy, n)
    step([x])
    names = [e.op.name for e in step.replicated_graph.eqns]
    assert names.count("host_reduce_scatter") == 2 and names.count("host_all_gather") == 3
    assert names.count("host_all_reduce") == 2 and "copy_to" in names     # broadcast: copies
    (rs, _) = [e for e in step.replicated_graph.eqns if e.op.name == "host_reduce_scatter"]
    assert [v.ty.shape for v in rs.outputs] == [(4,)] * 3         # chunks of 4, 3, 3


@pytest.mark.parametrize("computed", [True, False], ids=["computed", "argument"])
@pytest.mark.parametrize("name", ["host", "ring", "one_device"])
def test_threads_mode_runs_every_collective(name, computed, monkeypatch):
    """One thread per device: the fused host nodes and the copies cross threads, on values
    the step computed and on its arguments themselves (a collective reading another
    device's argument used to wait for a value its thread never sent, until the timeout)."""
    from graphdist import config

    monkeypatch.setattr(config, "device_concurrency", lambda: "threads")
    n = 3
    make, ref = CPU_LOWERINGS[name]
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=make())
    vals = [np.arange(7, dtype=np.float64) * (r + 1) for r in range(n)]
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: vals[ctx.replica_id_in_sync_group])
    monkeypatch.setattr(config, "collective_timeout", lambda: 10.0)
    step = _step(strategy, n, computed=computed)
    results = [_values(v, n) for v in step([x])]
    assert step._latest().plan.mode == "threads"
    total = ref(vals, "sum")
    for d in range(n):
        np.testing.assert_array_equal(results[1][d], _shards(total, n)[d])
        np.testing.assert_array_equal(results[2][d], total)
        np.testing.assert_array_equal(results[6][d], vals[n - 1])
        np.testing.assert_array_equal(results[7][d], np.concatenate(vals))


def test_merged_mode_runs_shards_as_per_device_copies(monkeypatch):
    """The merged program has no batched form of reduce_scatter/all_gather: the step runs
    as per-device copies instead (logged), with the same results."""
    from graphdist import config

    monkeypatch.setattr(config, "device_concurrency", lambda: "merged")
    n = 3
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                   cross_device_ops=cdo.HostAllReduce())
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(5, dtype=np.float32) + ctx.replica_id_in_sync_group)
    step = gd.function(lambda x: strategy.run(
        lambda v: all_gather(reduce_scatter(v, "mean", n), n, total=5), args=(x,)))
    np.testing.assert_array_equal(_values(step(x), n)[2], np.arange(5, dtype=np.float32) + 1)
    assert step._latest().plan.mode != "merged"


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("size", [1, 5, 4099])
def test_host_reduce_scatter_kernel_form_matches_its_reference(size, op):
    """The out= form (what the runtime calls into planned buffers) writes each replica's
    padded shard as the impl does, whatever the outputs held, inputs untouched."""
    rng = np.random.default_rng(size)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    keep = [x.copy() for x in xs]
    want = OPS["host_reduce_scatter"].impl(np, *xs, op=op)
    outs = tuple(np.full(-(-size // 3), np.nan, np.float32) for _ in xs)
    OPS["host_reduce_scatter"].out_impl(np, outs, *xs, op=op)
    for out, w, s in zip(outs, want, _shards(ref_device_order(xs, op), 3)):
        np.testing.assert_array_equal(out, w)
        np.testing.assert_array_equal(w, s)
    for x, k in zip(xs, keep):
        np.testing.assert_array_equal(x, k)


def test_ring_reduce_scatter_is_the_first_half_of_its_all_reduce():
    """Its copies go only to ring neighbours, n segments x (n-1) steps, no all-gather."""
    n = 4
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                   cross_device_ops=cdo.RingAllReduce())
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(10, ctx.replica_id_in_sync_group, np.float32))
    step = gd.function(lambda x: strategy.run(lambda v: reduce_scatter(v, "sum", n),
                                              args=(x,)))
    got = step(x)
    np.testing.assert_array_equal(np.stack(_values(got, n)),
                                  [[6.0] * 3, [6.0] * 3, [6.0, 6.0, 0.0], [6.0, 6.0, 0.0]])
    copies = [e for e in step.replicated_graph.eqns if e.op.name == "copy_to"]
    assert len(copies) == n * (n - 1)
    assert {(e.inputs[0].device, e.device) for e in copies} == {
        (f"cpu:{d}", f"cpu:{(d + 1) % n}") for d in range(n)}


def test_gradients_of_reduce_scatter_and_all_gather_are_each_other():
    """Replica r's loss c_r * sum(shard_r ** 2) + sum(all_gather(shard) * y_r), shard_r its
    reduce_scatter of v_r = w * x_r: the cotangent of every v_r is the shards' cotangents
    gathered (reduce_scatter's vjp), 2 c_d shard_d on shard d, plus the reduce_scatter of
    the y's (all_gather's vjp)."""
    n, size = 3, 7                                   # shards of 3, 2, 2
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                   cross_device_ops=cdo.RingAllReduce())
    rng = np.random.default_rng(3)
    xs, ys = rng.standard_normal((2, n, size))
    cs = rng.standard_normal(n)
    with strategy.scope():
        w = gd.Variable(np.ones(size), name="w")
    x, y, c = (strategy.experimental_distribute_values_from_function(
        lambda ctx, a=a: a[ctx.replica_id_in_sync_group]) for a in (xs, ys, cs))

    @gd.function
    def step(x, y, c):
        def replica_fn(x, y, c):
            with gd.GradientTape() as tape:
                shard = reduce_scatter(w * x, "sum", n)
                loss = c * gd.reduce_sum(shard * shard)
                loss = loss + gd.reduce_sum(all_gather(shard, n, total=size) * y)
            return tape.gradient(loss, w)
        return strategy.run(replica_fn, args=(x, y, c))

    grads = _values(step(x, y, c), n)
    total = np.sum(xs, axis=0)                       # w = 1
    c_at = np.repeat(cs, shard_sizes(size, n))       # c_d over shard d
    dv = 2 * c_at * total + np.sum(ys, axis=0)
    for r in range(n):
        np.testing.assert_allclose(grads[r], xs[r] * dv, rtol=1e-12)


def test_reduce_scatter_shape_errors_name_the_op():
    f32 = ArrayType((6,), np.dtype("float32"))
    with pytest.raises(ValueError, match="reduce_scatter: op must be one of"):
        OPS["reduce_scatter"].out_types(f32, op="max", n=2)
    with pytest.raises(ValueError, match=r"reduce_scatter: n \(the replica count\)"):
        OPS["reduce_scatter"].out_types(f32, op="sum", n=0)
    with pytest.raises(TypeError, match="reduce_scatter"):
        OPS["reduce_scatter"].out_types(ArrayType((6,), np.dtype("int32")), op="mean", n=2)
    assert OPS["reduce_scatter"].out_types(*[f32] * 4, op="sum", n=4) == (
        ArrayType((2,), f32.dtype),) * 4                 # chunks of 2, 2, 1, 1: padded
    with pytest.raises(ValueError, match=r"all_gather\(total=7, n=2\): a replica holds"):
        OPS["all_gather"].out_types(ArrayType((3,), f32.dtype), ArrayType((3,), f32.dtype),
                                    n=2, total=7)
    assert OPS["all_gather"].out_types(*[ArrayType((4,), f32.dtype)] * 2, n=2, total=7) == (
        ArrayType((7,), f32.dtype),) * 2


# ---------------------------------------------------------------- nccl: the lowered graph


def _interpret(eqns, env):
    """Run emitted eqns with each op's numpy impl."""
    def value(v):
        return np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]

    for eqn in eqns:
        out = eqn.op.impl(np, *(value(v) for v in eqn.inputs), **dict(eqn.params))
        outs = (out,) if len(eqn.outputs) == 1 and not isinstance(out, tuple) else out
        for v, o in zip(eqn.outputs, outs):
            assert np.shape(o) == v.ty.shape, eqn
            env[v] = np.asarray(o)
    return value


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("size", [1, 2, 7])
def test_nccl_lowers_every_collective_and_its_reference_matches_numpy(n, size, dtype):
    devices = tuple(f"gpu:{i}" for i in range(n))
    low = lowering_for(cdo.NcclAllReduce())
    rng = np.random.default_rng(size)
    vals = [rng.standard_normal(size).astype(dtype) for _ in range(n)]
    for op in REDUCE_OPS:
        b = Builder()
        xs = [Var(ArrayType((size,), np.dtype(dtype)), None, d) for d in devices]
        results = {"all_reduce": low.all_reduce(b, xs, op, devices),
                   "reduce_scatter": low.reduce_scatter(b, xs, op, devices, n),
                   "all_gather": low.all_gather(b, xs, devices, n),
                   "broadcast": low.broadcast(b, xs, 1, devices)}
        assert sum(e.op.name == "nccl_all_reduce" for e in b.eqns) == 2
        assert all(e.device in devices for e in b.eqns)
        value = _interpret(b.eqns, dict(zip(xs, vals)))
        total = ref_device_order(vals, op)
        for d in range(n):
            np.testing.assert_array_equal(value(results["all_reduce"][d]), total)
            np.testing.assert_array_equal(value(results["reduce_scatter"][d]),
                                          _shards(total, n)[d])
            np.testing.assert_array_equal(value(results["all_gather"][d]),
                                          np.concatenate(vals))
            np.testing.assert_array_equal(value(results["broadcast"][d]), vals[1])


NCCL_CHILD = r'''
import json, sys
import numpy as np
sys.path.insert(0, "tests/gpu")
import fake_cupy
fake_cupy.install()
import graphdist as gd
from graphdist.ops.collectives import all_gather, all_reduce, broadcast, reduce_scatter
n = 2
strategy = gd.MirroredStrategy([f"gpu:{i}" for i in range(n)], cross_device_ops=gd.NcclAllReduce())
rng = np.random.default_rng(0)
out = {}
for size in (1, 7):
    vals = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: vals[ctx.replica_id_in_sync_group])

    @gd.function
    def step(x):
        def fn(v):
            s = reduce_scatter(v, "mean", n)
            return all_reduce(v, "sum"), s, all_gather(s, n, total=size), broadcast(v, 1)
        return strategy.run(fn, args=(x,))

    got = step(x)
    def host(v):
        vs = v.values if isinstance(v, gd.PerReplica) else (v,) * n
        return [np.asarray(gd.device_get(t) if hasattr(gd, "device_get") else t).tolist()
                for t in vs]
    out[size] = {"vals": [v.tolist() for v in vals], "results": [host(v) for v in got]}
print("RESULT " + json.dumps(out))
'''


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="needs numba")
def test_nccl_collectives_on_the_simulated_gpus():
    """The CuPy stand-in of tests/gpu (2 physical GPUs, NCCL between them) runs the four
    collectives of the nccl lowering; the sums match numpy (NCCL's order is its own)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", GRAPHDIST_FAKE_CUPY="2")
    proc = subprocess.run([sys.executable, "-c", NCCL_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    for size, got in json.loads(line[7:]).items():
        vals = [np.asarray(v, np.float32) for v in got["vals"]]
        reduced, shards, gathered, bcast = [np.asarray(r, np.float32) for r in got["results"]]
        total = vals[0] + vals[1]
        for d in range(2):
            np.testing.assert_allclose(reduced[d], total, rtol=1e-6)
            np.testing.assert_allclose(shards[d], _shards(total / 2, 2)[d], rtol=1e-6)
            np.testing.assert_allclose(gathered[d], total / 2, rtol=1e-6)
            np.testing.assert_array_equal(bcast[d], vals[1])


# ---------------------------------------------------------------- mpi: 2 worker processes

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
if not os.path.exists(MPIEXEC):
    MPIEXEC = shutil.which("mpiexec")

MPI_WORKER = r'''
import json, math, sys
import numpy as np
import graphdist as gd
from graphdist.ops.collectives import all_gather, all_reduce, broadcast, reduce_scatter
out_dir, local = sys.argv[1], int(sys.argv[2])
strategy = gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)])
n = strategy.num_replicas_in_sync
report = {"n": n}
for dtype in ("float32", "float64"):
    for size in (1, 3, 7, 10):
        rng = np.random.default_rng(size)
        vals = [rng.standard_normal(size).astype(dtype) for _ in range(n)]  # every worker's
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx: vals[ctx.replica_id_in_sync_group])

        @gd.function
        def step(x):
            def fn(v):
                out = []
                for op in ("sum", "mean"):
                    s = reduce_scatter(v, op, n)
                    out += [all_reduce(v, op), s, all_gather(s, n, total=size)]
                return out + [broadcast(v, n - 1), all_gather(v, n)]
            return strategy.run(fn, args=(x,))

        got = step(x)
        report[f"{dtype}/{size}"] = [
            [np.asarray(c).tobytes().hex() for c in
             (v.values if isinstance(v, gd.PerReplica) else (v,) * local)] for v in got]
with open(f"{out_dir}/rank{strategy.worker_index}.json", "w") as f:
    json.dump(report, f)
'''


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                    reason="the mpi extra (mpi4py and mpich) is not installed: "
                           "pip install 'graphdist[mpi]'")
@pytest.mark.parametrize("local", [1, 2])
def test_mpi_collectives_across_two_workers(tmp_path, local):
    """2 workers of `local` replicas each: every local replica's result, bit for bit, is
    numpy's (each worker's replicas added in order, then the workers' sums in rank order)."""
    script = tmp_path / "worker.py"
    script.write_text(MPI_WORKER)
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path),
                           str(local)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    n = 2 * local
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["n"] == n
        for key, results in ((k, v) for k, v in report.items() if k != "n"):
            dtype, size = key.split("/")
            rng = np.random.default_rng(int(size))
            vals = [rng.standard_normal(int(size)).astype(dtype) for _ in range(n)]
            got = iter([[np.frombuffer(bytes.fromhex(h), dtype) for h in per]
                        for per in results])
            workers = [add_in_order(vals[w * local:(w + 1) * local]) for w in (0, 1)]
            for op in REDUCE_OPS:
                total = finish(workers[0] + workers[1], n, op)
                reduced, shards, gathered = next(got), next(got), next(got)
                for k in range(local):
                    replica = rank * local + k
                    np.testing.assert_array_equal(reduced[k], total, err_msg=key)
                    np.testing.assert_array_equal(shards[k], _shards(total, n)[replica],
                                                  err_msg=f"{key} {op} replica {replica}")
                    np.testing.assert_array_equal(gathered[k], total, err_msg=key)
            bcast, gathered = next(got), next(got)
            for k in range(local):
                np.testing.assert_array_equal(bcast[k], vals[n - 1])
                np.testing.assert_array_equal(gathered[k], np.concatenate(vals))


# ---------------------------------------------------------------- the registry

NAMES = ("one_device", "ring", "hierarchical", "host", "nccl", "mpi")


def test_every_lowering_is_registered_with_all_four_collectives_and_a_cost():
    assert set(LOWERINGS) == set(NAMES)
    assert set(COLLECTIVES) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    link = Link(5e-6, 25e9)
    for name, cls in LOWERINGS.items():
        low = cls()
        assert low.name == name and isinstance(low, Lowering)
        for collective in COLLECTIVES:
            assert callable(getattr(low, collective)), (name, collective)
            for pricing in (Pricing(), Pricing(shared_host=True, add=link)):
                if low.crosses_processes and pricing.shared_host:
                    continue
                assert low.cost(collective, 1, 2**20, link, pricing) == 0.0
                costs = [low.cost(collective, n, 2**20, link, pricing) for n in (2, 8, 64)]
                assert all(math.isfinite(c) and c > 0 for c in costs), (name, collective)
        with pytest.raises(ValueError, match=f"{name}: no collective 'all_to_all'"):
            low.cost("all_to_all", 4, 1, link)


def test_every_cross_device_ops_class_names_a_registered_lowering():
    classes = [cdo.ReductionToOneDevice(), cdo.RingAllReduce(), cdo.HierarchicalCopyAllReduce(),
               cdo.HostAllReduce(), cdo.NcclAllReduce()]
    for ops in classes:
        low = lowering_for(ops)
        assert low.name == ops.lowering
        assert {k: getattr(low, k) for k in ops.options()} == ops.options()
    assert {ops.lowering for ops in classes} | {cdo.MpiAllReduce.lowering} == set(NAMES)


def test_costs_per_algorithm():
    link, s = Link(5e-6, 25e9), 8 * 2**20
    ring, one = LOWERINGS["ring"](), LOWERINGS["one_device"]()
    # the ring's reduce-scatter is its first half: (n-1)/n S/B + (n-1) a
    assert ring.cost("reduce_scatter", 4, s, link) == pytest.approx(
        3 / 4 * s / 25e9 + 3 * 5e-6)
    assert ring.cost("all_reduce", 4, s, link) == pytest.approx(
        2 * ring.cost("reduce_scatter", 4, s, link))
    # one device: (n-1) messages of S in, (n-1) shards of S/n out
    assert one.cost("reduce_scatter", 4, s, link) == pytest.approx(
        3 * (5e-6 + s / 25e9) + 3 * (5e-6 + s / 4 / 25e9))
    # all-gather of n pieces, binomial broadcast: every lowering alike
    for name in NAMES:
        low = LOWERINGS[name]()
        assert low.cost("all_gather", 4, s, link) == pytest.approx(3 * (5e-6 + s / 25e9))
        assert low.cost("broadcast", 8, s, link) == pytest.approx(3 * (5e-6 + s / 25e9))
    # hierarchical reads its groups from the pricing (sqrt n when not given)
    hier = LOWERINGS["hierarchical"]()
    assert hier.cost("all_reduce", 64, s, link) == pytest.approx(21 * (5e-6 + s / 25e9))
    assert hier.cost("all_reduce", 64, s, link, Pricing(num_groups=2)) == pytest.approx(
        (2 * 31 + 1) * (5e-6 + s / 25e9))


def test_declared_properties_replace_name_checks():
    assert [n for n, c in LOWERINGS.items() if c.crosses_processes] == ["mpi"]
    assert [n for n, c in LOWERINGS.items() if c.runs_inline] == ["mpi"]
    assert [n for n, c in LOWERINGS.items() if c.fused_host_node] == ["host"]
    assert [n for n, c in LOWERINGS.items() if c.uses_groups] == ["hierarchical"]
    # one node the overlap stage can start early: the copy lowerings have none
    assert sorted(n for n, c in LOWERINGS.items() if c.splits_to_overlap) == [
        "host", "mpi", "nccl"]


def test_registering_a_lowering_needs_an_all_reduce_and_its_cost():
    with pytest.raises(TypeError, match="all_reduce"):
        @register
        class Nothing(Lowering):      # noqa: F841
            name = "nothing"
    assert "nothing" not in LOWERINGS


def test_a_registered_lowering_runs_the_step_and_is_priced(monkeypatch):
    """A new lowering is one class: here every all-reduce sums on the last device."""
    from dataclasses import dataclass

    from graphdist.passes.collectives.blocks import copy_to, finish_mean, sum_in_order

    monkeypatch.setattr("graphdist.passes.collectives.registry.LOWERINGS", dict(LOWERINGS))
    from graphdist.passes.collectives import registry

    @register
    @dataclass(frozen=True)
    class ToLast(Lowering):
        name = "to_last"

        def all_reduce(self, b, xs, op, devices):
            last = devices[-1]
            total = finish_mean(b, sum_in_order(b, [copy_to(b, x, last) for x in xs], last),
                                len(devices), last, op)
            return [copy_to(b, total, d) for d in devices]

        def all_reduce_cost(self, n, nbytes, link, pricing):
            return 2 * (n - 1) * link.time(nbytes)

    class ToLastOps(cdo.CrossDeviceOps):
        lowering = "to_last"

    assert "to_last" in registry.LOWERINGS
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=ToLastOps())
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(5, dtype=np.float32) * (ctx.replica_id_in_sync_group + 1))
    step = gd.function(lambda x: strategy.run(
        lambda v: (reduce_scatter(v, "sum", 3), broadcast(v, 0)), args=(x,)))
    shards, bcast = step(x)
    np.testing.assert_array_equal(np.stack(_values(shards, 3)), [[0, 6], [12, 18], [24, 0]])
    np.testing.assert_array_equal(_values(bcast, 3)[2], np.arange(5, dtype=np.float32))
    assert ToLast().cost("reduce_scatter", 3, 100, Link(1.0, 100.0)) == 8.0


def test_no_lowering_name_branches_outside_the_registry():
    """The pipeline, the passes and the simulator ask a lowering's declared properties;
    only passes/collectives/lowerings.py spells the names (each class's own)."""
    names = "|".join(NAMES)
    branch = re.compile(rf"""\blowering\s*(==|!=)|\.lowering\s+in\b|(==|!=)\s*["']({names})["']"""
                        rf"""|["']({names})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({names})["']""")
    assert branch.search('across = strategy.cross_device_ops.lowering == "mpi"')
    assert branch.search('if name in ("host", "ring"):')
    files = [ROOT / "graphdist" / "pipeline.py",
             *sorted((ROOT / "graphdist" / "passes").rglob("*.py")),
             *sorted((ROOT / "graphdist" / "simulate").rglob("*.py"))]
    for path in files:
        if path.name == "lowerings.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            assert not branch.search(line), f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"


def test_cli_lists_the_registered_lowerings(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(LOWERINGS) in text
    with pytest.raises(SystemExit):
        main(["simulate", "mod:build", "--cross-device-ops", "pigeon"])
    err = capsys.readouterr().err
    assert "invalid choice: 'pigeon'" in err and all(f"'{n}'" in err for n in NAMES)
