"""Clusters gd.simulate can price a step on (`graphdist simulate --preset NAME`): GPUs given
by their datasheet peak FLOP/s and memory bandwidth, with a roofline per op, and the links
inside and between nodes, with a hierarchical all-reduce. One place for every figure: the
docs (docs/benchmarks.md, "Predicting published clusters") and bench/published_scaling.py
read them from here.

An op's time on a GPU (the roofline; Williams, Waterman & Patterson 2009):

    t = OP_OVERHEAD_S + max(flops / (peak_flops * COMPUTE_EFFICIENCY[kind]),
                            bytes / (memory_bandwidth * MEMORY_EFFICIENCY))

`kind` is the op's cost kind (ops/core.py: "matmul" for GEMMs and convolutions, "reduce",
"elementwise"). The efficiencies: convolutions and GEMMs reach 75% of the float32 peak
(cuDNN's Winograd and FFT algorithms do fewer multiplies than the 2*MACs counted here, so
this is an effective rate), and a streaming kernel 70% of the memory bandwidth. Chains of
elementwise ops are priced as one fused kernel (predict.fused_bytes: as cuDNN's batch norm
and XLA run them). The one anchor: ResNet-50 on one V100 then trains at about 310
images/s at batch 32, against the 329 of PyTorch's DDP benchmark; the same figures serve
every GPU, model and cluster, none fitted per case.

A collective on n GPUs, g per node (Horovod's hierarchical all-reduce, NCCL's tree/ring
across nodes): a reduce-scatter inside each node over its link (NVLink or PCIe), an
all-reduce of 1/g of the bytes between the nodes (the g GPUs of a node run theirs at once,
sharing the node's network bandwidth), an all-gather inside the node:

    T = 2 [(g-1)/g * S / B_node_link + (g-1) a_node_link]
        + 2 (N-1)/N * (S/g) / (B_network / g) + 2 (N-1) a_network      (N = n / g nodes)

On one node (n <= g) it is the ring over the node's link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphdist.simulate.link import Link

# the roofline's per-op-kind efficiencies (see the module docstring) and the per-kernel
# overhead a GPU pays whatever the op (launch and tail: a few microseconds)
COMPUTE_EFFICIENCY = {"matmul": 0.65, "reduce": 0.5, "elementwise": 0.5}
MEMORY_EFFICIENCY = 0.7
# cuDNN runs 3x3 stride-1 convolutions (forward and both gradients) with Winograd's
# F(2x2, 3x3): 16 multiplies per 2x2 outputs where the direct form does 36
WINOGRAD_SPEEDUP = 36 / 16
OP_OVERHEAD_S = 2e-6


@dataclass(frozen=True)
class GPU:
    """One accelerator: float32 peak FLOP/s and memory bandwidth (its datasheet's)."""

    name: str
    peak_flops: float          # FLOP/s, float32
    memory_bandwidth: float    # bytes/s

    def op_seconds(self, flops: float, nbytes: float, kind: str) -> float:
        """The roofline time of one op of `kind` doing `flops` and touching `nbytes`."""
        compute = flops / (self.peak_flops * COMPUTE_EFFICIENCY[kind])
        memory = nbytes / (self.memory_bandwidth * MEMORY_EFFICIENCY)
        return OP_OVERHEAD_S + max(compute, memory)


@dataclass(frozen=True)
class LinkKind:
    """A named link and where its figures come from."""

    name: str
    link: Link
    source: str


# datasheet figures; "effective" bandwidths are what NCCL's all-reduce reaches (bus
# bandwidth, nccl-tests), below the line rate
GPUS = {
    "P100": GPU("NVIDIA Tesla P100 PCIe", 9.3e12, 732e9),
    "V100": GPU("NVIDIA Tesla V100 SXM2", 15.7e12, 900e9),
    "A100": GPU("NVIDIA A100 SXM4 40GB", 19.5e12, 1555e9),
}
LINKS = {
    "pcie3": LinkKind("PCIe 3.0 x16", Link(5e-6, 10e9),
                      "15.75 GB/s line rate; NCCL reaches about 10 GB/s between GPUs "
                      "through a PCIe switch"),
    "nvlink-v100": LinkKind("NVLink 2 (DGX-1 hybrid cube mesh)", Link(3e-6, 130e9),
                            "6 links x 25 GB/s per direction per V100; NCCL all-reduce bus "
                            "bandwidth about 130 GB/s on a DGX-1V"),
    "nvswitch-a100": LinkKind("NVLink 3 through NVSwitch", Link(3e-6, 230e9),
                              "12 links x 25 GB/s per direction per A100; NCCL all-reduce "
                              "bus bandwidth about 230 GB/s on a DGX A100"),
    "25gbe": LinkKind("25 Gbit/s Ethernet (RoCE)", Link(10e-6, 2.8e9),
                      "3.125 GB/s line rate, about 90% of it for large messages"),
    "ib-edr": LinkKind("100 Gbit/s InfiniBand EDR", Link(2e-6, 11.5e9),
                       "12.5 GB/s line rate per port, about 92% of it"),
    "ib-hdr": LinkKind("200 Gbit/s InfiniBand HDR", Link(2e-6, 23e9),
                       "25 GB/s line rate per port, about 92% of it"),
}


@dataclass(frozen=True)
class Cluster:
    """Nodes of `gpus_per_node` GPUs joined inside by `node_link` (per GPU) and between
    nodes by `network` x `network_ports` (per node)."""

    name: str
    description: str
    gpu: GPU
    gpus_per_node: int
    node_link: LinkKind
    network: LinkKind
    network_ports: int = 1

    @property
    def network_link(self) -> Link:
        """A node's whole network: its ports' bandwidth together, one port's latency."""
        one = self.network.link
        return Link(one.latency, one.bandwidth * self.network_ports)

    def all_reduce_seconds(self, n: int, nbytes: float) -> float:
        """The hierarchical all-reduce of `nbytes` on n GPUs (the module docstring)."""
        return hierarchical_all_reduce(n, nbytes, self.gpus_per_node, self.node_link.link,
                                       self.network_link)

    def collective_seconds(self, collective: str, n: int, nbytes: float) -> float:
        """Seconds for one collective whose input is `nbytes` per GPU: the all-reduce as
        above; a reduce-scatter (of the full input) and a broadcast half of it, as the
        ring's halves; an all-gather of n shards half the all-reduce of their total."""
        if collective == "all_reduce":
            return self.all_reduce_seconds(n, nbytes)
        if collective == "all_gather":
            return self.all_reduce_seconds(n, nbytes * n) / 2
        return self.all_reduce_seconds(n, nbytes) / 2

    def line(self, width: int = 13) -> str:
        """One line for `--preset list` (the name padded to `width`)."""
        return (f"{self.name:<{width}} {self.description}: {self.gpu.name} "
                f"({self.gpu.peak_flops / 1e12:.1f} TFLOP/s fp32, "
                f"{self.gpu.memory_bandwidth / 1e9:.0f} GB/s) x {self.gpus_per_node} per node "
                f"over {self.node_link.name}, nodes over "
                f"{'' if self.network_ports == 1 else f'{self.network_ports} x '}"
                f"{self.network.name}")


def _ring(n: int, nbytes: float, link: Link) -> float:
    """The ring all-reduce: 2(n-1)/n * S/B + 2(n-1) a."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def hierarchical_all_reduce(n: int, nbytes: float, per_node: int, node_link: Link,
                            network: Link) -> float:
    """Reduce-scatter inside each node, all-reduce of S/g between the nodes (g rings at once
    on the node's network: each gets B/g), all-gather inside the node; on one node, the ring.
    n that does not fill whole nodes is taken as ceil(n / g) nodes."""
    if n <= 1:
        return 0.0
    g = min(n, per_node)
    nodes = math.ceil(n / g)
    if nodes == 1:
        return _ring(g, nbytes, node_link)
    inside = _ring(g, nbytes, node_link)            # reduce-scatter + all-gather: one ring
    between = _ring(nodes, nbytes / g, Link(network.latency, network.bandwidth / g))
    return inside + between


HOST = "host"       # not a cluster: this machine, calibrated (gd.simulate's default)

PRESETS = {c.name: c for c in (
    Cluster("p100-25gbe", "Horovod's benchmark servers (Sergeev & Del Balso 2018)",
            GPUS["P100"], 4, LINKS["pcie3"], LINKS["25gbe"]),
    Cluster("dgx1-v100", "NVIDIA DGX-1 with V100 (PyTorch's DDP benchmark)",
            GPUS["V100"], 8, LINKS["nvlink-v100"], LINKS["ib-edr"], 4),
    Cluster("dgx-a100", "NVIDIA DGX A100",
            GPUS["A100"], 8, LINKS["nvswitch-a100"], LINKS["ib-hdr"], 8),
)}


def preset(name: str) -> Cluster | None:
    """The cluster called `name` (None for "host": this machine, calibrated), or a
    ValueError naming the presets."""
    if name == HOST:
        return None
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--preset {name!r}: no such cluster; have {', '.join(names())} "
                         "(--preset list describes them)") from None


def names() -> list[str]:
    return [*PRESETS, HOST]


def describe() -> str:
    """`graphdist simulate --preset list`: one line per preset."""
    return "\n".join([c.line() for c in PRESETS.values()]
                     + [f"{HOST:<13} this machine: per-op costs calibrated here, the step "
                        "measured (the default)"])


__all__ = ["COMPUTE_EFFICIENCY", "GPU", "GPUS", "HOST", "LINKS", "MEMORY_EFFICIENCY",
           "OP_OVERHEAD_S", "PRESETS", "Cluster", "LinkKind", "describe",
           "hierarchical_all_reduce", "names", "preset"]
