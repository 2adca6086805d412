"""Graph -> one self-contained HTML file: the placed graph in device lanes, collectives and
copies highlighted, hover details, pan/zoom, search, collapsible name scopes. The layout is
computed in Python (viz/layout.py); viewer.js (ours, no dependencies) only draws it on a
canvas. Nothing is loaded from the network."""

from __future__ import annotations

import html
import json
import os
import re
from importlib import resources

from graphdist.viz.layout import layout
from graphdist.viz.model import (KINDS, collective_groups, collective_totals,
                                  human_bytes, human_count, read)

KIND_CODE = {k: i for i, k in enumerate(KINDS)}


class _Table:
    """Interns repeated strings (ops, types, scopes) so a 10k-node page stays small."""

    def __init__(self):
        self.items: list = []
        self.index: dict = {}

    def __call__(self, s: str) -> int:
        k = self.index.get(s)
        if k is None:
            k = self.index[s] = len(self.items)
            self.items.append(s)
        return k


def page_data(g, title: str | None = None, profile: dict | None = None) -> dict:
    """The JSON the page draws: nodes, groups and edges as parallel arrays. `profile`: a
    Chrome trace of this graph's step (`f.profile`): each collective node gets the
    collective time no compute covered (`exposed_ms`), which the page marks."""
    view = read(g)
    lay = layout(view)
    strings = _Table()
    nodes = view.nodes
    N = len(nodes)
    data = {
        "title": title or "graphdist graph",
        "lanes": [view.lane_label(d) for d in view.lanes],
        "kinds": list(KINDS),
        "n": {
            "kind": [KIND_CODE[n.kind] for n in nodes],
            "op": [strings(n.op) for n in nodes],
            "name": [" ".join(n.names) for n in nodes],
            "type": [strings(" ".join(map(str, n.types))) for n in nodes],
            "dev": [strings(n.device or "") for n in nodes],
            "scope": [strings(n.scope) for n in nodes],
            "params": [strings(n.params) for n in nodes],
            "src": [strings(n.source) for n in nodes],
            "flops": [n.flops for n in nodes],
            "bytes": [n.bytes for n in nodes],
            "moved": [n.moved for n in nodes],
            "view": [int(n.view) for n in nodes],
        },
        "g": {"label": lay.label, "path": lay.path, "size": lay.size,
              "open": [int(o) for o in lay.opened], "stack": [int(x) for x in lay.stack]},
        "item": {"parent": lay.parent, "col": lay.col, "row": lay.row, "lane": lay.lane,
                 "lane_end": lay.lane_end},
        "edges": [x for src, dst, port, _ in view.edges for x in (src, dst, port)],
        "strings": strings.items,
        "nodes": N,
    }
    # a node drawn across lanes labels each lane with its first output on that lane's device
    data["lane_names"] = {str(n.id): [_first_on(n, d) for d in view.lanes] for n in nodes
                          if n.spanning}
    flops = sum(n.flops for n in nodes)
    count, members, moved = collective_totals(collective_groups(view))   # as g.summary()
    data["stats"] = (f"{len(g.eqns):,} eqns · {len(view.lanes)} lane"
                     f"{'s' if len(view.lanes) > 1 else ''} · {human_count(flops)} FLOPs · "
                     f"{count} collective{'s' if count != 1 else ''} ({members} nodes) · "
                     f"{human_bytes(moved)} moved")
    data["banner"] = g.mode_note()
    if profile is not None:
        exposed = _exposed_ms(profile)
        data["n"]["exposed"] = [round(exposed.get(n.index, 0.0), 4) for n in nodes]
    return data


def _exposed_ms(trace: dict) -> dict:
    """eqn index -> the largest exposed collective ms of its events (runtime/profile.py)."""
    out: dict = {}
    for e in trace.get("traceEvents", ()):
        args = e.get("args") or {}
        if e.get("cat") == "collective" and args.get("node") is not None:
            out[args["node"]] = max(out.get(args["node"], 0.0), args.get("exposed_ms", 0.0))
    return out


def _first_on(node, device) -> str:
    return next((name for name, v in zip(node.names, node.outputs) if v.device == device), "")


def _asset(name: str) -> str:
    return resources.files("graphdist.viz").joinpath(name).read_text(encoding="utf-8")


# Inside <script> the HTML parser ends the data at "</script" and, after "<!--", at the
# next "<script"/"</script" pair (the "script data escaped" states), whatever JSON thinks;
# & and the JavaScript line separators are escaped too, as HTML-embedded JSON usually is.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                              "\u2028": "\\u2028", "\u2029": "\\u2029"})


def script_json(data) -> str:
    """`data` as JSON that can sit inside a <script> element: no name in it (a variable or
    name scope called "</script>" or "<!--<script") can end the element early. These
    characters only occur inside JSON strings, where the \\uXXXX forms mean the same."""
    return json.dumps(data, separators=(",", ":")).translate(_SCRIPT_SAFE)


def render(g, title: str | None = None, profile: dict | None = None) -> str:
    """The page as a string (to_html writes it to a file)."""
    data = page_data(g, title, profile)
    blob = script_json(data)
    parts = {"TITLE": html.escape(data["title"]), "CSS": _asset("viewer.css"), "DATA": blob,
             "JS": _asset("viewer.js")}
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], _asset("viewer.html"))


def to_html(g, path, profile: dict | None = None) -> str:
    """Write `g` as one interactive HTML file (no network needed to view it); returns the path.
    With `profile` (the trace of `f.profile(...)` for this graph), collectives that left
    time exposed (not hidden by compute) are outlined in red, their tooltip saying how much.

        >>> f.replicated_graph.to_html("step.html")
        'step.html'
    """
    path = os.fspath(path)
    title = f"{os.path.splitext(os.path.basename(path))[0]}: {len(g.eqns)} eqns"
    text = render(g, title, profile)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
