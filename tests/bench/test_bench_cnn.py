"""bench/cnn.py without the peers: each peer gets a row saying why it did not run, the table
shows every contender's first and third losses, and the run still saves its JSON and plot
(the timing parts shrunk: graphdist's steps, profile and conv probes given)."""

from __future__ import annotations

import json
import sys

import pytest

from bench import cnn, common

TIMING = {"median_s": 0.04, "min_s": 0.038, "repeat": 1}
LOSSES = [3.66492, 3.09642, 2.61790]


def test_a_run_without_peers_saves_rows_that_say_why(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    bare = tmp_path / "bare-python"                 # finds no TensorFlow, PyTorch or JAX
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    monkeypatch.setattr(common, "peer_python", lambda: str(bare))
    monkeypatch.setattr(cnn, "peer_python", lambda: str(bare))
    monkeypatch.setattr(cnn, "unpinned_rerun", lambda module, argv: False)
    monkeypatch.setattr(cnn, "steps", lambda repeat: (
        {"graphdist 1 device": {**TIMING, "losses": LOSSES}, cnn.DEFAULT: dict(TIMING)}, 1e-7))
    monkeypatch.setattr(cnn, "fresh_process_rows",       # the peers only: no graphdist runs
                        lambda own, *args: common.fresh_process_rows(None, *args))
    monkeypatch.setattr(cnn, "op_profile", lambda: {"conv2d": 9.0, "matmul": 2.0})
    monkeypatch.setattr(cnn, "sgemm_gflops", lambda: 400.0)
    monkeypatch.setattr(cnn, "conv_gflops", lambda batch: [("conv1", "forward", 1e-3, 100.0)])
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    entry = cnn.main([])
    saved = json.loads((tmp_path / "cnn.json").read_text())
    assert saved["results"] == entry and saved["tf_ops_ms"] is None
    assert {name: r["status"].split(":")[0] for name, r in entry.items() if "status" in r} == \
        {f"{m.rsplit('.', 1)[1]} --devices {d}": "not installed" for m, d in cnn.PEERS}
    first = next(line for line in saved["table"].splitlines()
                 if line.strip().startswith("graphdist 1 device"))
    assert first.split()[-2:] == ["3.66492", "2.61790"]     # loss 1, loss 3
    assert "tf_cnn --devices 4  not installed: tensorflow is not installed" in saved["table"]
    assert (tmp_path / "cnn.png").exists()
