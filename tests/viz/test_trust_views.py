"""Views and measurements that tell the truth (issue 21, item 5): the progress bar's rate is
the current one, the HTML header and g.summary() count collectives alike, and a hostile
name cannot end the viewer's embedded data early."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from graphdist.progress import ProgressBar
from graphdist.viz.html import page_data, render
from graphdist.viz.summary import stats

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_VARIABLE = "w<!--<script"
HOSTILE_SCOPE = "</script><!--<script>"


# ---------------------------------------------------------------- the progress bar


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rates(text: str) -> list[float]:
    return [float(r) for r in re.findall(r"([\d.]+) steps/s", text)]


def test_progress_rate_leaves_out_the_compile_once_steps_follow():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(100, stream=out, clock=clock)
    clock.now += 2.0 + 10 * 0.001            # first call: 2 s to compile, then 10 steps
    bar.update(10)
    for done in range(20, 101, 10):          # then 10 steps every 10 ms: 1000 steps/s
        clock.now += 0.01
        bar.update(done)
    shown = rates(out.getvalue())
    assert len(shown) == 10
    assert shown[0] == pytest.approx(round(10 / 2.01, 1))   # only the first call so far
    # an average since the start would read 20 / 2.02 = 9.9, ..., 100 / 2.1 = 47.6
    assert shown[1:] == [pytest.approx(1000.0)] * 9


def test_progress_rate_follows_a_change_of_speed():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(400, stream=out, clock=clock, window=5)
    bar.update(0)
    for done in range(1, 401):
        clock.now += 0.001 if done <= 200 else 0.01        # 1000/s, then 100/s
        bar.update(done)
        if done == 200:
            assert bar.rate() == pytest.approx(1000.0)
    assert bar.rate() == pytest.approx(100.0)
    assert rates(out.getvalue())[-1] == pytest.approx(100.0)


# ---------------------------------------------------------------- counting collectives


def replicated_step(cross_device_ops):
    """A 4-device training step with two all-reduces in its logical graph: the gradients of
    three variables (one bucket) and the loss."""
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)],
                                   cross_device_ops=cross_device_ops)
    with strategy.scope():
        ws = [gd.Variable(np.full((4, 3), 0.1 * (i + 1), np.float32), name=f"w{i}")
              for i in range(3)]
        optimizer = gd.optimizers.SGD(0.1)

    def replica_fn(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(x @ ws[0] + x @ ws[1] + x @ ws[2]))
        optimizer.apply_gradients(zip(tape.gradient(loss, ws), ws))
        return loss

    @gd.function
    def step(x):
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x,)))

    x = np.arange(64, dtype=np.float32).reshape(16, 4) / 64
    step(next(iter(strategy.experimental_distribute_dataset([x]))))
    return step


def header_counts(g) -> tuple[int, int]:
    found = re.search(r"(\d+) collectives? \((\d+) nodes\)", page_data(g)["stats"])
    assert found, page_data(g)["stats"]
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("cross_device_ops", [
    None, gd.RingAllReduce(), gd.HierarchicalCopyAllReduce(num_groups=2),
    gd.ReductionToOneDevice()], ids=["host", "ring", "hierarchical", "one_device"])
def test_header_and_summary_count_one_collective_per_logical_one(cross_device_ops):
    step = replicated_step(cross_device_ops)
    logical = [e for e in step.graph.eqns if e.op.collective]
    assert [e.op.name for e in logical] == ["all_reduce", "all_reduce"]
    g = step.replicated_graph
    s = stats(g)
    count, nodes = header_counts(g)
    assert count == len(s["collectives"]) == len(logical)
    assert nodes == s["collective_nodes"] == sum(len(c["nodes"]) for c in s["collectives"])
    # every node of a lowering is in exactly one collective
    lowered = [e for e in g.eqns if e.scope == "collectives" or e.op.name == "copy_to"]
    assert nodes >= len(lowered) and (cross_device_ops is None or nodes > 2)
    assert f"collectives: {count} ({nodes} nodes)" in g.summary()
    moved = sum(c["moved"] for c in s["collectives"])
    assert s["moved"] == moved and re.search(r" · (.+) moved$", page_data(g)["stats"])


# ---------------------------------------------------------------- hostile names


@pytest.fixture(scope="module")
def hostile_graph():
    w = gd.Variable(np.ones((3, 2), np.float32), name=HOSTILE_VARIABLE)
    b = gd.Variable(np.float32(1.0), name="a&b\u2028c\u2029d>e")

    @gd.function
    def f(x):
        with gd.name_scope(HOSTILE_SCOPE):
            return gd.reduce_sum(x @ w) + b

    f(np.ones((4, 3), np.float32))
    return f.graph


def embedded_data(text: str) -> str:
    start = text.index('<script id="graph-data" type="application/json">')
    start = text.index(">", start) + 1
    return text[start:text.index("</script>", start)]


def test_embedded_data_escapes_what_would_end_the_script(hostile_graph):
    text = render(hostile_graph)
    blob = embedded_data(text)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in blob, raw
    data = json.loads(blob)                      # the escapes decode to the same strings
    assert data == json.loads(json.dumps(page_data(hostile_graph)))
    assert HOSTILE_VARIABLE in data["n"]["name"] and HOSTILE_SCOPE in data["strings"]
    # the page has exactly its two scripts: the data and the viewer, both whole
    assert text.count("<script") == 2 and text.count("</script>") == 2


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="the `chromium` command is not installed, so the viewer is not "
                           "checked in a real browser (Debian: apt-get install chromium; "
                           ".ci/run installs it)")
@pytest.mark.parametrize("query", [HOSTILE_VARIABLE, HOSTILE_SCOPE])
def test_viewer_renders_and_finds_a_hostile_name(hostile_graph, tmp_path, query):
    path = hostile_graph.to_html(tmp_path / "hostile.html")
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=3000", "--dump-dom",
           f"file://{path}#q={urllib.parse.quote(query, safe='')}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    assert 'data-ready="1"' in body.group(0) and "data-error" not in body.group(0)
    hits = re.search(r'<span id="hits">([^<]*)</span>', out.stdout)
    data = page_data(hostile_graph)                  # the viewer searches names and scopes
    expected = sum(query in name or query == data["strings"][scope]
                   for name, scope in zip(data["n"]["name"], data["n"]["scope"]))
    assert expected == (1 if query == HOSTILE_VARIABLE else len(hostile_graph.eqns))
    assert hits and hits.group(1) == f"1 / {expected}", hits


# ---------------------------------------------------------------- the bench builders of the docs


def docs_builder():
    """`build` of the `graphdist bench` example in docs/inspect.md, run as written."""
    text = (ROOT / "docs" / "inspect.md").read_text()
    code = re.search(r"```python\n(# mystep\.py\n.*?)```", text, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/inspect.md (mystep.py)", "exec"), namespace)   # noqa: S102
    return namespace["build"]


def docstring_builder():
    """`build` of gd.benchmark's docstring example."""
    import doctest

    from graphdist.benchmark import benchmark

    [test] = doctest.DocTestFinder().find(benchmark, globs={"gd": gd, "np": np})
    namespace = dict(test.globs)
    for example in test.examples:
        if "def build" in example.source:
            exec(compile(example.source, "gd.benchmark's docstring", "exec"), namespace)  # noqa: S102
    return namespace["build"]


def rows_per_replica(step, args) -> list[int]:
    """The rows of x that each replica of the traced step reads."""
    step(*args)
    g = step.replicated_graph
    x_type = np.asarray(args[0].values[0] if hasattr(args[0], "values") else args[0])
    return [v.ty.shape[0] for v in g.inputs[:g.num_args] if v.ty.shape[1:] == x_type.shape[1:]
            and v.ty.dtype == x_type.dtype][:len(g.devices) or 1]


@pytest.mark.parametrize("make", [docs_builder, docstring_builder], ids=["inspect.md",
                                                                          "docstring"])
def test_the_docs_bench_builders_split_the_batch_among_the_replicas(make):
    build = make()
    one = rows_per_replica(*build(1))
    four_step, four_args = build(4)
    assert all(isinstance(a, gd.PerReplica) for a in four_args)
    global_rows = sum(len(shard) for shard in four_args[0].values)
    assert global_rows == 4 * one[0]                 # weak scaling: the batch grows with n
    # each replica does one replica's share, not the whole global batch
    assert rows_per_replica(four_step, four_args) == [one[0]] * 4
