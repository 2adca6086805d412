"""Workers that disagree are caught before a byte moves (issue 23, items 1, 3 and 7): 2
workers under mpiexec and under graphdist launch run tests/mpi/agreement.py, one scenario
per launch, and report as JSON; check_mirrored on one process's MirroredStrategy runs
here."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

import graphdist as gd
from mpi_launch import LAUNCHERS, MPIEXEC, needs_mpi, two_workers


def _launch(scenario, out_dir, launcher="mpiexec"):
    """Both ranks' reports; a hang fails the test at the hard limit instead of stalling."""
    done = two_workers("agreement.py", [out_dir, scenario], launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = {}
    for rank in (0, 1):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            reports[rank] = json.load(f)
    return reports


@needs_mpi
@pytest.mark.parametrize("scenario, named", [
    ("shape", ["'w'", "shape (8, 4) float32", "shape (4, 8) float32"]),
    ("dtype", ["'w'", "(8, 4) float32", "(8, 4) float64"]),
    ("extra", ["'extra'", "variable #2"]),
    ("extra_last", ["'extra'", "its first step after"]),
    ("layout", ["layout", "2 local devices", "1 local device"]),
])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_workers_that_make_different_variables_raise_before_training(scenario, named,
                                                                     launcher, tmp_path):
    reports = _launch(scenario, tmp_path, launcher)
    for rank in (0, 1):
        report = reports[rank]
        assert report["raised"] == "WorkerError", report
        assert not report["trained"]
        for text in named + ["worker 0", "worker 1"]:
            assert text in report["message"], (text, report["message"])


@pytest.fixture(scope="module", params=LAUNCHERS)
def agreeing(request, tmp_path_factory):
    if importlib.util.find_spec("mpi4py") is None or MPIEXEC is None:
        pytest.skip("the mpi extra is not installed")
    return _launch("train", tmp_path_factory.mktemp("agreeing"), request.param)


def _sgd_reference(steps=2):
    """The agreement script's training on one device, in numpy: loss = mean((x w + b)^2)."""
    x = np.arange(32, dtype=np.float64).reshape(4, 8) / 32
    w, b = np.full((8, 4), 0.5), np.zeros(4)
    for _ in range(steps):
        g = 2 * (x @ w + b) / (x.shape[0] * w.shape[1])
        w, b = w - 0.1 * x.T @ g, b - 0.1 * g.sum(0)
    return w


def test_agreeing_workers_train_as_one_device_and_check_mirrored_passes(agreeing):
    for rank in (0, 1):
        report = agreeing[rank]
        assert "raised" not in report, report
        assert report["trained"]
        np.testing.assert_allclose(report["w"], _sgd_reference(), rtol=1e-5)
        assert report["check"] == [None, None]


def test_check_mirrored_names_a_tampered_component_on_every_worker(agreeing):
    for rank in (0, 1):      # worker 1's second local replica: global replica 3
        kind, message = agreeing[rank]["check_tampered"]
        assert kind == "WorkerError"
        assert "'w'" in message and "replicas [3]" in message, message


def test_restore_agrees_on_the_same_file_and_refuses_different_files(agreeing):
    for rank in (0, 1):
        report = agreeing[rank]
        assert report["same_files"] == [None, None]
        np.testing.assert_array_equal(report["after_same"], np.ones((8, 4)))
        assert report["check_after_same"] == [None, None]
        kind, message = report["different_files"]
        assert kind == "WorkerError"
        for text in ("chief.ckpt", "stale.ckpt", "worker 0", "worker 1"):
            assert text in message, (text, message)
        assert report["unchanged"]                      # nothing was restored
        assert report["check_after_different"] == [None, None]

    # a file missing on worker 1 only: it raises CheckpointError, the chief WorkerError
    assert agreeing[1]["missing_on_one"][0] == "CheckpointError"
    kind, message = agreeing[0]["missing_on_one"]
    assert kind == "WorkerError" and "worker 1" in message and "missing.ckpt" in message
    assert agreeing[0]["unchanged_after_missing"] and agreeing[1]["unchanged_after_missing"]


def test_workers_in_different_checks_raise_together_naming_both(agreeing):
    for rank in (0, 1):      # the chief in check_mirrored, worker 1 in a restore
        kind, message = agreeing[rank]["out_of_step"]
        assert kind == "WorkerError", message
        assert "check_mirrored" in message and "restore" in message, message


def test_check_mirrored_on_one_process_names_the_variable_and_replicas():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        gd.Variable(np.ones(3, np.float32), name="a")
        w = gd.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
        counts = gd.Variable(np.arange(3, dtype=np.float32), name="counts",
                             synchronization=gd.VariableSynchronization.ON_READ,
                             aggregation=gd.VariableAggregation.SUM)
    counts.values[1][0] = 7.0               # sync-on-read replicas may differ: not checked
    assert strategy.check_mirrored() is None
    w.values[2][1, 2] = -0.0 if w.values[2][1, 2] == 0 else np.nextafter(
        w.values[2][1, 2], np.float32(np.inf))     # one ulp: bit-identical means bit-identical
    with pytest.raises(ValueError, match=r"'w' differs between replica 0 \(cpu:0\) and "
                                         r"replica 2 \(cpu:2\)"):
        strategy.check_mirrored()
