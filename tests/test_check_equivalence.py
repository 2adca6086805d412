"""gd.check_equivalence and `graphdist check`: a builder per known cause of N devices not
matching one (tests/equivalence_builders.py) is found at its node, line and cause; an
equivalent builder passes; the command exits 0 / 1 / 2."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from graphdist import cli
from graphdist.equivalence import EquivalenceError

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import equivalence_builders as builders  # noqa: E402
from mpi_launch import needs_mpi  # noqa: E402


def _line_of(text: str, builder: str = "_linear") -> str:
    """'equivalence_builders.py:N' of the first line containing `text` in or after the
    function `builder` of the builders' module."""
    lines = (TESTS / "equivalence_builders.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {builder}("))
    n = next(i for i, line in enumerate(lines[start:], start + 1) if text in line)
    return f"equivalence_builders.py:{n}"


CASES = [  # builder, cause, the node that differs, the line it was traced at
    ("uneven_mean", "uneven_mean", "all_reduce[op=mean] over 2 replicas",
     "opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))"),
    ("empty_shard", "empty_mean", "reduce_mean", "loss = gd.reduce_mean(per_example)"),
    ("average_loss_mean", "average_loss_mean", "all_reduce[op=mean] over 2 replicas",
     "opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))"),
    ("batch_norm", "batch_norm", "= sub ", "h = bn(x, training=True)"),
    ("dropout", "random", "philox_random", "gd.nn.dropout(x, 0.5, generator=generator)"),
    ("kink", "rounding", "relu_grad", "opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))"),
]


@pytest.mark.parametrize("name, cause, node, line", CASES, ids=[c[0] for c in CASES])
def test_each_known_cause_is_found_at_its_node_line_and_cause(name, cause, node, line):
    report = gd.check_equivalence(getattr(builders, name), devices=(1, 2), steps=2)
    assert not report.equivalent
    d = report.first_divergence
    assert d.devices == 2 and d.step == 1
    assert d.cause == cause
    assert node in d.node
    assert d.source.startswith(_line_of(line, name if name in ("batch_norm", "dropout", "kink")
                                        else "_linear"))
    if cause == "batch_norm":
        assert "a statistic of its own shard" in d.detail
    text = str(report)
    assert "2 devices: NOT equivalent" in text and gd.equivalence.CAUSES[cause][:40] in text


def test_an_equivalent_builder_is_equivalent_on_every_count():
    report = gd.check_equivalence(builders.equivalent, devices=(1, 2, 4), steps=3)
    assert report.equivalent and report.first_divergence is None
    assert [r.devices for r in report.results] == [2, 4]
    assert all(r.max_diff < 1e-5 for r in report.results)
    assert "4 devices: equivalent" in str(report)


@pytest.mark.parametrize("name", ["equivalent_mlp", "batch_norm_synchronized"])
def test_the_correct_recipes_are_equivalent(name):
    """No false alarm: softmax cross entropy, relu and Adam on 10 rows over 2, 3 and 4
    devices (uneven shards, compute_average_loss, sum); a synchronized batch norm (its
    4 rows split evenly: on 3 devices its per-replica mean loss is rightly reported)."""
    devices = (1, 2, 3, 4) if name == "equivalent_mlp" else (1, 2, 4)
    report = gd.check_equivalence(getattr(builders, name), devices=devices, steps=3)
    assert report.equivalent, str(report)


def test_gradients_in_one_bucket_are_traced_back_to_their_all_reduce():
    """Adam's four gradients travel concatenated in one bucket: the all-reduce behind the
    bucket's split is the node that differs, and the slots are not called gradients."""
    d = gd.check_equivalence(builders.uneven_mean_mlp, devices=(1, 3), steps=1).first_divergence
    assert d.cause == "uneven_mean" and d.node == "all_reduce[op=mean] over 3 replicas"
    assert d.source.startswith(_line_of("opt.apply_gradients", "_mlp"))
    assert "the gradient of w0" in d.others
    assert not any("Adam" in other and "gradient" in other for other in d.others)


def _per_example(rows: int) -> np.ndarray:
    """The builders' linear model's per-example loss before the first step, in float64."""
    x, y = builders._data(rows, np.float64)
    w = np.linspace(-1, 1, 6).reshape(3, 2)
    return ((x @ w - y) ** 2).sum(axis=1)


