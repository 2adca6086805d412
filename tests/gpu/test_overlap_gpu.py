"""Overlap on GPUs (issue 26, item 1): each bucket's NCCL all-reduce that has backward work
left to hide behind becomes `nccl_all_reduce_start` + `collective_wait`. The start queues
the reduction on the devices' communication streams after an event of each compute
stream (recorded after the bucket's producers); the wait makes each compute stream wait on
the communication stream's event before the first reader. Buckets start last first, the
results are bit-identical with overlap off, the bucket's buffers live until the wait, and
the profile draws each on a "<device> collectives" lane.

On a machine with a GPU these run on CuPy (tools/gpu_check.sh runs tests/gpu); in CI
tests/runtime/test_overlap_on_simulated_gpus.py runs them on tests/gpu/fake_cupy.py with the CUDA kernels
in numba's simulator, where every kernel, copy and NCCL call is checked for stream order:
the tests that take a wait out and see the race run there only.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import graphdist as gd
from graphdist import config
from graphdist.ops.device_collectives import nccl_all_reduce_p
from graphdist.ops.overlap_collectives import collective_wait_p, nccl_all_reduce_start_p
from overlap_builders import train_mlp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gd.devices("gpu"), reason="needs a GPU (CuPy + CUDA)")]

SIM = bool(numba.config.ENABLE_CUDASIM)     # the simulator runs each CUDA thread in Python
HIDDEN = 16 if SIM else 256
# buckets of 1 KiB (64 KiB on a GPU), in forward order: [w0] [w1] [w2] [w3 w4 w5]
BUCKET = 1024 if SIM else 64 * 1024
SIZES = [(HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, 4), (4,)]


def _fake_cupy() -> bool:
    import cupy

    return cupy.__name__ == "fake_cupy"


def _mlp(devices, overlap: bool, kind: str = "sgd", steps: int = 2):
    """A 3-layer MLP trained on `devices`: (parameters of every replica on the host,
    losses, step, batch)."""
    config.set_overlap(overlap)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, HIDDEN)).astype(np.float32)
    y = rng.integers(0, 4, 16).astype(np.int32)
    ws, losses, step, batch = train_mlp(
        devices, SIZES, bucket_bytes=BUCKET, x=x, y=y, steps=steps, scale=0.3,
        optimizer=lambda: (gd.optimizers.SGD(0.05, momentum=0.9) if kind == "sgd"
                           else gd.optimizers.Adam(0.01)))
    return [[np.asarray(c.get()) for c in w.values] for w in ws], losses, step, batch


def _lowered(step, batch):
    return step.get_stages(batch)["schedule"]


def _wait_of(eqns, start: int) -> int:
    channel = eqns[start].attrs["channel"]
    return next(k for k, e in enumerate(eqns)
                if e.op is collective_wait_p and e.attrs["channel"] is channel)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_overlapped_gpu_steps_equal_inline_bit_for_bit(logical_gpus, kind):
    on, losses_on, step, batch = _mlp(logical_gpus, True, kind)
    assert any(e.op is nccl_all_reduce_start_p for e in _lowered(step, batch).eqns)
    off, losses_off, step, batch = _mlp(logical_gpus, False, kind)
    assert not any(e.op is nccl_all_reduce_start_p for e in _lowered(step, batch).eqns)
    assert losses_on == losses_off
    for a, b in zip(on, off):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert all(np.array_equal(a[0], x) for x in a[1:])     # every replica the same


def test_buckets_start_last_first_and_wait_before_their_first_reader(logical_gpus):
    _, _, step, batch = _mlp(logical_gpus, True, steps=1)
    g = _lowered(step, batch)
    eqns = list(g.eqns)
    starts = [i for i, e in enumerate(eqns)               # the buckets (the loss is 1 number)
              if e.op is nccl_all_reduce_start_p and e.inputs[0].ty.size > 1]
    h = HIDDEN
    # reverse forward order: [w3 w4 w5] leaves the backward pass first, then [w2], [w1];
    # [w0] comes last, with nothing to hide behind: it stays an inline nccl_all_reduce
    assert [eqns[i].inputs[0].ty.size for i in starts] == [h + h * 4 + 4, h * h, h]
    assert [e.inputs[0].ty.size for e in eqns if e.op is nccl_all_reduce_p] == [h * h]
    matmuls = [i for i, e in enumerate(eqns) if e.op.name.startswith("matmul")]
    assert starts[0] < matmuls[-1]              # it starts while the backward pass goes on
    live = g.liveness
    for i in starts:
        assert eqns[i].op.orders_own_streams
        assert [v.device for v in eqns[i].inputs] == logical_gpus   # one part per replica
        w = _wait_of(eqns, i)
        results = set(eqns[w].outputs)
        assert [v.device for v in eqns[w].outputs] == logical_gpus
        first_reader = next(k for k, e in enumerate(eqns) if results & set(e.inputs))
        assert i < w < first_reader
        after = next(k for k in range(w, len(eqns)) if eqns[k].op is not collective_wait_p)
        assert after == first_reader or eqns[after].op.collective
        # the bucket's buffers live until the wait: the planner reuses none of them while
        # the communication stream may still read them
        for v in eqns[i].inputs:
            assert live.last_use[live.root.get(v, v)] >= w
    # every wait comes before the inline NCCL call: the communicators see one order of
    # calls on every GPU (the compute stream's call after the communication stream's)
    (inline,) = [k for k, e in enumerate(eqns) if e.op is nccl_all_reduce_p]
    assert all(k < inline for k, e in enumerate(eqns) if e.op is collective_wait_p)


def test_profile_draws_gpu_collectives_on_their_lanes(logical_gpus):
    _, _, step, batch = _mlp(logical_gpus, True, steps=1)
    trace = step.profile(batch)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    collectives = [e for e in trace["traceEvents"] if e.get("cat") == "collective"]
    for device in logical_gpus:
        lane = next(t for t, n in names.items() if n == f"{device} collectives")
        mine = [e for e in collectives if e["tid"] == lane]
        overlapped = [e for e in mine if e["args"]["overlapped"]]
        assert len(overlapped) == 4                # the loss and three buckets
        assert len(mine) == 5                      # and the inline last bucket
        assert all(e["name"] == "nccl_all_reduce" for e in mine)
        assert all(e["dur"] >= 0 and 0 <= e["args"]["exposed_ms"] <= e["dur"] / 1e3 + 1e-9
                   for e in overlapped)
    report = gd.profile_report(trace)
    assert 0 <= report["exposed_s"] <= report["collective_s"] and report["collective_s"] > 0


def _race(step, batch) -> AssertionError:
    """The stand-in's StreamRace a step raised (wrapped or not)."""
    import cupy

    with pytest.raises(Exception) as caught:
        step(batch)
    error = caught.value
    while error is not None and not isinstance(error, cupy.StreamRace):
        error = error.__cause__ or error.__context__
    assert error is not None, repr(caught.value)
    return error


