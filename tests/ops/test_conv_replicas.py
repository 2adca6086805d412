"""The CNN's convolutions on 4 replicas against one device (bench/epilogue.py): the per-op
profile of a 4-replica step sums every replica's own nodes but counts a collective, drawn
on every device's lane, once (counted per lane the all-reduce fused with Adam read 2.5 ms
for its 0.6), and the split timing runs each conv op on the whole batch and on its
replicas' shares."""

from __future__ import annotations

import pytest

from bench import epilogue


class _Profiled:
    """A step whose profile is a fixed trace (Function.profile's event form)."""

    def __init__(self, events):
        self.events = events

    def profile(self, data):
        return {"traceEvents": self.events}


def _event(name, node, device, ts, dur_us):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur_us,
            "args": {"node": node, "device": device, "program": 0}}


def _four_replica_trace(conv_us, update_us):
    """Each replica's own conv node, then one all-reduce + Adam node drawn on every lane."""
    lanes = [f"cpu:{d}" for d in range(4)]
    own = [_event("conv2d_bias_act", 10 + d, dev, 100.0 * d, conv_us)
           for d, dev in enumerate(lanes)]
    shared = [_event("host_reduce_update", 50, dev, 900.0, update_us) for dev in lanes]
    return own + shared + [{"ph": "M", "name": "thread_name", "args": {}}]


def test_a_collective_counts_once_and_each_replicas_own_node_apiece():
    got = epilogue._group_ms(_Profiled(_four_replica_trace(1000.0, 600.0)), None)
    assert got == {"conv forward": pytest.approx(4.0),
                   "all-reduce + Adam": pytest.approx(0.6)}


def test_the_replica_profile_puts_one_device_beside_four_replicas():
    one = [_event("conv2d_bias_act", 1, "cpu:0", 0.0, 3000.0),
           _event("adam_multi_update", 2, "cpu:0", 5000.0, 250.0)]
    made = {1: {True: (None, _Profiled(one), None)},
            4: {True: (None, _Profiled(_four_replica_trace(800.0, 500.0)), None)}}
    rows = {r[0]: r[1:] for r in epilogue.replica_profile_rows(made, profiles=2)}
    assert rows["conv forward"] == pytest.approx([3.0, 3.2, 3.0, 3.2, 3.2 / 3.0])
    assert rows["all-reduce + Adam"][:4] == pytest.approx([0.0, 0.5, 0.0, 0.5])
    assert rows["Adam"][:2] == pytest.approx([0.25, 0.0])
    assert rows["sum"][:2] == pytest.approx([3.25, 3.7])


def test_the_split_timing_covers_every_conv_op_of_the_step():
    rows = epilogue.conv_split_rows(repeat=1, batch=8, replicas=4)
    assert [(r[0], r[1]) for r in rows] == [
        ("first", "forward + bias + relu"), ("first", "filter grad"),
        ("second", "forward + bias + relu"), ("second", "filter grad"),
        ("second", "input grad")]
    assert all(t > 0 for r in rows for t in r[2:6])
