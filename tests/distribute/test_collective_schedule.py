"""Collective schedules agreed across workers (issue 23, item 2): 2 workers under mpiexec
and under graphdist launch (tests/mpi/schedule.py) that call different collectives raise
gd.WorkerError on both, naming the collective and each rank's line, before any data moves;
and the fingerprint of a schedule, in this process."""

from __future__ import annotations

import json
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir.types import ArrayType
from graphdist.runtime.schedule_check import fingerprint, schedule_of

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: mpi/ scripts
sys.path.insert(0, os.path.join(HERE, "mpi"))
from training import train  # noqa: E402

from mpi_launch import LAUNCHERS, needs_mpi, two_workers  # noqa: E402


def _two_workers(scenario: str, out_dir: str, launcher: str = "mpiexec") -> list[dict]:
    done = two_workers("schedule.py", [out_dir, scenario], launcher, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = []
    for rank in (0, 1):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def _at(error: str, rank: int, where: str) -> bool:
    """Whether `error` shows `rank` at the same call number as rank 0, at `where`."""
    calls = dict(re.findall(r"rank (\d): call #(\d+) at ", error))
    return calls.get(str(rank)) == calls.get("0") is not None and \
        re.search(rf"rank {rank}: call #\d+ at {re.escape(where)}", error) is not None


@needs_mpi
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_extra_reduce_on_the_chief_raises_on_both_workers_and_changes_nothing(tmp_path, launcher):
    reports = _two_workers("extra_reduce", str(tmp_path), launcher)
    for rank, report in enumerate(reports):
        error = report["error"]
        assert error is not None, f"worker {rank} did not raise"
        assert error.startswith(f"worker {rank}: the workers are about to run different "
                                "collectives")
        # the chief's reduce of 5 floats, worker 1's step: each with its own line
        assert _at(error, 0, "schedule.py:") and "strategy.reduce(" in error
        assert "all_reduce sum of float32(5,)" in error
        assert _at(error, 1, "schedule.py:") and "step(*batches[1])" in error
        # nothing was summed: the weights are those after the one agreed step
        np.testing.assert_array_equal(report["after"], report["before"])
        assert np.isfinite(report["after"]).all()
    assert reports[0]["after"] == reports[1]["after"]


@needs_mpi
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_workers_that_compiled_different_steps_raise_at_its_first_call(tmp_path, launcher):
    reports = _two_workers("other_step", str(tmp_path), launcher)
    for rank, report in enumerate(reports):
        error = report["error"]
        assert error is not None, f"worker {rank} did not raise"
        # the gradient all-reduce (#0) agrees; the metric's (#1) is 2 floats against 3
        assert "collective #1 of their programs differs" in error
        assert _at(error, 0, "") and "all_reduce sum of float32(2,)" in error
        assert _at(error, 1, "") and "all_reduce sum of float32(3,)" in error
        np.testing.assert_array_equal(report["after"], report["before"])


@needs_mpi
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_collective_outside_compiled_code_meeting_a_step_raises_on_both(tmp_path, launcher):
    reports = _two_workers("rendezvous", str(tmp_path), launcher)
    for rank, report in enumerate(reports):
        error = report["error"]
        assert error is not None, f"worker {rank} did not raise"
        assert _at(error, 0, "schedule.py:")
        assert "Checkpoint.save of variables(1,)" in error
        assert _at(error, 1, "schedule.py:") and "step(*batches[1])" in error
        np.testing.assert_array_equal(report["after"], report["before"])


@needs_mpi
@pytest.mark.parametrize("scenario, worker_one", [
    ("sync_read", ["step(*batches[1])", "all_reduce mean of float32(8,)"]),
    ("two_reads", ["counts.numpy()", "all_reduce (a sync-on-read read) sum of float32(3,)"]),
])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_sync_on_read_read_outside_compiled_code_is_checked_before_data_moves(
        tmp_path, scenario, worker_one, launcher):
    reports = _two_workers(scenario, str(tmp_path), launcher)
    for rank, report in enumerate(reports):
        assert report["total"] == 4.0        # the agreed read: 4 replicas of the chief's 1.0
        error = report["error"]
        assert error is not None, f"worker {rank} did not raise"
        assert error.startswith(f"worker {rank}: the workers are about to run different "
                                "collectives")
        assert _at(error, 0, "schedule.py:") and "total.numpy()" in error
        assert "all_reduce (a sync-on-read read) sum of float32()" in error
        assert _at(error, 1, "schedule.py:")
        for text in worker_one:
            assert text in error, (text, error)
        np.testing.assert_array_equal(report["after"], report["before"])


@needs_mpi
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_eager_gather_crosses_the_workers_and_an_extra_one_is_caught(tmp_path, launcher):
    reports = _two_workers("gather", str(tmp_path), launcher)
    for rank, report in enumerate(reports):
        # replica r's component is [[r, r]]: every worker gets all four, in replica order
        np.testing.assert_array_equal(report["gathered"],
                                      np.repeat(np.arange(4.0), 2).reshape(4, 2))
        error = report["error"]
        assert error is not None, f"worker {rank} did not raise"
        assert _at(error, 0, "schedule.py:") and "strategy.gather(" in error
        assert _at(error, 1, "schedule.py:") and "step(*batches[1])" in error
        np.testing.assert_array_equal(report["after"], report["before"])


@needs_mpi
def test_agreeing_workers_train_as_four_devices(tmp_path):
    reports = _two_workers("agree", str(tmp_path))
    four = train(gd.MirroredStrategy([f"cpu:{i}" for i in range(4)]), seed=100)
    for report in reports:
        np.testing.assert_allclose(report["w"], four["w"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(report["table"], four["table"].numpy(), rtol=1e-5,
                                   atol=1e-6)
    assert reports[0]["w_bytes"] == reports[1]["w_bytes"]


# ---------------------------------------------------------------- the fingerprint
def _graph(*nodes):
    """A stand-in placed graph: nodes (op name, shape, dtype, reduce op, source line)."""
    eqns = [SimpleNamespace(op=SimpleNamespace(name=name),
                            inputs=(SimpleNamespace(ty=ArrayType(shape, dtype)),),
                            attrs={"op": op, "group": None}, source=line)
            for name, shape, dtype, op, line in nodes]
    return SimpleNamespace(eqns=eqns)


def test_the_fingerprint_changes_with_kind_shape_dtype_op_and_order():
    grads = ("mpi_all_reduce", (8,), "float32", "mean", "train.py:3")
    metric = ("mpi_all_reduce", (2,), "float32", "sum", "train.py:4")
    base = fingerprint(schedule_of(_graph(grads, metric)))
    assert len(base) == 32
    assert fingerprint(schedule_of(_graph(grads, metric))) == base
    # the same collectives traced from other lines agree
    moved = ("mpi_all_reduce", (2,), "float32", "sum", "other.py:9")
    assert fingerprint(schedule_of(_graph(grads, moved))) == base
    changed = [
        [grads, ("mpi_all_gather", (2,), "float32", None, "")],      # kind
        [grads, ("mpi_all_reduce", (3,), "float32", "sum", "")],     # shape
        [grads, ("mpi_all_reduce", (2,), "float64", "sum", "")],     # dtype
        [grads, ("mpi_all_reduce", (2,), "float32", "mean", "")],    # reduce op
        [metric, grads],                                             # order
        [grads],                                                     # one fewer
    ]
    digests = {fingerprint(schedule_of(_graph(*nodes))) for nodes in changed}
    assert base not in digests and len(digests) == len(changed)


def test_a_replicated_step_without_workers_has_no_schedule():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    trained = train(strategy, seed=1, steps=1)
    assert schedule_of(trained["step"].replicated_graph) == []
