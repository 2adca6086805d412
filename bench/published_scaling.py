"""The simulator against published scaling tables no one here wrote.

(a) Horovod on 128 and 512 Pascal GPUs, 4 per server over PCIe, servers joined by 25 Gbit/s
    RoCE; tf_cnn_benchmarks, synthetic data, batch 64 per GPU. Horovod's docs/benchmarks.rst
    (512 GPUs, 128 servers): "90% scaling efficiency for both Inception V3 and ResNet-101,
    and 68% scaling efficiency for VGG-16"; the same page before April 2018 (128 GPUs, 32
    servers): 90%, 90% and 79%. Sergeev & Del Balso, arXiv:1802.05799, figure 6, plot the
    128-GPU figures.
(b) PyTorch's DDP benchmark (pytorch/pytorch benchmarks/distributed/ddp/README.md): 8 DGX-1
    (8 V100 over NVLink, 4 x 100 Gbit/s InfiniBand each), batch 32 per GPU, NCCL, 25 MB
    buckets, p50: ResNet-50 329 images/s per GPU on 1 GPU without DDP, 306 on 16 GPUs (2
    machines): 93.0%; ResNet-101 197 -> 178: 90.4%; on 8 GPUs (one machine) 307 and 179:
    93.3% and 90.9%.

Each model is built with graphdist's layers (bench/cnn_zoo.py) and traced (never run); its
step is priced on the preset cluster (graphdist/simulate/presets.py: the roofline per op,
the hierarchical all-reduce, each bucket's all-reduce overlapping the backward pass from
its last gradient), weak scaling, efficiency = T1 / TN; and again with no overlap (every
all-reduce after the backward pass), beside it. The assumptions are presets.py's (printed
first). Target: every efficiency within 10 points of the published one.

    python -m bench.published_scaling       (about 30 s: every model traced, never run)
"""

from __future__ import annotations

import argparse

from bench.cnn_zoo import builder
from bench.common import save, table
from graphdist.simulate import simulate
from graphdist.simulate.presets import (COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY,
                                        OP_OVERHEAD_S, PRESETS)

HOROVOD = "Horovod docs/benchmarks.rst; arXiv:1802.05799 fig. 6"
DDP = "pytorch/pytorch benchmarks/distributed/ddp/README.md (p50)"

# (model, preset, per-GPU batch, GPUs, published efficiency, source)
PUBLISHED = [
    ("inception_v3", "p100-25gbe", 64, 128, 0.90, HOROVOD + " (128 GPUs)"),
    ("resnet101", "p100-25gbe", 64, 128, 0.90, HOROVOD + " (128 GPUs)"),
    ("vgg16", "p100-25gbe", 64, 128, 0.79, HOROVOD + " (128 GPUs)"),
    ("inception_v3", "p100-25gbe", 64, 512, 0.90, HOROVOD + " (512 GPUs)"),
    ("resnet101", "p100-25gbe", 64, 512, 0.90, HOROVOD + " (512 GPUs)"),
    ("vgg16", "p100-25gbe", 64, 512, 0.68, HOROVOD + " (512 GPUs)"),
    ("resnet50", "dgx1-v100", 32, 8, 307 / 329, DDP + ": 329 -> 307 images/s"),
    ("resnet50", "dgx1-v100", 32, 16, 306 / 329, DDP + ": 329 -> 306 images/s"),
    ("resnet101", "dgx1-v100", 32, 8, 179 / 197, DDP + ": 197 -> 179 images/s"),
    ("resnet101", "dgx1-v100", 32, 16, 178 / 197, DDP + ": 197 -> 178 images/s"),
]
# published single-GPU throughput (images/s), beside the roofline's
ONE_GPU = {("resnet50", "dgx1-v100"): 329, ("resnet101", "dgx1-v100"): 197}


def predict(overlap: bool = True) -> list[dict]:
    """One row per published figure: the prediction beside it."""
    rows, cases = [], {}
    for model, name, batch, gpus, _, _ in PUBLISHED:
        cases.setdefault((model, name, batch), []).append(gpus)
    predicted = {}
    for (model, name, batch), counts in cases.items():
        got = simulate(builder(model, batch), [1, *counts], preset=name, overlap=overlap)
        for r in got:
            predicted[model, name, r["devices"]] = r
    for model, name, batch, gpus, published, source in PUBLISHED:
        r, one = predicted[model, name, gpus], predicted[model, name, 1]
        rows.append({"model": model, "cluster": name, "gpus": gpus, "batch": batch,
                     "published": published, "predicted": r["efficiency"],
                     "difference_points": 100 * (r["efficiency"] - published),
                     "step_ms": 1e3 * r["step_s"], "compute_ms": 1e3 * r["compute_s"],
                     "comm_ms": 1e3 * r["comm_s"], "exposed_ms": 1e3 * r["exposed_comm_s"],
                     "images_per_s_1gpu": batch / one["step_s"],
                     "published_images_per_s_1gpu": ONE_GPU.get((model, name)),
                     "overlap": overlap, "source": source})
    return rows


def assumptions() -> list[str]:
    lines = [f"roofline: compute efficiency {COMPUTE_EFFICIENCY}, memory efficiency "
             f"{MEMORY_EFFICIENCY}, {OP_OVERHEAD_S * 1e6:.0f} us per op; elementwise "
             "chains fused"]
    for c in PRESETS.values():
        lines.append(c.line())
        for kind in (c.node_link, c.network):
            lines.append(f"    {kind.name}: latency {kind.link.latency * 1e6:.0f} us, "
                         f"{kind.link.bandwidth / 1e9:.1f} GB/s ({kind.source})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    print("\n".join(assumptions()))
    rows = predict(overlap=True)
    for r, serial in zip(rows, predict(overlap=False)):
        r["predicted_no_overlap"] = serial["predicted"]
    table("published scaling efficiency against the simulator's (weak scaling, T1 / TN)",
          ["model", "cluster", "GPUs", "published", "predicted", "difference",
           "no overlap", "exposed ms", "step ms", "1-GPU img/s"],
          [[r["model"], r["cluster"], r["gpus"], f"{r['published']:.1%}",
            f"{r['predicted']:.1%}", f"{r['difference_points']:+.1f} pts",
            f"{r['predicted_no_overlap']:.1%}", f"{r['exposed_ms']:.1f}", f"{r['step_ms']:.1f}",
            f"{r['images_per_s_1gpu']:.0f}"
            + (f" (published {r['published_images_per_s_1gpu']})"
               if r["published_images_per_s_1gpu"] else "")] for r in rows])
    worst = max(abs(r["difference_points"]) for r in rows)
    print(f"largest difference: {worst:.1f} points (target: 10)")
    save("published_scaling", {"assumptions": assumptions(), "rows": rows})


if __name__ == "__main__":
    main()
