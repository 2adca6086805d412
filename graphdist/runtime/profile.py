"""Chrome trace events from a profiled run: one lane (thread) per device, one complete
("X") event per node, with the node's index in the placed graph so a bar can be found in
the graph views. Opens in Perfetto (ui.perfetto.dev) and chrome://tracing."""

from __future__ import annotations

import json
import os

from graphdist.ir import eqn_text
from graphdist.ir.printer import Namer


def chrome_trace(executable, name: str = "step", steps=()) -> dict:
    """`steps`: (start, end) perf_counter times of the calls of a multi-step run, each drawn
    as a "step k" slice around its nodes on every lane."""
    programs = executable.programs
    starts = [e[1] for p in programs for e in p.events] + [b[0] for b in steps]
    origin = min(starts) if starts else 0.0
    index = {id(eqn): i for i, eqn in enumerate(executable.graph.eqns)}
    namer = Namer(executable.graph.devices)     # the names the text form gives
    graph = executable.graph
    label = f"graphdist {name}" + (" (replicas merged)" if graph.merged else "")
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": label}}]
    lanes = {device: lane for lane, device in enumerate(executable.devices)}
    for device, lane in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": lane,
                       "args": {"name": device}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": lane,
                       "args": {"sort_index": lane}})
    for k, (start, end) in enumerate(steps):
        for lane in lanes.values():
            events.append({"name": f"step {k}", "cat": "step", "ph": "X", "pid": 0,
                           "tid": lane, "ts": (start - origin) * 1e6,
                           "dur": (end - start) * 1e6, "args": {"step": k}})
    for program in programs:
        eqns = program.graph.eqns
        for i, start, end in program.events:
            eqn = eqns[i]
            device = eqn.device if eqn.device in lanes else executable.devices[0]
            lane = lanes[device]
            in_types = [v.ty for v in eqn.inputs]
            flops, nbytes = eqn.op.cost(in_types, [v.ty for v in eqn.outputs], dict(eqn.params))
            events.append({
                "name": eqn.op.name, "cat": "collective" if eqn.op.collective else "compute",
                "ph": "X", "pid": 0, "tid": lane,
                "ts": (start - origin) * 1e6, "dur": max(0.0, (end - start) * 1e6),
                "args": {"node": index.get(id(eqn), i), "device": device, "scope": eqn.scope,
                         "eqn": eqn_text(eqn, namer), "flops": flops, "bytes": nbytes,
                         "source": eqn.source}})
    mode = "one device" if len(graph.devices) < 2 else ("merged" if graph.merged
                                                           else "per-device")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"function": name, "devices": list(graph.devices), "mode": mode,
                          "note": graph.mode_note() or f"{mode}: one lane per device"}}


def write_trace(trace: dict, path) -> str:
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path
