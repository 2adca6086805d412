"""Benchmark plots (PNG), drawn from a benchmark's saved JSON payload.

Each benchmark module that has a picture worth looking at defines `plot(payload) -> Figure`
next to the code that produced the numbers; this module gives them a common look and
decides where the PNG goes: beside the JSON for a run under results/runs/ or --out, and
`docs/img/bench-NAME.png` when the committed results are saved (what the docs show).
matplotlib lives in the benchmark environment (`.venv-bench`), not in graphdist's
dependencies; without it a run saves its JSON and says the plot was skipped.

    python -m bench.plots [NAME ...]    # redraw docs/img/ from the committed results
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"

GRAPHDIST = "#1f77b4"       # graphdist's contenders are blue everywhere, peers grey/orange
PEER = "#9e9e9e"
REFERENCE = "#ff7f0e"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def figure(title: str, width: float = 8.0, height: float = 4.5, ncols: int = 1):
    """A figure with `ncols` axes side by side, a title and a footnote naming the machine
    is added by render()."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def color(name: str) -> str:
    """graphdist's rows in blue, references (probes, bounds, one-pass kernels) in orange,
    peers in grey."""
    lower = name.lower()
    if "graphdist" in lower:
        return GRAPHDIST
    if any(word in lower for word in ("probe", "one-pass", "bound", "copy", "reference")):
        return REFERENCE
    return PEER


def bars(ax, values: dict, xlabel: str, fmt: str | None = None, *, mins: dict | None = None,
         highlight=(), colors: dict | None = None, log: bool = False, wrap: int = 34) -> None:
    """Horizontal bars, one per contender (dict order, first at the top), value printed at
    the bar's end. `mins` adds each contender's fastest run as a black tick on its bar (the
    median shows the typical run, the min what the code can do when the machine is quiet);
    `highlight` names rows drawn with a dark edge and a bold label (graphdist's default);
    `colors` overrides color() per name; long names wrap onto several lines; `fmt` formats
    the printed values (default: 3 significant digits, no exponent)."""
    names = [n for n in values if values[n] is not None]
    ys = list(range(len(names)))
    vals = [values[n] for n in names]
    picked = [(colors or {}).get(n) or color(n) for n in names]
    edges = ["#222222" if n in highlight else "none" for n in names]
    ax.barh(ys, vals, color=picked, edgecolor=edges, linewidth=1.5)
    ax.set_yticks(ys, [_wrap(n, wrap) for n in names], fontsize=7)
    for label, n in zip(ax.get_yticklabels(), names):
        if n in highlight:
            label.set_fontweight("bold")
    if mins:
        marks = [(mins[n], y) for n, y in zip(names, ys) if mins.get(n) is not None]
        if marks:
            ax.plot(*zip(*marks), "|", color="black", markersize=10, markeredgewidth=1.5)
    if log and vals:
        ax.set_xscale("log")
        ax.set_xlim(min(vals) / 2, max(vals) * 6)     # room for the printed value
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    for y, v in zip(ys, vals):
        ax.text(v, y, " " + (fmt.format(v) if fmt else number(v)), va="center", fontsize=7)
    if not log:
        ax.margins(x=0.15)


def grouped(ax, series: dict, xlabel: str, fmt: str | None = None, wrap: int = 34,
            colors: dict | None = None) -> None:
    """Horizontal bars in groups: `series` is {series name: {category: value}} (say
    {"graphdist": {...}, "PyTorch": {...}}), one bar per series in each category, the
    categories in the first series' order; a legend names the series, `colors` overrides
    color() per series."""
    names = list(series)
    categories = list(dict.fromkeys(c for s in series.values() for c in s))
    height = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        ys = [i + (k - (len(names) - 1) / 2) * height for i, c in enumerate(categories)
              if series[name].get(c) is not None]
        vals = [series[name][c] for c in categories if series[name].get(c) is not None]
        ax.barh(ys, vals, height=height, color=(colors or {}).get(name) or color(name),
                label=name)
        for y, v in zip(ys, vals):
            ax.text(v, y, " " + (fmt.format(v) if fmt else number(v)), va="center",
                    fontsize=6)
    ax.set_yticks(range(len(categories)), [_wrap(c, wrap) for c in categories],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(names),
              frameon=False)                        # above the bars: never on top of one
    ax.margins(x=0.15)


def _wrap(label: str, width: int) -> str:
    return textwrap.fill(label, width, break_on_hyphens=False)   # "opt-in" stays whole


def number(v: float) -> str:
    """3 significant digits, without the exponent a 5,340 ms bar would get from {:.3g}."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def timings(results: dict, key: str = "median_s", scale: float = 1e3) -> tuple[dict, dict]:
    """({name: median}, {name: min}) in ms (times `scale`) from {name: {"median_s": ..,
    "min_s": ..}}, skipping entries that are not timings (a param diff, a failed peer)."""
    rows = {n: r for n, r in (results or {}).items() if isinstance(r, dict) and key in r}
    return ({n: r[key] * scale for n, r in rows.items()},
            {n: r["min_s"] * scale for n, r in rows.items() if "min_s" in r})


def rows_height(n: int, base: float = 1.6, per_row: float = 0.36) -> float:
    """A figure height (inches) that gives each of n bars room for a two-line label."""
    return base + per_row * max(n, 3)


def png_path(name: str, json_path: Path) -> Path:
    json_path = Path(json_path)
    if json_path.parent == RESULTS:
        tag = json_path.stem[len(name):]          # "-avx512" for results/NAME-avx512.json
        return DOCS_IMG / f"bench-{name}{tag}.png"
    return json_path.with_suffix(".png")


def render(name: str, payload: dict, json_path: Path) -> Path | None:
    """Draw `bench.NAME.plot(payload)` into its PNG; None when the benchmark has no plot or
    matplotlib is missing."""
    module = importlib.import_module(f"bench.{name}")
    if not hasattr(module, "plot"):
        return None
    if not available():
        print(f"bench: no plot for {name} (matplotlib is not installed here; "
              "`make bench` sets up .venv-bench with it)", file=sys.stderr)
        return None
    import matplotlib.pyplot as plt

    try:        # a plot that trips on an odd payload must not end a long suite: JSON is saved
        fig = module.plot(payload)
    except Exception as e:  # noqa: BLE001
        print(f"bench: plot for {name} failed ({type(e).__name__}: {e}); its JSON is saved",
              file=sys.stderr)
        return None
    if fig is None:                                    # nothing to draw (say, no results)
        return None
    machine = payload.get("machine", {})
    fig.text(0.99, 0.005, f"{payload.get('date', '')}  {machine.get('processor', '')} "
             f"x{machine.get('cpu_count', '?')}", ha="right", va="bottom", fontsize=6,
             color="#777777")
    fig.tight_layout(rect=(0, 0.025, 1, 1))          # leave the footnote its own strip
    path = png_path(name, json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plotted {path}")
    return path


def main(argv=None) -> int:
    names = argv if argv is not None else sys.argv[1:]
    paths = sorted(RESULTS.glob("*.json"))
    if names:
        paths = [p for p in paths if p.stem.split("-")[0] in names or p.stem in names]
    for path in paths:
        payload = json.loads(path.read_text())
        render(payload.get("benchmark", path.stem), payload, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
