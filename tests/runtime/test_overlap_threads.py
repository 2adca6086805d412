"""Overlap in the other ways of running logical CPU devices (issue 26, item 1):

- a thread per device (`set_device_concurrency("threads")`): the collectives run in the
  first device's program; a bucket's all-reduce starts on the communication thread once
  every device thread has made its part, the first device's thread goes on with its
  backward pass, and each result is waited for at its first reader (the other devices get
  it from there);
- merged (`"merged"`): one batched program where an all-reduce is a sum over the replica
  axis, folded into the gradient's own GEMM (passes/merge.py): no communication is left
  to hide, so the graph has no start or wait (checked here, said in docs/guide.md).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import graphdist as gd
from graphdist.device import threads
from graphdist.ops.host_collectives import host_all_reduce_p, host_reduce_update_p
from graphdist.runtime.overlap import collective_wait_p, host_all_reduce_start_p
from overlap_builders import train_mlp

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
SIZES = [(32, 64), (64,), (64, 64), (64,), (64, 10), (10,)]


@pytest.fixture
def concurrency():
    """set_device_concurrency for the test; overlap back on and "auto" after it."""
    yield gd.config.set_device_concurrency
    gd.config.set_device_concurrency("auto")
    gd.config.set_overlap(True)


def _mlp(mode: str, overlap: bool, steps: int = 3, bucket_bytes: int = 8 * 1024):
    """A 3-layer MLP's SGD-momentum steps on 4 logical devices in `mode`, buckets of 8 KiB
    ([w0] [w1] [w2] [w3 w4 w5]): (parameters of every replica, losses, step, batch)."""
    gd.config.set_device_concurrency(mode)
    gd.config.set_overlap(overlap)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    ws, losses, step, batch = train_mlp(
        DEVICES, SIZES, bucket_bytes=bucket_bytes, x=x, y=y, steps=steps,
        optimizer=lambda: gd.optimizers.SGD(0.05, momentum=0.9))
    return [w.values for w in ws], losses, step, batch


def _same_bits(a, b) -> bool:
    return all(np.array_equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _lowered(step, batch):
    return step.get_stages(batch)["schedule"]


def test_threads_overlapped_equal_inline_bit_for_bit(concurrency):
    on, losses_on, _, _ = _mlp("threads", True)
    off, losses_off, _, _ = _mlp("threads", False)
    assert losses_on == losses_off
    assert _same_bits(on, off)
    # and the same bits as one program (the sequential mode, overlapped)
    seq, losses_seq, _, _ = _mlp("sequential", True)
    assert losses_seq == losses_on and _same_bits(seq, on)


def test_threads_split_the_buckets_with_compute_behind_them(concurrency):
    """Each bucket but the one made last starts on the communication thread in the first
    device's program, last bucket first, right after the first device's part of it and
    before that device's remaining backward matmuls; each wait comes before its first
    reader. Off: every all-reduce inline."""
    _, _, step, batch = _mlp("threads", True, steps=1)
    assert step._latest().plan.mode == "threads"
    eqns = list(_lowered(step, batch).eqns)
    starts = [i for i, e in enumerate(eqns)
              if e.op is host_all_reduce_start_p and e.inputs[0].ty.size > 1]
    assert [eqns[i].inputs[0].ty.size for i in starts] == [64 + 64 * 10 + 10, 64 * 64, 64]
    assert all(eqns[i].device == DEVICES[0] for i in starts)
    # the first bucket, ready last, stays inline (nothing to hide behind)
    inline = [e for e in eqns if e.op in (host_all_reduce_p, host_reduce_update_p)]
    assert [(e.op, e.inputs[0].ty.size, e.device) for e in inline] == [
        (host_all_reduce_p, 32 * 64, DEVICES[0])]
    mine = [i for i, e in enumerate(eqns) if e.device == DEVICES[0]]
    matmuls = [i for i in mine if eqns[i].op.name == "matmul"]
    assert starts[0] < matmuls[-1]       # device 0 computes on while it reduces
    for i in starts:
        channel = eqns[i].attrs["channel"]
        w = next(k for k, e in enumerate(eqns)
                 if e.op is collective_wait_p and e.attrs["channel"] is channel)
        first_reader = next(k for k, e in enumerate(eqns) if set(eqns[w].outputs) & set(e.inputs))
        assert i < w < first_reader
    _, _, step, batch = _mlp("threads", False, steps=1)
    ops = {e.op for e in _lowered(step, batch).eqns}
    assert host_all_reduce_start_p not in ops and collective_wait_p not in ops


def test_threads_run_the_start_in_the_first_devices_program(concurrency):
    """The programs of the device threads: the first device's calls the starts and the
    waits; the others only hand it their parts and read the results it posts."""
    _, _, step, batch = _mlp("threads", True, steps=1)
    executable = step._latest().executable
    programs = executable.programs
    assert len(programs) == len(executable.groups) == min(len(DEVICES), threads.cores())
    assert executable.groups[0][0] == 0
    first = programs[0].graph.eqns
    assert sum(e.op is host_all_reduce_start_p for e in first) == 4    # the loss, 3 buckets
    assert sum(e.op is collective_wait_p for e in first) == 4
    for program in programs[1:]:
        assert not any(e.op.collective for e in program.graph.eqns)


def test_threads_profile_draws_the_thread_times_on_the_collectives_lanes(concurrency):
    _, _, step, batch = _mlp("threads", True, steps=1)
    trace = step.profile(batch)
    overlapped = [e for e in trace["traceEvents"]
                  if e.get("cat") == "collective" and e["args"].get("overlapped")]
    assert {e["args"]["device"] for e in overlapped} == set(DEVICES)
    report = gd.profile_report(trace)
    assert 0 <= report["exposed_s"] <= report["collective_s"] and report["collective_s"] > 0


def test_threads_profile_does_not_time_waits_for_other_devices_as_compute(concurrency):
    """In a profiled per-device program, waiting for a value another device sends (the
    all-reduce's result, a part of a bucket) happens before the eqn's timer starts: time
    blocked on another thread is not compute, and would hide exposed communication."""
    _, _, step, batch = _mlp("threads", True, steps=1)
    step.profile(batch)
    waits = 0
    for program in step._latest().profiled.programs:
        timing = False
        for line in program.source.splitlines():
            line = line.strip()
            if line == "_t0 = _clock()":
                timing = True
            elif line.startswith("_events.append"):
                timing = False
            elif re.search(r"= W\d+\(\)$", line):
                waits += 1
                assert not timing, line
    assert waits > 0


def test_merged_mode_has_no_communication_to_hide(concurrency):
    """Merged, the all-reduce of a gradient is a sum over the replica axis inside one
    batched program (one GEMM over every replica's rows): there is no collective node to
    start early, with overlap on as with it off, and the results are those of the
    per-device run with overlap."""
    merged, losses_merged, step, batch = _mlp("merged", True)
    assert step._latest().plan.mode == "merged"
    ops = {e.op for e in _lowered(step, batch).eqns}
    assert not any(op.collective for op in ops)
    assert host_all_reduce_start_p not in ops and collective_wait_p not in ops
    assert "overlap" not in step.get_stages(batch)
    seq, losses_seq, _, _ = _mlp("sequential", True)
    np.testing.assert_allclose(losses_merged, losses_seq, rtol=1e-5)
    for m, s in zip(merged, seq):
        np.testing.assert_allclose(m[0], s[0], rtol=1e-4, atol=1e-6)
