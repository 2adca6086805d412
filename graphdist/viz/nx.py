"""Graph -> networkx.DiGraph: one node per graph input and per eqn, one edge per producer and
consumer pair, named as the text form names them."""

from __future__ import annotations

from graphdist.viz.model import read


def node_keys(view) -> list:
    """The key of each node: its first output's text name, made unique when it is not."""
    keys, taken = [], set()
    for n in view.nodes:
        key = n.name
        if key in taken:
            key = f"{n.op}#{n.index if n.index is not None and not n.body else n.id}"
        taken.add(key)
        keys.append(key)
    return keys


def to_networkx(g):
    """A `networkx.DiGraph` of `g`. Node keys are the printed names of each node's first
    output; attributes: op, kind, device, devices, shape, dtype, type, scope, flops, bytes,
    moved, params, outputs, index. Edge attributes: name, shape, dtype, bytes, cross_device.

        >>> d = f.replicated_graph.to_networkx()
        >>> sorted({a["device"] for _, a in d.nodes(data=True)})
        ['cpu:0', 'cpu:1']
    """
    import networkx as nx

    view = read(g)
    keys = node_keys(view)
    d = nx.DiGraph(devices=[view.lane_label(x) for x in view.lanes])
    for n, key in zip(view.nodes, keys):
        ty = n.types[0] if n.types else None
        d.add_node(key, op=n.op, kind=n.kind, device=n.device, devices=n.devices,
                   shape=ty.shape if ty else None, dtype=str(ty.dtype) if ty else None,
                   type=" ".join(map(str, n.types)), scope=n.scope, flops=n.flops,
                   bytes=n.bytes, moved=n.moved, params=n.params, source=n.source,
                   outputs=list(n.names), index=n.index)
    for src, dst, port, v in view.edges:
        u, w = keys[src], keys[dst]
        name = view.nodes[src].names[port]
        cross = v.device is not None and view.nodes[dst].device not in (None, v.device)
        if d.has_edge(u, w):   # several outputs of one node feed the same consumer
            a = d.edges[u, w]
            a["name"] += ", " + name
            a["bytes"] += v.ty.nbytes
            continue
        d.add_edge(u, w, name=name, shape=v.ty.shape, dtype=str(v.ty.dtype), type=str(v.ty),
                   bytes=v.ty.nbytes, cross_device=cross)
    return d
