"""Memory you can see: g.summary()'s per-device bytes of parameters, gradients, optimizer
slots and peak activations, and `graphdist simulate --memory` (the ZeRO paper's
arithmetic), checked against sizes computed here from the shapes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import graphdist as gd
from graphdist.simulate.memory import builder_rows, paper_rows
from graphdist.viz.summary import peak_bytes, stats

SHAPES = {"w1": (6, 9), "b1": (9,), "w2": (9, 2)}        # 54 + 9 + 18 = 81 parameters


def build(n, stage=0, k=1):
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)], zero_stage=stage)
    rng = np.random.default_rng(0)
    with strategy.scope():
        ws = [gd.Variable(rng.standard_normal(s).astype(np.float32), name=name)
              for name, s in SHAPES.items()]
        opt = gd.optimizers.Adam(0.01, gradient_accumulation_steps=k)

    @gd.function
    def step(x, y):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = gd.tanh(x @ ws[0] + ws[1])
                loss = gd.reduce_mean(gd.square(h @ ws[2] - y))
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.run(replica_fn, args=(x, y))

    x = np.ones((4 * n, 6), np.float32)
    y = np.zeros((4 * n, 2), np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    return step, batch


def _whole_bytes():
    return 4 * sum(math.prod(s) for s in SHAPES.values())


def _shard_bytes(n):
    return 4 * sum(-(-math.prod(s) // n) for s in SHAPES.values())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_summary_lists_parameters_gradients_slots_and_peak_activations(stage):
    step, batch = build(4, stage)
    step(*batch)
    g = step.replicated_graph
    memory = stats(g)["memory"]
    assert sorted(memory, key=str) == [f"cpu:{i}" for i in range(4)]
    gradients = _whole_bytes() if stage == 0 else _shard_bytes(4)
    for device, row in memory.items():
        assert row["parameters"] == _whole_bytes()              # every replica's copy
        assert row["optimizer slots"] == 2 * gradients          # Adam's m and v
        assert row["gradients"] == gradients
        assert row["peak activations"] == peak_bytes(g)[device] > 0
    text = g.summary()
    assert "memory per device" in text and "optimizer slots" in text
    assert "peak activations" in text


@pytest.mark.usefixtures("one_program")
def test_a_bucket_shared_by_cut_updates_counts_once():
    # the MLP's six parameters on 4 replicas, overlap off: the fused all-reduce + Adam
    # update comes in two nodes that both read the same bucket, which must count once
    shapes = [(300, 256), (256,), (256, 256), (256,), (256, 10), (10,)]
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    with strategy.scope():
        ws = [gd.Variable(np.full(s, 0.1, np.float32)) for s in shapes]
        opt = gd.optimizers.Adam(0.01)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                h = x
                for i in range(0, 6, 2):
                    h = h @ ws[i] + ws[i + 1]
                    h = gd.relu(h) if i < 4 else h
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(
                    np.zeros(1, np.int32), h))
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.run(replica_fn, args=(x,))

    x = np.ones((4, shapes[0][0]), np.float32)
    gd.config.set_overlap(False)          # the fused all-reduce + update runs inline only
    try:
        step(next(iter(strategy.experimental_distribute_dataset([x]))))
    finally:
        gd.config.set_overlap(True)
    g = step.replicated_graph
    assert sum(e.op.name == "host_reduce_update" for e in g.eqns) == 2
    assert stats(g)["memory"]["cpu:1"]["gradients"] == 4 * sum(math.prod(s) for s in shapes)


def test_accumulators_count_as_gradients():
    step, batch = build(2, 0, k=2)
    step(*batch)                                   # a micro-step: no collective at all
    row = stats(step.replicated_graph)["memory"]["cpu:0"]
    assert row["gradients"] == _whole_bytes()      # the accumulators
    step(*batch)                                   # applying: + the reduced gradients
    row = stats(step.replicated_graph)["memory"]["cpu:0"]
    assert row["gradients"] == 2 * _whole_bytes()


def test_the_logical_graph_has_one_replica_column():
    step, batch = build(2, 1)
    step(*batch)
    memory = stats(step.graph)["memory"]
    assert list(memory) == [None]
    assert memory[None]["optimizer slots"] == 2 * _shard_bytes(2)


def test_zero_papers_arithmetic():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, mixed-precision Adam, 64 devices
    rows = paper_rows(7.5e9, [64])
    assert [round(r["total_B"] / 1e9, 1) for r in rows] == [120.0, 31.4, 16.6]
    for r in rows:                          # 16 B/param; 4 + 12/N; 2 + 14/N
        per_param = {0: 16, 1: 4 + 12 / 64, 2: 2 + 14 / 64}[r["zero_stage"]]
        assert r["total_B"] == pytest.approx(per_param * 7.5e9)


def test_builder_rows_shard_slots_then_gradients():
    rows = {(r["devices"], r["zero_stage"]): r
            for r in builder_rows(lambda n: build(n), [1, 4], [0, 1, 2])}
    whole = _whole_bytes()
    assert rows[(4, 0)]["parameters_B"] == whole and rows[(4, 0)]["gradients_B"] == whole
    assert rows[(4, 0)]["optimizer_slots_B"] == 2 * whole
    assert rows[(4, 1)]["optimizer_slots_B"] == 2 * whole / 4
    assert rows[(4, 1)]["gradients_B"] == whole
    assert rows[(4, 2)]["gradients_B"] == whole / 4
    assert rows[(1, 2)]["total_B"] == rows[(1, 0)]["total_B"]
    assert rows[(4, 0)]["activations_B"] > 0


def test_simulate_memory_command():
    run = [sys.executable, "-m", "graphdist", "simulate", "--memory", "--params", "7.5e9",
           "--devices", "1,64"]
    text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "120.0" in text and "31.4" in text and "16.6" in text
    rows = json.loads(subprocess.run(run + ["--json", "--zero-stage", "2"],
                                     capture_output=True, text=True, check=True).stdout)
    assert [(r["devices"], r["zero_stage"]) for r in rows] == [(1, 2), (64, 2)]
    bad = subprocess.run(run + ["--zero-stage", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "zero stage must be 0, 1 or 2" in bad.stderr
