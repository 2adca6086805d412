"""graphdist.viz: the networkx, DOT, HTML and summary views agree with the graph they show."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import networkx as nx
import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import ArrayType, Eqn, Graph, Var
from graphdist.ops.core import OPS
from graphdist.viz.html import render
from graphdist.viz.layout import layout
from graphdist.viz.model import read
from graphdist.viz.summary import stats

F32 = np.dtype("float32")


def tiny() -> Graph:
    """Two replicas of x @ w, then a sum through explicit copies (as RingAllReduce lowers)."""
    ty_x, ty_w, ty_h = ArrayType((4, 3), F32), ArrayType((3, 2), F32), ArrayType((4, 2), F32)
    x0, x1 = Var(ty_x, "x", "cpu:0"), Var(ty_x, "x", "cpu:1")
    w0, w1 = Var(ty_w, "w", "cpu:0"), Var(ty_w, "w", "cpu:1")
    h0, h1 = Var(ty_h, "h", "cpu:0"), Var(ty_h, "h", "cpu:1")
    c, s, s1 = Var(ty_h, None, "cpu:0"), Var(ty_h, "s", "cpu:0"), Var(ty_h, "s", "cpu:1")
    eqns = (
        Eqn(OPS["matmul"], (x0, w0), (h0,), device="cpu:0", scope="dense"),
        Eqn(OPS["matmul"], (x1, w1), (h1,), device="cpu:1", scope="dense"),
        Eqn(OPS["copy_to"], (h1,), (c,), (("device", "cpu:0"),), "cpu:0", "collectives"),
        Eqn(OPS["add"], (h0, c), (s,), device="cpu:0", scope="collectives"),
        Eqn(OPS["copy_to"], (s,), (s1,), (("device", "cpu:1"),), "cpu:1", "collectives"),
    )
    return Graph((x0, x1, w0, w1), eqns, (s, s1), devices=("cpu:0", "cpu:1"))


def chain(layers: int, devices=()) -> Graph:
    """`layers` x (matmul, tanh), each pair in scope layer{i}, on every device."""
    ty = ArrayType((64, 64), F32)
    inputs, eqns, outputs = [], [], []
    for d in devices or (None,):
        x, w = Var(ty, "x", d), Var(ty, "w", d)
        inputs += [x, w]
        h = x
        for i in range(layers):
            y, z = Var(ty, None, d), Var(ty, None, d)
            eqns.append(Eqn(OPS["matmul"], (h, w), (y,), device=d, scope=f"layer{i}"))
            eqns.append(Eqn(OPS["tanh"], (y,), (z,), device=d, scope=f"layer{i}"))
            h = z
        outputs.append(h)
    return Graph(tuple(inputs), tuple(eqns), tuple(outputs), devices=tuple(devices))


@pytest.fixture(scope="module")
def step():
    """The example's step as per-device copies (the views' lanes and collectives)."""
    from graphdist.examples import mlp_digits

    gd.config.set_device_concurrency("sequential")
    try:
        return mlp_digits.train(devices=4, steps=1)["train_step"]
    finally:
        gd.config.set_device_concurrency("auto")


def graphs(step):
    return [tiny(), step.graph, step.replicated_graph]


def producer_pairs(g: Graph) -> set:
    """(producer, consumer) pairs straight from the IR: ("in", k) or ("eqn", i)."""
    made = {v: ("in", k) for k, v in enumerate(g.inputs)}
    pairs = set()
    for i, eqn in enumerate(g.eqns):
        for x in eqn.inputs:
            if isinstance(x, Var) and x in made:
                pairs.add((made[x], ("eqn", i)))
        made.update((v, ("eqn", i)) for v in eqn.outputs)
    return pairs


# ---------------------------------------------------------------- networkx


def test_networkx_agrees_with_the_graph(step):
    for g in graphs(step):
        d = g.to_networkx()
        assert isinstance(d, nx.DiGraph) and nx.is_directed_acyclic_graph(d)
        assert d.number_of_nodes() == len(g.inputs) + len(g.eqns)
        assert d.number_of_edges() == len(producer_pairs(g))
        by_index = {a["index"]: a for _, a in d.nodes(data=True) if a["index"] is not None}
        for i, eqn in enumerate(g.eqns):
            a = by_index[i]
            assert (a["op"], a["device"], a["scope"]) == (str(eqn.op), eqn.device, eqn.scope)
            if eqn.outputs:
                assert a["shape"] == eqn.outputs[0].ty.shape
                assert a["dtype"] == str(eqn.outputs[0].ty.dtype)
            assert a["flops"] >= 0 and a["bytes"] >= 0
        for _, _, e in d.edges(data=True):
            assert e["name"] and e["shape"] is not None


def test_networkx_uses_the_text_form_names(step):
    from graphdist.ir import graph_text

    g = step.replicated_graph
    try:
        text = graph_text(g, None, fold=False)   # every replica spelled out
    except TypeError:
        text = graph_text(g, None)
    d = g.to_networkx()
    for key, a in d.nodes(data=True):
        for name, ty in zip(a["outputs"], a["type"].split(" ")):
            assert f"{name}:{ty}" in text, name
    devices = {a["device"] for _, a in d.nodes(data=True)}
    assert devices == set(g.devices)


def test_networkx_tiny_edges_and_devices():
    d = tiny().to_networkx()
    assert d.nodes["h@0"]["device"] == "cpu:0" and d.nodes["h@1"]["device"] == "cpu:1"
    copy = next(k for k, a in d.nodes(data=True) if a["op"] == "copy_to" and a["device"] == "cpu:0")
    assert d.nodes[copy]["kind"] == "copy" and d.nodes[copy]["moved"] == 32
    e = d.edges["h@1", copy]
    assert (e["name"], e["shape"], e["cross_device"]) == ("h@1", (4, 2), True)


# ---------------------------------------------------------------- DOT


def test_dot_has_one_cluster_per_device(step):
    for g in (tiny(), step.replicated_graph):
        text = g.to_dot()
        clusters = re.findall(r'subgraph "cluster_dev(\d+)" \{\n\s*label="([^"]+)"', text)
        assert [label for _, label in clusters] == list(g.devices)
        assert text.count(" -> ") == len(read(g).edges)
    assert "cluster_dev" not in step.graph.to_dot()          # logical: no devices
    text = step.replicated_graph.to_dot()
    fused = [line for line in text.splitlines() if "host_all_reduce" in line and "[label" in line]
    assert fused and all("#c2255c" in line for line in fused)   # collectives styled apart
    assert 'shape="cds"' in tiny().to_dot()                      # and copies too


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz is not installed")
def test_dot_is_valid_graphviz(step):
    out = subprocess.run(["dot", "-Tsvg"], input=step.replicated_graph.to_dot(), text=True,
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- HTML


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.urls, self.data, self._in = [], [], None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a.get("id")))
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        self._in = a.get("id")

    def handle_data(self, data):
        if self._in == "graph-data":
            self.data = json.loads(data)
        self._in = None


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


def test_html_is_self_contained_and_shows_every_lane(step, tmp_path):
    g = step.replicated_graph
    path = g.to_html(tmp_path / "step.html")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    page = parse(text)
    assert ("canvas", "view") in page.tags and ("input", "search") in page.tags
    assert page.urls == []
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.IGNORECASE)
    assert "@import" not in text and not re.search(r"url\(\s*['\"]?(https?:)?//", text)
    data = page.data
    assert data["lanes"] == list(g.devices)
    assert len(data["n"]["kind"]) == len(g.inputs) + len(g.eqns)
    kinds = {data["kinds"][k] for k in data["n"]["kind"]}
    assert "collective" in kinds
    ops = {data["strings"][k] for k in data["n"]["op"]}
    assert "host_all_reduce_start" in ops and "collective_wait" in ops     # overlapped
    lanes_used = set(data["item"]["lane"][: data["nodes"]])
    assert lanes_used == set(range(len(g.devices)))


def test_html_copies_are_marked_and_logical_graph_has_one_lane(step):
    data = parse(render(tiny())).data
    kinds = [data["kinds"][k] for k in data["n"]["kind"]]
    assert kinds.count("copy") == 2 and kinds.count("collective") == 1
    assert parse(render(step.graph)).data["lanes"] == ["logical"]


def assert_edges_go_right(g: Graph) -> None:
    """At the level where an edge is drawn (its endpoints' innermost common group), the
    source's column is left of the target's: the layout is a proper layering."""
    view = read(g)
    lay = layout(view)

    def chain_of(i):
        out = [i]
        while lay.parent[out[-1]] != -1:
            out.append(lay.parent[out[-1]])
        return out[::-1]

    for src, dst, _, _ in view.edges:
        a, b = chain_of(src), chain_of(dst)
        k = 0
        while a[k] == b[k]:
            k += 1
        assert lay.col[a[k]] < lay.col[b[k]], (view.nodes[src].name, view.nodes[dst].name)
    for i, p in enumerate(lay.parent):   # groups are lane-local
        if p != -1:
            assert lay.lane[i] == lay.lane[p]


def test_layout_is_layered_with_scopes_and_stacks(step):
    for g in (tiny(), step.graph, step.replicated_graph, chain(50, ("cpu:0", "cpu:1"))):
        assert_edges_go_right(g)
    lay = layout(read(step.replicated_graph))
    assert any(lay.stack) and "dense1" in lay.label


def test_layout_breaks_a_scope_that_another_lane_splits():
    """cpu:0 runs a, b in scope s, but b needs a value that went through cpu:1: a box around
    a and b would make a cycle, so the scope is not drawn as one box."""
    ty = ArrayType((2,), F32)
    x = Var(ty, "x", "cpu:0")
    a, c, d, b = (Var(ty, n, dev) for n, dev in
                  (("a", "cpu:0"), ("c", "cpu:1"), ("d", "cpu:0"), ("b", "cpu:0")))
    eqns = (Eqn(OPS["neg"], (x,), (a,), device="cpu:0", scope="s"),
            Eqn(OPS["copy_to"], (a,), (c,), (("device", "cpu:1"),), "cpu:1"),
            Eqn(OPS["copy_to"], (c,), (d,), (("device", "cpu:0"),), "cpu:0"),
            Eqn(OPS["neg"], (d,), (b,), device="cpu:0", scope="s"))
    g = Graph((x,), eqns, (b,), devices=("cpu:0", "cpu:1"))
    assert_edges_go_right(g)
    assert layout(read(g)).label == []


def test_html_for_10k_nodes_is_small():
    text = render(chain(5000))
    assert len(text.encode()) < 5_000_000
    data = parse(text).data
    assert len(data["n"]["kind"]) == 10002
    assert sum(data["g"]["open"]) == 0 and len(data["g"]["label"]) == 5000  # scopes start closed


# ---------------------------------------------------------------- summary


def test_summary_matches_hand_counts():
    s = stats(tiny())
    assert s["ops"] == {"cpu:0": {"matmul": 1, "copy_to": 1, "add": 1},
                        "cpu:1": {"matmul": 1, "copy_to": 1}}
    assert s["flops"] == {"cpu:0": 2 * 4 * 2 * 3 + 8, "cpu:1": 2 * 4 * 2 * 3}
    # cpu:0 holds h@0, the copy and s at once; cpu:1 never more than one 4x2 f32
    assert s["peak_bytes"] == {"cpu:0": 96, "cpu:1": 32}
    [coll] = s["collectives"]
    assert (coll["payload"], coll["moved"]) == (32, 64)
    assert coll["ops"] == {"copy_to": 2, "add": 1}
    text = tiny().summary()
    for needle in ("cpu:0", "cpu:1", "matmul", "copy_to", "56", "48", "96", "64"):
        assert needle in text


def test_summary_counts_every_tensor_of_a_list_all_reduce():
    # one collective node over several tensors reports the bytes of all of them
    ty_w, ty_b = ArrayType((64, 32), F32), ArrayType((32,), F32)
    w, b = Var(ty_w, "dw"), Var(ty_b, "db")
    rw, rb = Var(ty_w, "gw"), Var(ty_b, "gb")
    logical = Graph((w, b), (Eqn(OPS["all_reduce"], (w, b), (rw, rb), (("op", "mean"),)),),
                    (rw, rb))
    [coll] = stats(logical)["collectives"]
    assert coll["payload"] == ty_w.nbytes + ty_b.nbytes == 8320
    assert coll["type"] == "f32[64,32], f32[32]"
    assert "8,320" in logical.summary()
    # placed: one fused node reading both tensors of each of two replicas
    devices = ("cpu:0", "cpu:1")
    ins = [Var(ty, name, d) for d in devices for ty, name in ((ty_w, "dw"), (ty_b, "db"))]
    outs = [Var(v.ty, "g" + v.hint[1:], v.device) for v in ins]
    placed = Graph(tuple(ins), (Eqn(OPS["host_all_reduce"], tuple(ins), tuple(outs),
                                    (("op", "sum"),), "cpu:0", "collectives"),),
                   tuple(outs), devices=devices)
    [coll] = stats(placed)["collectives"]
    assert coll["payload"] == 8320, "per replica: both tensors, not one, not both replicas'"


def test_summary_of_the_example(step):
    from graphdist.passes.schedule import liveness

    g, rg = step.graph, step.replicated_graph
    assert stats(g)["peak_bytes"] == {None: liveness(g).peak_bytes}
    s = stats(rg)
    assert set(s["ops"]) == set(rg.devices)
    assert sum(sum(c.values()) for c in s["ops"].values()) == len(rg.eqns)
    assert len(s["collectives"]) == 2 and all(c["moved"] > 0 for c in s["collectives"])
    text = rg.summary()
    assert "host_all_reduce" in text and "peak live bytes" in text
    assert all(d in text for d in rg.devices)


# ---------------------------------------------------------------- a real browser


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="the `chromium` command is not installed, so the viewer is not "
                           "checked in a real browser (Debian: apt-get install chromium; "
                           ".ci/run installs it)")
def test_page_renders_in_headless_chromium(step, tmp_path):
    path = step.replicated_graph.to_html(tmp_path / "step.html")
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=3000", "--dump-dom", f"file://{path}#q=host_all_reduce"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    assert 'data-ready="1"' in body.group(0) and "data-error" not in body.group(0)