def test_the_differences_reported_are_the_recipes_own():
    """Against numpy: the mean of [mean(rows 0,1), row 2] instead of the mean of 3 rows;
    compute_average_loss averaged over 2 replicas halves the gradient."""
    per = _per_example(3)
    d = gd.check_equivalence(builders.uneven_mean, devices=(1, 2), steps=1).first_divergence
    assert d.what == "loss"
    assert d.max_diff == pytest.approx(abs(per.mean() - (per[:2].mean() + per[2]) / 2),
                                       rel=1e-4)
    assert "the gradient of w" in d.others
    d = gd.check_equivalence(builders.average_loss_mean, devices=(1, 2), steps=1).first_divergence
    assert (d.what, d.variable) == ("gradient", "w")
    assert d.max_diff == pytest.approx(d.one_device / 2, rel=1e-5)


def test_float64_tells_rounding_from_a_bug():
    kink = gd.check_equivalence(builders.kink, devices=(1, 2), steps=1, float64=True)
    assert kink.first_divergence.cause == "rounding"
    assert "float64 rerun: equivalent" in str(kink)
    bug = gd.check_equivalence(builders.uneven_mean, devices=(1, 2), steps=1, float64=True)
    assert bug.first_divergence.cause == "uneven_mean"
    assert "float64 rerun: still differs" in str(bug)


def test_float64_needs_a_builder_that_takes_dtype():
    with pytest.raises(EquivalenceError, match="takes no dtype="):
        gd.check_equivalence(lambda n: builders.kink(n), devices=(1, 2), steps=1, float64=True)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="a count other than 1"):
        gd.check_equivalence(builders.equivalent, devices=(1,))
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        gd.check_equivalence(builders.equivalent, steps=0)


def _command(*args):
    return subprocess.run([sys.executable, "-m", "graphdist", "check", *args], cwd=TESTS,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="error::UserWarning"))


def test_the_command_exits_1_naming_the_cause_and_0_when_equivalent():
    out = _command("equivalence_builders:average_loss_mean", "--devices", "1,2", "--steps", "1")
    assert out.returncode == 1, out.stderr
    assert "graphdist check equivalence_builders:average_loss_mean" in out.stdout
    assert "likely cause: compute_average_loss with mean gradient reduction" in out.stdout
    assert _line_of("opt.apply_gradients") in out.stdout
    out = _command("equivalence_builders:equivalent", "--devices", "1,2,4", "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "2 devices: equivalent" in out.stdout and "4 devices: equivalent" in out.stdout


def test_cli_main_runs_the_check_in_process(monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    code = cli.main(["check", "equivalence_builders:kink", "--devices", "1,2", "--steps", "1",
                     "--float64", "--atol", "1e-6", "--rtol", "1e-5"])
    out = capsys.readouterr().out
    assert code == 1
    assert "first node that differs: a:f32[] = relu_grad" in out
    assert "float64 rerun: equivalent, so the difference is float32 rounding" in out
    with pytest.raises(SystemExit, match="graphdist check: module 'equivalence_builders' has "
                       "no 'missing'"):
        cli.main(["check", "equivalence_builders:missing", "--devices", "1,2"])


def _launched(builder: str):
    return subprocess.run([sys.executable, "-m", "graphdist", "launch", "-n", "2", "-m",
                           "graphdist", "check", f"equivalence_builders:{builder}",
                           "--devices", "1,2,4", "--steps", "2"], cwd=TESTS,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@needs_mpi
def test_across_workers_the_verdict_and_exit_status_hold():
    """Under graphdist launch -n 2: the chief prints one report; the recipe is equivalent on
    2 and 4 devices (exit 0), compute_average_loss averaged again is not (exit 1)."""
    good = _launched("across_workers_sum")
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count("graphdist check equivalence_builders:across_workers_sum") == 1
    assert "4 devices: equivalent (losses and parameters, across 2 workers" in good.stdout
    bad = _launched("across_workers")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "2 devices: NOT equivalent" in bad.stdout and "4 devices: NOT equivalent" in bad.stdout
    assert "the value of w after the step" in bad.stdout
    assert "span 2 worker processes" in bad.stdout
