"""Failures of multi-worker jobs, under `graphdist launch -n 2` and `mpiexec -n 2`: a worker
that fails outside a step (an exception, sys.exit, a hang) is named on the other, every
process exits, the launcher says why per rank; `--restarts` survives a killed worker;
Checkpoint.latest; the ranks' traffic on loopback and no pickles between ranks. Every
subprocess has a hard timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import graphdist as gd
from graphdist.device import mpi

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTS = os.path.join(HERE, "mpi", "faults.py")
RESTART = os.path.join(HERE, "mpi", "restart.py")
from mpi_launch import MPIEXEC, needs_mpi  # noqa: E402
LAUNCH = [sys.executable, "-m", "graphdist", "launch", "-n", "2"]


def _run(command, timeout=60, env=None):
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done, time.perf_counter() - start


def _reports(out_dir, done=None):
    reports = {}
    for rank in (0, 1):
        path = os.path.join(out_dir, f"rank{rank}.json")
        assert os.path.exists(path), f"worker {rank} wrote no report\n" + (
            done.stderr if done is not None else "")
        with open(path) as f:
            reports[rank] = json.load(f)
    return reports


def _launcher_lines(stderr: str) -> dict:
    # not anchored: a rank's last output, relayed by hydra, may end without a newline
    return dict(re.findall(r"graphdist launch: worker (\d+) \(pid \d+\): (.*)$", stderr, re.M))


# ---------------------------------------------------------------- failures named
@needs_mpi
@pytest.mark.parametrize("kind, says", [
    ("between", "ValueError: worker one broke between steps"),
    ("trace", "ValueError: worker one's step failed at trace time"),
    ("exit", "exited with status 3"),
    ("kill", "killed by SIGKILL")])
def test_a_failure_outside_a_step_is_named_on_the_other_worker_and_by_the_launcher(
        tmp_path, kind, says):
    done, _ = _run([*LAUNCH, FAULTS, str(tmp_path), kind])
    reports = _reports(tmp_path, done)
    assert done.returncode != 0, done.stderr
    assert reports[0]["raised"] == "WorkerError", done.stderr
    assert "worker 1 failed" in reports[0]["message"] and says in reports[0]["message"]
    detection = reports[0]["at"] - reports[1]["failed_at"]     # about 5 ms when measured
    assert 0 <= detection < 10, detection
    lines = _launcher_lines(done.stderr)
    assert set(lines) == {"0", "1"}, done.stderr
    assert "worker 1 failed" in lines["0"] and says in lines["1"]


@needs_mpi
def test_under_mpiexec_too_the_other_worker_names_the_failure_and_the_job_exits(tmp_path):
    done, _ = _run([MPIEXEC, "-n", "2", sys.executable, FAULTS, str(tmp_path), "between"])
    reports = _reports(tmp_path, done)
    assert done.returncode != 0
    assert reports[0]["raised"] == "WorkerError"
    assert "worker 1 failed" in reports[0]["message"]
    assert "worker one broke between steps" in reports[0]["message"]


@needs_mpi
@pytest.mark.parametrize("check, waiting_in", [
    # every call checks the schedule first: worker 0 waits in that header's exchange
    ("every", "the check of the workers' collective schedules (call"),
    # first calls only: it waits in the step's gradient all-reduce, traced in sgd_worker.py
    ("first", "an all-reduce of f32[12] (call")])
def test_a_hung_worker_is_named_at_the_timeout_and_the_launch_exits(tmp_path, check,
                                                                     waiting_in):
    done, seconds = _run([*LAUNCH, FAULTS, str(tmp_path), "hang"],     # timeout 3 s inside
                         env={**os.environ, "GRAPHDIST_SCHEDULE_CHECK": check})
    assert done.returncode != 0
    assert seconds < 3 + 15, seconds          # no hang in MPI_Finalize (about 5.5 s measured)
    message = _reports(tmp_path, done)[0]["message"]
    assert f"worker 0: timed out after 3 s in {waiting_in}" in message
    assert "at faults.py:" in message and "step(x, y)" in message      # the user's line
    if check == "first":      # and the line the collective's node was traced at
        assert "step(x, y); traced at sgd_worker.py:" in message
        assert "opt.apply_gradients([(tape.gradient(loss, w), w)])" in message
    assert "ranks that had arrived: [0]" in message
    assert "worker 1: no answer" in message
    assert "recent: call" in message                                   # the flight recorder
    lines = _launcher_lines(done.stderr)
    # the sleeping worker is told by the launcher and names the one that gave up on it
    assert "timed out" in lines["0"]
    assert "worker 0 failed (MPI abort with exit code 1" in lines["1"], done.stderr


def test_the_launchers_word_raises_at_once_only_in_the_users_own_code():
    """A worker told by the launcher that another failed raises where the signal found it
    only in the script's own code (asleep, say); inside graphdist, the standard library or
    an installed package (a Numba compile) it waits for its next collective."""
    import inspect
    import json as stdlib_json

    import numba

    assert mpi._in_user_code(inspect.currentframe())
    assert not mpi._in_user_code(None)
    frames = []
    stdlib_json.loads("1", parse_int=lambda text: frames.append(sys._getframe(1)) or 1)
    assert frames and not mpi._in_user_code(frames[0])                 # the stdlib's
    assert not mpi._in_user_code(sys._getframe().f_back)               # pytest's (a package)
    assert numba.__file__ and not mpi._in_user_code(
        type("F", (), {"f_code": type("C", (), {"co_filename": numba.__file__})})())
    assert not mpi._in_user_code(_graphdist_frame())


def _graphdist_frame():
    found = []
    gd.function(lambda x: found.append(sys._getframe(1)) or x)(np.ones(2, np.float32))
    return found[0]


def test_the_launcher_reads_pmi_fields_and_names_exit_statuses():
    from graphdist.device import launcher

    assert launcher._fields("exitcode=3 message=application called MPI_Abort(comm, 3) "
                            "- process 1") == {
        "exitcode": "3", "message": "application called MPI_Abort(comm, 3) - process 1"}
    assert launcher._fields("kvsname=kvs_1 key=P0-businesscard value=description#abc$") == {
        "kvsname": "kvs_1", "key": "P0-businesscard", "value": "description#abc$"}
    assert launcher.how_it_ended(-9) == "killed by SIGKILL"
    assert launcher.how_it_ended(-15) == "killed by SIGTERM"
    assert launcher.how_it_ended(3) == "exit 3"


# ---------------------------------------------------------------- restarts
@needs_mpi
def test_launch_restarts_a_job_whose_worker_was_killed_and_it_ends_as_an_uninterrupted_run(
        tmp_path):
    runs = {}
    for name, extra, restarts in (("killed", ["kill"], ["--restarts", "1"]),
                                  ("whole", [], [])):
        out, ckpts = tmp_path / name, tmp_path / name / "checkpoints"
        ckpts.mkdir(parents=True)
        done, _ = _run([*LAUNCH, *restarts, RESTART, str(out), str(ckpts), *extra])
        assert done.returncode == 0, done.stderr
        runs[name] = (np.load(out / "final.npz"), done.stderr)
    killed, whole = runs["killed"][0], runs["whole"][0]
    assert int(killed["attempt"]) == 1 and int(killed["resumed_from"]) == 4
    stderr = runs["killed"][1]
    assert "restarting the job" in stderr
    # the first attempt's end: the killed worker named by rank and signal, by the launcher
    # and by the surviving worker's WorkerError
    assert re.search(r"worker 1 \(pid \d+\) failed first \(killed by SIGKILL\)", stderr), stderr
    lines = _launcher_lines(stderr)
    assert lines["1"] == "killed by SIGKILL, before it could report", stderr
    assert re.match(r"exit 1: worker 1 failed \(killed by SIGKILL, pid \d+; seen by graphdist "
                    r"launch\) while worker 0 waited in ", lines["0"]), stderr
    assert int(whole["attempt"]) == 0 and int(whole["resumed_from"]) == 0
    np.testing.assert_array_equal(killed["w"], whole["w"])
    assert not np.array_equal(whole["w"], np.linspace(-1, 1, 12, dtype=np.float32)
                              .reshape(4, 3))        # it trained


def test_checkpoint_latest_picks_the_newest_whole_file_by_step_number(tmp_path):
    assert gd.Checkpoint.latest(tmp_path) is None
    checkpoint = gd.Checkpoint(w=gd.Variable(np.ones(3, np.float32)))
    for step in (2, 10, 4):
        checkpoint.save(tmp_path / f"ckpt-{step}.npz")
    (tmp_path / ".ckpt-12.npz.host.1.abcd.tmp").write_bytes(b"half")    # a save under way
    (tmp_path / "ckpt-14.npz").write_bytes(b"not a checkpoint")
    assert gd.Checkpoint.latest(tmp_path) == os.path.join(tmp_path, "ckpt-10.npz")


def test_checkpoint_latest_without_step_numbers_picks_the_last_written(tmp_path):
    checkpoint = gd.Checkpoint(w=gd.Variable(np.ones(3, np.float32)))
    for name, mtime in (("b.npz", 100), ("a.npz", 300), ("c.npz", 200)):
        checkpoint.save(tmp_path / name)
        os.utime(tmp_path / name, (mtime, mtime))
    assert gd.Checkpoint.latest(tmp_path) == os.path.join(tmp_path, "a.npz")


# ---------------------------------------------------------------- safer by default
def test_no_pickle_between_ranks_objects_travel_as_json_and_raw_arrays():
    with open(mpi.__file__) as f:
        source = f.read()
    assert not re.search(r"import pickle|pickle\.(loads?|dumps?)\b", source)
    # mpi4py's lower-case methods (send, recv, bcast...) pickle; the buffer ones do not
    assert not re.search(r"(\.comm|\.notices|COMM_WORLD)\.[a-z]\w*\(", source)
    value = {"file": "ckpt-2.npz", "sizes": (1, 2), "w": np.arange(6, dtype=np.float32)
             .reshape(2, 3), "none": None}
    back = mpi.decode(mpi.encode(value))
    assert back["file"] == "ckpt-2.npz" and back["sizes"] == [1, 2] and back["none"] is None
    assert back["w"].dtype == np.float32
    np.testing.assert_array_equal(back["w"], value["w"])
    assert mpi.decode(mpi.encode(None)) is None


LISTENER = """
import os, sys, time
import graphdist as gd
strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
strategy.reduce("sum", 1.0, axis=None)
open(os.path.join(sys.argv[1], f"ready{strategy.worker_index}"), "w").close()
time.sleep(1)
strategy.reduce("sum", 1.0, axis=None)
"""


@needs_mpi
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_local_launch_listens_on_the_loopback_interface_only(tmp_path):
    """Every listening TCP socket of the job (the launcher and its workers: MPICH's hydra
    mpiexec listened on 0.0.0.0 for its control connections, and its ranks inherited
    that socket) is bound to 127.0.0.1 or ::1."""
    script = tmp_path / "listener.py"
    script.write_text(LISTENER)
    job = subprocess.Popen([*LAUNCH, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert time.time() < deadline and job.poll() is None, "the workers did not start"
            time.sleep(0.05)
        pids = {job.pid} | _children(job.pid)
        assert len(pids) == 3, pids                      # the launcher and 2 workers
        listening = _listening_sockets(pids)
    finally:
        job.communicate(timeout=60)
    assert job.returncode == 0
    assert listening, "the workers listen on no TCP socket: nothing was checked"
    for pid, address in listening:
        assert address.startswith(("127.", "::1")), (pid, address, listening)


def _children(pid: int) -> set:
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _listening_sockets(pids: set) -> list:
    """(pid, local address) of every TCP socket in LISTEN state that `pids` hold open."""
    inodes = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:         # 0A: LISTEN
                    found.append((inodes[fields[9]], _address(fields[1])))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp's 0100007F:1F90 as 127.0.0.1:8080 (and IPv6 alike)."""
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # host order
    return f"{ipaddress.ip_address(words)}:{int(port, 16)}"
