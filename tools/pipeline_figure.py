"""Draw docs/img/pipeline.png: the compile pipeline of graphdist/pipeline.py, stage by stage.

    .venv/bin/pip install matplotlib        # a tool dependency only, never graphdist's
    .venv/bin/python tools/pipeline_figure.py

Every box named in code font is a stage: `f.stages[name]` and `graphdist show --stage NAME`
give the graph after it. Keep the boxes in step with pipeline.py when a stage changes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "pipeline.png"

LOGICAL = ("#dceefb", "#4098d7")     # one-replica stages
PLACED = ("#e3f9e5", "#57ae5b")      # stages on placed graphs
OPT_IN = ("#fff8e1", "#d9a400")      # merge: opt-in
OUTSIDE = ("#f0f4f8", "#829ab1")     # not a stage: the user's function, the runtime
MONO = "DejaVu Sans Mono"


def box(ax, x, y, w, h, title, note="", colors=LOGICAL, stage=True, dashed=False):
    """A box centred at (x, y); `title` in code font when it is a stage name."""
    fill, edge = colors
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                boxstyle="round,pad=0.02,rounding_size=0.12", fc=fill, ec=edge,
                                lw=1.6, ls="--" if dashed else "-"))
    dy = 0.16 if note else 0
    ax.text(x, y + dy, title, ha="center", va="center", fontsize=11.5, weight="bold",
            family=MONO if stage else None, color="#102a43")
    if note:
        ax.text(x, y - 0.2, note, ha="center", va="center", fontsize=8.6, color="#334e68")


def arrow(ax, a, b, color="#486581", dashed=False, rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=13, lw=1.4,
                                 color=color, ls="--" if dashed else "-",
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def side(ax, y, text):
    ax.text(10.6, y, text, ha="left", va="center", fontsize=8.6, color="#627d98",
            family=MONO)


def main() -> None:
    fig, ax = plt.subplots(figsize=(11.6, 12.2), dpi=110)
    ax.set_xlim(0, 12.9)
    ax.set_ylim(-2.0, 11.2)
    ax.axis("off")
    ax.text(0.2, 10.85, "The compile pipeline (graphdist/pipeline.py)", fontsize=14,
            weight="bold", color="#102a43")
    ax.text(0.2, 10.5, "every stage is a Graph -> Graph pass run through passes.run_passes; "
            "f.stages and `graphdist show --stages` give the graph after each",
            fontsize=9, color="#486581")

    cx = 5.2
    box(ax, cx, 9.7, 3.6, 0.55, "your step function", "@gd.function, strategy.run",
        OUTSIDE, stage=False)
    box(ax, cx, 8.75, 3.6, 0.7, "trace", "Python runs once; tape.gradient adds the backward")
    side(ax, 8.75, "trace.py, autodiff.py")
    arrow(ax, (cx, 9.42), (cx, 9.1))

    # the logical passes: one replica, before any device is chosen
    names = ["dce", "cse", "simplify", "cse.2", "dce.2", "fuse_optimizer", "fuse_accumulate"]
    widths = [0.7, 0.7, 1.3, 0.95, 0.95, 2.1, 2.25]
    gap = 0.16
    total = sum(widths) + gap * (len(widths) - 1)
    x = cx - total / 2
    y = 7.55
    ax.add_patch(FancyBboxPatch((x - 0.2, y - 0.62), total + 0.4, 1.12,
                                boxstyle="round,pad=0.02,rounding_size=0.12", fc="#f5faff",
                                ec="#9fb3c8", lw=1))
    ax.text(cx, y + 0.32, "logical passes (one replica)", ha="center", fontsize=8.6,
            color="#486581")
    for i, (name, w) in enumerate(zip(names, widths)):
        box(ax, x + w / 2, y - 0.1, w, 0.5, name)
        if i:
            arrow(ax, (x - gap, y - 0.1), (x, y - 0.1))
        x += w + gap
    side(ax, 7.45, "passes/dce.py, cse.py,\nsimplify.py, fuse.py,\naccumulate.py")
    arrow(ax, (cx, 8.4), (cx, 8.07))

    # placement: one of three
    yb = 5.75
    box(ax, 1.65, yb, 3.0, 0.95, "place", "one device: no strategy\nor OneDeviceStrategy",
        PLACED)
    box(ax, cx, yb, 3.5, 0.95, "replicate", "the default for N devices: one copy per\n"
        "device, each collective one N-way node", PLACED)
    box(ax, 8.85, yb, 3.2, 0.95, "merge", 'opt-in ("merged"): logical CPU\nreplicas as one '
        "batched program", OPT_IN, dashed=True)
    side(ax, yb - 0.75, "passes/place.py, replicate.py,\nmerge.py")
    top = y - 0.64
    arrow(ax, (cx - 0.6, top), (1.65, yb + 0.5))
    arrow(ax, (cx, top), (cx, yb + 0.5))
    arrow(ax, (cx + 0.6, top), (8.85, yb + 0.5), dashed=True)

    ye = 4.45
    box(ax, cx, ye, 7.4, 0.8, "epilogues", "host devices: bias + activation into each matmul / "
        "conv2d's output pass;\nrelu's gradient with the bias gradient's sum", PLACED)
    side(ax, ye, "passes/epilogue.py")
    arrow(ax, (1.65, yb - 0.5), (1.65, ye + 0.42))
    arrow(ax, (cx, yb - 0.5), (cx, ye + 0.42))
    arrow(ax, (8.85, yb - 0.5), (8.85, ye + 0.42), dashed=True)

    yl = 3.2
    box(ax, cx, yl, 4.4, 0.9, "lower_collectives", "each N-way collective becomes what runs:\n"
        "one_device | ring | hierarchical | host | mpi | nccl", PLACED)
    side(ax, yl, "passes/collectives/\n(cross_device_ops names\nthe lowering)")
    arrow(ax, (cx, ye - 0.42), (cx, yl + 0.47))

    yf = 1.85
    box(ax, cx, yf, 6.9, 0.9, "overlap, fuse_reduce_update, fuse_sharded_update",
        "early buckets start + wait; replicas in one program: the last all-reduce\n"
        "(or a ZeRO bucket's reduce-scatter + update + all-gather) fused with the update",
        PLACED)
    side(ax, yf, "passes/overlap.py,\nfuse.py, fuse_zero.py")
    arrow(ax, (cx, yl - 0.47), (cx, yf + 0.47))

    yx = 0.55
    box(ax, cx, yx, 7.4, 0.7, "fuse_elementwise", "each cluster of elementwise ops: one "
        "generated loop", PLACED)
    side(ax, yx, "passes/fuse_elementwise.py")
    arrow(ax, (cx, yf - 0.47), (cx, yx + 0.37))
    arrow(ax, (1.65, ye - 0.42), (1.65, yx + 0.37), rad=0.0)
    arrow(ax, (8.85, ye - 0.42), (8.85, yx + 0.37), dashed=True)

    ys = -0.55
    box(ax, cx, ys, 3.6, 0.6, "schedule", "program order and buffer liveness", PLACED)
    side(ax, ys, "passes/schedule.py")
    arrow(ax, (cx, yx - 0.37), (cx, ys + 0.32))

    yr = -1.6
    box(ax, cx, yr, 7.0, 0.7, "runtime: lower to generated programs, run them",
        "a thread per logical CPU device (default) or one program; numpy or CuPy buffers",
        OUTSIDE, stage=False)
    side(ax, yr, "runtime/")
    arrow(ax, (cx, ys - 0.32), (cx, yr + 0.37))

    fig.savefig(OUT, bbox_inches="tight", pad_inches=0.15, facecolor="white")
    from PIL import Image  # comes with matplotlib: 256 colours, a third of the bytes

    image = Image.open(OUT).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        OUT, optimize=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
