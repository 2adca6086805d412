"""Lowering: a placed, scheduled one-device graph becomes a generated Python function.

The generated code is a flat list of direct calls (ufuncs with `out=`, bound impls,
kernels) on pre-resolved names: no per-node lookups at run time. Buffers come from a
static plan made here: outputs of 16 KiB or more get arena buffers reused after their
last use, elementwise ops may write over a dying input, and a value that becomes a
variable's final state is computed straight into the variable's storage when safe.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from graphdist import config
from graphdist.device.backends import Backend, backend_for
from graphdist.ir import Graph, Lit, Var
from graphdist.ir.liveness import liveness
from graphdist.ir.types import LOW_PRECISION
from graphdist.runtime import kernel_table, warmup
from graphdist.runtime.program import Program, compile_program
from graphdist.runtime.streams import StreamOrder

ARENA_MIN_BYTES = 16 * 1024


class _Lowering:
    def __init__(self, g: Graph, backend: Backend, storage: dict, fused: bool,
                 imports: dict | None = None, exports: dict | None = None,
                 events: list | None = None, deferred: bool = False):
        self.g = g
        self.deferred = deferred          # kernels with an exact numpy form: that form
        self.kernel_calls: list = []      # warmup.KernelCall of each kernel the program calls
        self.events = events              # profiling: (eqn index, start, end) per eqn run
        self.imports = imports or {}      # Var made on another device -> its wait() callable
        self.exports = exports or {}      # Var another device reads -> its post() callable
        self.backend = backend            # the device of unplaced values, and the default
        self.xp = backend.xp
        self.streams = StreamOrder(self) if backend.ordered else None
        self.storage = storage            # state input Var -> the variable's component array
        self.fused = fused
        self.live = g.liveness or liveness(g)
        if self.exports:   # another device reads these whenever it gets there: never reuse
            last_use = dict(self.live.last_use)
            for v in self.exports:
                last_use[self.live.root.get(v, v)] = len(g.eqns)
            self.live = type(self.live)(self.live.root, last_use, self.live.peak_bytes)
        self.env: dict = {"_np": np}
        if events is not None:
            import time

            self.env.update(_events=events, _clock=time.perf_counter)
        self.name: dict = {}              # Var -> expression naming its value
        self.arena_of: dict = {}          # root Var -> arena buffer name
        self.pool: dict = {}              # (shape, dtype) -> free arena buffer names
        self.lines: list[str] = []
        self.line_eqn: list = []          # the eqn each line runs (None for glue)
        self.counter = itertools.count()
        self.fresh_names: dict = {}       # root Var -> names of fresh arrays viewing it
        self.returned = {v for v in g.outputs[: g.num_results] if isinstance(v, Var)}
        self.placed: dict = {}            # Var -> expression of its slice in a concat buffer
        self.packed: dict = {}            # concat eqn -> (buffer name, inputs already in place)
        self.plan_packing()

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

    # ------------------------------------------------------------ buffers
    def root(self, v):
        return self.live.root.get(v, v)

    def dies_at(self, v, i: int) -> bool:
        return isinstance(v, Var) and self.live.last_use.get(self.root(v)) == i

    def sink_storage(self, out: Var, i: int, elementwise: bool):
        """The variable storage `out` may be written into: `out` is that variable's final
        state and the old value is not read after eqn i (or only by this elementwise eqn)."""
        g = self.g
        for var_in, final in zip(g.inputs[g.num_args:], g.outputs[g.num_results:]):
            if self.root(final) is out and final is not var_in:
                last = self.live.last_use.get(var_in, -1)
                if last < i or (last == i and elementwise):
                    return self.name[var_in]
        return None

    def plan_packing(self) -> None:
        """Zero-copy packing: a value that only exists to be flattened into a 1-D concat (a
        gradient going into its all-reduce bucket) is computed straight into its slice of
        the concat's buffer, so the concat copies nothing for it."""
        producer = {v: e for e in self.g.eqns for v in e.outputs}
        for i, eqn in enumerate(self.g.eqns):
            out = eqn.outputs[0] if eqn.op == "concat" else None
            if out is None or out.ty.ndim != 1 or out.ty.nbytes < ARENA_MIN_BYTES:
                continue
            name = self.glob("B", self.backend_of(eqn.device).empty(out.ty.shape, out.ty.dtype))
            offset, inside = 0, set()
            for v in eqn.inputs:
                root = self.packable(v, i, producer, out.ty.dtype)
                if root is not None:
                    view = self.env[name][offset:offset + v.ty.size].reshape(root.ty.shape)
                    self.placed[root] = self.glob("B", view)
                    inside.add(v)
                offset += v.ty.size
            self.packed[eqn] = (name, inside)

    def packable(self, v, i: int, producer: dict, dtype):
        """The value `v` flattens, if it can be computed in place in concat eqn i: v is
        reshape(x), x dies at the concat, and x's op writes into a given buffer."""
        made = producer.get(v)
        if made is None or made.op != "reshape" or not isinstance(made.inputs[0], Var):
            return None
        x = made.inputs[0]
        maker = producer.get(x)
        if (maker is None or maker.op.view or len(maker.outputs) != 1
                or not (maker.op.ufunc or maker.op.out_impl) or self.root(v) is not x):
            return None
        if (self.live.last_use.get(x) != i or x in self.returned or x.ty.dtype != dtype
                or x.ty.nbytes < ARENA_MIN_BYTES):
            return None
        return x

    def buffer_for(self, eqn, i: int, out: Var, k: int | None = None) -> str:
        """Where output `out` (the k-th, for an op with several) is computed: its slice of a
        packed concat, its variable's storage, a dying input's buffer, a pooled or a new
        arena buffer."""
        if out in self.placed:
            return self.placed[out]
        sink = self.sink_storage(out, i, eqn.op.elementwise and eqn.op.out_may_alias)
        if sink:
            return sink
        if eqn.op.out_may_alias:   # elementwise: any input; several outputs: input k
            for v in eqn.inputs if k is None else eqn.inputs[k:k + 1]:
                donated = self.donated(eqn, i, v, out)
                if donated:
                    return donated
        key = (out.ty.shape, out.ty.dtype, out.device)   # each device keeps its own buffers
        free = self.pool.get(key)
        if free:
            return free.pop()
        return self.glob("B", self.backend_of(out.device).empty(out.ty.shape, out.ty.dtype))

    def release(self, i: int, dying: list) -> None:
        for r in dying:
            buf = self.arena_of.pop(r, None)
            if buf is not None:
                self.pool.setdefault((r.ty.shape, r.ty.dtype, r.device), []).append(buf)
            names = self.fresh_names.pop(r, ())
            if names:
                self.emit(f"del {', '.join(names)}")

    # ------------------------------------------------------------ eqns
    def lower_eqn(self, i: int, eqn) -> None:
        if self.events is not None:
            self.emit("_t0 = _clock()")
            before = len(self.lines)
        for v in eqn.inputs:
            if v in self.imports and v not in self.name:
                self.name[v] = f"v{next(self.counter)}"
                self.emit(f"{self.name[v]} = {self.glob('W', self.imports[v])}()")
        if self.streams is not None:
            self.streams.before(eqn)
        self.lower_eqn_body(i, eqn)
        if self.streams is not None:
            self.streams.after(eqn)
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
        params = dict(eqn.params)
        backend = self.backend_of(eqn.device)
        xp = backend.xp
        if op == "constant":
            self.name[eqn.outputs[0]] = self.glob("C", backend.from_host(params["value"].value))
            return
        if op.alias_input is not None and op.name in ("read_var", "assign_var", "stop_gradient"):
            self.name[eqn.outputs[0]] = self.ref(eqn.inputs[op.alias_input])
            return
        if eqn in self.packed:
            self.lower_packed_concat(eqn)
            return
        if op.view and self.static_view(eqn, backend, params):
            return
        args = ", ".join(self.ref(v) for v in eqn.inputs)
        types = [v.ty for v in (*eqn.inputs, *eqn.outputs)]
        kernel = kernel_table.kernel(backend, op, types, self.deferred, self.fused)
        out_kernel = kernel_table.out_kernel(backend, op, types, self.fused, self.deferred)
        out_impl = kernel_table.out_impl(backend, op, types, self.fused, self.deferred)
        # a listed kernel of an op with several outputs writes them all, small ones too
        listed = not op.collective and out_kernel is not None
        if kernel is not None and op.inplace:
            self.note_kernel(kernel, params, warmup.INPLACE, eqn)
            self.lower_inplace(i, eqn, kernel, params)
            return
        (out, *more) = eqn.outputs
        # a returned value gets a fresh array (handed to the caller) rather than an arena
        # buffer plus a copy
        big = (not more and out.ty.nbytes >= ARENA_MIN_BYTES and not op.view
               and out not in self.returned)
        # a float16/bfloat16 matmul runs its impl (float32 accumulation), not numpy's ufunc
        ufunc = None if op.accumulates and any(t.dtype in LOW_PRECISION for t in types) \
            else op.ufunc
        if big and ufunc:
            buf = self.buffer_for(eqn, i, out)
            fn = self.glob("U", getattr(xp, ufunc))
            self.emit(f"{fn}({args}, out={buf})", eqn)
            self.bind_buffer(out, buf)
        elif big and out_impl is not None:
            if out_kernel is not None:
                self.note_kernel(out_kernel, params, warmup.OUT, eqn)
            buf = self.buffer_for(eqn, i, out)
            fn = self.glob("O", functools.partial(out_impl, **params))
            self.emit(f"{fn}({buf}{', ' if args else ''}{args})", eqn)
            self.bind_buffer(out, buf)
        elif more and (kernel is not None or out_impl is not None and not op.elementwise
                       and (listed or all(v.ty.nbytes >= ARENA_MIN_BYTES
                                          for v in eqn.outputs))):
            # several outputs: out_impl(xp, (out0, out1, ...), *ins), or the device's kernel
            bufs = [self.fresh_buffer(v) if v in self.returned else self.buffer_for(eqn, i, v, k)
                    for k, v in enumerate(eqn.outputs)]
            if kernel is not None or out_kernel is not None:
                self.note_kernel(kernel or out_kernel, params, warmup.OUTS, eqn)
            fn = self.glob("O", functools.partial(kernel, **params) if kernel is not None
                           else functools.partial(out_impl, **params))
            self.emit(f"{fn}(({', '.join(bufs)},){', ' if args else ''}{args})", eqn)
            for v, buf in zip(eqn.outputs, bufs):
                if buf.startswith("v"):
                    self.name[v] = buf
                    self.fresh_names.setdefault(v, []).append(buf)
                else:
                    self.bind_buffer(v, buf)
        else:
            fn = (self.glob("U", getattr(xp, ufunc)) if ufunc and not params
                  else self.glob("F", functools.partial(op.impl, xp, **params)))
            names = [f"v{next(self.counter)}" for _ in eqn.outputs]
            target = names[0] if op.num_outputs == 1 else ", ".join(names) + ","
            self.emit(f"{target} = {fn}({args})", eqn)
            self.name.update(zip(eqn.outputs, names))
            for v, n in zip(eqn.outputs, names):
                r = self.root(v)
                if r is v or r in self.fresh_names:
                    self.fresh_names.setdefault(r, []).append(n)

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

    def donated(self, eqn, i: int, v, out: Var) -> str | None:
        """Input v's buffer for `out`, when v (or the buffer v views, e.g. flattened) dies at
        this eqn and nothing else here reads it: one pass instead of a read and a fresh
        write. Only for ops whose out= impls may alias their inputs."""
        if not isinstance(v, Var) or not (eqn.op.elementwise or v.ty.size == out.ty.size):
            return None
        root = self.root(v)
        roots = [self.root(x) for x in eqn.inputs if isinstance(x, Var)]
        if not (root in self.arena_of and root not in self.placed and self.dies_at(root, i)
                and roots.count(root) == 1 and root.ty.dtype == out.ty.dtype
                and root.ty.size == out.ty.size and (root is v or not eqn.op.elementwise)):
            return None
        buf = self.arena_of.pop(root)
        if root.ty.shape == out.ty.shape:
            return buf
        return self.glob("B", self.env[buf].reshape(out.ty.shape))

    def fresh_buffer(self, v: Var) -> str:
        """A new array each call, for a value handed to the caller (no copy on return)."""
        name = f"v{next(self.counter)}"
        empty = self.glob("E", functools.partial(self.backend_of(v.device).empty, v.ty.shape,
                                                 v.ty.dtype))
        self.emit(f"{name} = {empty}()")
        return name

    def lower_packed_concat(self, eqn) -> None:
        name, inside = self.packed[eqn]
        offset = 0
        for v in eqn.inputs:
            size = v.ty.size
            if v not in inside:   # not computed in place: copy it into its slice
                self.emit(f"{name}[{offset}:{offset + size}] = {self.ref(v)}.reshape(-1)", eqn)
            offset += size
        self.bind_buffer(eqn.outputs[0], name)

    def bind_buffer(self, out: Var, buf: str) -> None:
        self.name[out] = buf
        if buf.startswith("B") and out not in self.placed:
            self.arena_of[out] = buf

    def note_kernel(self, kernel, params, form: str, eqn) -> None:
        """Remember a CPU kernel call for warmup (what a first call may run without); an
        in-place numpy form (unfused, or deferred) has nothing to load."""
        if (kernel in kernel_table.NUMPY_KERNELS.values()
                or kernel in kernel_table.NUMPY_OUT_KERNELS.values()):
            return
        if self.backend_of(eqn.device).kind == "cpu":
            ins = tuple(v.ty if isinstance(v, Var) else np.asarray(v.value, v.ty.dtype)[()]
                        for v in eqn.inputs)
            self.kernel_calls.append(warmup.KernelCall(
                eqn.op.name, functools.partial(kernel, **params), form, ins,
                tuple(v.ty for v in eqn.outputs)))

    def lower_inplace(self, i: int, eqn, kernel, params) -> None:
        """A kernel that updates some inputs in place (optimizer updates): donate buffers
        that die here, copy the others first."""
        targets = {}
        inplace = eqn.op.inplace(eqn.params) if callable(eqn.op.inplace) else eqn.op.inplace
        for o, j in inplace.items():
            v, out = eqn.inputs[j], eqn.outputs[o]
            name = self.ref(v)
            storage_ok = self.sink_storage(out, i, True) == name
            arena_ok = self.root(v) is v and v in self.arena_of and self.dies_at(v, i)
            if not (storage_ok or arena_ok):
                copy = f"v{next(self.counter)}"
                self.emit(f"{copy} = {name}.copy()")
                name = copy
            elif arena_ok:
                self.arena_of.pop(v)
                self.arena_of[out] = name
            targets[j] = name
            self.name[out] = name
        args = ", ".join(targets.get(j, self.ref(v)) for j, v in enumerate(eqn.inputs))
        fn = self.glob("K", functools.partial(kernel, **params))
        self.emit(f"{fn}({args})", eqn)

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
        dying: dict = {}
        for r, i in self.live.last_use.items():
            dying.setdefault(i, []).append(r)
        for i, eqn in enumerate(g.eqns):
            self.lower_eqn(i, eqn)
            self.release(i, dying.get(i, []))
        results = []
        for v in g.outputs:          # outputs another device made: receive them
            if v in self.imports and v not in self.name:
                self.name[v] = f"v{next(self.counter)}"
                self.emit(f"{self.name[v]} = {self.glob('W', self.imports[v])}()")
        for v in g.outputs[: g.num_results]:
            ref = self.ref(v)
            if isinstance(v, Lit):
                results.append(f"_np.array({ref})")
            elif self.streams is not None:   # to the host, on the stream that made it
                results.append(f"v{next(self.counter)}")
                self.emit(f"{results[-1]} = {self.streams.to_host(v)}({ref})")
            elif self.root(v) in self.fresh_names:
                results.append(ref)
            else:   # arena, storage or an input: copy now, before state is written
                results.append(f"v{next(self.counter)}")
                self.emit(f"{results[-1]} = {ref}.copy()")
        self.write_state()
        self.emit(f"return ({', '.join(results)}{',' if len(results) == 1 else ''})")
        return self.finish(arg_names)

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

    def finish(self, arg_names) -> Program:
        return compile_program(self.lines, self.line_eqn, self.env, arg_names, self.g,
                               self.events)

def lower(g: Graph, backend: Backend, storage: dict, fused: bool | None = None,
          imports: dict | None = None, exports: dict | None = None,
          events: list | None = None) -> Program:
    """Compile a placed one-device graph. `storage` maps each state input Var to the array
    holding that variable's component on this device; `imports`/`exports` connect values
    that cross to or from other devices (inputs listed among the graph's arguments)."""
    fused = config.fused_kernels() if fused is None else fused
    lowering = _Lowering(g, backend, storage, fused, imports, exports, events)
    program = lowering.run()
    if events is not None:          # profiled: time the kernels, not their first load
        warmup.load_now(lowering.kernel_calls)
    if events is not None or imports or exports or not warmup.enabled():
        return program
    calls = warmup.pending(lowering.kernel_calls)
    if not any(c.op in kernel_table.EXACT_FALLBACK for c in calls):
        return program
    first = _Lowering(g, backend, storage, fused, deferred=True).run()
    return warmup.tiered(program, first, calls)

