"""bench/plots.py and the progress bar of bench.common: where a benchmark's PNG goes, that a
benchmark without a plot (or without matplotlib) still saves cleanly, and that the bar shows
on a terminal only."""

from __future__ import annotations

import io
import sys
import types

import pytest

from bench import common, plots


def test_png_path_puts_committed_plots_in_docs_and_runs_beside_their_json(tmp_path):
    assert plots.png_path("mlp_step", plots.RESULTS / "mlp_step.json") == \
        plots.DOCS_IMG / "bench-mlp_step.png"
    assert plots.png_path("mlp_step", plots.RESULTS / "mlp_step-avx512.json") == \
        plots.DOCS_IMG / "bench-mlp_step-avx512.png"
    run = common.RUNS / "mlp_step-20260101-120000-2.json"
    assert plots.png_path("mlp_step", run) == run.with_suffix(".png")
    assert plots.png_path("cnn", tmp_path / "cnn.json") == tmp_path / "cnn.png"


def test_render_skips_a_benchmark_without_a_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bench.no_plot_here", types.ModuleType("no_plot_here"))
    assert plots.render("no_plot_here", {"results": {}}, tmp_path / "no_plot_here.json") is None
    assert not list(tmp_path.iterdir())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_interleaved_shows_a_bar_on_a_terminal_only(monkeypatch, tty):
    stream = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(common, "PROGRESS_AFTER_S", 0.0)    # draw even for a short loop
    calls = []
    t = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                           repeat=2, warmup=1)
    assert len(calls) == 6 and t["a"]["repeat"] == 2
    if tty:
        last = stream.getvalue().rstrip("\n").split("\r")[-1]
        assert "6/6" in last and "a, b" in last and last.startswith("[" + "#" * 30 + "]")
    else:
        assert stream.getvalue() == ""


def test_a_short_timing_loop_draws_no_bar(monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(common, "PROGRESS_AFTER_S", 60.0)
    common.timeit(lambda: None, repeat=3, warmup=1)
    assert stream.getvalue() == ""


def test_render_draws_a_png_and_survives_a_broken_plot(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from bench import mirrored_mlp

    timing = {"median_s": 0.02, "min_s": 0.018, "repeat": 3}
    payload = {"results": {"adam": {"graphdist 1 device": timing, mirrored_mlp.DEFAULT: timing,
                                    "max_param_diff_after_3_steps": 1e-7}}}
    path = plots.render("mirrored_mlp", payload, tmp_path / "mirrored_mlp.json")
    assert path == tmp_path / "mirrored_mlp.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    broken = types.ModuleType("broken")
    broken.plot = lambda payload: payload["results"]["missing"]
    monkeypatch.setitem(sys.modules, "bench.broken", broken)
    assert plots.render("broken", {"results": {}}, tmp_path / "broken.json") is None
    assert "plot for broken failed (KeyError" in capsys.readouterr().err
