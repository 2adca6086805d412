"""Cross-device ops through the real path (strategy.run in a gd.function: replicate, lower,
multi-device executor): every op equals a numpy reference that adds in the op's own order,
bit for bit, on every replica and every run; the placed graph shows the copies; grouping,
device checks and the default choice."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from reference_sums import add_in_order, finish
from graphdist.distribute import cross_device_ops as cdo
from graphdist.ir import ArrayType, Var
from graphdist.ops import OPS
from graphdist.runtime.adapters import collectives as kernel_collectives
from graphdist.ops.host_collectives import host_all_reduce_ref
from graphdist.passes import collectives
from graphdist.ir.builder import Builder

SHAPES = [(), (1,), (7,), (8, 125), (4097,)]   # sizes 1, 1, 7, 1000, 4097
OPS_UNDER_TEST = {
    "ReductionToOneDevice": cdo.ReductionToOneDevice,
    "RingAllReduce": cdo.RingAllReduce,
    "RingAllReduce(num_chunks=3)": lambda: cdo.RingAllReduce(num_chunks=3),
    "HierarchicalCopyAllReduce": cdo.HierarchicalCopyAllReduce,
    "HostAllReduce": cdo.HostAllReduce,
}


# ---------------------------------------------------------------- references, in each order


def ref_device_order(xs, op):
    return finish(add_in_order(xs), len(xs), op)


def ref_ring(xs, op):
    n, flat = len(xs), [x.reshape(-1) for x in xs]
    out, start = np.empty_like(flat[0]), 0
    for c, length in enumerate(collectives.near_equal(flat[0].size, n)):   # segment c: c+1, ..., c
        seg = slice(start, start + length)
        out[seg] = finish(add_in_order([flat[(c + k) % n][seg] for k in range(1, n + 1)]),
                           n, op)
        start += length
    return out.reshape(xs[0].shape)


def ref_hierarchical(xs, op, num_groups=2):
    groups = collectives.groups_of(tuple(range(len(xs))), num_groups)
    partials = [add_in_order([xs[d] for d in group]) for group in groups]
    return finish(add_in_order(partials), len(xs), op)


REFS = {"ReductionToOneDevice": ref_device_order, "RingAllReduce": ref_ring,
        "RingAllReduce(num_chunks=3)": ref_ring,
        "HierarchicalCopyAllReduce": ref_hierarchical, "HostAllReduce": ref_device_order}


# ---------------------------------------------------------------- the real path


def _strategy(n, ops):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=ops)


def _inputs(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(shape).astype(dtype) for _ in range(n)] for shape in SHAPES]


def _all_reduce_everything(strategy, per_shape):
    """(run, step): step is a gd.function all-reducing every input (sum and mean); run()
    calls it and returns {(op, shape index): every replica's result}."""
    xs = [strategy.experimental_distribute_values_from_function(
        lambda ctx, vals=vals: vals[ctx.replica_id_in_sync_group]) for vals in per_shape]

    @gd.function
    def step(xs):
        def replica_fn(*vs):
            ctx = gd.get_replica_context()
            return [ctx.all_reduce(op, v)[...] for op in ("sum", "mean") for v in vs]
        return strategy.run(replica_fn, args=tuple(xs))

    def run():
        out = step(xs)
        return {(op, k): _replicas(out[i * len(xs) + k])
                for i, op in enumerate(("sum", "mean")) for k in range(len(xs))}
    return run, step


def _replicas(value) -> tuple:
    values = value.values if isinstance(value, gd.PerReplica) else (value,)
    return tuple(np.asarray(v) for v in values)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(OPS_UNDER_TEST))
