"""Graph -> Graphviz DOT text: one cluster per device (scopes nest inside it), fused
multi-device collectives between the clusters, collectives and cross-device copies styled apart."""

from __future__ import annotations

from graphdist.ir import COLLECTIVES_SCOPE
from graphdist.viz.model import read

COLORS = {"op": "#e8eef6", "arg": "#dff0e1", "state": "#ebe3f5", "collective": "#c2255c",
          "copy": "#e8590c"}
SHAPES = {"op": "box", "arg": "ellipse", "state": "cylinder", "collective": "box",
          "copy": "cds"}
CROSS = "#e8590c"


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _label(n) -> str:
    params = n.params if len(n.params) <= 40 else n.params[:37] + "..."
    head = f"{n.op}[{params}]" if params else n.op
    types = " ".join(map(str, n.types[:3])) + (" ..." if len(n.types) > 3 else "")
    if n.kind in ("arg", "state"):
        return f"{n.name}\n{types}"
    return f"{' '.join(n.names[:3])}{' ...' if len(n.names) > 3 else ''} = {head}\n{types}"


def _node(n) -> str:
    attrs = {"label": _label(n), "shape": SHAPES[n.kind], "fillcolor": COLORS[n.kind],
             "tooltip": f"{n.op} on {n.device or 'any device'}"
             + (f"  scope {n.scope}" if n.scope else "")}
    if n.kind in ("collective", "copy"):
        attrs.update(fontcolor="white", penwidth="2", color=COLORS[n.kind])
    return f"n{n.id} [" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "];"


def _scope_path(n) -> tuple:
    if n.spanning or not n.scope or n.scope == COLLECTIVES_SCOPE:
        return ()
    return tuple(n.scope.split("/"))


def _tree(nodes) -> dict:
    tree: dict = {"nodes": [], "kids": {}}
    for n in nodes:
        t = tree
        for part in _scope_path(n):
            t = t["kids"].setdefault(part, {"nodes": [], "kids": {}})
        t["nodes"].append(n)
    return tree


def _emit(tree, prefix: str, depth: int, out: list) -> None:
    pad = "  " * depth
    for n in tree["nodes"]:
        out.append(pad + _node(n))
    for k, (name, sub) in enumerate(tree["kids"].items()):
        cid = f"{prefix}_s{k}"
        out.append(f"{pad}subgraph {_q(cid)} {{")
        out.append(f'{pad}  label={_q(name)}; style="dashed,rounded"; color="#7b8794"; '
                   f'fontcolor="#52606d";')
        _emit(sub, cid, depth + 1, out)
        out.append(pad + "}")


def to_dot(g) -> str:
    """Graphviz text for `g`: `dot -Tsvg` draws it left to right, one cluster per device.

        >>> open("step.dot", "w").write(f.replicated_graph.to_dot())
    """
    view = read(g)
    out = ["digraph graphdist {",
           ('  graph [rankdir=LR, newrank=true, fontname="Helvetica", fontsize=12, '
            'nodesep=0.15, ranksep=0.35];'),
           ('  node [style="rounded,filled", fontname="Helvetica", fontsize=9, color="#7b8794", '
            'height=0.3, margin="0.08,0.03"];'),
           '  edge [color="#9aa5b1", arrowsize=0.5, fontname="Helvetica", fontsize=8];']
    spanning = [n for n in view.nodes if n.spanning]
    placed = [n for n in view.nodes if not n.spanning]
    for d, device in enumerate(view.lanes):
        members = [n for n in placed if n.device == device]
        if device is None and len(view.lanes) == 1:
            _emit(_tree(members), "cluster_logical", 1, out)
            continue
        out.append(f"  subgraph {_q(f'cluster_dev{d}')} {{")
        out.append(f'    label={_q(view.lane_label(device))}; style="filled,rounded"; '
                   f'fillcolor="#f5f7fa"; color="#bcccdc"; fontsize=14;')
        _emit(_tree(members), f"cluster_dev{d}", 2, out)
        out.append("  }")
    if spanning:
        out.append("  // fused multi-device collectives, between the device clusters")
        for n in spanning:
            out.append("  " + _node(n))
    for src, dst, port, v in view.edges:
        s, t = view.nodes[src], view.nodes[dst]
        name = f"{s.names[port]}:{v.ty}"
        cross = v.device is not None and t.device is not None and v.device != t.device
        style = f', color="{CROSS}", penwidth=1.6, label={_q(name)}' if cross else ""
        out.append(f"  n{src} -> n{dst} [tooltip={_q(name)}{style}];")
    out.append("}")
    return "\n".join(out) + "\n"
