"""The command line and the bundled example, end to end."""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import numpy as np

from graphdist.cli import main
from graphdist.examples import mlp_digits


def test_example_reaches_95_percent_held_out():
    result = mlp_digits.train(devices=1, steps=300)
    assert result["accuracy"] >= 0.95
    assert result["losses"][-1] < result["losses"][0] / 5


def test_example_matches_numpy_reference_for_a_few_steps():
    """Three Adam steps of the example agree with the same steps written in numpy."""
    from graphdist.datasets import load_digits

    result = mlp_digits.train(devices=1, steps=3, batch_size=64, seed=3)
    x, y = load_digits("train")
    import graphdist as gd

    batches = iter(gd.data.batches((x, y), 64, shuffle=True, seed=3, repeat=True))
    p = mlp_digits.init_params(3)
    m = [np.zeros_like(a) for a in p]
    v = [np.zeros_like(a) for a in p]
    for t in range(1, 4):
        xb, yb = next(batches)
        h_pre = xb @ p[0] + p[1]
        h = np.maximum(h_pre, 0)
        logits = h @ p[2] + p[3]
        e = np.exp(logits - logits.max(1, keepdims=True))
        d = e / e.sum(1, keepdims=True)
        d[np.arange(len(yb)), yb] -= 1
        d /= len(yb)
        dh = (d @ p[2].T) * (h_pre > 0)
        grads = [xb.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]
        lr_t = 1e-2 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            p[i] = p[i] - lr_t * m[i] / (np.sqrt(v[i]) + 1e-7)
    for got, want in zip(result["params"], p):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_cli_devices(capsys):
    assert main(["devices"]) == 0
    assert "cpu:0" in capsys.readouterr().out


