"""g.summary(): op counts per device, FLOPs and bytes per device, the bytes each collective
moves between devices, and each device's peak live bytes from the schedule's liveness.
`stats(g)` returns the same numbers as a dict; `summary(g)` formats them."""

from __future__ import annotations

from collections import Counter

from graphdist.ir import Graph, Var
from graphdist.ops.collectives import all_reduce_p, broadcast_p
from graphdist.ops.host_collectives import host_reduce_update_p
from graphdist.ops.zero_collectives import host_sharded_update_p
from graphdist.viz.model import (collective_groups, collective_totals, human_bytes,
                                  human_count, read)


def peak_bytes(g: Graph) -> dict:
    """Device -> most bytes of eqn-made buffers alive at once on it. Lifetimes come from the
    schedule's liveness in program order; each buffer counts on the device that holds it, so
    a one-device graph gives exactly `liveness(g).peak_bytes`."""
    from graphdist.ir.liveness import liveness

    lv = liveness(g)
    dying: dict = {}
    for r, i in lv.last_use.items():
        dying.setdefault(i, []).append(r)
    inputs = set(g.inputs)
    devices = list(dict.fromkeys([*g.devices, *(e.device for e in g.eqns)])) or [None]
    live, peak, owner = Counter(), dict.fromkeys(devices, 0), {}
    for i, eqn in enumerate(g.eqns):
        for v in eqn.outputs:
            if lv.root[v] is v:
                d = owner[v] = v.device if v.device is not None else eqn.device
                live[d] += v.ty.nbytes
                peak[d] = max(peak.get(d, 0), live[d])
        for r in dying.get(i, ()):
            if r not in inputs and r in owner:
                live[owner[r]] -= r.ty.nbytes
    return peak


MEMORY_ROWS = ("parameters", "gradients", "optimizer slots", "peak activations")


def _reducing_ops() -> tuple:
    """The ops whose outputs are reduced gradients: the logical collectives and their
    lowerings (one process, MPI, NCCL)."""
    from graphdist.ops.collectives import reduce_scatter_p
    from graphdist.ops.device_collectives import nccl_all_reduce_p
    from graphdist.ops.host_collectives import host_all_reduce_p, host_reduce_scatter_p
    from graphdist.ops.mpi_collectives import mpi_all_reduce_p, mpi_reduce_scatter_p

    return (all_reduce_p, reduce_scatter_p, host_all_reduce_p, host_reduce_scatter_p,
            mpi_all_reduce_p, mpi_reduce_scatter_p, nccl_all_reduce_p)


def memory_bytes(g: Graph) -> dict:
    """Device -> {row of MEMORY_ROWS: bytes}: the trainable variables' components on it, the
    reduced gradients the step makes there (the outputs of its all-reduces and
    reduce-scatters: whole gradients, or a replica's shards under zero_stage > 0; a fused
    all-reduce + update's gradient buckets) plus gradient accumulators, the optimizer slots'
    components (a replica's shards when sharded), and the peak live bytes of the values the
    step makes (`peak_bytes`: activations, gradients and temporaries, from the liveness)."""
    peak = peak_bytes(g)
    devices = list(dict.fromkeys([*peak, *g.devices])) or [None]
    out = {d: dict.fromkeys(MEMORY_ROWS, 0) for d in devices}

    def add(device, row, nbytes):
        out.setdefault(device, dict.fromkeys(MEMORY_ROWS, 0))[row] += nbytes

    states = g.inputs[len(g.inputs) - len(g.variables):] if g.variables else ()
    rows = {"parameter": "parameters", "slot": "optimizer slots", "accumulator": "gradients"}
    for var, ref in zip(states, g.variables):
        row = rows.get(getattr(ref, "role", ""))
        if row is not None:
            add(var.device, row, var.ty.nbytes)
    buckets: set = set()
    reducing = _reducing_ops()
    for eqn in g.eqns:
        # an all-reduce split to overlap the compute (runtime/overlap.py): its start and
        # its wait share a channel, and the wait's outputs are the reduced values
        channel = dict(eqn.params).get("channel")
        split = getattr(channel, "collective", None) in reducing and \
            tuple(v.ty for v in eqn.outputs) == tuple(channel.out_types)   # not the start
        if eqn.op in reducing or split:
            for v in eqn.outputs:
                add(v.device if v.device is not None else eqn.device, "gradients", v.ty.nbytes)
        elif eqn.op is host_reduce_update_p:  # the buckets, reduced chunk by chunk; an update
            for v in eqn.inputs[:dict(eqn.params).get("replicas", 0)]:   # cut in parts
                if isinstance(v, Var) and v not in buckets:             # shares them
                    buckets.add(v)
                    add(v.device, "gradients", v.ty.nbytes)
        elif eqn.op is host_sharded_update_p:   # zero_stage > 0: each replica's reduced
            params = dict(eqn.params)          # shard, summed chunk by chunk
            for v in eqn.inputs[:params["replicas"]]:
                add(v.device, "gradients", sum(params["lengths"]) * v.ty.dtype.itemsize)
    for d, nbytes in peak.items():
        add(d, "peak activations", nbytes)
    return out


