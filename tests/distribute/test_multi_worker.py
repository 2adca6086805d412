"""MultiWorkerMirroredStrategy: 2 worker processes under mpiexec (and `graphdist launch`)
against 1 worker with 4 devices and one device on the global batch, in this process.
The workers run tests/mpi/worker_checks.py and worker_fails.py and report as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import graphdist as gd

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: mpi/ scripts
sys.path.insert(0, os.path.join(HERE, "mpi"))
from training import train  # noqa: E402

from mpi_launch import MPIEXEC, needs_mpi  # noqa: E402
pytestmark = needs_mpi


def _run(command, out_dir, timeout=120):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    reports = {}
    for rank in (0, 1):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[rank] = json.load(f)
    return done, reports


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("workers"))
    single = os.path.join(str(tmp_path_factory.mktemp("single")), "one.npz")
    gd.Checkpoint(w=gd.Variable(np.arange(24, dtype=np.float32).reshape(8, 3))).save(single)
    done, reports = _run([MPIEXEC, "-n", "2", sys.executable,
                          os.path.join(HERE, "mpi", "worker_checks.py"), out, "2", single], out)
    assert done.returncode == 0, done.stdout + done.stderr
    return reports, out


def test_two_workers_of_two_devices_train_as_four_devices_and_as_one(two_workers):
    reports, _ = two_workers
    four = train(gd.MirroredStrategy([f"cpu:{i}" for i in range(4)]), seed=100)
    one = train(gd.OneDeviceStrategy("cpu:0"), seed=100)
    for rank in (0, 1):
        w, table = np.array(reports[rank]["w"]), np.array(reports[rank]["table"])
        np.testing.assert_allclose(w, four["w"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w, one["w"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(table, one["table"].numpy(), rtol=1e-5, atol=1e-6)
    # the chief's initial values won, though the workers made theirs from other seeds
    np.testing.assert_array_equal(reports[1]["initial_w"], reports[0]["initial_w"])
    np.testing.assert_allclose(reports[0]["initial_w"], four["initial"], rtol=0)


@pytest.mark.parametrize("rows", [11, 3])
def test_shards_of_different_sizes_on_the_workers_train_as_one_device(two_workers, rows):
    """11 rows on 2 workers x 2 devices: shards 3, 3 | 3, 2; 3 rows: 1, 1 | 1, 0 (a replica
    with no example). With the loss averaged over the global batch and the gradients
    summed, every layout equals one device on the whole batch."""
    reports, _ = two_workers
    one = train(gd.OneDeviceStrategy("cpu:0"), seed=7, rows=rows, global_average=True)
    for rank in (0, 1):
        got = reports[rank][f"uneven_{rows}"]
        np.testing.assert_allclose(got["w"], one["w"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["table"], one["table"].numpy(), rtol=1e-5, atol=1e-6)
    assert reports[0][f"uneven_{rows}"] == reports[1][f"uneven_{rows}"]


def test_mirrored_components_are_bit_identical_across_replicas_and_workers(two_workers):
    reports, _ = two_workers
    assert reports[0]["components_equal"] and reports[1]["components_equal"]
    assert reports[0]["w_bytes"] == reports[1]["w_bytes"]
    # the dense gradient all-reduced (overlapped, the default: started early, then waited
    # for; runtime/overlap.py) and the embedding's sparse rows all-gathered over MPI
    assert reports[0]["collective_ops"] == ["mpi_all_gather", "mpi_all_reduce_start"]


def test_replica_ids_reductions_and_sync_on_read_are_global(two_workers):
    reports, _ = two_workers
    assert reports[0]["replica_ids"] == [0, 1] and reports[1]["replica_ids"] == [2, 3]
    for r in reports.values():                 # replicas hold 1, 2, 3, 4
        assert r["eager_sum"] == 10.0 and r["eager_mean"] == 2.5 and r["traced_sum"] == 20.0
        assert r["on_read_sum"] == 10.0 and r["on_read_mean"] == 2.5
        assert r["value_of_replica_3"] == 4.0       # an mpi_broadcast from worker 1


def test_a_single_process_checkpoint_restores_onto_the_workers(two_workers):
    reports, _ = two_workers
    for r in reports.values():
        np.testing.assert_array_equal(r["restored_from_single"], np.arange(24).reshape(8, 3))
        assert r["restored_components_equal"]


def test_the_chief_writes_one_checkpoint_that_restores_onto_other_layouts(two_workers):
    reports, out = two_workers
    assert reports[0]["checkpoint"] == reports[1]["checkpoint"] == os.path.join(out,
                                                                                 "ckpt.npz")
    assert os.listdir(out).count("ckpt.npz") == 1 and not any(
        name.endswith(".tmp") for name in os.listdir(out))
    for strategy in (gd.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
                     gd.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            w = gd.Variable(np.zeros((8, 3), np.float32))
            table = gd.Variable(np.zeros((500, 3), np.float32))
            opt = gd.optimizers.Adam(0.05)
        gd.Checkpoint(w=w, table=table, opt=opt).restore(reports[0]["checkpoint"])
        np.testing.assert_array_equal(w.numpy(), np.asarray(reports[0]["w"], np.float32))
        assert int(opt.iterations.numpy()) == 4
        assert all(np.array_equal(c, w.values[0]) for c in w.values)


@pytest.mark.parametrize("launcher", ["mpiexec", "graphdist launch"])
def test_a_failing_worker_makes_the_other_raise_naming_it_and_the_launch_fail(launcher,
                                                                             tmp_path):
    script = os.path.join(HERE, "mpi", "worker_fails.py")
    command = ([MPIEXEC, "-n", "2", sys.executable, script, str(tmp_path)]
               if launcher == "mpiexec" else
               [sys.executable, "-m", "graphdist", "launch", "-n", "2", script, str(tmp_path)])
    done, reports = _run(command, str(tmp_path))
    assert done.returncode != 0
    assert reports[1]["raised"] == "ValueError" and "labels in [0, 3)" in reports[1]["message"]
    assert reports[0]["raised"] == "WorkerError"
    assert "worker 1 failed" in reports[0]["message"] and "labels" in reports[0]["message"]
    assert reports[0]["seconds"] < 10             # well within the 20 s collective timeout


def test_strategy_arguments_are_checked():
    with pytest.raises(ValueError, match="cross_device_ops must be None"):
        gd.MultiWorkerMirroredStrategy(cross_device_ops=gd.RingAllReduce())


def test_the_demo_runs_under_graphdist_launch():
    done = subprocess.run([sys.executable, "-m", "graphdist", "launch", "-n", "2", "-m",
                           "graphdist", "demo", "--devices", "2", "--steps", "20", "--html", ""],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "2 workers x 2 cpu device(s)" in out and out.count("final loss") == 1  # the chief
    diff = float(out.split("max |parameter difference| vs one device: ")[1].split()[0])
    assert diff < 1e-4
    assert "mpi_all_reduce" in out


def test_launch_checks_its_arguments(tmp_path):
    from graphdist.cli import main

    assert main(["launch", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert main(["launch", "-n", "2"]) == 2


def test_a_worker_that_dies_ends_the_launch_with_an_error(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, numpy as np, graphdist as gd\n"
        "gd.config.set_collective_timeout(20.0)\n"
        "s = gd.MultiWorkerMirroredStrategy(['cpu:0'])\n"
        "step = gd.function(lambda x: s.run(lambda v: gd.get_replica_context()"
        ".all_reduce('sum', v), args=(x,)))\n"
        "step(np.ones(4, np.float32))\n"
        "if s.worker_index == 1:\n"
        "    os._exit(5)\n"
        "step(np.ones(4, np.float32))\n")
    done = subprocess.run([sys.executable, "-m", "graphdist", "launch", "-n", "2",
                           str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