def test_cli_demo_runs_and_prints_graph(capsys):
    assert main(["demo", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "adam_multi_update" in out and "# dense1" in out


def test_python_dash_m_graphdist():
    done = subprocess.run([sys.executable, "-m", "graphdist", "devices"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "cpu:0" in done.stdout


def test_cli_show_prints_and_exports(tmp_path, capsys):
    html, dot = tmp_path / "step.html", tmp_path / "step.dot"
    assert main(["show", "graphdist.examples.mlp_digits:traced_step", "--devices", "2",
                 "--merged"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas merged into one batched program" in out and "opt-in" in out
    assert main(["show", "graphdist.examples.mlp_digits:traced_step", "--devices", "2",
                 "--html", str(html), "--dot", str(dot), "--summary"]) == 0
    out = capsys.readouterr().out       # the default: one copy per device, as it runs
    assert "merged" not in out
    assert "on cpu:0,cpu:1" in out and "# replica cpu:1" in out and "peak live bytes" in out
    assert html.stat().st_size > 1000 and "cpu:1" in html.read_text()
    assert "cluster_dev0" in dot.read_text() and "cluster_dev1" in dot.read_text()


def test_cli_demo_on_two_devices_checks_against_one(tmp_path, capsys):
    html = tmp_path / "demo.html"
    assert main(["demo", "--devices", "2", "--steps", "20", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    difference = float(out.split("max |parameter difference| vs one device: ")[1].split()[0])
    assert difference < 1e-4 and str(html) in out and html.exists()


def test_cli_bench_finds_the_checkout_and_checks_names(tmp_path, monkeypatch, capsys):
    import graphdist.cli as cli

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert main(["bench", "--suite", "no_such_benchmark"]) == 2  # checked before it runs
    assert "no_such_benchmark" in capsys.readouterr().err

    def no_bench(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(cli.importlib, "import_module", no_bench)
    assert main(["bench", "--suite", "overhead"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_cli_show_explains_what_it_cannot_show(tmp_path, monkeypatch, capsys):
    (tmp_path / "showmod.py").write_text(
        "import numpy as np, graphdist as gd\n"
        "@gd.function\n"
        "def untraced(x): return x * 2\n"
        "@gd.function\n"
        "def traced(x): return x * 2\n"
        "traced(np.ones(3, np.float32))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["show", "showmod:untraced"]) == 2
    assert "not been traced yet" in capsys.readouterr().err
    assert main(["show", "showmod:traced", "--devices", "2"]) == 2
    assert "traced for 1 device(s), not 2" in capsys.readouterr().err
    assert main(["show", "showmod:traced"]) == 0
    assert "mul x 2.0" in capsys.readouterr().out



def test_cli_show_prints_the_graph_not_what_the_function_returned(tmp_path, monkeypatch,
                                                                  capsys):
    (tmp_path / "showret.py").write_text(
        "import numpy as np, graphdist as gd\n"
        "def trains(devices):\n"
        "    step = gd.function(lambda x: x * 3.0)\n"
        "    losses = [step(np.full(2, 7.5, np.float32)) for _ in range(2)]\n"
        "    return {'losses': losses, 'params': [np.full(4, 123456.0)], 'train_step': step}\n"
        "def only_arrays(devices):\n"
        "    return {'params': [np.full(4, 123456.0)]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["show", "showret:trains"]) == 0
    out = capsys.readouterr().out
    assert "mul x 3.0" in out
    assert "123456" not in out and "22.5" not in out and "losses" not in out, out
    assert main(["show", "showret:only_arrays"]) == 2
    captured = capsys.readouterr()
    assert "123456" not in captured.out + captured.err
    assert "returned a dict holding no gd.function or gd.Graph" in captured.err


def test_cli_show_stages_prints_the_graph_after_every_stage(capsys):
    target = "graphdist.examples.mlp_digits:traced_step"
    assert main(["show", target, "--devices", "2", "--stages"]) == 0
    out = capsys.readouterr().out
    # overlap (the default) splits each all-reduce instead of fusing it into the update
    order = ["trace", "dce", "cse", "simplify", "fuse_optimizer", "replicate",
             "lower_collectives", "overlap", "schedule"]
    positions = [out.index(f"==== after {name}:") for name in order]
    assert positions == sorted(positions)
    replicated = out[out.index("==== after replicate:"):out.index("==== after lower_coll")]
    lowered = out[out.index("==== after lower_collectives:"):out.index("==== after overlap")]
    split = out[out.index("==== after overlap:"):out.index("==== after schedule")]
    assert "all_reduce" in replicated and "host_all_reduce" not in replicated
    assert "host_all_reduce" in lowered
    assert "host_all_reduce_start" in split and "collective_wait" in split
    assert main(["show", target, "--devices", "2", "--stage", "replicate"]) == 0
    one = capsys.readouterr().out
    assert one.count("==== after") == 1 and "on cpu:0,cpu:1" in one
    assert main(["show", target, "--devices", "2", "--stage", "nope"]) == 2
    assert "lower_collectives" in capsys.readouterr().err


def test_cli_rejects_non_positive_steps_and_devices(capsys):
    import pytest

    for argv, flag in [(["demo", "--steps", "0"], "--steps"), (["demo", "--devices", "0"],
                                                                "--devices"),
                       (["demo", "--steps", "-3"], "--steps"),
                       (["show", "x:y", "--devices", "0"], "--devices")]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument {flag}: must be an integer >= 1, got " in err, err
        assert "Traceback" not in err


def test_bench_never_overwrites_committed_results_unless_asked(tmp_path, monkeypatch, capsys):
    import types

    import bench.__main__ as runner
    from bench import common

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    committed = tmp_path / "results"
    committed.mkdir()
    (committed / "overhead.json").write_text('{"committed": true}')
    monkeypatch.setattr(common, "RESULTS", committed)
    monkeypatch.setattr(common, "RUNS", committed / "runs")
    for var in ("BENCH_SAVE", "BENCH_OUT", "BENCH_TAG"):
        monkeypatch.delenv(var, raising=False)
    fake = types.SimpleNamespace(main=lambda: common.save("overhead", {"value": 1}))
    monkeypatch.setitem(sys.modules, "bench.overhead", fake)   # what the runner imports

    assert runner.main(["overhead"]) == 0                  # python -m bench overhead
    assert main(["bench", "--suite", "overhead"]) == 0     # graphdist bench --suite ...
    runs = sorted((committed / "runs").glob("overhead-*.json"))
    assert len(runs) == 2 and all('"value": 1' in p.read_text() for p in runs)
    assert (committed / "overhead.json").read_text() == '{"committed": true}'
    out = tmp_path / "mine"
    assert main(["bench", "--suite", "overhead", "--out", str(out)]) == 0
    assert '"value": 1' in (out / "overhead.json").read_text()
    assert (committed / "overhead.json").read_text() == '{"committed": true}'
    assert runner.main(["overhead", "--save"]) == 0       # only when asked
    assert '"value": 1' in (committed / "overhead.json").read_text()
    assert len(list((committed / "runs").glob("*.json"))) == 2
    capsys.readouterr()