def test_equals_numpy_on_every_replica(name, n, dtype):
    per_shape = _inputs(n, dtype, seed=n)
    run, _ = _all_reduce_everything(_strategy(n, OPS_UNDER_TEST[name]()), per_shape)
    first = run()
    for (op, k), results in first.items():
        xs = per_shape[k]
        want = REFS[name](xs, op)
        assert len(results) == n
        for r in results:     # every replica: the same bits as the ordered reference
            assert r.shape == xs[0].shape and r.dtype == dtype
            np.testing.assert_array_equal(r, want, err_msg=f"{name} {op} {SHAPES[k]}")
        exact = np.sum(np.stack(xs).astype(np.float64), axis=0) / (n if op == "mean" else 1)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(results[0], exact, rtol=tol, atol=tol)
    again = run()             # deterministic: the same bits on a second run
    for key, results in first.items():
        for r, s in zip(results, again[key]):
            assert r.tobytes() == s.tobytes()


def test_ring_chunks_do_not_change_the_bits():
    per_shape = _inputs(4, np.float32, seed=7)
    got = [_all_reduce_everything(_strategy(4, cdo.RingAllReduce(k)), per_shape)[0]()
           for k in (None, 2, 5)]
    for key in got[0]:
        for other in got[1:]:
            np.testing.assert_array_equal(other[key][0], got[0][key][0])


# ---------------------------------------------------------------- the placed graph


def _edges(g):
    """(source device, destination device) of every copy_to in a placed graph."""
    return {(eqn.inputs[0].device, eqn.device) for eqn in g.eqns if eqn.op.name == "copy_to"}


def _graph_of(ops, n=4, shape=(10,)):
    strategy = _strategy(n, ops)
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(shape, ctx.replica_id_in_sync_group, np.float32))

    @gd.function
    def step(x):
        return strategy.run(lambda v: gd.get_replica_context().all_reduce("sum", v), args=(x,))

    np.testing.assert_array_equal(step(x), np.full(shape, n * (n - 1) / 2, np.float32))
    return step.replicated_graph


def test_reduction_to_one_device_copies_to_the_target_and_back():
    g = _graph_of(cdo.ReductionToOneDevice("cpu:2"))
    others = [f"cpu:{i}" for i in (0, 1, 3)]
    assert _edges(g) == {(d, "cpu:2") for d in others} | {("cpu:2", d) for d in others}
    assert "copy_to[device=cpu:2]" in str(g)


def test_ring_copies_only_between_ring_neighbours():
    g = _graph_of(cdo.RingAllReduce())
    assert _edges(g) == {(f"cpu:{d}", f"cpu:{(d + 1) % 4}") for d in range(4)}
    copies = [e for e in g.eqns if e.op.name == "copy_to"]
    assert len(copies) == 4 * 2 * 3          # n segments x (n-1) steps, twice
    adds = [e for e in g.eqns if e.op.name == "add"]
    assert len(adds) == 4 * 3 and all(e.inputs[0].device == e.device for e in adds)
    assert len(_graph_of(cdo.RingAllReduce(num_chunks=2), shape=(40,)).eqns) > len(g.eqns)


def test_hierarchical_groups_and_copies():
    assert collectives.groups_of(("a", "b", "c", "d"), 2) == [("a", "b"), ("c", "d")]
    assert collectives.groups_of(("a", "b", "c"), 2) == [("a", "b"), ("c",)]
    assert collectives.groups_of(("a", "b", "c", "d", "e"), 3) == [("a", "b"), ("c", "d"), ("e",)]
    assert collectives.groups_of(("a",), 2) == [("a",)]
    assert collectives.groups_of(("a", "b"), 4) == [("a",), ("b",)]
    g = _graph_of(cdo.HierarchicalCopyAllReduce(2))
    assert _edges(g) == {("cpu:1", "cpu:0"), ("cpu:3", "cpu:2"),      # into the leaders
                         ("cpu:2", "cpu:0"), ("cpu:0", "cpu:2"),      # leaders exchange
                         ("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")}      # back to the groups
    g3 = _graph_of(cdo.HierarchicalCopyAllReduce(3), n=3)             # groups of one
    assert _edges(g3) == {(f"cpu:{a}", f"cpu:{b}") for a in range(3) for b in range(3) if a != b}
    with pytest.raises(ValueError, match="num_groups"):
        cdo.HierarchicalCopyAllReduce(0)