def _carried(g: Graph, n) -> list:
    """The tensors one replica sends into collective node `n`: its inputs on one device (all
    of them for a list all-reduce over several tensors, and in a logical graph), the largest
    such group; of a fused all-reduce + update only the buckets (its first `replicas`)."""
    eqn = g.eqns[n.index]
    ins = eqn.inputs[:dict(eqn.params).get("replicas", len(eqn.inputs))]
    groups: dict = {}
    for x in ins:
        if isinstance(x, Var):
            groups.setdefault(x.device, []).append(x.ty)
    return max(groups.values(), key=lambda ts: sum(t.nbytes for t in ts),
               default=list(n.types[:1]))


def _types_text(types) -> str:
    text = ", ".join(str(t) for t in types[:3])
    return text + (f" +{len(types) - 3} more" if len(types) > 3 else "")


def _describe(g: Graph, nodes) -> dict:
    # a view's node names its op (Node.op): the logical N-way collectives are the main ones
    logical = (all_reduce_p.name, broadcast_p.name)
    main = [n for n in nodes if n.kind == "copy" or n.spanning or n.op in logical] or nodes
    counts = Counter(n.op for n in nodes)
    first = max(main, key=lambda n: sum(t.nbytes for t in n.types))
    # the op and, when short, its parameters (a fused update's hyper-parameters are not)
    head = f"{first.op}[{first.params}]" if 0 < len(first.params) <= 24 else first.op
    carried = [_carried(g, n) for n in main]                 # what a collective carries
    payload = max((sum(t.nbytes for t in ts) for ts in carried), default=0)
    shown = _carried(g, first)
    return {"op": head, "ops": dict(counts), "type": _types_text(shown),
            "payload": payload, "moved": sum(n.moved for n in nodes),
            "devices": sorted({d for n in nodes for d in n.devices}, key=str),
            "nodes": [n.name for n in nodes]}


def stats(g: Graph) -> dict:
    """The numbers summary() prints: per-device op counts, FLOPs, bytes touched, peak live
    bytes, and one entry per collective (payload bytes and bytes moved between devices)."""
    view = read(g)
    lanes = view.lanes
    ops = {d: Counter() for d in lanes}
    flops = dict.fromkeys(lanes, 0)
    touched = dict.fromkeys(lanes, 0)
    for n in view.nodes:
        if n.index is None or n.body:       # a body's eqns are their control node's cost
            continue
        ops[n.device][n.op] += 1
        flops[n.device] += n.flops
        touched[n.device] += n.bytes
    groups = collective_groups(view)
    _, members, moved = collective_totals(groups)        # as the HTML header counts them
    return {"devices": lanes, "eqns": len(g.eqns), "inputs": len(g.inputs),
            "ops": {d: dict(c) for d, c in ops.items()}, "flops": flops, "bytes": touched,
            "peak_bytes": peak_bytes(g), "memory": memory_bytes(g),
            "collectives": [_describe(g, c) for c in groups],
            "collective_nodes": members, "moved": moved}


