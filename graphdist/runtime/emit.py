"""The emitter: a placed, scheduled one-device graph and its buffer plan (runtime/buffers.py)
become the lines of a generated Python function: a flat list of direct calls (ufuncs with
`out=`, bound impls, kernels) on pre-resolved names, no per-node lookups at run time. It
allocates the plan's buffers, names every value, and adds the glue: device streams,
cross-device sends and receives, profiling timers, result copies and state write-back.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from graphdist import config
from graphdist.device.backends import Backend, backend_for
from graphdist.device.host import HOST_KERNELS
from graphdist.ir import Graph, Lit, Var
from graphdist.ir.types import is_float
from graphdist.runtime import control_flow, kernel_table, numerics, warmup
from graphdist.runtime.buffers import Buffer, BufferPlan, Place
from graphdist.runtime.program import Program, compile_program
from graphdist.runtime.streams import StreamOrder


class Emitter:
    def __init__(self, g: Graph, plan: BufferPlan, backend: Backend, storage: dict,
                 imports: dict | None = None, exports: dict | None = None,
                 events: list | None = None, replica_devices: tuple = ()):
        self.g = g
        # the step's devices in replica order, where this program is one device's of several
        # (a thread per device): the errors name a value's replica by them
        self.replica_devices = replica_devices or g.devices
        self.plan = plan
        self.kernel_calls: list = []      # warmup.KernelCall of each kernel the program calls
        self.events = events              # profiling: (eqn index, start, end) per eqn run
        self.imports = imports or {}      # Var made on another device -> its wait() callable
        self.exports = exports or {}      # Var another device reads -> its post() callable
        self.backend = backend            # the device of unplaced values, and the default
        self.xp = backend.xp
        self.streams = StreamOrder(self) if backend.ordered else None
        self.storage = storage            # state input Var -> the variable's component array
        self.env: dict = {"_np": np}
        if events is not None:
            import time

            self.env.update(_events=events, _clock=time.perf_counter)
        self.name: dict = {}              # Var -> expression naming its value
        self.buffer_name: dict = {}       # Buffer -> the global holding its array
        self.lines: list[str] = []
        self.line_eqn: list = []          # the eqn each line runs (None for glue)
        self.counter = itertools.count()
        self.numerics = config.numerics_checked()   # a check after every float node
        for buffer, inside in plan.packed.values():   # packed buffers and their slices first
            for b in (buffer, *inside.values()):
                self.buffer_name[b] = self.glob("B", self.allocate(b))

    # ------------------------------------------------------------ naming
    def backend_of(self, device) -> Backend:
        return self.backend if device is None or device == self.backend.device \
            else backend_for(device)

    def glob(self, prefix: str, obj) -> str:
        name = f"{prefix}{next(self.counter)}"
        self.env[name] = obj
        return name

    def ref(self, v) -> str:
        if isinstance(v, Lit):
            return self.glob("L", np.asarray(v.value, dtype=v.ty.dtype)[()])
        return self.name[v]

    def emit(self, line: str, eqn=None) -> None:
        self.lines.append("    " + line)
        self.line_eqn.append(eqn)

    def place_name(self, place: Place) -> str:
        """The name of the array a planned place denotes, allocated on first use."""
        if place.kind == "storage":
            return self.name[place.source]
        buffer = place.buffer
        if buffer not in self.buffer_name:
            self.buffer_name[buffer] = self.glob("B", self.allocate(buffer))
        return self.buffer_name[buffer]

    def allocate(self, buffer: Buffer):
        if buffer.base is None:
            return self.backend_of(buffer.device).empty(buffer.shape, buffer.dtype)
        base = self.env[self.place_name(Place("arena", buffer.base))]
        if buffer.offset is not None:
            base = base[buffer.offset:buffer.offset + math.prod(buffer.shape)]
        return base.reshape(buffer.shape)

    # ------------------------------------------------------------ eqns
    def lower_eqn(self, i: int, eqn) -> None:
        for v in eqn.inputs:      # waiting for another device's value is not this eqn's time
            if v in self.imports and v not in self.name:
                self.name[v] = f"v{next(self.counter)}"
                self.emit(f"{self.name[v]} = {self.glob('W', self.imports[v])}()")
        if self.events is not None:
            self.emit("_t0 = _clock()")
            before = len(self.lines)
        if self.streams is not None:
            self.streams.before(eqn)
        body = len(self.lines)
        self.lower_eqn_body(i, eqn)
        if self.streams is not None:
            self.streams.after(eqn)
        if self.numerics and len(self.lines) > body:   # not an alias, constant or fixed view
            self.check_numerics(eqn)
        for v in eqn.outputs:
            if v in self.exports:
                self.emit(f"{self.glob('P', self.exports[v])}({self.name[v]})")
        if self.events is not None:
            if len(self.lines) > before:
                if self.streams is not None:   # a profile times the GPU's work, not the launch
                    backend = self.backend_of(eqn.device)
                    self.emit(f"{self.glob('Y', backend.synchronize)}()")
                self.emit(f"_events.append(({i}, _t0, _clock()))")
            else:
                self.lines.pop()
                self.line_eqn.pop()

    def lower_eqn_body(self, i: int, eqn) -> None:
        op = eqn.op
        form = self.plan.forms[i]
        params = dict(eqn.params)
        backend = self.backend_of(eqn.device)
        if form.kind == "constant":
            self.name[eqn.outputs[0]] = self.glob("C", backend.from_host(params["value"].value))
            return
        if form.kind == "alias":
            self.name[eqn.outputs[0]] = self.ref(eqn.inputs[op.alias_input])
            return
        if form.kind == "packed":
            self.lower_packed_concat(eqn)
            return
        if op.view and self.static_view(eqn, backend, params):
            return
        if control_flow.lowers(op):       # cond / while / scan: their bodies' programs
            control_flow.lower_eqn(self, eqn, backend)
            return
        args = ", ".join(self.ref(v) for v in eqn.inputs)
        if form.kind == "inplace":
            self.note_kernel(form.kernel, params, warmup.INPLACE, eqn)
            self.lower_inplace(eqn, form.kernel, params)
        elif form.kind == "ufunc":
            buf = self.place_name(self.plan.places[eqn.outputs[0]])
            fn = self.glob("U", getattr(backend.xp, form.ufunc))
            self.emit(f"{fn}({args}, out={buf})", eqn)
            self.name[eqn.outputs[0]] = buf
        elif form.kind == "out":
            if form.out_kernel is not None:
                self.note_kernel(form.out_kernel, params, warmup.OUT, eqn)
            place = self.plan.places[eqn.outputs[0]]
            buf = (self.fresh_buffer(eqn.outputs[0]) if place.kind == "fresh"
                   else self.place_name(place))
            fn = self.glob("O", functools.partial(form.out_impl, **params))
            self.emit(f"{fn}({buf}{', ' if args else ''}{args})", eqn)
            self.name[eqn.outputs[0]] = buf
        elif form.kind == "outs":
            self.lower_outs(eqn, form, args, params)
        else:
            fn = (self.glob("U", getattr(backend.xp, form.ufunc)) if form.ufunc and not params
                  else self.glob("F", functools.partial(op.impl, backend.xp, **params)))
            names = [f"v{next(self.counter)}" for _ in eqn.outputs]
            target = names[0] if op.num_outputs == 1 else ", ".join(names) + ","
            self.emit(f"{target} = {fn}({args})", eqn)
            self.name.update(zip(eqn.outputs, names))

    def check_numerics(self, eqn) -> None:
        """gd.config.check_numerics: after a node, a check of each float output (one
        reduction), given the inputs too, to say which were finite when one is not."""
        ins = "".join(f", {self.ref(v)}" for v in eqn.inputs)
        devices, runs_on = self.replica_devices, eqn.device or self.backend.device
        for k, v in enumerate(eqn.outputs):
            if not is_float(v.ty.dtype):
                continue
            device = v.device or runs_on       # a collective's outputs lie on every device
            backend = self.backend_of(device)
            where = f"{device} (replica {devices.index(device)})" \
                if len(devices) > 1 and device in devices else device
            switch = functools.partial(numerics.on_device, backend) if device != runs_on \
                else None
            check = self.glob("N", numerics.checker(eqn, k, backend.xp, where, switch))
            self.emit(f"{check}({self.name[v]}{ins})")

    def lower_outs(self, eqn, form, args: str, params: dict) -> None:
        """Several outputs: out_impl(xp, (out0, out1, ...), *ins), or the device's kernel."""
        places = [self.plan.places[v] for v in eqn.outputs]
        bufs = [self.fresh_buffer(v) if place.kind == "fresh" else self.place_name(place)
                for v, place in zip(eqn.outputs, places)]
        kernel = form.kernel
        if kernel is not None or form.out_kernel is not None:
            self.note_kernel(kernel or form.out_kernel, params, warmup.OUTS, eqn)
        fn = self.glob("O", functools.partial(kernel, **params) if kernel is not None
                       else functools.partial(form.out_impl, **params))
        self.emit(f"{fn}(({', '.join(bufs)},){', ' if args else ''}{args})", eqn)
        self.name.update(zip(eqn.outputs, bufs))

    def static_view(self, eqn, backend, params) -> bool:
        """A view of buffers that keep their identity for the program's life (arena
        buffers, variable storage, constants, other such views) is made once, here, rather
        than on every run. Ops that would copy instead (a reshape of a transposed buffer)
        stay in the program."""
        names = [self.ref(v) for v in eqn.inputs]
        if not names or not all(isinstance(v, Var) and n[0] in "BSCV" for v, n in
                                zip(eqn.inputs, names)):
            return False
        source = self.env[names[0]]
        with backend.current():
            made = eqn.op.impl(backend.xp, *(self.env[n] for n in names), **params)
            outs = made if eqn.op.num_outputs != 1 else (made,)
            if not all(backend.xp.may_share_memory(o, source) for o in outs):
                return False      # it copied (numpy hides the copy behind a view of it)
        for v, o in zip(eqn.outputs, outs):
            self.name[v] = self.glob("V", o)
        return True

    def fresh_buffer(self, v: Var) -> str:
        """A new array each call, for a value handed to the caller (no copy on return)."""
        name = f"v{next(self.counter)}"
        empty = self.glob("E", functools.partial(self.backend_of(v.device).empty, v.ty.shape,
                                                 v.ty.dtype))
        self.emit(f"{name} = {empty}()")
        return name

    def lower_packed_concat(self, eqn) -> None:
        buffer, inside = self.plan.packed[eqn]
        name = self.place_name(Place("arena", buffer))
        offset = 0
        for v in eqn.inputs:
            size = v.ty.size
            if v not in inside:   # not computed in place: copy it into its slice
                self.emit(f"{name}[{offset}:{offset + size}] = {self.ref(v)}.reshape(-1)", eqn)
            offset += size
        self.name[eqn.outputs[0]] = name

    def note_kernel(self, kernel, params, form: str, eqn) -> None:
        """Remember a host kernel call for warmup (what a first call may run without); an
        in-place numpy form (unfused, or deferred) has nothing to load."""
        if kernel_table.is_numpy_twin(kernel):
            return
        if self.backend_of(eqn.device).kernel_kind == HOST_KERNELS:
            ins = tuple(v.ty if isinstance(v, Var) else np.asarray(v.value, v.ty.dtype)[()]
                        for v in eqn.inputs)
            self.kernel_calls.append(warmup.KernelCall(
                eqn.op.name, functools.partial(kernel, **params), form, ins,
                tuple(v.ty for v in eqn.outputs)))

    def lower_inplace(self, eqn, kernel, params) -> None:
        """A kernel that updates some inputs in place: into the buffers the plan donated,
        into copies of the others."""
        targets = {}
        inplace = eqn.op.inplace(eqn.params) if callable(eqn.op.inplace) else eqn.op.inplace
        for o, j in inplace.items():
            v, out = eqn.inputs[j], eqn.outputs[o]
            name = self.ref(v)
            if self.plan.places[out].kind == "copy":
                copy = f"v{next(self.counter)}"
                self.emit(f"{copy} = {name}.copy()")
                name = copy
            targets[j] = name
            self.name[out] = name
        args = ", ".join(targets.get(j, self.ref(v)) for j, v in enumerate(eqn.inputs))
        fn = self.glob("K", functools.partial(kernel, **params))
        self.emit(f"{fn}({args})", eqn)

    def drop_fresh(self, i: int) -> None:
        for group in self.plan.drops.get(i, ()):
            self.emit(f"del {', '.join(self.name[v] for v in group)}")

    # ------------------------------------------------------------ whole graph
    def run(self) -> Program:
        g = self.g
        params = [v for v in g.inputs[: g.num_args] if v not in self.imports]
        arg_names = [f"a{k}" for k in range(len(params))]
        self.name.update(zip(params, arg_names))
        for v in g.inputs[g.num_args:]:
            self.name[v] = self.glob("S", self.storage[v])
        if self.streams is not None:
            self.streams.start(zip(params, arg_names))
        for v in g.inputs:      # inputs another device reads: send them first thing
            if v in self.exports and v in self.name:
                self.emit(f"{self.glob('P', self.exports[v])}({self.name[v]})")
        for i, eqn in enumerate(g.eqns):
            self.lower_eqn(i, eqn)
            self.drop_fresh(i)
        results = []
        for v in g.outputs:          # outputs another device made: receive them
            if v in self.imports and v not in self.name:
                self.name[v] = f"v{next(self.counter)}"
                self.emit(f"{self.name[v]} = {self.glob('W', self.imports[v])}()")
        for v, copy in zip(g.outputs[: g.num_results], self.plan.copy_results):
            ref = self.ref(v)
            if isinstance(v, Lit):
                results.append(f"_np.array({ref})")
            elif self.streams is not None:   # to the host, on the stream that made it
                results.append(f"v{next(self.counter)}")
                self.emit(f"{results[-1]} = {self.streams.to_host(v)}({ref})")
            elif not copy:
                results.append(ref)
            else:   # arena, storage or an input: copy now, before state is written
                results.append(f"v{next(self.counter)}")
                self.emit(f"{results[-1]} = {ref}.copy()")
        self.write_state()
        self.emit(f"return ({', '.join(results)}{',' if len(results) == 1 else ''})")
        return compile_program(self.lines, self.line_eqn, self.env, arg_names, self.g,
                               self.events)

    def write_state(self) -> None:
        g = self.g
        pending = [(self.name[s_in], self.ref(final)) for s_in, final in
                   zip(g.inputs[g.num_args:], g.outputs[g.num_results:])
                   if self.ref(final) != self.name[s_in]]
        storages = {dst for dst, _ in pending}
        snap = {}
        for _, src in pending:   # a swap (a := b, b := a) must read both before writing
            if src.startswith("S") and src in storages and src not in snap:
                snap[src] = f"v{next(self.counter)}"
                self.emit(f"{snap[src]} = {src}.copy()")
        finals = {self.name[s_in]: (s_in, final) for s_in, final in
                  zip(g.inputs[g.num_args:], g.outputs[g.num_results:])}
        for dst, src in pending:
            if self.streams is not None:
                self.streams.before_write(*finals[dst])
            self.emit(f"_np.copyto({dst}, {snap.get(src, src)})" if self.xp is np else
                      f"{dst}[...] = {snap.get(src, src)}")
            if self.streams is not None:
                self.streams.after_write(*finals[dst])
