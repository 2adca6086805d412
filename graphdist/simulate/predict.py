"""The predictor of gd.simulate: one replica's logical graph priced per device count (compute
by the calibrated per-op model scaled to a measured step, collectives by their lowering's
cost model), list-scheduled, in weak or strong scaling."""

from __future__ import annotations

from dataclasses import dataclass

from graphdist.ir import Var
from graphdist.ops.array import concat_p, reshape_p
from graphdist.ops.conv import conv2d_backprop_filter_p, conv2d_backprop_input_p, conv2d_p
from graphdist.passes.collectives import LOWERINGS, Pricing
from graphdist.simulate.calibration import best_time, host_link, load_calibration
from graphdist.simulate import presets
from graphdist.simulate.costs import eqn_seconds
from graphdist.simulate.link import DEFAULT_LINK, Link, parse_link

# ---------------------------------------------------------------- scheduling, collectives


def _payload(eqn) -> int:
    return sum(v.ty.nbytes for v in eqn.inputs if isinstance(v, Var))


def _step_time(items, serial: bool) -> float:
    """List-schedule the eqns: compute in program order on the device, collectives on the
    link as soon as their inputs are ready (a bucket whose gradients are ready early
    overlaps the compute that follows), each eqn after the values it reads. `serial`
    (logical devices of one host, or a lowering the executor runs inline): nothing
    overlaps."""
    if serial:
        return sum(t for _, t, _ in items)
    ready, clock, wire = {}, 0.0, 0.0
    for eqn, t, comm in items:
        deps = max((ready.get(v, 0.0) for v in eqn.inputs if isinstance(v, Var)), default=0.0)
        start = max(wire if comm else clock, deps)
        if comm:
            wire = start + t
        else:
            clock = start + t
        for v in eqn.outputs:
            ready[v] = start + t
    return max(clock, wire)


# what distribute/buckets.py adds between the gradients and a bucket's all-reduce
PACKING_OPS = (reshape_p, concat_p)


