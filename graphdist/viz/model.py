"""The one reading of a Graph that every view shares: a node per graph input and per eqn, named
as the text form names them (ir.printer.Namer), with its kind, devices and cost, and the edges
between them. Views (networkx, DOT, HTML, summary) only format this; none of them edit the IR.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphdist.ir import COLLECTIVES_SCOPE, Graph, Var
from graphdist.ir.printer import Namer, param_text
from graphdist.ops.collectives import copy_p

KINDS = ("arg", "state", "op", "collective", "copy")


@dataclass(slots=True)
class Node:
    id: int
    kind: str                 # one of KINDS: arg/state (graph inputs), op, collective, copy
    op: str                   # the op's name; "input" or "variable" for graph inputs
    names: tuple              # text-form names of the outputs (of the input itself)
    types: tuple              # their ArrayTypes
    device: str | None        # where it runs (an eqn) or lives (an input)
    devices: tuple            # every device it touches; more than one for a fused collective
    scope: str = ""
    flops: int = 0
    bytes: int = 0            # bytes the op touches (Op.cost)
    moved: int = 0            # bytes that cross devices at this node
    params: str = ""          # "k=v,..." as the text form prints them
    source: str = ""
    index: int | None = None  # position in g.eqns; None for a graph input
    outputs: tuple = ()       # the Vars it defines
    view: bool = False        # a view op (reshape, transpose, read_var): no new buffer
    in_types: tuple = ()      # the ArrayTypes it reads (a collective's payload is the first)
    body: str = ""            # inside a branch or loop body: that body's group path

    @property
    def name(self) -> str:
        return self.names[0] if self.names else f"{self.op}#{self.index}"

    @property
    def spanning(self) -> bool:
        """A fused multi-device node (host_all_reduce, NCCL): drawn across device lanes."""
        return self.kind == "collective" and len(self.devices) > 1


@dataclass(slots=True)
class View:
    graph: Graph
    nodes: list
    edges: list               # (src id, dst id, output index of src, Var), one per use
    lanes: list               # devices in lane order; None is the lane of unplaced nodes
    producer: dict = field(default_factory=dict)   # Var -> (node id, output index)

    def lane_label(self, d) -> str:
        return "logical" if d is None else str(d)


def kind_of(eqn) -> str:
    if eqn.op is copy_p:
        return "copy"
    if getattr(eqn.op, "collective", False) or eqn.scope == COLLECTIVES_SCOPE \
            or eqn.scope.endswith("/" + COLLECTIVES_SCOPE):
        return "collective"
    return "op"


def cost(eqn) -> tuple[int, int]:
    ins = [x.ty for x in eqn.inputs]
    outs = [v.ty for v in eqn.outputs]
    try:
        flops, nbytes = eqn.op.cost(ins, outs, dict(eqn.params))
        return int(flops), int(nbytes)
    except Exception:  # noqa: BLE001 -- a cost rule that fails here only loses the FLOPs
        return 0, sum(t.nbytes for t in (*ins, *outs))


def moved_bytes(eqn) -> int:
    """Bytes crossing devices at `eqn`: inputs read from, and outputs written to, another device."""
    if eqn.device is None:
        return 0
    vs = [x for x in eqn.inputs if isinstance(x, Var)] + list(eqn.outputs)
    return sum(v.ty.nbytes for v in vs if v.device is not None and v.device != eqn.device)


def read(g: Graph) -> View:
    """Every view's reading of `g`; names follow the printer's order (inputs, then each eqn's
    outputs), so a picture and `print(g)` use the same names."""
    namer = Namer(g.devices)
    nodes: list = []
    producer: dict = {}
    for i, v in enumerate(g.inputs):
        state = i >= g.num_args
        nodes.append(Node(len(nodes), "state" if state else "arg",
                          "variable" if state else "input", (namer(v),), (v.ty,), v.device,
                          (v.device,) if v.device else ()))
        producer[v] = (len(nodes) - 1, 0)
        nodes[-1].outputs = (v,)
    edges = []
    for index, eqn in enumerate(g.eqns):
        names = tuple(namer(v) for v in eqn.outputs)
        for x in eqn.inputs:
            namer(x)
        kind = kind_of(eqn)
        touched = [eqn.device] + [v.device for v in (*eqn.inputs, *eqn.outputs)
                                  if isinstance(v, Var)]
        devices = tuple(dict.fromkeys(d for d in touched if d is not None))
        flops, nbytes = cost(eqn)
        params = ",".join(f"{k}={param_text(v)}" for k, v in eqn.params)
        node = Node(len(nodes), kind, str(eqn.op), names, tuple(v.ty for v in eqn.outputs),
                    eqn.device, devices, eqn.scope, flops, nbytes, moved_bytes(eqn), params,
                    eqn.source, index, eqn.outputs, bool(getattr(eqn.op, "view", False)),
                    tuple(x.ty for x in eqn.inputs))
        nodes.append(node)
        seen = set()
        for x in eqn.inputs:
            if isinstance(x, Var) and x in producer and x not in seen:
                seen.add(x)
                src, port = producer[x]
                edges.append((src, node.id, port, x))
        for k, v in enumerate(eqn.outputs):
            producer[v] = (node.id, k)
        _read_bodies(eqn, node, namer, nodes, edges)
    lanes = list(dict.fromkeys(g.devices))
    for n in nodes:
        for d in (n.device, *n.devices):
            if d not in lanes and (d is not None or n.device is None):
                lanes.append(d)
    if not lanes:
        lanes = [None]
    return View(g, nodes, edges, lanes, producer)


def _read_bodies(eqn, node: Node, namer, nodes: list, edges: list) -> None:
    """The eqns of a control-flow node's branches and bodies, as nodes in a group named
    after it (`scope/cond#7/branches[0]`), so the HTML viewer draws each body as a group
    that opens. Their costs are the control node's already: they count for nothing."""
    from graphdist.ir.printer import named_bodies

    for name, g in named_bodies(eqn):
        path = "/".join(p for p in (eqn.scope, f"{eqn.op}#{node.index}", name) if p)
        producer = {v: (node.id, 0) for v in g.inputs}
        for e in g.eqns:
            inner = Node(len(nodes), kind_of(e), str(e.op), tuple(namer(v) for v in e.outputs),
                         tuple(v.ty for v in e.outputs), eqn.device,
                         (eqn.device,) if eqn.device else (), path,
                         params=",".join(f"{k}={param_text(v)}" for k, v in e.params),
                         source=e.source, index=node.index, outputs=e.outputs,
                         view=bool(getattr(e.op, "view", False)),
                         in_types=tuple(x.ty for x in e.inputs), body=path)
            nodes.append(inner)
            for x in dict.fromkeys(x for x in e.inputs if isinstance(x, Var)):
                if x in producer:
                    src, port = producer[x]
                    edges.append((src, inner.id, port, x))
            producer.update((v, (inner.id, k)) for k, v in enumerate(e.outputs))
            _read_bodies(e, inner, namer, nodes, edges)


