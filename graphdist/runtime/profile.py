"""Chrome trace events from a profiled run: one lane (thread) per device and one for its
collectives, one complete ("X") event per node, with the node's index in the placed graph
so a bar can be found in the graph views. Opens in Perfetto (ui.perfetto.dev) and
chrome://tracing. `profile_report` sums a trace into compute, collective and exposed
collective seconds per step."""

from __future__ import annotations

import json
import os

from graphdist.ir import eqn_text
from graphdist.ir.printer import Namer
from graphdist.runtime.overlap import collective_wait_p, is_start


def chrome_trace(executable, name: str = "step", steps=()) -> dict:
    """`steps`: (start, end) perf_counter times of the calls of a multi-step run, each drawn
    as a "step k" slice around its nodes on every lane. Every device has a second lane,
    "<device> collectives", holding its collectives with their real start and end: an
    overlapped one (runtime/overlap.py) as its communication thread ran it, each with the
    part of it no compute of its program covered (`exposed_ms`); the program's wait for it
    is a "wait" event on the compute lane."""
    programs = executable.programs
    starts = [e[1] for p in programs for e in p.events] + [b[0] for b in steps]
    origin = min(starts) if starts else 0.0
    index = {id(eqn): i for i, eqn in enumerate(executable.graph.eqns)}
    namer = Namer(executable.graph.devices)     # the names the text form gives
    graph = executable.graph
    label = f"graphdist {name}" + (" (replicas merged)" if graph.merged else "")
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": label}}]
    lanes = {device: lane for lane, device in enumerate(executable.devices)}
    comm_lanes = {device: len(lanes) + lane for device, lane in lanes.items()}
    for device, lane in lanes.items():
        for tid, text in ((lane, device), (comm_lanes[device], f"{device} collectives")):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"name": text}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"sort_index": tid}})
    for k, (start, end) in enumerate(steps):
        for lane in (*lanes.values(), *comm_lanes.values()):
            events.append({"name": f"step {k}", "cat": "step", "ph": "X", "pid": 0,
                           "tid": lane, "ts": (start - origin) * 1e6,
                           "dur": (end - start) * 1e6, "args": {"step": k}})
    nodes = []
    for p, program in enumerate(programs):
        eqns = program.graph.eqns
        for i, start, end in program.events:
            if not is_start(eqns[i].op):       # its span comes from the thread that ran it
                nodes.append((p, eqns[i], start, end))
        for eqn in eqns:
            if is_start(eqn.op):
                nodes.extend((p, eqn, t0, t1) for t0, t1 in eqn.attrs["channel"].times()
                             if t0 >= origin)
    compute: dict = {}            # program -> its compute intervals (perf_counter)
    for p, eqn, start, end in nodes:
        if _category(eqn) == "compute":
            compute.setdefault(p, []).append((start, end))
    covered = {p: _union(spans) for p, spans in compute.items()}
    for p, eqn, start, end in nodes:
        cat = _category(eqn)
        in_types = [v.ty for v in eqn.inputs]
        out_types = [v.ty for v in eqn.outputs] if not is_start(eqn.op) else \
            list(eqn.attrs["channel"].out_types)
        flops, nbytes = eqn.op.cost(in_types, out_types, dict(eqn.params))
        args = {"node": index.get(id(eqn)), "scope": eqn.scope,
                "eqn": eqn_text(eqn, namer), "flops": flops, "bytes": nbytes,
                "source": eqn.source}
        if cat == "collective":
            hidden = _overlap_length((start, end), covered.get(p, []))
            args["exposed_ms"] = max(0.0, end - start - hidden) * 1e3
            args["overlapped"] = is_start(eqn.op)
            tids = [(d, comm_lanes[d]) for d in _devices_of(eqn, lanes, executable)]
        else:
            device = eqn.device if eqn.device in lanes else executable.devices[0]
            tids = [(device, lanes[device])]
        title = eqn.attrs["channel"].collective.name if is_start(eqn.op) else eqn.op.name
        for device, tid in tids:
            events.append({"name": title, "cat": cat, "ph": "X", "pid": 0, "tid": tid,
                           "ts": (start - origin) * 1e6, "dur": max(0.0, (end - start) * 1e6),
                           "args": {**args, "device": device, "program": p}})
    mode = "one device" if len(graph.devices) < 2 else ("merged" if graph.merged
                                                           else "per-device")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"function": name, "devices": list(graph.devices), "mode": mode,
                          "note": graph.mode_note() or f"{mode}: one lane per device"}}