def overlap_order(eqns) -> list:
    """The eqns in the order an overlapping executor runs them: every collective, and the
    packing that only feeds collectives (a bucket's reshapes and concatenation,
    PACKING_OPS), as soon as its inputs exist; the compute in program order. The buckets
    are the graph's own (distribute/buckets.py packs the gradients, in their order), so a
    bucket's all-reduce starts once its last gradient exists, while the backward pass of
    earlier layers goes on, and the link takes the buckets in the order they become ready
    (DDP issues its reverse-forward buckets the same way)."""
    import heapq

    eqns = list(eqns)
    consumers: dict = {}
    for e in eqns:
        for v in e.inputs:
            if isinstance(v, Var):
                consumers.setdefault(v, []).append(e)
    early: set = set()         # collectives, and packing whose outputs only feed early ones
    for e in reversed(eqns):
        users = [u for v in e.outputs for u in consumers.get(v, ())]
        if e.op.collective or (e.op in PACKING_OPS and users
                               and all(id(u) in early for u in users)):
            early.add(id(e))
    producer = {v: i for i, e in enumerate(eqns) for v in e.outputs}
    waiting = [len({producer[v] for v in e.inputs if isinstance(v, Var) and v in producer})
               for e in eqns]
    after: dict = {}
    for i, e in enumerate(eqns):
        for j in {producer[v] for v in e.inputs if isinstance(v, Var) and v in producer}:
            after.setdefault(j, []).append(i)
    ready = [(id(e) not in early, i) for i, e in enumerate(eqns) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(eqns[i])
        for k in after.get(i, ()):
            waiting[k] -= 1
            if not waiting[k]:
                heapq.heappush(ready, (id(eqns[k]) not in early, k))
    return order


@dataclass(frozen=True)
class _Costs:
    """How one prediction prices its collectives."""

    lowering: str
    link: Link
    shared_host: bool
    num_groups: int | None
    add: Link                 # one elementwise pass on this host, per byte touched
    devices_per_worker: int = 1
    link_from: str = "default"          # where `link` came from, for the table's header
    lowering_from: str = "given"        # where `lowering` came from

    @property
    def model(self):
        """The registered lowering whose cost model prices the collectives."""
        return LOWERINGS[self.lowering]()

    def pricing(self) -> Pricing:
        return Pricing(self.shared_host, self.add, self.num_groups, self.devices_per_worker)

    def assumed(self) -> dict:
        """The keys every row of simulate() gets: what its collectives were priced with."""
        groups = (self.num_groups or "sqrt(n)") if self.model.uses_groups else None
        return {"lowering": self.lowering, "lowering_from": self.lowering_from,
                **({"num_groups": groups} if groups is not None else {}),
                "link_latency_s": self.link.latency, "link_bandwidth_Bps": self.link.bandwidth,
                "link_from": self.link_from}


def _collective_seconds(eqn, n: int, c: _Costs) -> float:
    return c.model.cost(eqn.op.name, n, _payload(eqn), c.link, c.pricing())


def _lowering_of(f) -> str:
    """The lowering the builder's step was lowered with, recognised by the fused nodes it
    made (ring, which makes none of its own, otherwise); an all-reduce split to overlap
    the compute (runtime/overlap.py) is known by its start, `<fused node>_start`."""
    names = {e.op.name.removesuffix("_start") for e in f.replicated_graph.eqns}
    for name, cls in LOWERINGS.items():
        if names & set(cls.fused_nodes):
            return name
    return "ring"


def _compute_flops(g) -> int:
    return sum(e.op.cost([v.ty for v in e.inputs], [v.ty for v in e.outputs],
                         dict(e.params))[0] for e in g.eqns if not e.op.collective)


# ---------------------------------------------------------------- strong scaling


def batch_of(args) -> int | None:
    """The (per-replica) batch of a step's arguments: the leading axis of the first array
    among them (of replica 0's value for per-replica arguments)."""
    from graphdist.pytree import flatten

    arrays = [x for x in flatten(args)[0] if getattr(x, "ndim", 0) >= 1]
    return int(arrays[0].shape[0]) if arrays else None


def _cut(args, old: int, new: int):
    """The arguments with every array whose leading axis is `old` cut to its first `new`."""
    from graphdist.pytree import flatten, unflatten

    leaves, _, tree = flatten(args)
    return unflatten(tree, [x[:new] if getattr(x, "ndim", 0) >= 1 and x.shape[0] == old
                            else x for x in leaves])


def per_replica_batch(global_batch: int, n: int) -> int:
    """global_batch / n, which must be a whole number of examples, at least 1."""
    if global_batch < n:
        raise ValueError(f"simulate (strong scaling): a global batch of {global_batch} "
                         f"examples on {n} devices leaves each replica "
                         f"{global_batch / n:.3g} examples, fewer than 1; use at most "
                         f"{global_batch} devices or a larger global batch")
    if global_batch % n:
        raise ValueError(f"simulate (strong scaling): the global batch of {global_batch} "
                         f"examples does not split evenly among {n} devices "
                         f"({global_batch} / {n} = {global_batch / n:.3g} per replica); "
                         "choose device counts that divide it")
    return global_batch // n


def _strong_graphs(devices, args1, g1, f2, args2, g2) -> tuple[dict, int]:
    """{per-replica batch: logical graph traced at it}, for global/n with each n in
    `devices` (and 1), and the global batch (the builder's batch on 1 device). The builder's
    2-device step is traced again on its arguments cut to the smaller batch."""
    total, per2 = batch_of(args1), batch_of(args2)
    if total is None or per2 is None:
        raise ValueError("simulate (strong scaling): the builder's step takes no array "
                         "argument with a batch axis to split among the replicas")
    graphs = {}
    for n in sorted({1, *devices}):
        b = per_replica_batch(total, n)
        if b == per2:
            graphs[b] = g2
        elif b < per2:
            graphs[b] = f2.get_graph(*_cut(args2, per2, b))
        elif n == 1:
            graphs[b] = g1
        else:
            raise ValueError(f"simulate (strong scaling): the builder gives each of 2 "
                             f"replicas {per2} examples, fewer than the {b} that {n} "
                             f"devices need of a global batch of {total}; build n=2 with "
                             "the global batch split in 2 (or per replica)")
    return graphs, total


# ---------------------------------------------------------------- the predictor


def _resolve(cross_device_ops, f2, link, cal: dict, shared_host: bool, num_groups,
             devices_per_worker: int) -> _Costs:
    """The lowering, link and knobs a prediction prices its collectives with, and where
    each came from (the table says so: a prediction is only as good as what it assumed)."""
    lowering_from = "given"
    if isinstance(cross_device_ops, str):
        lowering = cross_device_ops
    elif getattr(cross_device_ops, "lowering", None):
        lowering = cross_device_ops.lowering
        lowering_from = f"given: {type(cross_device_ops).__name__}"
    else:
        lowering = _lowering_of(f2)
        lowering_from = f"the builder's step lowers to {lowering}"
    if lowering not in LOWERINGS:
        raise ValueError(f"simulate: no cost model for cross-device ops {lowering!r} "
                         f"(have: {', '.join(sorted(LOWERINGS))})")
    model = LOWERINGS[lowering]
    if model.one_process_only and not shared_host and cross_device_ops is None:
        lowering, model = "ring", LOWERINGS["ring"]  # no meaning across machines
        lowering_from = ("the builder's step uses the host's fused all-reduce, which only "
                         "joins devices of one process; priced as ring across machines")
    if model.crosses_processes and shared_host:
        raise ValueError(f"simulate: the {lowering} lowering runs one process per worker, not "
                         "logical devices of one process; drop shared_host (local replicas "
                         "per worker: devices_per_worker)")
    link_from = "given" if link is not None else "default"
    if link is None and shared_host:      # each copy is a node: its overhead too
        kind = "host" if model.fused_host_node else "copy"
        base = host_link(cal, kind)
        link = Link(base.latency + cal["node_overhead_s"], base.bandwidth)
        link_from = (f"this host's {'fused all-reduce' if model.fused_host_node else 'memory copy'}"
                     ", calibrated, plus the executor's per-node overhead")
    if link is None and model.crosses_processes:
        link = host_link(cal, "mpi")      # between workers of this host, as calibrated
        link_from = ("calibrated between 2 MPI processes of this host"
                     if cal["links"]["mpi"].get("measured", True) else
                     "assumed for processes of one host: MPI could not be measured here")
    if cross_device_ops is not None and not isinstance(cross_device_ops, str):
        num_groups = num_groups or cross_device_ops.options().get("num_groups")
    link = parse_link(link) if isinstance(link, str) else (link or DEFAULT_LINK)
    ew = cal["ops"]["elementwise"]        # the adds of a copy-based lowering on one host
    add = Link(cal["node_overhead_s"] + ew["a"], 1 / ew["per_unit"])
    return _Costs(lowering, link, shared_host, num_groups, add, max(1, devices_per_worker),
                  link_from, lowering_from)


def _row(n: int, g, model: dict, costs: _Costs, overlap: bool = True) -> dict:
    """One device count's prediction on logical graph g (`model`: compute eqn -> seconds)."""
    lowering = costs.model
    replicas_here = n if costs.shared_host else (
        min(n, costs.devices_per_worker) if lowering.crosses_processes else 1)
    serial = costs.shared_host or lowering.runs_inline or not overlap
    return _scheduled(n, g, model, lambda e: _collective_seconds(e, n, costs), serial,
                      replicas_here, {**costs.assumed(), "overlap": not serial})


def _scheduled(n: int, g, model: dict, collective, serial: bool, replicas_here: int = 1,
               assumed: dict | None = None) -> dict:
    """The row of one device count: compute eqns priced by `model` (x the replicas that
    run one after another here), collectives by `collective(eqn)`, scheduled in the
    executor's overlapping order (overlap_order) unless `serial`; `exposed_comm_s` is the
    collective time the compute does not hide."""
    eqns = g.eqns if serial else overlap_order(g.eqns)
    items = [(e, model[e] * replicas_here, False) if e in model else
             (e, collective(e), True) for e in eqns]
    step = _step_time(items, serial)
    compute = sum(t for _, t, c in items if not c)
    return {"devices": n, "step_s": step, "compute_s": compute,
            "comm_s": sum(t for _, t, c in items if c),
            "exposed_comm_s": max(step - compute, 0.0), **(assumed or {})}


def _seconds_text(seconds: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _rate_text(per_second: float) -> str:
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if per_second >= size:
            return f"{per_second / size:.3g} {unit}"
    return f"{per_second:.3g} B/s"


def assumptions(row: dict) -> str:
    """The line saying what a row of simulate() assumed: the link and the lowering, and
    where each came from (default, given, calibrated, the builder's step); for a preset,
    the cluster (simulate/presets.py)."""
    overlap = ("overlap: on (each bucket's all-reduce from its last gradient)"
               if row.get("overlap") else "overlap: off")
    if "preset" in row:
        return (f"preset: {presets.PRESETS[row['preset']].line(0)}; roofline per op; "
                f"{overlap}")
    lowering = row["lowering"]
    if "num_groups" in row:
        lowering += f", {row['num_groups']} groups"
    return (f"link: latency {_seconds_text(row['link_latency_s'])}, bandwidth "
            f"{_rate_text(row['link_bandwidth_Bps'])} ({row['link_from']}); "
            f"lowering: {lowering} ({row['lowering_from']}); {overlap}")


def format_table(rows: list[dict]) -> str:
    """simulate()'s rows as the table `graphdist simulate` prints, under the line saying
    which link and lowering (or preset) priced the collectives; "exposed ms" is the
    collective time the compute does not hide."""
    lines = [assumptions(rows[0]) if rows else "",
             f"{'devices':>8} {'step ms':>10} {'compute ms':>11} {'comm ms':>10} "
             f"{'exposed ms':>10} {'efficiency':>10}"]
    lines += [f"{r['devices']:>8} {r['step_s'] * 1e3:>10.3f} {r['compute_s'] * 1e3:>11.3f} "
              f"{r['comm_s'] * 1e3:>10.3f} {r.get('exposed_comm_s', r['comm_s']) * 1e3:>10.3f} "
              f"{r['efficiency']:>10.3f}" for r in rows]
    return "\n".join(lines)


def simulate(builder, devices, link=None, cross_device_ops=None, *, scaling: str = "weak",
             calibration=None, recalibrate: bool = False, measure: bool = True,
             shared_host: bool = False, num_groups: int | None = None,
             devices_per_worker: int = 1, repeat: int = 5, min_seconds: float = 1.0,
             compute_s: float | None = None, preset=None, overlap: bool = True) -> list[dict]:
    """Predict the builder's step on each device count; one dict per count with keys
    `devices`, `step_s`, `compute_s`, `comm_s`, `efficiency`, and what it assumed:
    `lowering` (with `num_groups` for hierarchical), `link_latency_s`, `link_bandwidth_Bps`,
    and `lowering_from` / `link_from`, where each came from (`format_table` prints them).

    builder(n) -> (f, args) as for `graphdist bench`; it runs at n=1 (measured: the best
    of `repeat` steps, sampled for at least `min_seconds`, scales the calibrated per-op
    model to this step; with measure=False the model alone prices the graph) and is traced
    at n=2 (its logical graph gives the collectives and their payloads). `compute_s`: the
    1-device step time measured elsewhere (then it is not run). `link`: a Link or
    'latency=5us,bandwidth=25GB/s' (default 25 GB/s, 5 us; for the mpi lowering, the MPI
    link calibrated between 2 workers of this host). `cross_device_ops`: a lowering name
    (ring, hierarchical, one_device, host, nccl, mpi) or CrossDeviceOps; default: the
    builder's own.

    `scaling`: "weak" (each replica keeps the builder's per-replica batch; efficiency =
    T1 / TN) or "strong" (the builder's batch on 1 device is the global batch, split
    among the N replicas, which must leave each a whole number of examples, at least 1;
    efficiency = T1 / (N * TN)). `shared_host=True` models logical devices of this one
    host (replicas and copies run one after another). `devices_per_worker` (mpi): local
    replicas per worker process, which run one after another and sum before MPI.

    `preset`: a cluster of simulate/presets.py (a name or a Cluster; "host" or None: this
    machine, calibrated): every compute eqn priced by the GPU's roofline, every collective
    by the cluster's hierarchical all-reduce; nothing is measured or calibrated, and
    `link`, `cross_device_ops`, `shared_host` do not apply. `overlap` (default True): each
    bucket's all-reduce starts once its last gradient exists and runs beside the compute
    that follows (`overlap_order`); False: every collective waits for the compute before
    it, and the compute for it. Logical devices of one host (`shared_host`) and inline
    lowerings (mpi) never overlap. Every row has `overlap` and `exposed_comm_s`.

        >>> gd.simulate(build, [1, 8, 1024], link="latency=5us,bandwidth=25GB/s")
        ... # doctest: +SKIP
    """
    devices = [int(n) for n in devices]
    if not devices or min(devices) < 1:
        raise ValueError(f"simulate: device counts must be integers >= 1, got {devices}")
    if scaling not in ("weak", "strong"):
        raise ValueError(f"simulate: scaling must be 'weak' or 'strong', got {scaling!r}")
    cluster = presets.preset(preset) if isinstance(preset, str) else preset
    f1, args1 = builder(1)
    g1 = f1.get_graph(*args1)
    f2, args2 = builder(2)
    g2 = f2.get_graph(*args2)
    if scaling == "strong":
        graphs, total = _strong_graphs(devices, args1, g1, f2, args2, g2)
        graph_of = {n: graphs[total // n] for n in {1, *devices}}
    else:
        flops1, flops2 = _compute_flops(g1), _compute_flops(g2)
        if abs(flops1 - flops2) > 0.05 * max(flops1, flops2, 1):
            raise ValueError(f"simulate models weak scaling by default (the same "
                             f"per-replica batch at every device count), but the builder's "
                             f"step does {flops1:,} FLOPs per replica on 1 device and "
                             f"{flops2:,} on 2; give each replica the same batch (global "
                             "batch = per-replica batch * n), or pass scaling='strong' "
                             "(--scaling strong) for a fixed global batch")
        graph_of = dict.fromkeys({1, *devices}, g2)
    if cluster is not None:
        return _on_cluster(cluster, devices, graph_of, scaling, overlap)
    cal = load_calibration(calibration, recalibrate)
    costs = _resolve(cross_device_ops, f2, link, cal, shared_host, num_groups,
                     devices_per_worker)
    scale = 1.0
    if compute_s is not None or measure:
        # the best of `repeat` steps: what the step costs when nothing else runs
        measured = compute_s if compute_s is not None else best_time(
            lambda: f1(*args1), repeat, min_seconds)
        # scaled on the 1-device graph: what only n > 1 runs (packing the gradient buckets)
        # keeps its modelled cost
        one = sum(eqn_seconds(e, cal) for e in g1.eqns if not e.op.collective)
        scale = measured / max(one, 1e-12)
    models = {id(g): {e: eqn_seconds(e, cal) * scale for e in g.eqns if not e.op.collective}
              for g in graph_of.values()}
    out = [_row(n, graph_of[n], models[id(graph_of[n])], costs, overlap) for n in devices]
    return _with_efficiency(out, sum(models[id(graph_of[1])].values()), scaling)


def _with_efficiency(rows: list[dict], base: float, scaling: str) -> list[dict]:
    """Each row's efficiency against `base`, T1 (one device, no collectives)."""
    for row in rows:
        n = row["devices"] if scaling == "strong" else 1
        row["efficiency"] = base / (n * row["step_s"]) if row["step_s"] else 1.0
    return rows


def _filter_shape(eqn) -> tuple | None:
    """(kh, kw, in, out) of a convolution eqn (forward or either gradient), else None."""
    if eqn.op is conv2d_backprop_filter_p:
        return tuple(eqn.outputs[0].ty.shape)
    if eqn.op in (conv2d_p, conv2d_backprop_input_p):
        return tuple(eqn.inputs[1].ty.shape)
    return None


def roofline_seconds(eqn, gpu, nbytes: float | None = None) -> float:
    """One compute eqn's time on `gpu` (presets.GPU): its op's FLOPs and bytes touched
    (the op's cost rule, or `nbytes`) through the roofline of its cost kind; a 3x3
    stride-1 convolution does presets.WINOGRAD_SPEEDUP times fewer multiplies."""
    flops, touched = eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                                 dict(eqn.params))
    shape, params = _filter_shape(eqn), dict(eqn.params)
    if (shape is not None and shape[:2] == (3, 3) and tuple(params.get("strides", ())) == (1, 1)
            and tuple(params.get("dilations", (1, 1))) == (1, 1)):
        flops /= presets.WINOGRAD_SPEEDUP
    return gpu.op_seconds(flops, touched if nbytes is None else nbytes, eqn.op.cost_kind)


def fused_bytes(g) -> dict:
    """{elementwise eqn: bytes it moves when chains of elementwise ops run as one kernel},
    as GPU frameworks run them (cuDNN's batch norm, XLA and TorchScript fusion): an
    elementwise eqn reads only the inputs no elementwise eqn made and writes only the
    outputs something else (or the step's result) reads."""
    made_by = {v: e for e in g.eqns for v in e.outputs}
    read_by: dict = {}
    for e in g.eqns:
        for v in e.inputs:
            if isinstance(v, Var):
                read_by.setdefault(v, []).append(e)

    def elementwise(e) -> bool:
        return e is not None and not e.op.collective and e.op.cost_kind == "elementwise"

    out = {}
    for e in g.eqns:
        if elementwise(e):
            reads = sum(v.ty.nbytes for v in e.inputs
                        if isinstance(v, Var) and not elementwise(made_by.get(v)))
            writes = sum(v.ty.nbytes for v in e.outputs
                         if not read_by.get(v) or not all(map(elementwise, read_by[v])))
            out[e] = reads + writes
    return out


def _on_cluster(cluster, devices, graph_of: dict, scaling: str, overlap: bool) -> list[dict]:
    """simulate() on a preset cluster: the roofline prices compute (elementwise chains
    fused, fused_bytes), the cluster's hierarchical all-reduce the collectives
    (presets.py)."""
    models = {}
    for g in graph_of.values():
        fused = fused_bytes(g)
        models[id(g)] = {e: roofline_seconds(e, cluster.gpu, fused.get(e)) for e in g.eqns
                         if not e.op.collective}
    assumed = {"preset": cluster.name, "gpus_per_node": cluster.gpus_per_node}
    rows = [_scheduled(n, graph_of[n], models[id(graph_of[n])],
                       lambda e, n=n: cluster.collective_seconds(e.op.name, n, _payload(e)),
                       not overlap, 1, {**assumed, "overlap": bool(overlap)})
            for n in devices]
    return _with_efficiency(rows, sum(models[id(graph_of[1])].values()), scaling)
