"""gd.simulate: the collective cost formulas, the link parser, the calibration file, and the
predictor through Python and `graphdist simulate` on tiny weak- and strong-scaling
builders."""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import graphdist as gd
from graphdist.cli import main
from graphdist.ir import ArrayType, Var
from graphdist.simulate import (
    COSTS,
    Link,
    _step_time,
    calibrate,
    format_table,
    hierarchical_cost,
    host_cost,
    load_calibration,
    mpi_cost,
    one_device_cost,
    parse_link,
    per_replica_batch,
    per_unit,
    ring_cost,
    shared_host_cost,
)

LINK = Link(latency=5e-6, bandwidth=25e9)
S = 8 * 2**20

BUILDER = '''
import numpy as np
import graphdist as gd

def build(n, per=8):
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        w = gd.Variable(np.full((4, 3), 0.1, np.float32), name="w")
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.square(x @ w))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x,)))

    x = np.ones((per * n, 4), np.float32)
    return step, (next(iter(strategy.experimental_distribute_dataset([x]))),)

def strong(n):
    return build(n, per=16 // n)
'''


@pytest.fixture(scope="module")
def cal_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.json"
    calibrate(path, repeat=2, mpi=False)
    return path


@pytest.fixture
def builder(tmp_path, monkeypatch):
    (tmp_path / "simbuild.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "simbuild", raising=False)
    import simbuild

    return simbuild


# ---------------------------------------------------------------- cost formulas


def test_ring_cost_is_the_textbook_formula():
    for n in (2, 3, 8, 1024):
        want = 2 * (n - 1) / n * S / 25e9 + 2 * (n - 1) * 5e-6
        assert ring_cost(n, S, LINK) == pytest.approx(want)
    assert ring_cost(1, S, LINK) == 0.0


def test_one_device_and_hierarchical_costs():
    assert one_device_cost(4, S, LINK) == pytest.approx(6 * (5e-6 + S / 25e9))
    # 8 devices in 2 groups of 4: 3 in, 1 leader exchange, 3 out
    assert hierarchical_cost(8, S, LINK, 2) == pytest.approx(7 * (5e-6 + S / 25e9))
    # 64 devices in 8 groups of 8: 7 + 7 + 7 messages
    assert hierarchical_cost(64, S, LINK, 8) == pytest.approx(21 * (5e-6 + S / 25e9))
    assert host_cost(4, S, LINK) == pytest.approx(5e-6 + 4 * S / 25e9)
    assert set(COSTS) >= {"ring", "one_device", "hierarchical", "host", "nccl"}


def test_ring_tends_to_twice_bytes_over_bandwidth_and_grows_with_n():
    free = Link(0.0, 25e9)
    costs = [ring_cost(n, S, free) for n in (2, 4, 64, 1024, 2**20)]
    assert costs == sorted(costs)
    assert costs[-1] == pytest.approx(2 * S / 25e9, rel=1e-5)
    assert all(c < 2 * S / 25e9 for c in costs)
    # with latency, large rings are latency-bound: a small payload is cheaper hierarchically
    assert hierarchical_cost(1024, 4096, LINK, 32) < ring_cost(1024, 4096, LINK)
    assert ring_cost(1024, 2**30, LINK) < hierarchical_cost(1024, 2**30, LINK, 32)


def test_shared_host_pays_every_copy():
    # 4 logical devices: the ring's 4 * 6 copies of S/4, one after another
    copy = Link(1e-6, 10e9)
    assert shared_host_cost("ring", 4, S, copy) == pytest.approx(6 * S / 10e9 + 24e-6)
    assert shared_host_cost("one_device", 4, S, copy) == one_device_cost(4, S, copy)
    assert shared_host_cost("ring", 1, S, copy) == 0.0


def test_overlap_of_an_early_collective_with_later_compute():
    ty = ArrayType((), np.dtype("float32"))
    a, b, c, d = (Var(ty, h, None) for h in "abcd")
    e = [SimpleNamespace(inputs=(), outputs=(a,)),       # gradient ready at t=1
         SimpleNamespace(inputs=(a,), outputs=(b,)),     # its all-reduce, 2 s
         SimpleNamespace(inputs=(), outputs=(c,)),       # 3 s of independent compute
         SimpleNamespace(inputs=(b, c), outputs=(d,))]   # the update reads both
    items = [(e[0], 1.0, False), (e[1], 2.0, True), (e[2], 3.0, False), (e[3], 1.0, False)]
    assert _step_time(items, serial=False) == pytest.approx(5.0)   # hidden
    assert _step_time(items, serial=True) == pytest.approx(7.0)    # serial
    items[1] = (e[1], 10.0, True)
    assert _step_time(items, serial=False) == pytest.approx(12.0)  # exposed


def test_mpi_cost_is_local_passes_plus_a_ring_between_workers():
    local = Link(1e-6, 10e9)
    # 1 device per worker: copy in + divide (4 S touched) + the ring among n workers
    assert mpi_cost(8, S, LINK, 1, local) == pytest.approx(
        2 * 7 / 8 * S / 25e9 + 14 * 5e-6 + 1e-6 + 4 * S / 10e9)
    # 16 devices, 4 per worker: 4 workers in the ring, 5*4-1 = 19 S touched locally
    assert mpi_cost(16, S, LINK, 4, local) == pytest.approx(
        ring_cost(4, S, LINK) + 1e-6 + 19 * S / 10e9)
    assert mpi_cost(2, S, LINK) == ring_cost(2, S, LINK)     # local passes free
    # the registry's mpi lowering prices its all-reduce with it
    assert COSTS["mpi"](16, S, LINK, 4, local) == mpi_cost(16, S, LINK, 4, local)


def test_every_collective_is_priced_by_its_lowering():
    """A logical eqn of each collective costs what its lowering's model says: the ring's
    reduce-scatter is half its all-reduce; all-gather and broadcast as their algorithms."""
    from graphdist.ops import OPS
    from graphdist.simulate.predict import _collective_seconds, _Costs

    x = Var(ArrayType((S // 4,), np.dtype("float32")), "x", None)
    costs = _Costs("ring", LINK, False, None, Link(0.0, math.inf))
    seconds = {name: _collective_seconds(SimpleNamespace(op=OPS[name], inputs=(x,)), 8, costs)
               for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}
    assert seconds["all_reduce"] == pytest.approx(ring_cost(8, S, LINK))
    assert seconds["reduce_scatter"] == pytest.approx(ring_cost(8, S, LINK) / 2)
    assert seconds["all_gather"] == pytest.approx(7 * (5e-6 + S / 25e9))
    assert seconds["broadcast"] == pytest.approx(3 * (5e-6 + S / 25e9))


def test_rate_by_size_interpolates_in_log_size():
    model = {"per_unit": 1.0, "by_size": [{"size": 1, "per_unit": 8.0},
                                          {"size": 16, "per_unit": 2.0},
                                          {"size": 256, "per_unit": 1.0}]}
    assert per_unit(model, 4) == pytest.approx(5.0)       # halfway in log
    assert per_unit(model, 1024) == 1.0 and per_unit(model, None) == 1.0
    assert per_unit({"per_unit": 3.0}, 8) == 3.0


# ---------------------------------------------------------------- the link parser


def test_parse_link():
    assert parse_link("latency=5us,bandwidth=25GB/s") == Link(5e-6, 25e9)
    assert parse_link("bandwidth=100Gb/s") == Link(5e-6, 12.5e9)
    assert parse_link("latency=1.5ms") == Link(1.5e-3, 25e9)


@pytest.mark.parametrize("text, words", [
    ("latency=5", "latency='5'"), ("bandwidth=fast", "bandwidth='fast'"),
    ("speed=1GB/s", "expected latency=TIME"), ("latency", "expected latency=TIME"),
    ("bandwidth=0GB/s", "must be positive")])
def test_bad_link_strings_raise_clear_errors(text, words):
    with pytest.raises(ValueError, match="--link") as e:
        parse_link(text)
    assert words in str(e.value)


# ---------------------------------------------------------------- the calibration file


def test_calibration_written_and_reused(cal_path, tmp_path, monkeypatch):
    no_mpi = {"latency": 1e-5, "bandwidth": 1e9, "measured": False}
    monkeypatch.setattr(sys.modules["graphdist.simulate.calibration"], "calibrate_mpi",
                        lambda repeat: no_mpi)            # no mpiexec from this test
    cal = json.loads(cal_path.read_text())
    assert [r["size"] for r in cal["ops"]["matmul"]["by_size"]] == [1, 4, 16, 64, 256]
    assert cal["links"]["mpi"]["measured"] is False and cal["links"]["mpi"]["bandwidth"] > 0
    assert cal["machine"]["cpu_count"] and cal["ops"]["matmul"]["per_unit"] > 0
    assert cal["links"]["copy"]["bandwidth"] > 0 and cal["node_overhead_s"] >= 0
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**cal, "date": "reused"}))
    assert load_calibration(path)["date"] == "reused"                  # read, not measured
    again = load_calibration(path, recalibrate=True)
    assert again["date"] != "reused" and again["links"]["mpi"] == no_mpi
    path.write_text(json.dumps({**cal, "date": "x", "machine": {"node": "elsewhere"}}))
    assert load_calibration(path)["date"] != "x"                       # another machine
    assert json.loads(path.read_text())["machine"] == cal["machine"]


# ---------------------------------------------------------------- the predictor


def test_python_form(builder, cal_path):
    rows = gd.simulate(builder.build, [1, 2, 64, 1024], calibration=cal_path, repeat=2)
    assert [r["devices"] for r in rows] == [1, 2, 64, 1024]
    for r in rows:
        assert set(r) >= {"devices", "step_s", "compute_s", "comm_s", "efficiency"}
        assert 0 < r["efficiency"] <= 1 and r["step_s"] >= r["compute_s"] > 0
    assert rows[0]["comm_s"] == 0 and rows[0]["efficiency"] == 1
    comm = [r["comm_s"] for r in rows]
    assert comm == sorted(comm) and comm[-1] > comm[1]
    # two collectives (the gradient, the loss) under the default link: ring, latency-bound
    assert rows[-1]["comm_s"] == pytest.approx(2 * ring_cost(1024, 48, LINK), rel=0.05)


def test_shared_host_and_lowerings(builder, cal_path):
    rows = gd.simulate(builder.build, [1, 4], cross_device_ops="one_device",
                       calibration=cal_path, shared_host=True, measure=False)
    assert rows[1]["compute_s"] == pytest.approx(4 * rows[0]["compute_s"])
    assert rows[1]["efficiency"] < 0.26
    ring = gd.simulate(builder.build, [64], "latency=1ms,bandwidth=1GB/s",
                       gd.RingAllReduce(), calibration=cal_path, measure=False)
    one = gd.simulate(builder.build, [64], "latency=1ms,bandwidth=1GB/s", "one_device",
                      calibration=cal_path, measure=False)
    assert one[0]["comm_s"] > ring[0]["comm_s"] > 2 * 2 * 63 * 1e-3 - 1e-9
    with pytest.raises(ValueError, match="no cost model"):
        gd.simulate(builder.build, [2], cross_device_ops="pigeon", calibration=cal_path,
                    measure=False)


def test_strong_scaling_builder_is_refused_under_weak_scaling(builder, cal_path):
    with pytest.raises(ValueError, match="weak scaling.*scaling='strong'"):
        gd.simulate(builder.strong, [1, 2], calibration=cal_path, measure=False)


@pytest.mark.parametrize("build", ["strong", "build"])
def test_strong_scaling(builder, cal_path, build):
    # the global batch is the builder's on 1 device (strong: 16, build: 8), whichever batch
    # it gives each of 2 devices (strong: 8, build: 8, cut to 4 and 2 for 2 and 4 devices)
    rows = gd.simulate(getattr(builder, build), [1, 2, 4, 16 if build == "strong" else 8],
                       scaling="strong", calibration=cal_path, measure=False)
    weak = gd.simulate(builder.build, [1, 16], calibration=cal_path, measure=False)
    compute = [r["compute_s"] for r in rows]
    assert compute == sorted(compute, reverse=True) and compute[-1] < compute[0]
    assert rows[0]["efficiency"] == 1 and rows[0]["comm_s"] == 0
    for r in rows[1:]:
        # the gradient all-reduce does not shrink with the batch
        assert r["comm_s"] == pytest.approx(2 * ring_cost(r["devices"], 48, LINK), rel=0.05)
        assert 0 < r["efficiency"] <= 1
        assert r["efficiency"] == pytest.approx(
            rows[0]["step_s"] / (r["devices"] * r["step_s"]))
    if build == "strong":                  # 1 example per replica < 8 of the weak builder's
        assert rows[-1]["compute_s"] < weak[1]["compute_s"]


def test_strong_scaling_batch_errors(builder, cal_path):
    assert per_replica_batch(512, 4) == 128
    with pytest.raises(ValueError, match="16 examples on 32 devices.*fewer than 1"):
        gd.simulate(builder.strong, [1, 32], scaling="strong", calibration=cal_path,
                    measure=False)
    with pytest.raises(ValueError, match="batch of 16 examples does not split evenly among "
                                         "3 devices"):
        gd.simulate(builder.strong, [3], scaling="strong", calibration=cal_path,
                    measure=False)
    with pytest.raises(ValueError, match="scaling must be"):
        gd.simulate(builder.strong, [2], scaling="sideways", calibration=cal_path)


def test_mpi_lowering_uses_the_calibrated_mpi_link_and_no_overlap(builder, cal_path):
    cal = json.loads(cal_path.read_text())
    mpi = Link(cal["links"]["mpi"]["latency"], cal["links"]["mpi"]["bandwidth"])
    rows = gd.simulate(builder.build, [1, 4], cross_device_ops="mpi", calibration=cal_path,
                       measure=False)
    assert rows[1]["comm_s"] > 2 * ring_cost(4, 48, mpi)
    assert rows[1]["step_s"] == pytest.approx(rows[1]["compute_s"] + rows[1]["comm_s"])
    with pytest.raises(ValueError, match="devices_per_worker"):
        gd.simulate(builder.build, [2], cross_device_ops="mpi", shared_host=True,
                    calibration=cal_path, measure=False)


def test_cli_json(builder, cal_path, capsys):
    assert main(["simulate", "simbuild:build", "--devices", "1,2,8", "--json",
                 "--calibration", str(cal_path), "--link", "latency=2us,bandwidth=10GB/s"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["devices"] for r in rows] == [1, 2, 8]
    assert all(set(r) >= {"devices", "step_s", "compute_s", "comm_s", "efficiency"}
               for r in rows)
    assert rows[2]["comm_s"] == pytest.approx(2 * ring_cost(8, 48, Link(2e-6, 10e9)), rel=0.05)
    assert main(["simulate", "simbuild:build", "--devices", "1,4",
                 "--calibration", str(cal_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("link: ")
    assert "efficiency" in out.splitlines()[1] and len(out.splitlines()) == 4


def test_cli_strong_scaling_json(builder, cal_path, capsys):
    assert main(["simulate", "simbuild:strong", "--devices", "1,2,4", "--scaling", "strong",
                 "--json", "--calibration", str(cal_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["devices"] for r in rows] == [1, 2, 4]
    assert all(set(r) >= {"devices", "step_s", "compute_s", "comm_s", "efficiency"}
               for r in rows)
    assert rows[2]["compute_s"] < rows[0]["compute_s"] and rows[2]["efficiency"] <= 1
    assert main(["simulate", "simbuild:strong", "--devices", "5", "--scaling", "strong",
                 "--calibration", str(cal_path)]) == 2
    assert "does not split evenly among 5 devices" in capsys.readouterr().err


def test_cli_bad_link(builder, cal_path, capsys):
    assert main(["simulate", "simbuild:build", "--link", "latency=fast",
                 "--calibration", str(cal_path)]) == 2
    err = capsys.readouterr().err
    assert "graphdist simulate: --link: latency='fast'" in err and "5us" in err
    assert math.isfinite(ring_cost(2, 1, LINK))


# ---------------------------------------------------------------- what a prediction assumed


ASSUMED = {"lowering", "lowering_from", "link_latency_s", "link_bandwidth_Bps", "link_from"}


def test_rows_say_the_default_link_and_the_lowering_they_assumed(builder, cal_path, capsys):
    rows = gd.simulate(builder.build, [1, 64], calibration=cal_path, measure=False)
    for r in rows:
        assert set(r) == {"devices", "step_s", "compute_s", "comm_s", "efficiency",
                          "exposed_comm_s", "overlap"} | ASSUMED
        assert (r["link_latency_s"], r["link_bandwidth_Bps"]) == (5e-6, 25e9)
        assert r["link_from"] == "default"
        # logical CPU devices all-reduce with the host's fused pass: priced as a ring
        assert r["lowering"] == "ring" and "host's fused all-reduce" in r["lowering_from"]
    assert main(["simulate", "simbuild:build", "--devices", "1,64",
                 "--calibration", str(cal_path)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("link: latency 5 us, bandwidth 25 GB/s (default); lowering: ring "
                           "(the builder's step uses the host's fused all-reduce"), head
    assert main(["simulate", "simbuild:build", "--devices", "1,64", "--json",
                 "--calibration", str(cal_path)]) == 0
    json_rows = json.loads(capsys.readouterr().out)
    assert [r["link_from"] for r in json_rows] == ["default", "default"]
    assert json_rows[1]["lowering"] == "ring"


def test_table_says_a_given_link_and_lowering(builder, cal_path, capsys):
    assert main(["simulate", "simbuild:build", "--devices", "1,16", "--calibration",
                 str(cal_path), "--link", "latency=2us,bandwidth=10GB/s",
                 "--cross-device-ops", "hierarchical"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head == ("link: latency 2 us, bandwidth 10 GB/s (given); "
                    "lowering: hierarchical, sqrt(n) groups (given); overlap: on (each "
                    "bucket's all-reduce from its last gradient)")
    [row] = gd.simulate(builder.build, [16], "latency=1ms,bandwidth=800Mb/s",
                        gd.HierarchicalCopyAllReduce(num_groups=4), calibration=cal_path,
                        measure=False)
    assert (row["link_latency_s"], row["link_bandwidth_Bps"]) == (1e-3, 1e8)
    assert (row["lowering"], row["num_groups"]) == ("hierarchical", 4)
    assert row["lowering_from"] == "given: HierarchicalCopyAllReduce"
    assert format_table([row]).splitlines()[0] == (
        "link: latency 1 ms, bandwidth 100 MB/s (given); "
        "lowering: hierarchical, 4 groups (given: HierarchicalCopyAllReduce); overlap: on "
        "(each bucket's all-reduce from its last gradient)")


def test_rows_say_a_calibrated_link(builder, cal_path):
    cal = json.loads(cal_path.read_text())
    [shared] = gd.simulate(builder.build, [4], cross_device_ops="one_device",
                           calibration=cal_path, shared_host=True, measure=False)
    copy = cal["links"]["copy"]
    assert shared["link_latency_s"] == pytest.approx(copy["latency"] + cal["node_overhead_s"])
    assert shared["link_bandwidth_Bps"] == pytest.approx(copy["bandwidth"])
    assert "this host's memory copy, calibrated" in shared["link_from"]
    [mpi] = gd.simulate(builder.build, [4], cross_device_ops="mpi", calibration=cal_path,
                        measure=False)
    assert (mpi["lowering"], mpi["lowering_from"]) == ("mpi", "given")
    assert mpi["link_bandwidth_Bps"] == pytest.approx(cal["links"]["mpi"]["bandwidth"])
    assert "MPI could not be measured here" in mpi["link_from"]   # calibrate(mpi=False)
