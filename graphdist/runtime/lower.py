"""Lowering: a placed, scheduled one-device graph becomes a generated Python function.

Two steps, each testable alone: runtime/buffers.py plans where every value lives (outputs
of 16 KiB or more get arena buffers reused after their last use, elementwise ops may write
over a dying input, a value that becomes a variable's final state is computed straight
into the variable's storage when safe), and runtime/emit.py writes the program's lines
from that plan. Here: both, and the tiered first program of runtime/warmup.py.
"""

from __future__ import annotations

from graphdist import config
from graphdist.device.backends import Backend
from graphdist.ir import Graph
from graphdist.runtime import kernel_table, warmup
from graphdist.runtime.buffers import plan_buffers
from graphdist.runtime.emit import Emitter
from graphdist.runtime.program import Program


def _emitter(g: Graph, backend: Backend, storage: dict, fused: bool, imports=None,
             exports=None, events=None, deferred: bool = False,
             replica_devices: tuple = ()) -> Emitter:
    plan = plan_buffers(g, backend, fused=fused, deferred=deferred, exports=exports or ())
    return Emitter(g, plan, backend, storage, imports, exports, events, replica_devices)


def lower(g: Graph, backend: Backend, storage: dict, fused: bool | None = None,
          imports: dict | None = None, exports: dict | None = None,
          events: list | None = None, replica_devices: tuple = ()) -> Program:
    """Compile a placed one-device graph. `storage` maps each state input Var to the array
    holding that variable's component on this device; `imports`/`exports` connect values
    that cross to or from other devices (inputs listed among the graph's arguments);
    `replica_devices`: the step's devices, where this is one device's program of several."""
    fused = config.fused_kernels() if fused is None else fused
    emitter = _emitter(g, backend, storage, fused, imports, exports, events,
                       replica_devices=replica_devices)
    program = emitter.run()
    if events is not None:          # profiled: time the kernels, not their first load
        warmup.load_now(emitter.kernel_calls)
    if events is not None or not warmup.enabled():
        return program
    calls = warmup.pending(emitter.kernel_calls)
    exact = kernel_table.exact_ops()
    if not any(c.op in exact for c in calls):
        return program
    # a device's program with a thread of its own (imports, exports: its values that cross
    # devices) switches forms between two of its calls too; the forms give the same bits
    first = _emitter(g, backend, storage, fused, imports, exports, deferred=True,
                     replica_devices=replica_devices).run()
    return warmup.tiered(program, first, calls)
