"""bench/gpt2.py without the peers: a peer that cannot run (no benchmark environment, its
framework not installed, or it fails) gets a row saying why and the run still saves its
table, JSON and plot; the losses column tells a peer that built another model; the run
drops the environment's OpenBLAS pin by starting itself again without it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from bench import common, gpt2

TIMING = {"median_s": 0.03, "min_s": 0.028, "repeat": 1}
LOSSES = [4.87220, 4.65615, 4.50477]


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def _without_site_packages(tmp_path) -> str:
    """A Python that finds no TensorFlow, PyTorch or JAX, whatever this one has."""
    return _script(tmp_path, "bare-python", f'exec "{sys.executable}" -S "$@"')


def test_a_missing_framework_gets_a_not_installed_row(tmp_path, monkeypatch):
    bare = _without_site_packages(tmp_path)
    monkeypatch.setattr(common, "peer_python", lambda: bare)
    rows = common.fresh_process_rows(None, gpt2.PEERS, 0.03)
    assert list(rows) == ["jax_gpt2 --devices 1", "tf_gpt2 --devices 1",
                          "torch_gpt2 --devices 1", "jax_gpt2 --devices 4",
                          "tf_gpt2 --devices 4"]
    assert rows["tf_gpt2 --devices 4"]["status"] == \
        f"not installed: tensorflow is not installed in {bare}"
    assert rows["torch_gpt2 --devices 1"]["status"].startswith("not installed: torch ")


def test_no_benchmark_environment_or_no_peers_says_so(monkeypatch):
    monkeypatch.setattr(common, "peer_python", lambda: None)
    rows = common.fresh_process_rows(None, gpt2.PEERS, 0.03)
    assert {r["status"] for r in rows.values()} == \
        {"not installed: no benchmark environment (.venv-bench: `make bench`)"}
    rows = common.fresh_process_rows(None, gpt2.PEERS, 0.03, True)
    assert {r["status"] for r in rows.values()} == {"not run (--no-peers)"}


def test_a_peer_that_fails_gets_a_failed_row(tmp_path, monkeypatch, capsys):
    # finds every framework (the probe prints no missing name), then fails to run the peer
    broken = _script(tmp_path, "broken-python",
                     'case "$1" in -c) exit 0;; *) echo "peer exploded" >&2; exit 1;; esac')
    monkeypatch.setattr(common, "peer_python", lambda: broken)
    rows = common.fresh_process_rows(None, [("bench.peers.jax_gpt2", 4)], 0.03)
    assert rows == {"jax_gpt2 --devices 4": {"status": "failed (its error is above, on "
                                                      "stderr)"}}
    assert "peer exploded" in capsys.readouterr().err


def _entry(**peers) -> dict:
    graphdist = {gpt2.ONE: {**TIMING, "losses": LOSSES, "vs_graphdist_1": 1.0}}
    return {**graphdist, **{name: {**TIMING, "vs_graphdist_1": 1.0, **r}
                            for name, r in peers.items()}}


def test_the_table_flags_a_peer_whose_losses_differ(capsys):
    same = [a * (1 + 1e-5) for a in LOSSES]
    other = [LOSSES[0], LOSSES[1], LOSSES[2] * 1.01]       # a different model or optimizer
    text = gpt2.steps_table(_entry(**{"JAX jit": {"losses": same}}), 3)
    assert "losses after 1 and 3 steps agree within 0.001" in text
    text = gpt2.steps_table(_entry(**{"JAX jit": {"losses": same},
                                      "TF tf.function": {"losses": other},
                                      "tf_gpt2 --devices 4": {"status": "not installed: x"}}),
                            3)
    assert "NOT THE SAME MODEL: TF tf.function (losses off" in text
    assert "not installed: x" in text
    assert "NOT THE SAME MODEL: TF tf.function" in capsys.readouterr().err


def test_a_run_without_peers_saves_its_table_json_and_plot(tmp_path, monkeypatch):
    """main() with the timing parts shrunk (the gelu kernels on 4 x 8 values, graphdist's
    steps and profile given): the peer rows, the JSON and the PNG."""
    pytest.importorskip("matplotlib")
    bare = _without_site_packages(tmp_path)
    monkeypatch.setattr(common, "peer_python", lambda: bare)
    monkeypatch.setattr(gpt2, "peer_python", lambda: bare)
    monkeypatch.setattr(gpt2, "unpinned_rerun", lambda module, argv: False)
    monkeypatch.setattr(gpt2, "SHAPE", (4, 8))
    monkeypatch.setattr(gpt2, "graphdist_part", lambda repeat: {
        gpt2.ONE: {**TIMING, "losses": LOSSES}, gpt2.DEFAULT: {**TIMING, "losses": LOSSES}})
    monkeypatch.setattr(gpt2, "fresh_process_rows",       # the peers only: no graphdist runs
                        lambda own, *args: common.fresh_process_rows(None, *args))
    monkeypatch.setattr(gpt2, "op_profile", lambda **kwargs: ({"matmul/einsum": 20.0},
                                                              {"matmul": 20.0}))
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    entry = gpt2.main(["--repeat", "1"])
    saved = json.loads((tmp_path / "gpt2.json").read_text())
    assert saved["results"] == entry
    assert [r["status"].split(":")[0] for r in entry.values() if "status" in r] == \
        ["not installed"] * len(gpt2.PEERS)
    assert "not installed: tensorflow is not installed" in saved["table"]
    assert set(saved["gelu"]) >= {"tanh form, kernel (after)", "exact form, kernel"}
    assert (tmp_path / "gpt2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_starts_again_without_the_openblas_pin(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(common.subprocess, "run",
                        lambda cmd, env, cwd, check: started.append((cmd, env)))
    for k in common.OPENBLAS_PIN:
        monkeypatch.delenv(k, raising=False)
    assert not common.unpinned_rerun("bench.gpt2", ["--repeat", "3"]) and not started
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "512")
    assert common.unpinned_rerun("bench.gpt2", ["--repeat", "3"])
    [(cmd, env)] = started
    assert cmd == [sys.executable, "-m", "bench.gpt2", "--repeat", "3"]
    assert not set(common.OPENBLAS_PIN) & set(env) and env["PATH"] == os.environ["PATH"]
    assert "without the environment's OpenBLAS pin (OPENBLAS_CORETYPE=Haswell, " \
           "OPENBLAS_L2_SIZE=512), as on a user's machine" in capsys.readouterr().err


def test_the_targets_compare_graphdist_with_the_fastest_peer_at_each_device_count():
    def row(median, low, devices=None):
        return {"median_s": median, "min_s": low, **({"devices": devices} if devices else {})}

    entry = {gpt2.ONE: row(0.030, 0.027), gpt2.DEFAULT: row(0.040, 0.036),
             "graphdist 1 device (own process)": row(0.020, 0.019, 1),      # not a peer
             "graphdist Mirrored x4 (own process)": row(0.010, 0.009, 4),
             "JAX jit": row(0.050, 0.045, 1), "TF tf.function": row(0.025, 0.018, 1),
             "JAX pmap x4": row(0.036, 0.030, 4), "tf_gpt2 --devices 4": {"status": "x"}}
    targets = common.versus_best_peer(entry)
    fresh, here = targets["fresh processes"], targets["interleaved"]
    assert fresh[1]["best_peer"] == here[1]["best_peer"] == "TF tf.function"
    assert fresh[1]["median_ratio"] == pytest.approx(0.020 / 0.025)
    assert here[1]["median_ratio"] == pytest.approx(0.030 / 0.025)
    assert here[1]["min_ratio"] == pytest.approx(0.027 / 0.018)
    assert fresh[4]["best_peer"] == here[4]["best_peer"] == "JAX pmap x4"
    assert fresh[4]["median_ratio"] == pytest.approx(0.010 / 0.036)
    assert here[4]["median_ratio"] == pytest.approx(0.040 / 0.036)
    assert common.versus_text(targets).splitlines()[2] == (
        "interleaved, 1 device: graphdist 1 device / TF tf.function = 1.20 (medians), "
        "1.50 (mins); target: at most 1")
    del entry["graphdist Mirrored x4 (own process)"]
    assert 4 not in common.versus_best_peer(entry)["fresh processes"]
    assert common.versus_best_peer({gpt2.ONE: row(0.03, 0.03)}) == {}


def test_fresh_processes_run_in_turn_and_keep_the_median_of_their_rounds(monkeypatch):
    calls = []
    medians = {"own": iter([0.040, 0.030, 0.035]), "jax": iter([0.020, 0.050, 0.021])}

    def fake_run(python, module, *args, env_extra=None):
        name = "own" if module == "bench.peers.graphdist_gpt2" else "jax"
        calls.append((name, args[1], bool(env_extra)))
        if name == "own" and (args[1] != "4" or env_extra):
            return None                  # only the warm 4-device run of graphdist here
        m = next(medians[name])
        return {"peer": name, "median_s": m, "min_s": m - 0.001, "first_call_s": 1.0}

    monkeypatch.setattr(common, "peer_python", lambda: sys.executable)
    monkeypatch.setattr(common, "missing_frameworks", lambda python: {})
    monkeypatch.setattr(common, "run_peer", fake_run)
    rows = common.fresh_process_rows("bench.peers.graphdist_gpt2",
                                     [("bench.peers.jax_gpt2", 4)], 0.03, rounds=3)
    one_round = [("own", "1", False), ("own", "4", False), ("own", "4", True),
                 ("jax", "4", False)]
    assert calls == one_round * 3                      # every contender once per round
    assert rows["own"]["median_s"] == 0.035 and rows["own"]["min_s"] == pytest.approx(0.029)
    assert rows["own"]["round_medians_s"] == [0.040, 0.030, 0.035]
    assert rows["jax"]["median_s"] == 0.021 and rows["jax"]["rounds"] == 3
    assert rows["jax"]["vs_graphdist_1"] == pytest.approx(0.7)