@pytest.mark.parametrize("parallel", [True, False])
def test_host_all_reduce_is_one_node_and_no_copies(parallel, monkeypatch):
    monkeypatch.setitem(gd.config._state, "overlap", False)     # the inline node
    # in one program, where every replica's bucket is in its arena (with a thread per
    # device the others' buckets reach the first device's program through channels)
    monkeypatch.setitem(gd.config._state, "device_concurrency", "sequential")
    monkeypatch.setattr(kernel_collectives, "PARALLEL_MIN_BYTES", 0 if parallel else 1 << 40)
    g = _graph_of(cdo.HostAllReduce(), shape=(64, 100))   # 25 KiB: the kernel's buffers
    fused = [e for e in g.eqns if e.op.name == "host_all_reduce"]
    assert len(fused) == 1 and not _edges(g)
    (eqn,) = fused
    assert eqn.device == "cpu:0" and [v.device for v in eqn.outputs] == [f"cpu:{i}"
                                                                         for i in range(4)]
    assert "host_all_reduce[op=sum]" in str(g)


# ---------------------------------------------------------------- the fused kernel itself


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [0, 1, 4097, 3 * 65536 + 5])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_host_kernel_matches_its_reference(dtype, size, op, parallel, monkeypatch):
    monkeypatch.setattr(kernel_collectives, "PARALLEL_MIN_BYTES", 0 if parallel else 1 << 40)
    rng = np.random.default_rng(size)
    xs = [rng.standard_normal(size).astype(dtype) for _ in range(3)]
    keep = [x.copy() for x in xs]
    outs = tuple(np.full(size, np.nan, dtype) for _ in xs)
    OPS["host_all_reduce"].out_impl(np, outs, *xs, op=op)
    want = host_all_reduce_ref(xs, op)
    for out, w in zip(outs, want):
        np.testing.assert_array_equal(out, w)
    np.testing.assert_array_equal(want[0], ref_device_order(xs, op))
    for x, k in zip(xs, keep):                 # inputs untouched
        np.testing.assert_array_equal(x, k)


# ---------------------------------------------------------------- device checks, the default


def _vars(devices, shape=(4,)):
    return [Var(ArrayType(shape, np.dtype("float32")), None, d) for d in devices]


def test_nccl_is_constructible_but_refuses_cpu_devices():
    nccl = cdo.NcclAllReduce()
    devices = ("cpu:0", "cpu:1")
    with pytest.raises(ValueError, match=r"cpu:0.*cpu:1"):
        collectives.lower_all_reduce(nccl, Builder(), _vars(devices), "sum", devices)
    strategy = _strategy(2, nccl)
    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(3))
    step = gd.function(lambda x: strategy.run(
        lambda v: gd.get_replica_context().all_reduce("sum", v), args=(x,)))
    with pytest.raises(ValueError, match="NcclAllReduce"):
        step(x)


def test_host_all_reduce_refuses_gpu_devices():
    devices = ("gpu:0", "gpu:1")
    with pytest.raises(ValueError, match="gpu:0"):
        collectives.lower_all_reduce(cdo.HostAllReduce(), Builder(), _vars(devices), "sum",
                                     devices)


def test_choose_cross_device_ops(monkeypatch):
    from graphdist.device import names as devices_module

    assert isinstance(cdo.choose_cross_device_ops(["cpu:0", "cpu:1"]), cdo.HostAllReduce)
    assert isinstance(gd.MirroredStrategy(["cpu:0", "cpu:1"]).cross_device_ops,
                      cdo.HostAllReduce)
    monkeypatch.setattr(devices_module, "physical_gpu_count", lambda: 2)
    assert isinstance(cdo.choose_cross_device_ops(["gpu:0", "gpu:1"]), cdo.NcclAllReduce)
    # logical GPUs 0 and 2 share physical GPU 0 (round robin): the node sums them there
    assert isinstance(cdo.choose_cross_device_ops(["gpu:0", "gpu:2"]), cdo.NcclAllReduce)
    assert isinstance(cdo.choose_cross_device_ops(["cpu:0", "gpu:0"]),
                      cdo.ReductionToOneDevice)


