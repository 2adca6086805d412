"""gd.benchmark and `graphdist bench MODULE:BUILDER`: the user's own step timed per device
count from any folder; the project's suite (--suite, --list) only from a checkout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import graphdist as gd
from graphdist.benchmark import BuilderError
from graphdist.cli import main

BUILDER = '''
import numpy as np
import graphdist as gd


def build(n):
    """A tiny MLP step: one device on OneDeviceStrategy, else MirroredStrategy over n."""
    strategy = (gd.OneDeviceStrategy("cpu:0") if n == 1 else
                gd.MirroredStrategy([f"cpu:{i}" for i in range(n)]))
    rng = np.random.default_rng(0)
    with strategy.scope():
        params = [gd.Variable(rng.standard_normal((8, 16)).astype(np.float32) * 0.3),
                  gd.Variable(np.zeros(16, np.float32)),
                  gd.Variable(rng.standard_normal((16, 4)).astype(np.float32) * 0.3)]
        optimizer = gd.optimizers.SGD(0.1)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            h = gd.relu(x @ params[0] + params[1])
            loss = gd.reduce_mean(gd.square(h @ params[2] - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    @gd.function
    def step(x, y):
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x, y)),
                               axis=None)

    x = rng.standard_normal((8 * n, 8)).astype(np.float32)
    return step, (x, np.tanh(x[:, :4]))


def alone(n):
    return build(n)[0]


def wrong_count(n):
    return build(2)


def arrays(n):
    return np.ones(3), (1,)
'''


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A folder outside the checkout holding benchmod.py, the working directory; sys.path
    and sys.modules come back as they were."""
    (tmp_path / "benchmod.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "bench" or m.startswith(("bench.", "benchmod"))]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    sys.modules.pop("benchmod", None)


def test_cli_bench_times_a_builder_from_another_folder(elsewhere, capsys):
    assert main(["bench", "benchmod:build", "--devices", "1,2", "--steps", "3", "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert {"devices", "median_s", "min_s", "max_s", "compute_s", "collective_s",
                "first_call_s", "steps_per_s", "collective_share"} <= set(r)
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["compute_s"] > 0 and r["first_call_s"] > 0 and r["steps"] == 3
    assert rows[0]["collective_s"] == 0 and rows[0]["collective_share"] == 0
    assert rows[1]["collective_s"] > 0 and 0 < rows[1]["collective_share"] < 1
    assert "2 device(s)" in captured.err        # the progress line, kept off stdout


def test_cli_bench_prints_a_table_and_restores_the_mode(elsewhere, capsys):
    before = gd.config.device_concurrency()
    assert main(["bench", "benchmod:build", "--devices", "2", "--steps", "3",
                 "--mode", "threads"]) == 0
    out = capsys.readouterr().out
    assert "median ms" in out and "collective ms" in out and "mode threads" in out
    assert out.splitlines()[-1].split()[0] == "2"
    assert gd.config.device_concurrency() == before


def test_python_form(elsewhere):
    sys.path.insert(0, str(elsewhere))
    import benchmod

    before = gd.config.device_concurrency()
    rows = gd.benchmark(benchmod.build, devices=[1, 2], steps=3, mode="sequential")
    assert [r["devices"] for r in rows] == [1, 2] and rows[1]["mode"] == "sequential"
    assert rows[1]["collective_s"] > 0 and rows[0]["collective_s"] == 0
    assert gd.config.device_concurrency() == before
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        gd.benchmark(benchmod.build, steps=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        gd.benchmark(benchmod.build, mode="fast")
    for bad in ([], [0], [1, 1], "1,x", [1.5]):
        with pytest.raises(ValueError, match="device counts"):
            gd.benchmark(benchmod.build, devices=bad)
    with pytest.raises(BuilderError, match="returned a gd.function alone"):
        gd.benchmark(benchmod.alone, devices=[1])
    with pytest.raises(TypeError, match=r"must return \(f, args\).*got \(ndarray, tuple\)"):
        gd.benchmark(benchmod.arrays, devices=[1])
    with pytest.raises(BuilderError, match="on 2 device\\(s\\), not 1"):
        gd.benchmark(benchmod.wrong_count, devices=[1])


def test_cli_bench_explains_bad_inputs(elsewhere, capsys):
    assert main(["bench"]) == 2                              # no builder, no --suite: usage
    err = capsys.readouterr().err
    assert "MODULE:BUILDER" in err and "--suite" in err
    assert main(["bench", "overhead"]) == 2
    assert "expected MODULE:BUILDER, got 'overhead'" in capsys.readouterr().err
    assert main(["bench", "benchmod:alone", "--devices", "1", "--steps", "1"]) == 2
    assert "returned a gd.function alone" in capsys.readouterr().err
    assert main(["bench", "benchmod:arrays", "--devices", "1"]) == 2
    assert "must return (f, args)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no module 'nosuchmod'"):
        main(["bench", "nosuchmod:build"])
    with pytest.raises(SystemExit, match="module 'benchmod' has no 'nope'"):
        main(["bench", "benchmod:nope"])
    for argv, flag, what in [(["--devices", "1,0"], "--devices", "got '0'"),
                             (["--devices", "2,2"], "--devices", "listed twice"),
                             (["--devices", ","], "--devices", "integers >= 1"),
                             (["--steps", "0"], "--steps", "must be an integer >= 1")]:
        with pytest.raises(SystemExit) as info:
            main(["bench", "benchmod:build", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument {flag}: " in err and what in err, err


def test_cli_bench_suite_and_list_need_a_checkout(elsewhere, capsys):
    for argv in (["bench", "--list"], ["bench", "--suite"], ["bench", "--suite", "overhead"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "source checkout" in err and "MODULE:BUILDER" in err


def test_cli_bench_list_names_the_suite(monkeypatch, capsys):
    import bench.__main__ as runner

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.split() == runner.BENCHMARKS
    assert main(["bench", "--suite", "no_such_benchmark"]) == 2   # checked before running
    assert "no_such_benchmark" in capsys.readouterr().err


def test_format_table_and_device_counts():
    from graphdist.benchmark import device_counts, format_table

    assert device_counts("1, 2,4") == [1, 2, 4] and device_counts(3) == [3]
    row = {"devices": 2, "first_call_s": 0.5, "median_s": 2e-3, "min_s": 1e-3, "max_s": 3e-3,
           "spread": 1.0, "steps_per_s": 500.0, "compute_s": 1e-3, "collective_s": 1e-3,
           "collective_share": 0.5}
    text = format_table([row], "title")
    assert text.splitlines()[0] == "title"
    assert text.splitlines()[-1].split() == ["2", "0.500", "2.000", "1.000", "3.000", "100%",
                                             "500.0", "1.000", "1.000", "50%"]
