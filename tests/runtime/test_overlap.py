"""Communication overlapped with compute (runtime/overlap.py) and the profile's exposed
collective time (runtime/profile.py): the split is in the lowered graph, each bucket's
all-reduce starts right after its last gradient (last bucket first) and is waited for just
before its first reader, results are bit-identical with overlap off, and profile_report's
exposed seconds match hand-derived interval arithmetic."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir.printer import graph_text
from graphdist.ops.host_collectives import host_all_reduce_p, host_reduce_update_p
from graphdist.runtime.overlap import collective_wait_p, host_all_reduce_start_p

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
from mpi_launch import needs_mpi, two_workers  # noqa: E402
from overlap_builders import train_mlp  # noqa: E402

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


@pytest.fixture
def overlap_setting():
    yield gd.config.set_overlap
    gd.config.set_overlap(True)


def _mlp(overlap: bool, steps: int = 3, bucket_bytes: int = 25 * 2**20):
    """A 3-layer MLP's SGD-momentum steps on 4 logical devices: (variables, losses, step,
    batch)."""
    gd.config.set_overlap(overlap)
    rng = np.random.default_rng(1)
    sizes = [(32, 64), (64,), (64, 64), (64,), (64, 10), (10,)]
    x = rng.standard_normal((32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    ws, losses, step, batch = train_mlp(
        DEVICES, sizes, bucket_bytes=bucket_bytes, x=x, y=y, steps=steps,
        optimizer=lambda: gd.optimizers.SGD(0.05, momentum=0.9))
    return [w.values for w in ws], losses, step, batch


def _cnn(overlap: bool, steps: int = 2):
    """bench's tutorial-style CNN (conv, pool, dense) with Adam on 4 logical devices."""
    gd.config.set_overlap(overlap)
    rng = np.random.default_rng(1)
    strategy = gd.MirroredStrategy(DEVICES)
    with strategy.scope():
        model = gd.nn.Sequential([
            gd.nn.Conv2D(4, 3, activation="relu"), gd.nn.MaxPool2D(2), gd.nn.Flatten(),
            gd.nn.Dense(10)])
        model(np.zeros((1, 8, 8, 1), np.float32))
        opt = gd.optimizers.Adam(0.01)
    for v in model.trainable_variables:        # the same start for both runs
        v.assign((rng.standard_normal(v.shape) * 0.3).astype(np.float32))

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, model(x)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    x = rng.standard_normal((16, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(step(batch)) for _ in range(steps)]
    return [v.values for v in model.trainable_variables], losses


def _same_bits(a, b) -> bool:
    return all(np.array_equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_mlp_overlapped_equals_inline_bit_for_bit(overlap_setting):
    on, losses_on, _, _ = _mlp(True, bucket_bytes=8 * 1024)
    off, losses_off, _, _ = _mlp(False, bucket_bytes=8 * 1024)
    assert losses_on == losses_off
    assert _same_bits(on, off)


def test_cnn_overlapped_equals_inline_bit_for_bit(overlap_setting):
    on, losses_on = _cnn(True)
    off, losses_off = _cnn(False)
    assert losses_on == losses_off
    assert _same_bits(on, off)


def _lowered(step, batch):
    return step.get_stages(batch)["schedule"]


def test_the_split_is_in_the_lowered_graph_and_off_turns_it_off(overlap_setting):
    _, _, step, batch = _mlp(True, steps=1, bucket_bytes=8 * 1024)
    text = graph_text(_lowered(step, batch), max_eqns=None)
    assert "host_all_reduce_start[op=mean,channel=" in text
    assert "collective_wait[channel=" in text
    _, _, step, batch = _mlp(False, steps=1)
    ops = {e.op for e in _lowered(step, batch).eqns}
    assert host_all_reduce_start_p not in ops and collective_wait_p not in ops


@pytest.mark.usefixtures("one_program")
def test_a_bucket_with_nothing_left_to_hide_behind_stays_inline_and_fuses(overlap_setting):
    """One bucket holds every gradient (the default 25 MiB): it is ready only when the
    backward pass ends, so splitting it hides nothing; it stays inline, where the fused
    all-reduce + update reads the gradients once, as with overlap off. The loss's reduce,
    with the whole backward pass after it, is split."""
    _, _, step, batch = _mlp(True, steps=1)
    on = _lowered(step, batch).eqns
    _, _, step, batch = _mlp(False, steps=1)
    off = _lowered(step, batch).eqns
    assert [e.inputs[0].ty.size for e in on if e.op is host_all_reduce_start_p] == [1]
    fused = [e for e in on if e.op is host_reduce_update_p]
    assert fused and len(fused) == sum(e.op is host_reduce_update_p for e in off)


@pytest.mark.usefixtures("one_program")
def test_buckets_start_last_first_and_wait_before_their_first_reader(overlap_setting):
    # 8 KiB buckets of the gradients in forward order (w0 8 KiB, w1 256 B, w2 16 KiB, then
    # w3, w4, w5 2.8 KiB together): [w0] [w1] [w2] [w3 w4 w5]; [w0] comes last out of the
    # backward pass, with nothing left to hide behind: it stays inline
    _, _, step, batch = _mlp(True, steps=1, bucket_bytes=8 * 1024)
    g = _lowered(step, batch)
    eqns = list(g.eqns)
    starts = [i for i, e in enumerate(eqns)            # the buckets (the loss is 1 number)
              if e.op is host_all_reduce_start_p and e.inputs[0].ty.size > 1]
    sizes = [eqns[i].inputs[0].ty.size for i in starts]
    # reverse forward order, as each bucket's last gradient comes out of the backward pass
    assert sizes == [64 + 64 * 10 + 10, 64 * 64, 64]
    # the inline bucket is fused with its part of the update (the waited buckets' parts
    # are cut off from it), as with overlap off: one pass over its gradients
    assert [(e.op, e.inputs[0].ty.size) for e in eqns if e.op.collective and e.op is not
            collective_wait_p and e.op is not host_all_reduce_start_p] == [
        (host_reduce_update_p, 32 * 64)]
    matmuls = [i for i, e in enumerate(eqns) if e.op.name == "matmul"]
    assert starts[0] < matmuls[-1]           # it starts while the backward pass goes on
    for i in starts:
        channel = eqns[i].attrs["channel"]
        w = next(k for k, e in enumerate(eqns) if e.op is collective_wait_p
                 and e.attrs["channel"] is channel)
        results = set(eqns[w].outputs)
        first_reader = next(k for k, e in enumerate(eqns) if results & set(e.inputs))
        # as late as allowed: nothing of the backward pass runs between the wait and its
        # first reader (only other waits, views, the updates' scalars and other buckets'
        # updates); the inline last bucket's fused update comes after every wait, so that
        # workers issue their collectives in one order
        assert i < w < first_reader
        last_backward = max(k for k, e in enumerate(eqns) if e.op.name == "matmul")
        assert w > last_backward
        inline = next(k for k, e in enumerate(eqns) if e.op is host_reduce_update_p)
        assert w < inline


def test_profile_has_a_collective_lane_per_device_with_the_thread_times(overlap_setting):
    _, _, step, batch = _mlp(True, steps=1, bucket_bytes=8 * 1024)
    trace = step.profile(batch)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    collectives = [e for e in trace["traceEvents"] if e.get("cat") == "collective"]
    for device in DEVICES:
        lane = next(t for t, n in names.items() if n == f"{device} collectives")
        mine = [e for e in collectives if e["tid"] == lane]
        assert len(mine) == 5             # the loss and the 4 buckets, each on every device
        # the buckets with backward compute left behind them run on the communication
        # thread; the last bucket has none and stays inline (passes/overlap.py)
        overlapped = [e for e in mine if e["args"]["overlapped"]]
        assert 0 < len(overlapped) < len(mine)
        assert all(0 <= e["args"]["exposed_ms"] <= e["dur"] / 1e3 + 1e-9 for e in overlapped)
    report = gd.profile_report(trace)
    row = report["steps"][0]
    assert 0 < row["exposed_s"] <= row["collective_s"] and row["compute_s"] > 0


def _event(cat, ts, dur, device="cpu:0", program=0):
    return {"name": cat, "cat": cat, "ph": "X", "pid": 0, "tid": 0, "ts": ts, "dur": dur,
            "args": {"device": device, "program": program}}


def test_profile_report_counts_collective_time_no_compute_covers():
    # step 0 (0-100 us): compute 0-40 and 50-90; collectives 30-60 and 55-70 -> collective
    # union 30-70 (40 us), covered 30-40 and 50-70 (30 us), exposed 10 us.
    # step 1 (100-200 us): compute 100-110, collective 120-150: all 30 us exposed.
    trace = {"traceEvents": [
        {"name": "step 0", "cat": "step", "ph": "X", "ts": 0, "dur": 100, "args": {"step": 0}},
        {"name": "step 1", "cat": "step", "ph": "X", "ts": 100, "dur": 100,
         "args": {"step": 1}},
        _event("compute", 0, 40), _event("compute", 50, 40),
        _event("collective", 30, 30), _event("collective", 55, 15),
        _event("wait", 60, 5),
        _event("compute", 100, 10), _event("collective", 120, 30)]}
    report = gd.profile_report(trace)
    first, second = report["steps"]
    assert first["compute_s"] == pytest.approx(80e-6)
    assert first["collective_s"] == pytest.approx(40e-6)
    assert first["exposed_s"] == pytest.approx(10e-6)
    assert second["exposed_s"] == pytest.approx(30e-6)
    assert report["exposed_fraction"] == pytest.approx(40 / 70)
    assert first["devices"]["cpu:0"]["exposed_s"] == pytest.approx(10e-6)


def test_profile_report_tells_the_overlapped_collectives_from_the_inline_ones():
    # compute 0-50; an overlapped collective 10-60 (hidden 10-50: 10 us exposed) and an
    # inline one 70-90 (nothing covers it: all 20 us exposed)
    overlapped = _event("collective", 10, 50)
    overlapped["args"]["overlapped"] = True
    trace = {"traceEvents": [_event("compute", 0, 50), overlapped,
                             _event("collective", 70, 20)]}
    report = gd.profile_report(trace)
    assert report["collective_s"] == pytest.approx(70e-6)
    assert report["exposed_s"] == pytest.approx(30e-6)
    assert report["overlapped_s"] == pytest.approx(50e-6)
    assert report["overlapped_exposed_s"] == pytest.approx(10e-6)
    assert report["overlapped_exposed_fraction"] == pytest.approx(0.2)


@needs_mpi
def test_two_mpi_workers_overlapped_equal_inline_bit_for_bit(tmp_path):
    done = two_workers("overlap.py", [tmp_path], "mpiexec", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        for model in ("mlp", "cnn"):
            assert report[f"{model}_on"] == report[f"{model}_off"], model
        assert "mpi_all_reduce_start" in report["ops"] and "collective_wait" in report["ops"]
        row = report["profile"]["steps"][0]
        assert 0 < row["collective_s"] and 0 <= row["exposed_s"] <= row["collective_s"]
    assert reports[0]["mlp_on"] == reports[1]["mlp_on"]   # every worker has the same bits


BUILDER = '''
import numpy as np
import graphdist as gd


def build(n):
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    strategy.bucket_bytes = 4096
    rng = np.random.default_rng(0)
    with strategy.scope():
        ws = [gd.Variable((rng.standard_normal((32, 32)) * 0.1).astype(np.float32))
              for _ in range(3)]
        opt = gd.optimizers.SGD(0.01)

    @gd.function
    def step(x):
        def fn(x):
            with gd.GradientTape() as tape:
                h = x
                for w in ws:
                    h = gd.tanh(h @ w)
                loss = gd.reduce_mean(h * h)
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce("mean", strategy.run(fn, args=(x,)))
    x = rng.standard_normal((8 * n, 32)).astype(np.float32)
    return step, (next(iter(strategy.experimental_distribute_dataset([x]))),)
'''


def test_bench_overlap_reports_both_settings_per_device_count(tmp_path, monkeypatch, capsys):
    from graphdist.cli import main

    (tmp_path / "overlap_builder.py").write_text(BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["bench", "overlap_builder:build", "--devices", "2", "--steps", "2",
                 "--overlap", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["devices"], r["overlap"]) for r in rows] == [(2, True), (2, False)]
    for r in rows:
        assert 0 <= r["exposed_s"] <= r["collective_s"] + 1e-9 and r["compute_s"] > 0
    off = rows[1]                 # inline: nothing runs beside a collective
    assert off["exposed_fraction"] == pytest.approx(1.0)
    assert gd.config.overlap()    # the setting is restored


@pytest.mark.usefixtures("one_program")
def test_html_view_marks_the_collectives_a_profile_found_exposed(overlap_setting, tmp_path):
    from graphdist.viz.html import page_data
    from graphdist.viz.model import read

    _, _, step, batch = _mlp(True, steps=1, bucket_bytes=8 * 1024)
    trace = step.profile(batch)
    graph = step.replicated_graph
    want: dict = {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "collective":
            node = e["args"]["node"]
            want[node] = max(want.get(node, 0.0), e["args"]["exposed_ms"])
    data = page_data(graph, profile=trace)
    marked = {}
    for k, ms in enumerate(data["n"]["exposed"]):
        if ms > 0:
            marked[k] = ms
    index = {k: n.index for k, n in enumerate(read(graph).nodes)}
    assert marked and {index[k] for k in marked} == {n for n, ms in want.items() if ms > 0}
    for k, ms in marked.items():
        # a start whose wait was not covered, or the inline last bucket fused with its
        # update (all of it exposed)
        assert graph.eqns[index[k]].op in (host_all_reduce_start_p, host_reduce_update_p)
        assert ms == pytest.approx(want[index[k]], abs=1e-4)
    page = (tmp_path / "step.html")
    graph.to_html(page, profile=trace)
    assert '"exposed":[' in page.read_text() and "nd.exposed" in page.read_text()
    assert "exposed" not in page_data(graph)["n"]        # no profile, no marking



def test_a_channels_gpu_spans_are_read_once_when_a_profile_asks():
    """A GPU run's (start, end) is known only once its events have completed: the channel
    keeps a callable, which times() calls once and replaces with the times it gave."""
    from graphdist.ops.overlap_collectives import Channel, CommLane

    calls = []

    def read_events():
        calls.append(1)
        return (2.0, 3.5)

    channel = Channel(host_all_reduce_p, {"op": "sum"}, "cpu:0", [], CommLane(), False)
    channel.spans.append((0.0, 1.0))
    channel.spans.append(read_events)
    assert channel.times() == [(0.0, 1.0), (2.0, 3.5)]
    assert channel.times() == [(0.0, 1.0), (2.0, 3.5)]
    assert len(calls) == 1