def _category(eqn) -> str:
    if eqn.op is collective_wait_p:
        return "wait"
    return "collective" if is_start(eqn.op) or eqn.op.collective else "compute"


def _devices_of(eqn, lanes: dict, executable) -> list:
    """The devices a collective serves: those of its replicas' buffers."""
    found = [v.device for v in eqn.inputs if getattr(v, "device", None) in lanes]
    found = list(dict.fromkeys(found))
    if found:
        return found
    return [eqn.device if eqn.device in lanes else executable.devices[0]]


def _union(spans) -> list:
    """Sorted, disjoint intervals covering `spans`."""
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap_length(span, union: list) -> float:
    a, b = span
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


def profile_report(trace: dict) -> dict:
    """Per step of a profiled run (`Function.profile`, `call_many(..., profile=True)`):
    compute seconds (the time some node computed), collective seconds (the time some
    collective ran) and exposed collective seconds (collective time during which no compute
    ran: what communication added to the step), overall and per device; exposed_fraction =
    exposed / collective. `overlapped_s` and `overlapped_exposed_s` count the collectives
    started early alone (overlapped_exposed_fraction: how well the overlap hid the buckets
    it could split; the rest of the collective time is the inline ones, such as the last
    bucket). A run without step slices is one step.

    >>> report = gd.profile_report(step.profile(batch))
    >>> report["steps"][0]["exposed_s"], report["exposed_fraction"]
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({(e["args"]["step"], e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "step"})
    nodes = [e for e in events if e.get("cat") in ("compute", "collective", "wait")]
    if not steps:
        lo = min((e["ts"] for e in nodes), default=0.0)
        hi = max((e["ts"] + e["dur"] for e in nodes), default=0.0)
        steps = [(0, lo, hi)]
    rows = []
    for k, lo, hi in steps:
        inside = [e for e in nodes if lo <= e["ts"] + e["dur"] / 2 <= hi]
        row = {"step": k, "seconds": (hi - lo) * 1e-6, **_times(inside), "devices": {}}
        for device in sorted({e["args"]["device"] for e in inside}):
            mine = [e for e in inside if e["args"]["device"] == device]
            programs = {e["args"]["program"] for e in mine}
            # a device's compute is its program's: devices run as one program share it
            row["devices"][device] = _times(
                [e for e in inside if e["cat"] != "collective" and e["args"]["program"]
                 in programs] + [e for e in mine if e["cat"] == "collective"])
        rows.append(row)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in
            ("compute_s", "collective_s", "exposed_s", "overlapped_s", "overlapped_exposed_s")}
    return {"steps": rows, **mean,
            "exposed_fraction": _fraction(mean["exposed_s"], mean["collective_s"]),
            "overlapped_exposed_fraction": _fraction(mean["overlapped_exposed_s"],
                                                     mean["overlapped_s"])}


def _fraction(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _times(events: list) -> dict:
    """compute, collective and exposed seconds of events (microsecond ts/dur), and the same
    for the collectives started early (`args.overlapped`) alone: what the overlap stage
    hid of the buckets it could split, apart from the inline ones (the last bucket, ready
    when the backward pass ends, which nothing is left to hide)."""
    def spans(keep):
        return _union((e["ts"], e["ts"] + e["dur"]) for e in events if keep(e))

    compute = spans(lambda e: e["cat"] == "compute")

    def total_and_exposed(keep):
        collective = spans(lambda e: e["cat"] == "collective" and keep(e))
        total = sum(b - a for a, b in collective)
        hidden = sum(_overlap_length(s, compute) for s in collective)
        return total * 1e-6, max(0.0, total - hidden) * 1e-6

    collective_s, exposed_s = total_and_exposed(lambda e: True)
    overlapped_s, overlapped_exposed_s = total_and_exposed(
        lambda e: e.get("args", {}).get("overlapped", False))
    return {"compute_s": sum(b - a for a, b in compute) * 1e-6,
            "collective_s": collective_s, "exposed_s": exposed_s,
            "overlapped_s": overlapped_s, "overlapped_exposed_s": overlapped_exposed_s}


def write_trace(trace: dict, path) -> str:
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path
