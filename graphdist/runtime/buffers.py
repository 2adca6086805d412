"""The buffer plan of a lowering: for each value of a placed, scheduled one-device graph,
how its eqn runs and where the value is computed (an arena buffer reused after its last
use, a dying input's buffer, its slice of a packed concat, its variable's storage, a fresh
array), and when buffers are freed. Plain data: it allocates and names nothing; the
emitter (runtime/emit.py) turns it into the program's lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphdist.device.backends import Backend, backend_for
from graphdist.ir import Graph, Var
from graphdist.ir.liveness import Liveness, liveness
from graphdist.ir.types import LOW_PRECISION
from graphdist.ops.array import concat_p, constant_p, reshape_p, stop_gradient_p
from graphdist.ops.state import assign_p, read_p
from graphdist.runtime import kernel_table

# a single output this big gets an arena buffer reused after its last use; smaller ones are
# fresh arrays (allocating them costs less than tracking them)
ARENA_MIN_BYTES = 16 * 1024

# ops whose output is their input's array under another name, in the generated code too
NAME_ALIASES = (read_p, assign_p, stop_gradient_p)


@dataclass(frozen=True, eq=False)
class Buffer:
    """An array allocated once, when the program is lowered, and reused by every call. With
    `base`, a view of that buffer reshaped to `shape` (of the flat slice from `offset`, if
    given). Compared by identity: two values share a buffer when their places hold the same
    Buffer."""

    shape: tuple
    dtype: np.dtype
    device: str | None
    base: Buffer | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Place:
    """Where one eqn output is computed. `kind`:
    constant  uploaded once, when the program is lowered
    alias     `source`'s array under another name (read_var, assign_var, stop_gradient)
    view      a view op's output: its input's memory (made once when that input is static)
    slice     `buffer`, its slice of a packed concat's buffer
    storage   straight into the storage of the variable whose state input is `source`
    arena     `buffer`; `source` is the input whose buffer it takes over, if any
    fresh     a new array every call
    copy      a copy of input `source` that an in-place kernel then updates
    """

    kind: str
    buffer: Buffer | None = None
    source: object = None


@dataclass(frozen=True)
class EqnForm:
    """How an eqn runs. `kind`: constant | alias | packed (a concat some inputs were computed
    inside) | inplace (a kernel updating inputs) | ufunc (out=) | out (an out_impl or
    out-kernel writing one buffer) | outs (a kernel or out_impl writing several) | call (an
    impl returning new arrays; a view op is first tried as a view made once)."""

    kind: str
    ufunc: str | None = None
    kernel: object = None
    out_kernel: object = None
    out_impl: object = None


@dataclass(frozen=True)
class BufferPlan:
    forms: tuple           # EqnForm of each eqn
    places: dict           # each eqn output Var -> its Place
    frees: dict            # eqn index -> arena Buffers back in the pool after that eqn
    drops: dict            # eqn index -> groups of Vars whose fresh arrays die after it
    packed: dict           # packed concat Eqn -> (its Buffer, {input computed in its slice:
    #                        that slice's Buffer})
    copy_results: tuple    # per result: copied on return (it lives in a buffer the program
    #                        keeps: arena, storage, an input), or its fresh array handed over
    live: Liveness         # what the plan used: values another device reads live to the end
    fused: bool = True     # the kernels it picked: fused ones; numpy forms while they load
    deferred: bool = False


def plan_buffers(g: Graph, backend: Backend, *, fused: bool, deferred: bool = False,
                 exports=()) -> BufferPlan:
    """Plan `g`'s buffers for `backend` (the device of unplaced values); `fused`/`deferred`
    pick kernels as the lowering does; `exports` are values other devices read whenever they
    get there, so their buffers are never reused."""
    return _Planner(g, backend, fused, deferred, exports).run()


class _Planner:
    def __init__(self, g: Graph, backend: Backend, fused: bool, deferred: bool, exports):
        self.g = g
        self.backend = backend
        self.fused = fused
        self.deferred = deferred
        self.live = g.liveness or liveness(g)
        if exports:
            last_use = dict(self.live.last_use)
            for v in exports:
                last_use[self.live.root.get(v, v)] = len(g.eqns)
            self.live = Liveness(self.live.root, last_use, self.live.peak_bytes)
        self.returned = {v for v in g.outputs[: g.num_results] if isinstance(v, Var)}
        self.places: dict = {}
        self.arena_of: dict = {}         # root Var -> the arena Buffer holding it
        self.pool: dict = {}             # (shape, dtype, device) -> free arena Buffers
        self.fresh: dict = {}            # root Var -> Vars naming fresh arrays of it
        # Var -> the state input whose storage is its very array (so writes need no copy)
        self.storage_of: dict = {v: v for v in g.inputs[g.num_args:]}
        self.placed: dict = {}           # Var -> its slice Buffer in a packed concat
        self.packed: dict = {}
        self.frees: dict = {}
        self.drops: dict = {}
        self.plan_packing()

    def run(self) -> BufferPlan:
        g = self.g
        dying: dict = {}
        for r, i in self.live.last_use.items():
            dying.setdefault(i, []).append(r)
        forms = []
        for i, eqn in enumerate(g.eqns):
            forms.append(self.form(eqn))
            self.place_outputs(i, eqn, forms[-1])
            self.release(i, dying.get(i, []))
        copy_results = tuple(isinstance(v, Var) and self.root(v) not in self.fresh
                             for v in g.outputs[: g.num_results])
        return BufferPlan(tuple(forms), self.places, self.frees, self.drops, self.packed,
                          copy_results, self.live, self.fused, self.deferred)

    # ------------------------------------------------------------ liveness
    def root(self, v):
        return self.live.root.get(v, v)

    def dies_at(self, v, i: int) -> bool:
        return isinstance(v, Var) and self.live.last_use.get(self.root(v)) == i

    def backend_of(self, device) -> Backend:
        return self.backend if device is None or device == self.backend.device \
            else backend_for(device)

    # ------------------------------------------------------------ forms
    def form(self, eqn) -> EqnForm:
        op = eqn.op
        if op is constant_p:
            return EqnForm("constant")
        if op.alias_input is not None and op in NAME_ALIASES:
            return EqnForm("alias")
        if eqn in self.packed:
            return EqnForm("packed")
        backend = self.backend_of(eqn.device)
        types = [v.ty for v in (*eqn.inputs, *eqn.outputs)]
        flags = dict(fused=self.fused, deferred=self.deferred)
        kernel = kernel_table.kernel(backend, op, types, **flags)
        out_kernel = kernel_table.out_kernel(backend, op, types, **flags)
        out_impl = kernel_table.out_impl(backend, op, types, **flags)
        # a float16/bfloat16 matmul runs its impl (float32 accumulation), not numpy's ufunc;
        # a registered out= kernel runs in place of the ufunc
        ufunc = None if out_kernel is not None or op.accumulates and any(
            t.dtype in LOW_PRECISION for t in types) else op.ufunc
        forms = dict(ufunc=ufunc, kernel=kernel, out_kernel=out_kernel, out_impl=out_impl)
        if kernel is not None and op.inplace:
            return EqnForm("inplace", **forms)
        (out, *more) = eqn.outputs
        # a returned value gets a fresh array (handed to the caller) rather than an arena
        # buffer plus a copy
        big = (not more and out.ty.nbytes >= ARENA_MIN_BYTES and not op.view
               and out not in self.returned)
        # a listed kernel of an op with several outputs writes them all, small ones too
        listed = not op.collective and out_kernel is not None
        if big and ufunc:
            return EqnForm("ufunc", **forms)
        if big and out_impl is not None:
            return EqnForm("out", **forms)
        # a returned value of any size: its kernel all the same, into a fresh array (small
        # values the program keeps run the impl: a kernel call costs ~8 us more on 8 floats)
        if listed and not more and not op.view and out in self.returned:
            return EqnForm("out", **forms)
        # a small value its kernel makes from much (a first layer's filter gradient: 1 KiB
        # from 22 MB) runs that kernel all the same, into a fresh array: the impl took 2.9
        # against 2.0 ms there
        if listed and not more and not op.view and kernel_table.reduces(backend, op, types) \
                and sum(v.ty.nbytes for v in eqn.inputs) >= ARENA_MIN_BYTES:
            return EqnForm("out", **forms)
        if more and (kernel is not None or out_impl is not None and not op.elementwise
                     and (listed or all(v.ty.nbytes >= ARENA_MIN_BYTES for v in eqn.outputs))):
            return EqnForm("outs", **forms)
        return EqnForm("call", **forms)

    # ------------------------------------------------------------ places
    def place_outputs(self, i: int, eqn, form: EqnForm) -> None:
        kind = form.kind
        if kind == "constant":
            self.places[eqn.outputs[0]] = Place("constant")
        elif kind == "alias":
            source = eqn.inputs[eqn.op.alias_input]
            self.places[eqn.outputs[0]] = Place("alias", source=source)
            if isinstance(source, Var) and source in self.storage_of:
                self.storage_of[eqn.outputs[0]] = self.storage_of[source]
        elif kind == "packed":
            self.bind(eqn.outputs[0], Place("arena", self.packed[eqn][0]))
        elif kind == "inplace":
            self.place_inplace(i, eqn)
        elif kind == "out" and not self.arena_worthy(eqn.outputs[0]):
            self.places[eqn.outputs[0]] = Place("fresh")
            self.fresh.setdefault(eqn.outputs[0], []).append(eqn.outputs[0])
        elif kind in ("ufunc", "out"):
            self.bind(eqn.outputs[0], self.buffer_for(eqn, i, eqn.outputs[0]))
        elif kind == "outs":
            places = [Place("fresh") if v in self.returned else self.buffer_for(eqn, i, v, k)
                      for k, v in enumerate(eqn.outputs)]
            for v, place in zip(eqn.outputs, places):
                if place.kind == "fresh":
                    self.places[v] = place
                    self.fresh.setdefault(v, []).append(v)
                else:
                    self.bind(v, place)
        else:
            for v in eqn.outputs:
                self.places[v] = Place("view" if eqn.op.view else "fresh")
                r = self.root(v)
                if r is v or r in self.fresh:
                    self.fresh.setdefault(r, []).append(v)

    def arena_worthy(self, out: Var) -> bool:
        """A value big enough for an arena buffer that the program keeps (not returned)."""
        return out.ty.nbytes >= ARENA_MIN_BYTES and out not in self.returned

    def bind(self, out: Var, place: Place) -> None:
        self.places[out] = place
        if place.kind == "arena":
            self.arena_of[out] = place.buffer
        elif place.kind == "storage":
            self.storage_of[out] = place.source

    def buffer_for(self, eqn, i: int, out: Var, k: int | None = None) -> Place:
        """Where output `out` (the k-th, for an op with several) is computed: its slice of a
        packed concat, its variable's storage, a dying input's buffer, a pooled or a new
        arena buffer."""
        if out in self.placed:
            return Place("slice", self.placed[out])
        sink = self.sink_storage(out, i, eqn.op.elementwise and eqn.op.out_may_alias)
        if sink is not None:
            return Place("storage", source=sink)
        if eqn.op.out_may_alias:   # elementwise: any input; several outputs: input k
            for v in eqn.inputs if k is None else eqn.inputs[k:k + 1]:
                donated = self.donated(eqn, i, v, out)
                if donated is not None:
                    return donated
        key = (out.ty.shape, out.ty.dtype, out.device)   # each device keeps its own buffers
        free = self.pool.get(key)
        if free:
            return Place("arena", free.pop())
        return Place("arena", Buffer(out.ty.shape, out.ty.dtype, out.device))

    def sink_storage(self, out: Var, i: int, elementwise: bool):
        """The state input whose storage `out` may be written into: `out` is that variable's
        final state and the old value is not read after eqn i (or only by this elementwise
        eqn)."""
        g = self.g
        for var_in, final in zip(g.inputs[g.num_args:], g.outputs[g.num_results:]):
            # the whole of `out` (a final state that views only part of it, as a split
            # of an all-gathered bucket does, would overrun the variable's storage)
            if self.root(final) is out and final is not var_in \
                    and final.ty.size == out.ty.size:
                last = self.live.last_use.get(var_in, -1)
                if last < i or (last == i and elementwise):
                    return var_in
        return None

    def donated(self, eqn, i: int, v, out: Var) -> Place | None:
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
        if root.ty.shape != out.ty.shape:
            buf = Buffer(out.ty.shape, out.ty.dtype, buf.device, base=buf)
        return Place("arena", buf, source=v)

    def place_inplace(self, i: int, eqn) -> None:
        """A kernel that updates some inputs in place (optimizer updates): donate buffers
        that die here (a variable's storage, an arena buffer), copy the others first."""
        inplace = eqn.op.inplace(eqn.params) if callable(eqn.op.inplace) else eqn.op.inplace
        for o, j in inplace.items():
            v, out = eqn.inputs[j], eqn.outputs[o]
            sink = self.sink_storage(out, i, True)
            storage_ok = sink is not None and self.storage_of.get(v) is sink
            arena_ok = self.root(v) is v and v in self.arena_of and self.dies_at(v, i)
            if not (storage_ok or arena_ok):
                self.places[out] = Place("copy", source=v)
            elif arena_ok:
                self.bind(out, Place("arena", self.arena_of.pop(v), source=v))
            else:
                self.bind(out, Place("storage", source=sink))

    def release(self, i: int, dying: list) -> None:
        for r in dying:
            buf = self.arena_of.pop(r, None)
            if buf is not None:
                self.pool.setdefault((r.ty.shape, r.ty.dtype, r.device), []).append(buf)
                self.frees.setdefault(i, []).append(buf)
            fresh = self.fresh.pop(r, ())
            if fresh:
                self.drops.setdefault(i, []).append(tuple(fresh))

    # ------------------------------------------------------------ packing
    def plan_packing(self) -> None:
        """Zero-copy packing: a value that only exists to be flattened into a 1-D concat (a
        gradient going into its all-reduce bucket) is computed straight into its slice of
        the concat's buffer, so the concat copies nothing for it."""
        producer = {v: e for e in self.g.eqns for v in e.outputs}
        for i, eqn in enumerate(self.g.eqns):
            out = eqn.outputs[0] if eqn.op is concat_p else None
            if out is None or out.ty.ndim != 1 or out.ty.nbytes < ARENA_MIN_BYTES:
                continue
            buffer = Buffer(out.ty.shape, out.ty.dtype, eqn.device)
            offset, inside = 0, {}
            for v in eqn.inputs:
                root = self.packable(v, i, producer, out.ty.dtype)
                if root is not None:
                    inside[v] = self.placed[root] = Buffer(
                        root.ty.shape, root.ty.dtype, eqn.device, base=buffer, offset=offset)
                offset += v.ty.size
            self.packed[eqn] = (buffer, inside)

    def packable(self, v, i: int, producer: dict, dtype):
        """The value `v` flattens, if it can be computed in place in concat eqn i: v is
        reshape(x), x dies at the concat, and x's op writes into a given buffer."""
        made = producer.get(v)
        if made is None or made.op is not reshape_p or not isinstance(made.inputs[0], Var):
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
