"""gd.simulate on described clusters (simulate/presets.py): the preset list, the roofline per
op, the hierarchical all-reduce, overlap on and off, and a published table (PyTorch's DDP
benchmark on DGX-1 V100) predicted from ResNet-50 built with graphdist's layers."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

import graphdist as gd
from bench.cnn_zoo import builder, resnet_logits
from graphdist.cli import main
from graphdist.ir import ArrayType, Var
from graphdist.simulate import presets
from graphdist.simulate.link import Link
from graphdist.simulate.predict import overlap_order, roofline_seconds
from graphdist.simulate.presets import (COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY,
                                        OP_OVERHEAD_S, PRESETS, WINOGRAD_SPEEDUP)


def tiny_resnet(n):
    """A ResNet of 2 bottleneck blocks, width 8, on 32x32 images, 4 per replica."""
    return builder(None, 4, image=32,
                   logits=lambda L, x: resnet_logits(L, x, (1, 1), width=8, classes=10))(n)


def test_preset_list_names_every_cluster_with_one_line(capsys):
    assert main(["simulate", "--preset", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [*PRESETS, "host"]
    assert {"p100-25gbe", "dgx1-v100", "dgx-a100"} <= set(PRESETS)
    p100 = PRESETS["p100-25gbe"]
    assert (p100.gpus_per_node, p100.node_link.name, p100.network.name) == (
        4, "PCIe 3.0 x16", "25 Gbit/s Ethernet (RoCE)")
    assert "V100" in lines[1] and "NVLink" in lines[1] and "InfiniBand" in lines[1]


def test_an_unknown_preset_is_refused_by_name(capsys):
    assert main(["simulate", "bench.cnn_zoo:resnet50", "--preset", "tpu-pod"]) == 2
    err = capsys.readouterr().err
    assert "'tpu-pod'" in err and "p100-25gbe" in err and "--preset list" in err


def _eqn(op, ins, outs, **params):
    ty = lambda s: Var(ArrayType(s, np.dtype("float32")), None, None)   # noqa: E731
    return SimpleNamespace(op=op, inputs=tuple(map(ty, ins)), outputs=tuple(map(ty, outs)),
                           params=tuple(params.items()))


def test_roofline_of_a_matmul_and_of_an_add_by_hand():
    from graphdist.ops import OPS

    v100 = presets.GPUS["V100"]
    # (256 x 1024) @ (1024 x 512): compute-bound
    mm = _eqn(OPS["matmul"], [(256, 1024), (1024, 512)], [(256, 512)])
    flops = 2 * 256 * 1024 * 512
    assert roofline_seconds(mm, v100) == pytest.approx(
        OP_OVERHEAD_S + flops / (15.7e12 * COMPUTE_EFFICIENCY["matmul"]))
    # an add of two 4M-element vectors: memory-bound, 3 x 16 MiB touched
    add = _eqn(OPS["add"], [(2**22,), (2**22,)], [(2**22,)])
    assert roofline_seconds(add, v100) == pytest.approx(
        OP_OVERHEAD_S + 3 * 2**24 / (900e9 * MEMORY_EFFICIENCY))
    # the same add fused into a chain that moves only 1 x 16 MiB
    assert roofline_seconds(add, v100, nbytes=2**24) == pytest.approx(
        OP_OVERHEAD_S + 2**24 / (900e9 * MEMORY_EFFICIENCY))


def test_a_3x3_stride_1_convolution_runs_winograd():
    from graphdist.ops import OPS

    gpu = presets.GPU("test", 1e12, 1e15)          # compute-bound throughout
    x, out = (8, 32, 32, 64), (8, 32, 32, 64)
    macs = 8 * 32 * 32 * 64 * 3 * 3 * 64
    params = dict(strides=(1, 1), padding="SAME", dilations=(1, 1))
    conv = _eqn(OPS["conv2d"], [x, (3, 3, 64, 64)], [out], **params)
    rate = 1e12 * COMPUTE_EFFICIENCY["matmul"]
    assert roofline_seconds(conv, gpu) == pytest.approx(
        OP_OVERHEAD_S + 2 * macs / WINOGRAD_SPEEDUP / rate)
    strided = _eqn(OPS["conv2d"], [x, (3, 3, 64, 64)], [(8, 16, 16, 64)],
                   **{**params, "strides": (2, 2)})
    assert roofline_seconds(strided, gpu) == pytest.approx(OP_OVERHEAD_S + 2 * macs / 4 / rate)


def test_hierarchical_all_reduce_is_the_formula():
    dgx = PRESETS["dgx1-v100"]
    s = 100e6
    nvlink, ib = dgx.node_link.link, dgx.network.link
    node_bw = 4 * ib.bandwidth                    # 4 ports per node
    # one node of 8: the ring over NVLink
    assert dgx.all_reduce_seconds(8, s) == pytest.approx(
        2 * 7 / 8 * s / nvlink.bandwidth + 14 * nvlink.latency)
    # 4 nodes of 8: reduce-scatter + all-gather in the node, S/8 between 4 nodes on B/8 each
    inside = 2 * (7 / 8 * s / nvlink.bandwidth + 7 * nvlink.latency)
    between = 2 * 3 / 4 * (s / 8) / (node_bw / 8) + 2 * 3 * ib.latency
    assert dgx.all_reduce_seconds(32, s) == pytest.approx(inside + between)
    assert dgx.all_reduce_seconds(1, s) == 0.0
    assert dgx.collective_seconds("reduce_scatter", 32, s) == pytest.approx(
        (inside + between) / 2)
    # the network's share falls with more GPUs per node
    fat = dataclasses.replace(dgx, gpus_per_node=16)
    assert fat.all_reduce_seconds(64, s) < dgx.all_reduce_seconds(64, s)


def test_overlap_order_starts_a_bucket_before_the_rest_of_the_backward():
    """Hand-made: gradient g1 is ready after the first backward op; its bucket (reshape,
    concat, all_reduce) moves ahead of the second backward op; compute keeps its order."""
    from graphdist.ops import OPS

    ty = ArrayType((4,), np.dtype("float32"))
    x, g1, g2, r, c, a = (Var(ty, h, None) for h in ("x", "g1", "g2", "r", "c", "a"))
    e = lambda op, ins, outs: SimpleNamespace(op=OPS[op], inputs=ins, outputs=outs,  # noqa: E731
                                              params=())
    eqns = [e("neg", (x,), (g1,)), e("exp", (x,), (g2,)), e("reshape", (g1,), (r,)),
            e("concat", (r,), (c,)), e("all_reduce", (c,), (a,))]
    got = [q.op.name for q in overlap_order(eqns)]
    assert got == ["neg", "reshape", "concat", "all_reduce", "exp"]


def test_overlap_hides_communication_that_no_overlap_exposes():
    on = gd.simulate(tiny_resnet, [1, 8, 64], preset="p100-25gbe")
    off = gd.simulate(tiny_resnet, [1, 8, 64], preset="p100-25gbe", overlap=False)
    assert on[0]["step_s"] == off[0]["step_s"] == on[0]["compute_s"]
    for a, b in zip(on[1:], off[1:]):
        assert a["overlap"] and not b["overlap"]
        assert a["comm_s"] == pytest.approx(b["comm_s"]) and a["comm_s"] > 0
        assert b["step_s"] == pytest.approx(b["compute_s"] + b["comm_s"])    # serial
        assert b["exposed_comm_s"] == pytest.approx(b["comm_s"])
        assert a["step_s"] < b["step_s"] and a["exposed_comm_s"] < a["comm_s"]
        assert a["efficiency"] > b["efficiency"]


def test_prediction_rises_with_network_bandwidth():
    base = PRESETS["p100-25gbe"]
    efficiencies = []
    for gbps in (1, 3, 10, 30, 100):
        cluster = dataclasses.replace(base, network=dataclasses.replace(
            base.network, link=Link(base.network.link.latency, gbps * 1e9)))
        [row] = gd.simulate(tiny_resnet, [32], preset=cluster)
        efficiencies.append(row["efficiency"])
    assert efficiencies == sorted(efficiencies) and efficiencies[0] < efficiencies[-1]


def test_resnet50_on_two_dgx1_within_10_points_of_the_ddp_benchmark():
    """pytorch/pytorch benchmarks/distributed/ddp/README.md: ResNet-50, batch 32 per GPU,
    329 images/s on one V100 (no DDP), 306 per GPU on 16 (2 DGX-1, p50): 93.0%."""
    rows = gd.simulate(builder("resnet50", 32), [1, 16], preset="dgx1-v100")
    assert rows[1]["efficiency"] == pytest.approx(306 / 329, abs=0.10)
    assert 32 / rows[0]["step_s"] == pytest.approx(329, rel=0.15)   # the roofline's anchor


def test_cli_preset_and_no_overlap_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "tinynet.py").write_text(
        "from bench.cnn_zoo import builder, resnet_logits\n"
        "build = builder(None, 4, image=32, logits=lambda L, x: resnet_logits(\n"
        "    L, x, (1, 1), width=8, classes=10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tinynet", raising=False)
    assert main(["simulate", "tinynet:build", "--preset", "dgx1-v100", "--devices", "1,16",
                 "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert main(["simulate", "tinynet:build", "--preset", "dgx1-v100", "--devices", "1,16",
                 "--json", "--no-overlap"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in on] == ["dgx1-v100"] * 2
    assert (on[1]["overlap"], off[1]["overlap"]) == (True, False)
    assert off[1]["step_s"] == pytest.approx(off[1]["compute_s"] + off[1]["comm_s"])
    assert main(["simulate", "tinynet:build", "--preset", "dgx1-v100", "--devices", "16"]) == 0
    head, columns, row = capsys.readouterr().out.splitlines()
    assert head.startswith("preset: dgx1-v100 NVIDIA DGX-1") and "overlap: on" in head
    assert columns.split()[-3:] == ["exposed", "ms", "efficiency"]
    assert float(row.split()[4]) == pytest.approx(1e3 * on[1]["exposed_comm_s"], abs=1e-3)


def test_calibrated_prediction_without_overlap_is_serial(tmp_path):
    from graphdist.simulate import calibrate

    calibrate(tmp_path / "cal.json", repeat=1, mpi=False)
    kw = dict(calibration=tmp_path / "cal.json", measure=False, link="latency=5us,bandwidth=1GB/s")
    on = gd.simulate(tiny_resnet, [8], **kw)[0]
    off = gd.simulate(tiny_resnet, [8], overlap=False, **kw)[0]
    assert (on["overlap"], off["overlap"]) == (True, False)
    assert off["step_s"] == pytest.approx(off["compute_s"] + off["comm_s"])
    assert on["step_s"] < off["step_s"] and on["comm_s"] == pytest.approx(off["comm_s"])
