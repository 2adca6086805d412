"""From a logical graph to something callable: place it, schedule it, lower it per device."""

from __future__ import annotations

from graphdist.distribute import context
from graphdist.errors import TraceError
from graphdist.ir import Graph
from graphdist.passes import place, run_passes, schedule
from graphdist.runtime.backends import backend_for
from graphdist.runtime.lower import lower


class OneDeviceExecutable:
    def __init__(self, placed: Graph, program):
        self.graph = placed
        self.program = program
        self.source = program.source

    def __call__(self, arrays):
        return self.program(*arrays)


def _device_of(g: Graph) -> str:
    devices = {v.devices for v in g.variables}
    if len(devices) > 1:
        names = ", ".join(f"{v.name} on {list(v.devices)}" for v in g.variables)
        raise TraceError(f"one step uses variables placed on different devices: {names}")
    if devices:
        (devs,) = devices
        if len(devs) > 1:
            raise TraceError(f"variables {[v.name for v in g.variables]} are mirrored on "
                             f"{list(devs)}; run the step through that strategy's run()")
        return devs[0]
    return context.get_strategy().devices[0]


def compile_graph(g: Graph):
    device = _device_of(g)
    placed = run_passes(g, [lambda g: place(g, device), schedule])
    storage = {s: var.values[0] for s, var in zip(placed.inputs[placed.num_args:], g.variables)}
    return OneDeviceExecutable(placed, lower(placed, backend_for(device), storage))
