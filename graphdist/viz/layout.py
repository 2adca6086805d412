"""A layered layout for the HTML view, computed here so the page opens at once: device lanes,
name scopes as collapsible groups, and for every item (node or group) its column and its row
within its column, at its level of the scope tree. The page only turns these into pixels
(column widths and stacked heights depend on which groups are open). O(nodes + edges).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphdist.ir import COLLECTIVES_SCOPE
from graphdist.viz.model import View

OPEN_BUDGET = 400   # groups open by default while the visible items stay under this
STACK_CELL, STACK_MIN = 8, 4   # a column cell above 8 items folds each op with 4 or more


@dataclass(slots=True)
class Layout:
    parent: list      # item -> parent group item (-1: top level); items: nodes, then groups
    col: list         # item -> column at its level
    row: list         # item -> place in its column (per lane at the top level)
    lane: list        # item -> first lane
    lane_end: list    # item -> last lane (differs for fused multi-device collectives)
    label: list       # group g (item N + g) -> its scope name part
    path: list        # group g -> its full scope path
    size: list        # group g -> nodes inside it, at any depth
    opened: list      # group g -> open when the page loads
    columns: int      # columns at the top level
    stack: list       # group g -> a stack of same-op nodes of one column, not a name scope


def _scope_path(n) -> tuple:
    if n.index is None or n.spanning or not n.scope or n.scope == COLLECTIVES_SCOPE:
        return ()
    return tuple(n.scope.split("/"))


def _runs(view: View, lane: list) -> tuple[list, list, list]:
    """Groups as runs of consecutive nodes of one lane sharing a scope prefix."""
    parent = [-1] * len(view.nodes)
    label, gparent = [], []
    stacks = {k: [] for k in range(len(view.lanes))}
    for n in view.nodes:
        path = _scope_path(n)
        if n.spanning:
            for k in range(lane[n.id][0], lane[n.id][1] + 1):
                stacks[k].clear()
            continue
        stack = stacks[lane[n.id][0]]
        k = 0
        while k < len(stack) and k < len(path) and label[stack[k]] == path[k]:
            k += 1
        del stack[k:]
        for part in path[k:]:
            label.append(part)
            gparent.append(stack[-1] if stack else -1)
            stack.append(len(label) - 1)
        parent[n.id] = stack[-1] if stack else -1
    return parent, label, gparent


def _chains(parent: list, n_nodes: int) -> list:
    chains = []
    for i in range(n_nodes):
        chain = [i]
        p = parent[i]
        while p != -1:
            chain.append(p)
            p = parent[p]
        chains.append(chain[::-1])
    return chains


def _level_edges(view: View, parent: list) -> dict:
    """(parent item) -> set of (a, b): edges between the items of one level."""
    chains = _chains(parent, len(view.nodes))
    levels: dict = {}
    for src, dst, _, _ in view.edges:
        a, b = chains[src], chains[dst]
        i = 0
        while a[i] == b[i]:
            i += 1
        levels.setdefault(a[i - 1] if i else -1, set()).add((a[i], b[i]))
    return levels


def _order(items: list, edges: set) -> list | None:
    """Topological order of items (Kahn, stable), or None when there is a cycle."""
    succ = {i: [] for i in items}
    indeg = dict.fromkeys(items, 0)
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [i for i in items if indeg[i] == 0]
    out = []
    while ready:
        i = ready.pop()
        out.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return out if len(out) == len(items) else None


def _columns(items: list, edges: set, order: list) -> dict:
    preds = {i: [] for i in items}
    succs = {i: [] for i in items}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    col = {}
    for i in order:
        col[i] = max((col[p] + 1 for p in preds[i]), default=0)
    for i in reversed(order):   # then as late as possible: a value sits by its first use
        if succs[i]:
            col[i] = min(col[s] for s in succs[i]) - 1
    return col, preds, succs


def _rows(items, col, lane, preds, succs, first) -> dict:
    cells: dict = {}
    for i in sorted(items, key=lambda i: first[i]):
        cells.setdefault((lane[i][0], col[i]), []).append(i)
    row = {}
    for cell in cells.values():
        for r, i in enumerate(cell):
            row[i] = r
    keys = sorted(cells, key=lambda k: k[1])
    # barycentre sweeps: forward by predecessors, backward by successors, forward again
    def bary(i, neighbours):
        near = [row[j] for j in neighbours[i] if lane[j][0] == lane[i][0]]
        return (sum(near) / len(near) if near else row[i], row[i])

    for neighbours, ks in ((preds, keys), (succs, keys[::-1]), (preds, keys)):
        for key in ks:
            cell = cells[key]
            cell.sort(key=lambda i, nb=neighbours: bary(i, nb))
            for r, i in enumerate(cell):
                row[i] = r
    return row


def _groups(view: View, lane: list) -> tuple[list, list]:
    """Scope groups that can be boxes: runs of one lane, on no cycle, with two items or more.
    Returns (parent of every item, label of every group)."""
    node_parent, label, gparent = _runs(view, lane)
    N, G = len(view.nodes), len(label)
    parent = [p + N if p >= 0 else -1 for p in node_parent + gparent]
    alive = [True] * G
    while True:
        children: dict = {}
        for i, p in enumerate(parent):
            if i < N or alive[i - N]:
                children.setdefault(p, []).append(i)
        broken = {g for g in range(G) if alive[g] and len(children.get(g + N, ())) < 2}
        for p, edges in _level_edges(view, parent).items():
            if _order(children[p], edges) is None:   # groups on a cycle cannot be boxes
                import networkx as nx

                for scc in nx.strongly_connected_components(nx.DiGraph(list(edges))):
                    if len(scc) > 1:
                        broken.update(i - N for i in scc if i >= N)
        if not broken:
            break
        for g in broken:
            alive[g] = False
        for i, p in enumerate(parent):   # the children of a dissolved group move up
            while p != -1 and not alive[p - N]:
                p = parent[p]
            parent[i] = p
    keep = [g for g in range(G) if alive[g]]   # renumber the groups that are left
    new = {N + g: N + k for k, g in enumerate(keep)}
    return [new.get(parent[i], -1) for i in [*range(N), *(N + g for g in keep)]], \
        [label[g] for g in keep]


def layout(view: View) -> Layout:
    """Lay `view` out: groups, then per level a cycle-free item graph, columns and rows."""
    index = {d: k for k, d in enumerate(view.lanes)}
    lane = []
    for n in view.nodes:
        ks = sorted({index[d] for d in (n.device, *n.devices) if d in index}) or [0]
        lane.append((ks[0], ks[-1]) if n.spanning else (index.get(n.device, ks[0]),) * 2)
    parent, label = _groups(view, lane)
    N, G = len(view.nodes), len(label)
    children: dict = {}
    for i, p in enumerate(parent):
        children.setdefault(p, []).append(i)
    levels = _level_edges(view, parent)
    first = list(range(N)) + [N] * G
    for i in range(N):
        p = parent[i]
        while p != -1:
            first[p] = min(first[p], i)
            p = parent[p]
    lane = lane + [(lane[first[N + g]][0],) * 2 for g in range(G)]
    col, row = [0] * len(parent), [0] * len(parent)
    stack = [False] * G
    columns = 0
    for p, items in list(children.items()):
        edges = levels.get(p, set())
        c, preds, succs = _columns(items, edges, _order(items, edges))
        span = {i: i < N and lane[i][0] != lane[i][1] for i in items}
        keys = sorted({(c[i], 1 + i if span[i] else 0) for i in items})
        rank = {k: r for r, k in enumerate(keys)}   # a fused collective gets its own column
        c = {i: rank[(c[i], 1 + i if span[i] else 0)] for i in items}
        if p == -1:
            columns = len(keys)
        items = _stacks(view, items, c, lane, preds, succs, first, parent, label, stack, col,
                        row, p)
        r = _rows(items, c, lane, preds, succs, first)
        for i in items:
            col[i], row[i] = c[i], r[i]
    children = {}
    for i, p in enumerate(parent):
        children.setdefault(p, []).append(i)
    size = [0] * len(label)
    for i in range(N):
        p = parent[i]
        while p != -1:
            size[p - N] += 1
            p = parent[p]
    opened = _default_open(children, N, len(label), stack)
    return Layout(parent, col, row, [a for a, _ in lane], [b for _, b in lane], label,
                  [_path(g, parent, label, N) for g in range(len(label))], size, opened,
                  columns, stack)


def _stacks(view, items, c, lane, preds, succs, first, parent, label, stack, col, row, p):
    """Fold many same-op nodes of one column (150 gradient reshapes feeding a concat) into a
    collapsible stack, so one wide layer does not make its lane as tall as the page."""
    N = len(view.nodes)
    cells: dict = {}
    for i in items:
        if i < N and lane[i][0] == lane[i][1]:
            cells.setdefault((lane[i][0], c[i]), []).append(i)
    folded, alias = set(), {}
    for (ln, k), cell in cells.items():
        if len(cell) <= STACK_CELL:
            continue
        by_op: dict = {}
        for i in cell:
            by_op.setdefault((view.nodes[i].kind, view.nodes[i].op), []).append(i)
        for (_, op), members in by_op.items():
            if len(members) < STACK_MIN:
                continue
            s = len(parent)
            parent.append(p)
            label.append(f"{op} ×{len(members)}")
            stack.append(True)
            lane.append((ln, ln))
            first.append(min(members))
            col.append(0)
            row.append(0)
            c[s] = k
            preds[s] = sorted({q for m in members for q in preds[m]})
            succs[s] = sorted({q for m in members for q in succs[m]})
            for r, m in enumerate(sorted(members)):
                parent[m], col[m], row[m] = s, 0, r
            folded.update(members)
            items = items + [s]
            for m in members:
                alias[m] = s
    if alias:   # neighbours of the folded nodes now see the stack
        for i in items:
            if i not in folded:
                preds[i] = list(dict.fromkeys(alias.get(q, q) for q in preds[i]))
                succs[i] = list(dict.fromkeys(alias.get(q, q) for q in succs[i]))
    return [i for i in items if i not in folded]


def _path(g: int, parent: list, label: list, N: int) -> str:
    parts = []
    i = g + N
    while i != -1:
        parts.append(label[i - N])
        i = parent[i]
    return "/".join(reversed(parts))


def _default_open(children: dict, N: int, G: int, stack: list) -> list:
    """Open scopes breadth first while the items on screen stay under OPEN_BUDGET; stacks
    start folded."""
    opened = [False] * G
    visible = len(children.get(-1, ()))
    frontier = [i for i in children.get(-1, ()) if i >= N]
    while frontier:
        nxt = []
        for i in frontier:
            grow = len(children.get(i, ())) - 1
            if stack[i - N] or visible + grow > OPEN_BUDGET:
                continue
            opened[i - N] = True
            visible += grow
            nxt += [c for c in children.get(i, ()) if c >= N]
        frontier = nxt
    return opened