def collective_groups(view: View) -> list:
    """The graph's collectives, each as the list of its nodes (in graph order), ordered by
    their first node: the one count that the summary and the HTML header both report.

    A *collective* is one exchange between devices as the program asked for it: a logical
    all_reduce / broadcast / all_gather (an unplaced graph), a fused node (host_all_reduce,
    host_reduce_update, nccl_all_reduce, mpi_*), or the many nodes a lowering emits for one
    of them (a ring all-reduce on 4 devices is dozens of slices, copies and adds), together
    with the reshapes that pack and unpack its buffers. A copy outside any collective
    (placing a value on another device) counts as one too. The nodes of one collective are
    found as connected pieces: two collective or copy nodes belong together when one reads
    what the other wrote or both read the same value. So a collective that reads another's
    result directly, with nothing in between, is counted with it."""
    members = [n for n in view.nodes if n.index is not None and not n.body
               and n.kind in ("collective", "copy")]
    parent = {n.id: n.id for n in members}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(a, b):
        parent[root(a)] = root(b)

    readers: dict = {}
    for src, dst, _, var in view.edges:
        if dst in parent:
            if src in parent:
                join(src, dst)
            readers.setdefault(var, []).append(dst)
    for ids in readers.values():
        for other in ids[1:]:
            join(ids[0], other)
    groups: dict = {}
    for n in members:
        groups.setdefault(root(n.id), []).append(n)
    return sorted(groups.values(), key=lambda nodes: nodes[0].id)


def collective_totals(groups: list) -> tuple[int, int, int]:
    """(collectives, their nodes, bytes they move between devices) of collective_groups'
    answer: the numbers the summary's "collectives:" line and the HTML header both show."""
    nodes = [n for group in groups for n in group]
    return len(groups), len(nodes), sum(n.moved for n in nodes)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}P"
