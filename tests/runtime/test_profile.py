"""f.profile: a Chrome trace event object with one lane per device and one complete event
per executed node, carrying the node's index in the placed graph."""

from __future__ import annotations

import json

import numpy as np

import graphdist as gd


def _check_chrome_format(trace: dict) -> list:
    """The subset of the Chrome trace event format Perfetto needs; returns the X events."""
    assert isinstance(trace["traceEvents"], list)
    complete = []
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str) and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int)
            assert e["ts"] >= 0 and e["dur"] >= 0
            complete.append(e)
        else:
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index")
    json.dumps(trace)                       # serializable as is
    return complete


def test_one_device_profile(tmp_path):
    w = gd.Variable(np.ones((4, 3), np.float32))

    @gd.function
    def step(x):
        with gd.name_scope("dense"):
            h = gd.tanh(x @ w)
        w.assign_sub(np.full((4, 3), 0.1, np.float32))
        return gd.reduce_sum(h)

    x = np.ones((8, 4), np.float32)
    path = tmp_path / "trace.json"
    trace = step.profile(x, path=path)
    assert json.loads(path.read_text()) == trace
    events = _check_chrome_format(trace)
    names = [e["name"] for e in events]
    assert {"matmul", "tanh", "reduce_sum"} <= set(names)
    placed = step.replicated_graph
    for e in events:
        node = placed.eqns[e["args"]["node"]]
        assert node.op.name == e["name"] and e["args"]["device"] == "cpu:0"
    assert any(e["args"]["scope"] == "dense" for e in events)
    np.testing.assert_allclose(w.numpy(), 0.9)        # profile runs a real step


def test_profile_has_one_lane_per_device_and_shows_collectives():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        w = gd.Variable(np.ones((4, 2), np.float32))
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(batch):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(x @ w)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=(batch,)))

    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((6, 4), np.float32)])))
    step(batch)
    trace = step.profile(batch)
    events = _check_chrome_format(trace)
    lanes = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    assert sorted(lanes) == sorted(devices + [f"{d} collectives" for d in devices])
    assert {e["tid"] for e in events} == set(lanes.values())
    collectives = [e for e in events if e["cat"] == "collective"]
    assert collectives and all(e["args"]["eqn"] for e in collectives)
    for e in events:
        node = step.replicated_graph.eqns[e["args"]["node"]]
        if e["cat"] == "collective":      # on the lane of every device whose buffers it reads
            assert e["tid"] == lanes[f"{e['args']['device']} collectives"]
            assert e["args"]["device"] in {v.device for v in node.inputs}
        else:
            assert node.device == e["args"]["device"] and e["tid"] == lanes[node.device]
