"""zero_stage=1|2: slots sharded over the replicas, gradients reduce-scattered in buckets,
parameters all-gathered. Parameters and (whole) slots are compared with zero_stage=0 run
on the same data: bit for bit where only the reduction's order matters (it is the same),
within float32 rounding where clipping sums squares per shard."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.viz.summary import stats

RNG = np.random.default_rng(3)
W0 = RNG.standard_normal((5, 3)).astype(np.float32)
B0 = RNG.standard_normal(3).astype(np.float32) * 0.1
DATA = [(RNG.standard_normal((8, 5)).astype(np.float32),
         RNG.standard_normal((8, 3)).astype(np.float32)) for _ in range(4)]


def _optimizer(kind, **kw):
    return {"sgd": lambda: gd.optimizers.SGD(0.05, **kw),
            "momentum": lambda: gd.optimizers.SGD(0.05, momentum=0.9, nesterov=True, **kw),
            "adam": lambda: gd.optimizers.Adam(0.05, **kw),
            "adamw": lambda: gd.optimizers.AdamW(0.05, weight_decay=0.1, **kw)}[kind]()


class Run:
    """w, b and an optimizer under a MirroredStrategy of n replicas at `stage`."""

    def __init__(self, stage, kind="adam", n=4, loss_scale=False, **kw):
        self.n = n
        self.strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)], zero_stage=stage)
        with self.strategy.scope():
            self.w = gd.Variable(W0, name="w")
            self.b = gd.Variable(B0, name="b")
            self.opt = _optimizer(kind, **kw)
            if loss_scale:
                self.opt = gd.optimizers.LossScaleOptimizer(self.opt, initial_scale=4.0)
        opt, w, b = self.opt, self.w, self.b

        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.square(gd.tanh(x @ w + b) - y))
                if loss_scale:
                    loss = opt.get_scaled_loss(loss)
            grads = tape.gradient(loss, [w, b])
            if loss_scale:
                grads = opt.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(grads, [w, b]))
            return loss

        self.step = gd.function(lambda x, y: self.strategy.run(replica_fn, args=(x, y)))

    def __call__(self, x, y):
        xs, ys = np.array_split(x, self.n), np.array_split(y, self.n)
        per = self.strategy.experimental_distribute_values_from_function
        return self.step(per(lambda c: xs[c.replica_id_in_sync_group]),
                         per(lambda c: ys[c.replica_id_in_sync_group]))

    def train(self, batches):
        for x, y in batches:
            self(x, y)
        return self

    @property
    def inner(self):
        return getattr(self.opt, "inner_optimizer", self.opt)

    def state(self):
        return {"w": self.w.numpy(), "b": self.b.numpy(),
                **{k: np.asarray(s.numpy()) for k, s in self.inner.slots().items()}}


def _assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_steps_give_stage_0s_parameters_and_slots_bit_for_bit(kind, stage, n):
    base = Run(0, kind, n).train(DATA)
    sharded = Run(stage, kind, n).train(DATA)
    _assert_same(base.state(), sharded.state())
    for var in (sharded.w, sharded.b):                # every replica's copy is the same
        for component in var.values[1:]:
            np.testing.assert_array_equal(component, var.values[0])


def test_each_replica_keeps_one_nth_of_every_slot():
    run = Run(1, "adam", 4).train(DATA[:1])
    slots = run.opt.slots()
    assert set(slots) == {"w/m", "w/v", "b/m", "b/v"}
    assert [c.shape for c in slots["w/m"].values] == [(4,)] * 4      # ceil(15 / 4)
    assert [c.shape for c in slots["b/v"].values] == [(1,)] * 4      # ceil(3 / 4)
    assert slots["w/m"].numpy().shape == (5, 3)                       # read whole
    # the padding (w: 16 - 15 elements, b: 4 - 3) stays zero on the last replica
    assert slots["w/v"].values[3][-1] == 0 and slots["b/v"].values[3][0] == 0


def test_the_graph_reduce_scatters_and_all_gathers_instead_of_all_reducing():
    run = Run(1, "momentum", 2).train(DATA[:1])
    text = str(run.step.graph)
    assert text.count("reduce_scatter[") == 1 and text.count("all_gather[") == 1  # one bucket
    assert "all_reduce" not in text
    tiny = Run(1, "momentum", 2)
    tiny.strategy.bucket_bytes = 16       # w's and b's gradients in buckets of their own
    tiny.train(DATA[:1])
    assert str(tiny.step.graph).count("reduce_scatter[") == 2


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.05}])
def test_clipping_from_the_shards(clip):
    base = Run(0, "momentum", 4, **clip).train(DATA)
    sharded = Run(2, "momentum", 4, **clip).train(DATA)
    _assert_same(base.state(), sharded.state(), exact=False)
    unclipped = Run(0, "momentum", 4).train(DATA)
    assert not np.allclose(unclipped.w.numpy(), base.w.numpy(), rtol=1e-3)
    text = str(sharded.step.graph)
    assert text.count("all_reduce") == 1      # the sums of squares: one small all-reduce


def test_loss_scaling_skips_a_non_finite_step_on_every_replica():
    bad = DATA[1][0].copy()
    bad[7, 0] = np.inf                         # in the last replica's shard only
    batches = [DATA[0], (bad, DATA[1][1]), DATA[2]]
    base = Run(0, "adam", 4, loss_scale=True).train(batches)
    sharded = Run(1, "adam", 4, loss_scale=True).train(batches)
    assert int(sharded.opt.iterations.numpy()) == 2
    assert float(sharded.opt.loss_scale.numpy()) == 2.0
    _assert_same(base.state(), sharded.state())


def test_sparse_gradients_are_densified():
    table0 = RNG.standard_normal((6, 2)).astype(np.float32)
    ids = [np.array([[0, 1], [1, 5], [2, 2], [0, 3]], np.int32)]

    def run(stage):
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=stage)
        with strategy.scope():
            table = gd.Variable(table0, name="table")
            opt = gd.optimizers.Adam(0.1)

        @gd.function
        def step(ids):
            def replica_fn(ids):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_sum(gd.square(gd.gather(table, ids)))
                opt.apply_gradients(zip(tape.gradient(loss, [table]), [table]))
                return loss

            return strategy.run(replica_fn, args=(ids,))

        for batch in ids * 2:
            halves = np.array_split(batch, 2)
            step(strategy.experimental_distribute_values_from_function(
                lambda c: halves[c.replica_id_in_sync_group]))
        return table.numpy()

    np.testing.assert_allclose(run(1), run(0), rtol=1e-6, atol=1e-7)


def test_accumulation_with_sharded_state():
    base = Run(0, "adam", 2, gradient_accumulation_steps=2).train(DATA)
    sharded = Run(1, "adam", 2, gradient_accumulation_steps=2).train(DATA)
    assert int(sharded.opt.iterations.numpy()) == 2
    _assert_same(base.state(), sharded.state())


@pytest.mark.parametrize("save,restore", [((1, 4), (0, 2)), ((0, 2), (1, 4)),
                                          ((2, 2), (2, 4))])
def test_checkpoints_hold_whole_slots_and_restore_into_any_count_and_stage(tmp_path, save,
                                                                         restore):
    first = Run(save[0], "adam", save[1]).train(DATA[:2])
    path = gd.Checkpoint(w=first.w, b=first.b, opt=first.opt).save(tmp_path / "ckpt.npz")
    with np.load(path) as f:                               # whole slots in the file
        assert f["opt/slots/w/m"].shape == (5, 3)
    second = Run(restore[0], "adam", restore[1])
    gd.Checkpoint(w=second.w, b=second.b, opt=second.opt).restore(path).assert_consumed()
    _assert_same(first.state(), second.state())
    assert int(second.opt.iterations.numpy()) == 2
    second.train(DATA[2:])
    straight = Run(0, "adam", restore[1]).train(DATA)
    _assert_same(straight.state(), second.state(), exact=False)


@pytest.mark.parametrize("bad", [3, -1, True, "1"])
def test_bad_zero_stage_is_refused(bad):
    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
        gd.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=bad)


@pytest.mark.parametrize("stage", [0, 1])
def test_two_workers_with_accumulation_match_four_local_replicas(tmp_path, stage):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__))))
    from mpi_launch import needs_mpi, two_workers   # noqa: F401 (the skip marker's check)

    if needs_mpi.args[0]:
        pytest.skip(needs_mpi.kwargs["reason"])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "mpi"))
    from zero_accumulation import train

    done = two_workers("zero_accumulation.py", [tmp_path, stage], "mpiexec", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    w, opt = train(gd.MirroredStrategy([f"cpu:{i}" for i in range(4)]))
    # MPI adds each worker's local sum, (r0 + r1) + (r2 + r3), where 4 local replicas add
    # in order: equal within float32 rounding, and both workers hold the same bits
    assert reports[0] == reports[1]
    for report in reports:
        assert report["iterations"] == 2                 # 4 calls, 2 micro-batches each
        # this worker's 2 replicas' slot components: shards of ceil(21 / 4), or whole
        assert report["shard_shapes"] == ([[6], [6]] if stage else [[7, 3], [7, 3]])
        np.testing.assert_allclose(np.float32(report["w"]), w.numpy(), rtol=1e-5, atol=1e-7)
        for key, slot in opt.slots().items():
            np.testing.assert_allclose(np.float32(report["slots"][key]), slot.numpy(),
                                       rtol=1e-4, atol=1e-8)
    restored = gd.Variable(np.zeros((7, 3), np.float32), name="w")
    gd.Checkpoint(w=restored).restore(tmp_path / "ckpt.npz").expect_partial()
    np.testing.assert_array_equal(restored.numpy(), np.float32(reports[0]["w"]))


@pytest.mark.parametrize("shapes", [[(128, 64)], [(100, 100), (10,)]])
def test_large_parameters_all_gathered_into_their_storage(shapes):
    """Parameters past the arena threshold (16 KiB): the all-gathered bucket may be written
    straight into a parameter's storage only when it is that whole parameter (a 2-D one,
    filled flat), never when the parameter is a padded part of a bucket of several."""
    rng = np.random.default_rng(11)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    x = rng.standard_normal((8, 3)).astype(np.float32)

    def run(stage):
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)], zero_stage=stage)
        with strategy.scope():
            ws = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(initial)]
            opt = gd.optimizers.Adam(0.1)

        @gd.function
        def step(x):
            def replica_fn(x):
                with gd.GradientTape() as tape:
                    loss = sum(gd.reduce_sum(gd.square(w)) * gd.reduce_mean(x) for w in ws)
                opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
                return loss
            return strategy.run(replica_fn, args=(x,))

        batch = next(iter(strategy.experimental_distribute_dataset([x])))
        for _ in range(2):
            step(batch)
        return [w.numpy() for w in ws]

    for got, want in zip(run(1), run(0)):
        np.testing.assert_array_equal(got, want)


def test_a_large_gradient_is_reduce_scattered_alone():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=1)
    with strategy.scope():
        ws = [gd.Variable(np.full(s, 0.5, np.float32)) for s in [(3,), (512, 512), (4,)]]
        opt = gd.optimizers.SGD(0.1, momentum=0.9)

    @gd.function
    def step():
        def replica_fn():
            with gd.GradientTape() as tape:
                loss = sum(gd.reduce_sum(gd.square(w)) for w in ws)
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
        return strategy.run(replica_fn)

    step()
    ops = [e.op.name for e in step.graph.eqns if e.op.collective]
    # the 1 MiB gradient alone, the two small ones in one bucket; then the gathers
    assert ops == ["reduce_scatter", "reduce_scatter", "all_gather", "all_gather"]
    for w in ws:     # 0.5 - 0.1 * 2 * 0.5
        np.testing.assert_allclose(w.numpy(), np.full(w.shape, 0.4), rtol=1e-6)


def test_already_reduced_gradients_take_their_chunk():
    # all_reduce=False: the caller reduced them (here with the replica context's all-reduce)
    def run(stage):
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=stage)
        with strategy.scope():
            w = gd.Variable(W0, name="w")
            opt = gd.optimizers.Adam(0.05)

        @gd.function
        def step(x):
            def replica_fn(x):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean(gd.square(x @ w))
                (g,) = tape.gradient(loss, [w])
                g = gd.get_replica_context().all_reduce("mean", g)
                opt.apply_gradients([(g, w)], all_reduce=False)
            return strategy.run(replica_fn, args=(x,))

        halves = np.array_split(DATA[0][0], 2)
        for _ in range(2):
            step(strategy.experimental_distribute_values_from_function(
                lambda c: halves[c.replica_id_in_sync_group]))
        return w.numpy(), step

    (sharded, step), (base, _) = run(1), run(0)
    np.testing.assert_array_equal(sharded, base)
    assert "reduce_scatter" not in str(step.graph)


def test_sharded_state_outside_a_replica_is_refused():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=1)
    with strategy.scope():
        w = gd.Variable(W0, name="w")
        opt = gd.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(ValueError, match="zero_stage=1.*inside strategy.run"):
        opt.apply_gradients([(np.ones_like(W0), w)])
    np.testing.assert_array_equal(w.numpy(), W0)         # nothing changed
    assert int(opt.iterations.numpy()) == 0


# ---------------------------------------------------------------- the fused sharded update
# On logical CPU devices run as one program (fused kernels on), passes/fuse_zero.py makes
# each bucket's reduce-scatter, every replica's shard update and the all-gather one
# host_reduce_scatter_update_all_gather node (kernels/sharded_update.py).

FUSED = "host_reduce_scatter_update_all_gather"


def _trained(run, batches=DATA):
    """Train, with the kernels loaded after the first step, so the later steps run the
    Numba kernel and the first its numpy twin (both give the same bits)."""
    from graphdist.function import _kernels_loaded

    if batches[0] is not None:
        run.train(batches[:1])
    _kernels_loaded()
    return run.train(batches[1:])


@pytest.fixture
def unfused(monkeypatch):
    """Run(...) trained on `batches` as _trained does, its step compiled without the
    fusion: the reduce-scatter, updates and all-gather apart."""
    import graphdist.pipeline as pipeline

    def build(*args, batches=DATA, **kw):
        with monkeypatch.context() as m:
            m.setattr(pipeline, "fuse_sharded_update", lambda g: g)
            run = Run(*args, **kw).train(batches[:1])       # compiled here
        return _trained(run, [None, *batches[1:]])
    return build


def _fused_nodes(run) -> list:
    return [e for e in run.step.replicated_graph.eqns if e.op.name == FUSED]


@pytest.mark.usefixtures("one_program")
def test_the_fused_node_replaces_reduce_scatter_updates_and_all_gather():
    run = Run(1, "adam", 4).train(DATA[:1])
    (node,) = _fused_nodes(run)                       # w and b share one bucket
    params = dict(node.params)
    assert params["variables"] == ("w", "b") and params["update"] == "adam_multi_update"
    assert params["members"] == ("host_reduce_scatter", "adam_multi_update", "host_all_gather")
    assert params["lengths"] == (4, 1) and params["offsets"] == (0, 4)   # ceil(15/4), ceil(3/4)
    names = {e.op.name for e in run.step.replicated_graph.eqns}
    assert not names & {"host_reduce_scatter", "host_all_gather", "adam_multi_update",
                        "gather"}
    text = str(run.step.replicated_graph)
    assert f"{FUSED}[" in text and "variables=(w,b)" in text.replace("'", "").replace(" ", "")
    assert "fuse_sharded_update" in run.step.stages
    summary = run.step.replicated_graph.summary()
    assert FUSED in summary                                  # among the ops and collectives
    memory = stats(run.step.replicated_graph)["memory"]
    for row in memory.values():       # the reduced shard: ceil(15 / 4) + ceil(3 / 4) floats
        assert row["gradients"] == 4 * (4 + 1)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.usefixtures("one_program")
def test_the_fused_node_gives_the_unfused_bits(kind, n, unfused):
    fused = _trained(Run(1, kind, n))
    apart = unfused(1, kind, n)
    assert _fused_nodes(fused) and not _fused_nodes(apart)
    _assert_same(fused.state(), apart.state())
    _assert_same(fused.state(), _trained(Run(0, kind, n)).state())     # and stage 0's
    for var in (fused.w, fused.b):
        for component in var.values[1:]:
            np.testing.assert_array_equal(component, var.values[0])


def test_loss_scaling_keeps_the_reduce_scatter_apart(unfused):
    # LossScaleOptimizer reads the reduced shards (are they finite?) before any update
    # may land: the bucket stays three nodes, and the step gives what it gave before
    bad = DATA[1][0].copy()
    bad[7, 0] = np.inf
    batches = [DATA[0], (bad, DATA[1][1]), DATA[2], DATA[3]]
    fused = _trained(Run(1, "adam", 4, loss_scale=True), batches)
    apart = unfused(1, "adam", 4, loss_scale=True, batches=batches)
    assert not _fused_nodes(fused)
    assert int(fused.opt.iterations.numpy()) == 3
    _assert_same(fused.state(), apart.state())


def test_clipping_by_global_norm_keeps_the_reduce_scatter_apart(unfused):
    # the update reads the clipped shards, which need every shard's norm first: the
    # bucket stays three nodes, and the step gives what it gave before
    fused = _trained(Run(1, "adam", 4, global_clipnorm=0.05))
    apart = unfused(1, "adam", 4, global_clipnorm=0.05)
    assert not _fused_nodes(fused)
    assert any(e.op.name == "host_reduce_scatter" for e in fused.step.replicated_graph.eqns)
    _assert_same(fused.state(), apart.state())
    _assert_same(fused.state(), _trained(Run(0, "adam", 4, global_clipnorm=0.05)).state(),
                 exact=False)


@pytest.mark.usefixtures("one_program")
def test_many_members_split_into_nodes_of_at_most_16_tensors(unfused):
    shapes = [(3,), (2, 2), (5,), (1,), (7,)]
    rng = np.random.default_rng(5)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def run(build_unfused):
        import graphdist.pipeline as pipeline

        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)], zero_stage=1)
        with strategy.scope():
            ws = [gd.Variable(p, name=f"v{i}") for i, p in enumerate(initial)]
            opt = gd.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01)

        @gd.function
        def step():
            def replica_fn():
                with gd.GradientTape() as tape:
                    loss = sum(gd.reduce_sum(gd.square(w) * gd.sin(w)) for w in ws)
                opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return strategy.run(replica_fn)

        saved = pipeline.fuse_sharded_update
        if build_unfused:
            pipeline.fuse_sharded_update = lambda g: g
        try:
            step()
        finally:
            pipeline.fuse_sharded_update = saved
        for _ in range(3):
            step()
        nodes = [e for e in step.replicated_graph.eqns if e.op.name == FUSED]
        return [w.numpy() for w in ws], nodes

    (got, nodes), (want, none) = run(False), run(True)
    assert [dict(e.params)["n"] for e in nodes] == [4, 1] and not none   # 4 x 4, 4 x 1
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("save,restore", [((1, 4), (0, 2)), ((0, 2), (1, 4)),
                                          ((1, 2), (1, 4))])
@pytest.mark.usefixtures("one_program")
def test_the_fused_node_saves_and_restores_whole_slots(tmp_path, save, restore, unfused):
    """Save after 2 steps, restore into another replica count and stage, train 2 more:
    with the fused node the same bits as with the nodes apart, and whole slots in the
    file."""
    def through_checkpoint(build, folder):
        first = build(save[0], "adam", save[1], batches=DATA[:2])
        path = gd.Checkpoint(w=first.w, b=first.b, opt=first.opt).save(
            tmp_path / f"{folder}.npz")
        with np.load(path) as f:
            assert f["opt/slots/w/m"].shape == (5, 3)
        second = Run(restore[0], "adam", restore[1])
        gd.Checkpoint(w=second.w, b=second.b, opt=second.opt).restore(path).assert_consumed()
        _assert_same(first.state(), second.state())
        return first, second

    def fused(*args, batches, **kw):
        return _trained(Run(*args, **kw), batches)

    first, second = through_checkpoint(fused, "fused")
    second.train(DATA[2:])
    assert bool(_fused_nodes(first)) == (save[0] > 0)
    assert bool(_fused_nodes(second)) == (restore[0] > 0)
    first_apart, second_apart = through_checkpoint(unfused, "apart")
    _assert_same(first.state(), first_apart.state())
    import graphdist.pipeline as pipeline

    saved, pipeline.fuse_sharded_update = pipeline.fuse_sharded_update, lambda g: g
    try:
        second_apart.train(DATA[2:])
    finally:
        pipeline.fuse_sharded_update = saved
    assert not _fused_nodes(second_apart)
    _assert_same(second.state(), second_apart.state())


def test_one_device_per_worker_reduce_scatters_and_gathers_into_the_steps_buffers(tmp_path):
    """2 workers x 1 device: MPI's Reduce_scatter_block from the bucket and Allgather into
    the output (the out= forms) give the bits of the all-reduce and copies (the impls)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__))))
    from mpi_launch import needs_mpi, two_workers   # noqa: F401 (the skip marker's check)

    if needs_mpi.args[0]:
        pytest.skip(needs_mpi.kwargs["reason"])
    done = two_workers("zero_one_device.py", [tmp_path], "mpiexec", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert reports[0] == reports[1]                     # both workers hold the same bits
    out, impl = reports[0]["out"], reports[0]["impl"]
    # a bucket with backward work left to hide behind: a start and a wait (the overlap
    # stage)
    assert {"mpi_reduce_scatter_start", "collective_wait", "mpi_all_gather"} <= set(
        out.pop("ops"))
    assert impl.pop("ops") == ["mpi_all_gather", "mpi_reduce_scatter"]
    assert out == impl


def test_gather_writes_a_replica_s_chunk_into_a_planned_buffer():
    """Each replica's chunk of a parameter is gather(rows, replica_id) with a 0-d index;
    its out= form (into an arena buffer the in-place update then takes over) gives the
    impl's values and refuses an index out of range as the impl does."""
    from graphdist.ops.sparse import gather_p

    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    for index, shape in ((np.int32(2), (4,)), (np.array([0, 2], np.int32), (2, 4))):
        out = np.empty(shape, np.float32)
        gather_p.out_impl(np, out, rows, index)
        np.testing.assert_array_equal(out, gather_p.impl(np, rows, index))
        np.testing.assert_array_equal(out, rows[index])
    with pytest.raises(IndexError, match="gather: index 3 is out of range for 3 rows"):
        gather_p.out_impl(np, np.empty(4, np.float32), rows, np.int32(3))


@pytest.mark.usefixtures("one_program")
def test_the_simulator_knows_the_fused_node_s_lowering():
    # gd.simulate tells the lowering a step ran with by the fused nodes it made: a stage-1
    # step with nothing else collective is the host lowering's
    from graphdist.simulate.predict import _lowering_of

    run = Run(1, "adam", 4).train(DATA[:1])
    assert {e.op.name for e in run.step.replicated_graph.eqns if e.op.collective} == {FUSED}
    assert _lowering_of(run.step) == "host"


@pytest.mark.usefixtures("one_program")
def test_a_bucket_left_apart_leaves_the_graph_as_it_was():
    # LossScaleOptimizer reads the reduced shards: nothing to fuse, and the pass hands back
    # its input (the updates not even cut per bucket)
    from graphdist.passes.fuse_zero import fuse_sharded_update

    run = Run(1, "adam", 4, loss_scale=True)
    run.strategy.bucket_bytes = 16            # w and b in buckets of their own
    run.train(DATA[:1])
    before = run.step.stages["fuse_reduce_update"]
    assert sum(e.op.name == "host_reduce_scatter" for e in before.eqns) == 2
    assert fuse_sharded_update(before) is before