def _table(rows, header, left=(0,)) -> list:
    """Rows under a header; the columns in `left` (names) align left, numbers right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r):
        return "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def fused_lines(g: Graph) -> list:
    """One line per kind of fused node (an eqn whose `members` param names the ops it
    replaced, e.g. passes/epilogue.py's conv2d_bias_act) and how many there are."""
    kinds = Counter((str(e.op), dict(e.params)["members"]) for e in g.eqns
                    if "members" in dict(e.params))
    if not kinds:
        return []
    return ["fused nodes (the ops each one runs):", *(
        f"  {op} x{n}: {' + '.join(members)}" for (op, members), n in sorted(kinds.items())),
        ""]


def summary(g: Graph, max_ops: int = 30) -> str:
    """A printable overview of `g`.

        >>> print(f.replicated_graph.summary())
    """
    s = stats(g)
    lanes = s["devices"]
    label = ["logical" if d is None else str(d) for d in lanes]
    head = f"graph: {s['eqns']} eqns, {s['inputs']} inputs"
    if lanes == [None]:
        head += " (logical, not placed)"
    else:
        head += f" on {len(lanes)} device{'s' if len(lanes) > 1 else ''}"
    lines = [head] + ([g.mode_note()] if g.merged else []) + [""]
    total = Counter()
    for c in s["ops"].values():
        total.update(c)
    many = len(lanes) > 1
    names = [op for op, _ in total.most_common()]
    rows = [[op, *(s["ops"][d].get(op, 0) for d in lanes)] + ([total[op]] if many else [])
            for op in names[:max_ops]]
    if len(names) > max_ops:
        rest = names[max_ops:]
        rows.append([f"({len(rest)} more ops)",
                     *(sum(s["ops"][d].get(op, 0) for op in rest) for d in lanes)]
                    + ([sum(total[op] for op in rest)] if many else []))
    rows.append(["all ops", *(sum(s["ops"][d].values()) for d in lanes)]
                + ([sum(total.values())] if many else []))
    cols = label + (["total"] if many else [])
    lines += _table(rows, ["op", *cols])
    lines.append("")
    per = [("FLOPs", s["flops"], human_count), ("bytes touched", s["bytes"], human_bytes),
           ("peak live bytes", s["peak_bytes"], human_bytes)]
    rows = []
    for title, values, fmt in per:
        vals = [values.get(d, 0) for d in lanes]
        tot = [sum(vals)] if many and title != "peak live bytes" else ([""] if many else [])
        rows.append([title, *(f"{v:,}" for v in vals), *(f"{v:,}" if v != "" else v for v in tot)])
        rows.append(["", *(fmt(v) for v in vals), *(fmt(v) if v != "" else v for v in tot)])
    lines += _table(rows, ["per device", *cols])
    lines.append("")
    rows = [[row, *(human_bytes(s["memory"].get(d, {}).get(row, 0)) for d in lanes)]
            + ([""] if many else []) for row in MEMORY_ROWS]
    lines += _table(rows, ["memory per device", *cols])
    lines.append("")
    lines += fused_lines(g)
    colls = s["collectives"]
    lines.append(f"collectives: {len(colls)} ({s['collective_nodes']} nodes), {s['moved']:,} "
                 f"bytes moved between devices ({human_bytes(s['moved'])})")
    if colls:
        rows = []
        for k, c in enumerate(colls):
            steps = ", ".join(f"{op} x{n}" for op, n in sorted(c["ops"].items(),
                                                                 key=lambda kv: -kv[1]))
            rows.append([f"#{k}", c["op"], c["type"], f"{c['payload']:,}",
                         f"{c['moved']:,} ({human_bytes(c['moved'])})", steps])
        lines += ["  " + r for r in _table(rows, ["", "collective", "type", "payload B",
                                                  "moved B", "nodes"], left=(0, 1, 2, 5))]
    return "\n".join(lines)