def test_reprs_and_bad_arguments():
    assert repr(cdo.RingAllReduce(4)) == "RingAllReduce(num_chunks=4)"
    assert repr(cdo.HierarchicalCopyAllReduce()) == "HierarchicalCopyAllReduce(num_groups=2)"
    assert repr(cdo.HostAllReduce()) == "HostAllReduce()"
    with pytest.raises(ValueError, match="num_chunks"):
        cdo.RingAllReduce(0)


def test_host_all_reduce_runs_in_place_on_dying_buckets_in_a_training_step(monkeypatch):
    """Gradient buckets die at their all-reduce, so HostAllReduce writes each replica's result
    over its own bucket (one pass); the step still equals one device."""
    monkeypatch.setitem(gd.config._state, "overlap", False)     # the inline node
    # in one program, where every replica's bucket is in its arena (with a thread per
    # device the others' buckets reach the first device's program through channels)
    monkeypatch.setitem(gd.config._state, "device_concurrency", "sequential")
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((64, 128)).astype(np.float32) * 0.1      # 32 KiB: arena-sized
    x = rng.standard_normal((16, 64)).astype(np.float32)
    results = {}
    for devices in (["cpu:0"], ["cpu:0", "cpu:1"]):
        strategy = gd.MirroredStrategy(devices, cross_device_ops=gd.HostAllReduce())
        with strategy.scope():
            w = gd.Variable(w0, name="w")
            opt = gd.optimizers.SGD(0.1)

        @gd.function
        def step(batch):
            def replica_fn(xb):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean(gd.tanh(xb @ w) ** 2.0)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
                return loss
            return strategy.reduce("mean", strategy.run(replica_fn, args=(batch,)))

        batch = next(iter(strategy.experimental_distribute_dataset([x])))
        for _ in range(3):
            step(batch)
        results[len(devices)] = w.numpy()
        if len(devices) == 2:
            program = step._latest().executable.programs[0]
            env = program.fn.__globals__
            line = next(x for x in program.source.splitlines() if x.lstrip().startswith("O")
                        and "((" in x and env[x.split("(")[0].strip()].func.__name__
                        == "host_all_reduce_cpu")
            outs = line.split("((")[1].split(")")[0].rstrip(",").split(", ")
            assert all(o.startswith("B") for o in outs)
            bucket_bufs = [a for a in env if a.startswith("B") and env[a].shape == (64, 128)]
            shared = [o for o in outs if any(np.shares_memory(env[o], env[b])
                                             for b in bucket_bufs)]
            assert len(shared) == 2, "the all-reduce did not write over its dying buckets"
    np.testing.assert_allclose(results[2], results[1], rtol=1e-5, atol=1e-6)


def test_nccl_lowers_to_one_node_whose_reference_sums_in_device_order():
    devices = ("gpu:0", "gpu:1", "gpu:2")
    b = Builder()
    xs = _vars(devices, shape=(2, 3))
    outs = collectives.lower_all_reduce(cdo.NcclAllReduce(), b, xs, "mean", devices)
    (node,) = [e for e in b.eqns if e.op.name == "nccl_all_reduce"]
    assert dict(node.params) == {"op": "mean", "devices": devices}
    assert [v.device for v in node.outputs] == list(devices)
    assert [v.ty.shape for v in outs] == [(2, 3)] * 3
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(6).astype(np.float32) for _ in devices]
    got = OPS["nccl_all_reduce"].impl(np, *parts, op="mean", devices=devices)
    want = ((parts[0] + parts[1]) + parts[2]) / np.float32(3)
    for g in got:
        np.testing.assert_array_equal(g, want)