@pytest.mark.skipif(not gd.devices("gpu") or not _fake_cupy(),
                    reason="the stream-order check is the stand-in's")
def test_a_reader_that_skips_the_wait_is_caught(logical_gpus, monkeypatch):
    """Take the wait's stream wait out (the compute streams no longer wait for the
    communication streams' events): the first reader of a result reads a buffer the
    communication stream wrote, unordered, and the stand-in fails the step."""
    from graphdist.runtime import gpu_collectives

    _, _, step, batch = _mlp(logical_gpus, True, steps=1)
    monkeypatch.setattr(gpu_collectives, "finish_all_reduce", lambda events, devices: None)
    assert "read" in str(_race(step, batch))


@pytest.mark.skipif(not gd.devices("gpu") or not _fake_cupy(),
                    reason="the stream-order check is the stand-in's")
def test_a_start_that_skips_the_producers_event_is_caught(logical_gpus, monkeypatch):
    """Take the start's wait on the compute streams out: the communication stream reads
    the bucket while its producer may still be writing it, and the stand-in fails it."""
    from graphdist.device.gpu import gpu_backend
    from graphdist.runtime import gpu_collectives
    from graphdist.runtime.streams import comm_lane

    def start_unordered(outs, xs, op, devices):
        first = comm_lane(gpu_backend(devices[0]))
        begin = first.record()
        gpu_collectives.nccl_all_reduce(outs, *xs, op=op, devices=devices, comm=True)
        return begin, [comm_lane(gpu_backend(d)).record() for d in devices]

    _, _, step, batch = _mlp(logical_gpus, True, steps=1)
    monkeypatch.setattr(gpu_collectives, "start_all_reduce", start_unordered)
    assert "read" in str(_race(step, batch))


def test_the_copy_lowerings_are_not_split(logical_gpus):
    """RingAllReduce on GPUs is copies and adds on the devices' own streams, each a node
    of the graph that the stream order already runs beside the other devices' work; it has
    no node to start early (`splits_to_overlap` is False), so the stage does not run."""
    config.set_overlap(True)
    strategy = gd.MirroredStrategy(logical_gpus, gd.RingAllReduce())
    with strategy.scope():
        w = gd.Variable(np.ones((4, 4), np.float32), name="w")
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(gd.tanh(x @ w))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        strategy.run(replica_fn, args=(x,))

    x = next(iter(strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])))
    stages = step.get_stages(x)
    assert "overlap" not in stages
    ops = {e.op for e in stages["schedule"].eqns}
    assert nccl_all_reduce_start_p not in ops and collective_wait_p not in ops
    assert any(e.op.name == "copy_to" for e in stages["schedule"].eqns)
