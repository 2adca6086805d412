"""The compile pipeline (graphdist/pipeline.py): every stage in order, each graph valid, the
last one what runs, and the mode of issue decided here (per-device by default)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import check

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
LOGICAL = ["trace", "dce", "cse", "simplify", "cse.2", "dce.2", "fuse_optimizer",
           "fuse_accumulate"]


def _step(strategy):
    with strategy.scope():
        w = gd.Variable(np.ones((3, 2), np.float32), name="w")
        b = gd.Variable(np.zeros((2,), np.float32), name="b")
        opt = gd.optimizers.SGD(0.1, momentum=0.9)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean((x @ w + b) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=(x,)))

    return step


def _batch(strategy):
    x = np.arange(24, dtype=np.float32).reshape(8, 3) / 10
    return next(iter(strategy.experimental_distribute_dataset([x])))


def test_replicated_stages_in_order_each_valid_and_the_last_is_what_runs(device_threads):
    strategy = gd.MirroredStrategy(DEVICES)
    step = _step(strategy)
    batch = _batch(strategy)
    stages = step.get_stages(batch)
    # overlap (the default) splits the all-reduces with compute left behind them; with a
    # thread per device each device updates its own copy
    assert list(stages) == LOGICAL + ["replicate", "epilogues", "lower_collectives",
                                      "overlap", "fuse_elementwise", "schedule"]
    for name, g in stages.items():
        check(g, where=name)
    assert stages["schedule"] is step.replicated_graph
    assert stages["fuse_accumulate"] is step.graph
    # replicate leaves each collective one N-way node; lowering turns it into what runs
    joined = [e for e in stages["replicate"].eqns if e.op.name == "all_reduce"]
    assert joined and all(len(e.inputs) == len(DEVICES) for e in joined)
    lowered = stages["lower_collectives"]
    assert not any(e.op.name == "all_reduce" for e in lowered.eqns)
    assert any(e.op.name == "host_all_reduce" for e in lowered.eqns)
    assert {e.device for e in step.replicated_graph.eqns} == set(DEVICES)   # per device
    assert step.stages.keys() == stages.keys()


def test_one_device_stages_place_and_schedule():
    step = _step(gd.OneDeviceStrategy("cpu:0"))
    step(np.ones((4, 3), np.float32))
    assert list(step.stages) == LOGICAL + ["place", "epilogues", "fuse_elementwise",
                                           "schedule"]
    assert {e.device for e in step.stages["place"].eqns} == {"cpu:0"}


def test_merged_is_opt_in_and_its_stages_say_merge():
    strategy = gd.MirroredStrategy(DEVICES)
    batch = _batch(strategy)
    default = _step(strategy)
    default(batch)
    assert not default.replicated_graph.merged
    gd.config.set_device_concurrency("merged")
    try:
        merged = _step(strategy)
        merged(batch)
    finally:
        gd.config.set_device_concurrency("auto")
    assert list(merged.stages) == LOGICAL + ["merge", "epilogues", "fuse_elementwise",
                                             "schedule"]
    assert merged.replicated_graph.merged
    note = merged.replicated_graph.mode_note()
    assert "merged" in note and "opt-in" in note
    assert note in str(merged.replicated_graph) and note in merged.replicated_graph.summary()
    assert default.replicated_graph.mode_note() == ""


@pytest.mark.parametrize("mode, zero_stage, width, plan_mode", [
    ("auto", 0, 512, "threads"), ("sequential", 0, 512, "sequential"),
    ("threads", 0, 512, "threads"),
    # small nodes: their Python costs what their work does, and threads would contend
    ("auto", 0, 8, "sequential"), ("threads", 0, 8, "threads"),
    # sharded optimizer state: its reduce-scatter, shard updates and all-gather fuse into
    # one node only in one program, so "auto" keeps one there
    ("auto", 1, 512, "sequential"), ("threads", 1, 512, "threads")])
def test_the_pipeline_decides_how_replicas_are_issued(mode, zero_stage, width, plan_mode):
    strategy = gd.MirroredStrategy(DEVICES[:2], zero_stage=zero_stage)
    gd.config.set_device_concurrency(mode)
    try:
        step = _dense_step(strategy, width)
        x = np.ones((256, width), np.float32) / width
        step(next(iter(strategy.experimental_distribute_dataset([x]))))
    finally:
        gd.config.set_device_concurrency("auto")
    assert step._latest().plan.mode == plan_mode
    # one program or a thread per device: the loss's all-reduce overlapped (a start and a
    # wait)
    ops = {e.op.name for e in step.replicated_graph.eqns}
    assert "host_all_reduce_start" in ops


def _dense_step(strategy, width: int):
    """An SGD step of one dense layer of `width` units: 1 MiB weights at 512, 256 bytes at
    8 (its nodes' sizes decide "auto")."""
    with strategy.scope():
        w = gd.Variable(np.eye(width, dtype=np.float32) * 0.5, name="w")
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.tanh(x @ w) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=(x,)))
    return step


def _loop_step(strategy, width: int):
    """A step whose work is a 16-step fori_loop of a dense layer of `width` units."""
    with strategy.scope():
        w = gd.Variable(np.eye(width, dtype=np.float32) * 0.5, name="w")

    @gd.function
    def step(x):
        def replica_fn(x):
            h = gd.fori_loop(0, 16, lambda i, h: gd.tanh(h @ w) + h * 0.5, x)
            return gd.reduce_mean(h)
        return strategy.reduce("mean", strategy.run(replica_fn, args=(x,)))
    return step


@pytest.mark.parametrize("width, plan_mode", [(8, "sequential"), (512, "threads")])
def test_auto_runs_a_loop_of_small_nodes_as_one_program(width, plan_mode):
    """Small loop-body nodes spend as long in their Python as in their numpy work, and
    device threads would contend for the interpreter lock (docs/benchmarks.md, "An LSTM
    against the peers"): "auto" issues them from one program; large ones a thread each. A
    loop's body counts once a trip."""
    strategy = gd.MirroredStrategy(DEVICES[:2])
    step = _loop_step(strategy, width)
    x = np.ones((512, width), np.float32) / width
    step(next(iter(strategy.experimental_distribute_dataset([x]))))
    assert step._latest().plan.mode == plan_mode


def test_executed_nodes_count_each_loop_trip_and_the_larger_branch():
    from graphdist.ops.control_flow import executed_nodes

    def f(x, flag):
        h = gd.scan(lambda c, _: (c * 2.0 + 1.0, c), x, length=5)[0]            # 2 a trip
        return gd.cond(flag, lambda: h - 1.0, lambda: (h * h) * 3.0 - h)      # 1 or 3

    g = gd.function(f).get_graph(np.ones(3, np.float32), np.bool_(True))
    scans = [e for e in g.eqns if e.op.name == "scan"]
    body = dict(scans[0].params)["body"]
    outside = len(g.eqns)
    total, in_loops = executed_nodes(g)
    assert in_loops == 5 * len(body.eqns)
    assert total == outside + in_loops + 3       # the cond's larger branch: 3 eqns
