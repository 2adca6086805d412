"""Tracing: gd.Tensor, the Tracer that records eqns, and name scopes. gd.function (the
signature cache that traces and compiles) is graphdist/function.py."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

from graphdist.errors import TraceError, user_frame_text
from graphdist.ir import ArrayType, Eqn, Graph, Lit, Var, as_dtype
from graphdist.ops import state
from graphdist.ops.array import Const, constant_p
from graphdist.ops.collectives import replica_id_p
from graphdist.ops.control_flow import while_p, while_varying_outputs
from graphdist.ops.core import Symbolic, bind, current_tracer, pop_tracer, push_tracer
from graphdist.ops.operators import Operators
from graphdist.ops.sparse import IndexedSlices, densify

class Tensor(Operators, Symbolic):
    """A symbolic value inside traced code: it has a shape and dtype but no data yet."""

    __slots__ = ("var", "tracer")

    def __init__(self, var, tracer):
        self.var = var
        self.tracer = tracer

    shape = property(lambda self: tuple(self.var.ty.shape))
    dtype = property(lambda self: self.var.ty.dtype)
    device = property(lambda self: getattr(self.var, "device", None))
    ty = property(lambda self: self.var.ty)

    def __repr__(self) -> str:
        hint = getattr(self.var, "hint", None)
        return f"<gd.Tensor {self.var.ty}{' ' + hint if hint else ''}>"

    def __bool__(self):
        raise TraceError(f"bool() of {self!r} (an `if`, `while`, `and`/`or` on it): a symbolic "
                         "gd.Tensor has no truth value while tracing; Python control flow runs "
                         "at trace time, so branch on shapes or use gd.where")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a scalar tensor")
        return self.shape[0]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __array__(self, dtype=None, copy=None):
        raise TraceError(f"np.asarray() of {self!r} (numpy's __array__): a symbolic "
                         "gd.Tensor cannot become a numpy array while tracing; use gd ops on "
                         "it, or return it from the gd.function to get its value")

    def eager_value(self):
        raise TraceError(f"{self!r} belongs to a trace that has finished (a leaked tensor)")

    def numpy(self):
        return self.eager_value()


class Tracer:
    """Records eqns into a graph under construction. One per trace; nested gd.function calls
    and strategy.run join the active one."""

    def __init__(self):
        self.eqns: list[Eqn] = []
        self.arg_vars: list[Var] = []
        self.state_in: dict = {}      # Variable -> its state Var on entry (ordered)
        self.state_now: dict = {}     # Variable -> its current state Var
        self.reads: dict = {}         # state Var -> read Var (one read per state version)
        self.read_owner: dict = {}    # read Var -> Variable (what tapes differentiate to)
        self.scopes: list[str] = []
        self.strategy = None          # the strategy whose replicas this trace runs, if > 1
        # shapes of per-replica values crossing replicas (uneven shards; distribute/values.py
        # replica_shapes): this replica's, in order, and every replica's when gd.function knows
        self.replica_shapes_seen: list = []
        self.replica_shapes_known: list | None = None
        # None: gd.Variables may be made in this trace; else why not (gd.function allows it
        # on a function's first trace only)
        self.refuse_variables: str | None = None

    # ------------------------------------------------------------ values
    def new_arg(self, ty: ArrayType, hint: str | None) -> Tensor:
        v = Var(ty, hint)
        self.arg_vars.append(v)
        return Tensor(v, self)

    def lift(self, x):
        if isinstance(x, Tensor):
            if x.tracer is not self:
                raise TraceError(f"{x!r} comes from another trace (a leaked tensor); pass it "
                                 "in as an argument instead")
            return x.var
        if isinstance(x, Symbolic):                     # a Variable
            return x.traced_read(self).var
        if isinstance(x, (Var, Lit)):
            return x
        if isinstance(x, IndexedSlices):                # a sparse gradient used densely
            return self.lift(densify(x))
        a = np.asarray(x)
        as_dtype(a.dtype)
        if a.ndim == 0:
            return Lit(a[()], ArrayType((), a.dtype))
        (out,) = self.emit_vars(constant_p, (), {"value": Const(a)})
        return out

    # ------------------------------------------------------------ eqns
    def emit(self, op, args, params):
        try:                     # name the op whose argument is no array (a PerReplica, say)
            ins = tuple(self.lift(a) for a in args)
        except TypeError as e:
            raise TypeError(f"{op.name}: {e}") from None
        outs = self.emit_vars(op, ins, params)
        tensors = tuple(Tensor(v, self) for v in outs)
        return tensors[0] if op.num_outputs == 1 else tensors

    def emit_vars(self, op, ins: tuple, params: dict) -> tuple:
        try:
            out_types = op.out_types(*(v.ty for v in ins), **params)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e}\n  while tracing  {user_frame_text()}") from None
        outs = tuple(Var(ty) for ty in out_types)
        self.eqns.append(Eqn(op, ins, outs, tuple(sorted(params.items())),
                             scope="/".join(self.scopes), source=user_frame_text()))
        return outs

    # ------------------------------------------------------------ variables
    def creating_variable(self, name) -> None:
        """gd.Variable calls this before making a variable inside this trace."""
        if self.refuse_variables is not None:
            what = f"gd.Variable {name!r}" if name else "a gd.Variable (unnamed)"
            raise TraceError(f"{what} is created inside traced code: {self.refuse_variables}")

    def state_of(self, variable) -> Var:
        now = self.state_now.get(variable)
        if now is None:
            now = Var(ArrayType(variable.shape, variable.dtype), variable.name)
            self.state_in[variable] = now
            self.state_now[variable] = now
        return now

    def read(self, variable) -> Tensor:
        st = self.state_of(variable)
        r = self.reads.get(st)
        if r is None:
            (r,) = self.emit_vars(state.read_p, (st,), {"var": variable.ref})
            self.reads[st] = r
            self.read_owner[r] = variable
        return Tensor(r, self)

    def assign(self, variable, value):
        from graphdist.ops.array import cast

        value = self.lift(value)
        if isinstance(value, Lit):  # a number: broadcast to the variable's shape and dtype
            from graphdist.ops.array import broadcast_to

            value = self.lift(broadcast_to(cast(Tensor(value, self), variable.dtype),
                                           variable.shape))
        (new,) = self.emit_vars(state.assign_p, (self.state_of(variable), value),
                                {"var": variable.ref})
        self.state_now[variable] = new
        return variable

    # ------------------------------------------------------------ result
    def graph(self, results: list) -> Graph:
        variables = tuple(self.state_in)
        return Graph(inputs=tuple(self.arg_vars) + tuple(self.state_in[v] for v in variables),
                     eqns=tuple(self.eqns),
                     outputs=tuple(results) + tuple(self.state_now[v] for v in variables),
                     variables=tuple(v.ref for v in variables))

    def captured(self) -> dict:
        """StateRef -> Variable for every variable this trace touched: how the compiled
        function finds the storage behind the graph's references."""
        return {v.ref: v for v in self.state_in}

    # ------------------------------------------------------------ control flow
    def set_state(self, variable, var: Var) -> None:
        """`var` is the variable's value from now on (a branch or loop assigned it)."""
        self.state_of(variable)
        self.state_now[variable] = var

    def trace_body(self, fn, in_types, what: str, hints=None) -> TracedBody:
        """Trace `fn(*tensors)` (tensors of `in_types`; it returns a flat list) into a
        sub-graph of this trace: a branch or loop body (ops/control_flow.py)."""
        body = BodyTracer(self, what)
        with tracing(body):
            args = [body.new_arg(ty, h) for ty, h in zip(in_types, hints or [None] * len(
                in_types))]
            results = [body.lift(r) for r in fn(*args)]
        return body.finish(results)

    def wrap(self, v):
        """A Var of this trace as a gd.Tensor (a Lit stays a Lit: ops take it as is)."""
        return Tensor(v, self) if isinstance(v, Var) else v

    def call_graph(self, g: Graph, args) -> list:
        """`g` applied to `args` (tensors or arrays), inlined here; its results as tensors."""
        return [self.wrap(v) for v in self.inline(g, [self.lift(a) for a in args])]

    def inline(self, g: Graph, ins) -> list:
        """Emit `g`'s eqns here on `ins` (Vars or Lits, one per input); its outputs' Vars."""
        env = dict(zip(g.inputs, ins))
        for eqn in g.eqns:
            outs = tuple(Var(v.ty, v.hint) for v in eqn.outputs)
            env.update(zip(eqn.outputs, outs))
            self.eqns.append(replace(eqn, inputs=tuple(env.get(v, v) if isinstance(v, Var)
                                                       else v for v in eqn.inputs),
                                     outputs=outs))
        return [env.get(v, v) if isinstance(v, Var) else v for v in g.outputs]

    def per_replica(self, var) -> bool:
        """Whether `var` may differ between replicas under this trace's strategy: computed
        from the call's (per-replica) arguments, a sync-on-read variable's components or
        the replica's id, and not all-reduced since. Mirrored variables, constants and
        Python values are the same on every replica."""
        varying = self.varying_inputs()
        for eqn in self.eqns:
            if eqn.op.collective:
                continue
            if eqn.op is while_p:       # a loop in lock step may give mirrored values
                flags = while_varying_outputs(eqn, [isinstance(v, Var) and v in varying
                                                    for v in eqn.inputs])
                varying.update(v for v, f in zip(eqn.outputs, flags) if f)
                continue
            ref = dict(eqn.params).get("var")
            if (getattr(ref, "on_read", False) or eqn.op is replica_id_p
                    or any(isinstance(v, Var) and v in varying for v in eqn.inputs)):
                varying.update(eqn.outputs)
        return isinstance(var, Var) and var in varying

    def varying_inputs(self) -> set:
        return set(self.arg_vars)


class TracedBody:
    """A traced branch or loop body: `graph` takes (*args, *captured inputs) and gives
    (*results, *the new value of each variable in `assigned`); `captured` lists the
    enclosing trace's Vars its captured inputs stand for, `entry` the captured Var that is
    each variable's value on entry (its read in the enclosing trace)."""

    def __init__(self, graph: Graph, captured: list, assigned: list, entry: dict,
                 num_args: int, source: str):
        self.graph = graph
        self.captured = captured
        self.assigned = assigned
        self.entry = entry
        self.num_args = num_args
        self.source = source

    def aligned(self, slots: list, assigned: list, entries: dict) -> Graph:
        """This body as a graph with inputs (*args, *one per enclosing Var in `slots`) and
        outputs (*results, *one per variable in `assigned`: its new value here, else its
        value on entry, `entries[variable]`, which must be in `slots`). A loop puts the
        entries of the variables it assigns first among its slots: they are carried."""
        g = self.graph
        inner = dict(zip(self.captured, g.inputs[self.num_args:]))
        inputs = list(g.inputs[: self.num_args])
        for outer in slots:
            inputs.append(inner.get(outer) or Var(outer.ty, outer.hint))
        by_outer = dict(zip(slots, inputs[self.num_args:]))
        results = list(g.outputs[: len(g.outputs) - len(self.assigned)])
        new_values = dict(zip(self.assigned, g.outputs[len(results):]))
        for variable in assigned:
            results.append(new_values.get(variable, by_outer[entries[variable]]))
        return Graph(tuple(inputs), g.eqns, tuple(results))


class BodyTracer(Tracer):
    """Traces a branch or loop body into its own graph, inside an enclosing trace. A tensor
    of an enclosing trace becomes an input (a closure capture); a variable read captures
    the enclosing trace's read; an assignment gives the variable a new value in the body,
    which the control-flow op threads out (so it happens only when the body runs)."""

    def __init__(self, parent: Tracer, what: str):
        super().__init__()
        self.parent = parent
        self.what = what
        self.strategy = parent.strategy
        self.captures: dict = {}      # enclosing Var -> its input Var here
        self.entry: dict = {}         # Variable -> enclosing Var of its value on entry
        self.assigned: dict = {}      # Variable -> its value now (an assign_var output)
        self.refuse_variables = (f"inside {what}; create variables outside control flow "
                                 "(on the first call, outside the branch or loop)")

    def encloses(self, tracer) -> bool:
        t = self.parent
        while t is not None:
            if t is tracer:
                return True
            t = getattr(t, "parent", None)
        return False

    def lift(self, x):
        if isinstance(x, Tensor) and x.tracer is not self and self.encloses(x.tracer):
            return self.capture(self.parent.lift(x))
        return super().lift(x)

    def capture(self, outer: Var) -> Var:
        inner = self.captures.get(outer)
        if inner is None:
            inner = Var(outer.ty, outer.hint)
            self.captures[outer] = inner
        return inner

    def entry_value(self, variable) -> Var:
        outer = self.entry.get(variable)
        if outer is None:
            outer = self.parent.read(variable).var
            self.entry[variable] = outer
        return self.capture(outer)

    def read(self, variable) -> Tensor:
        now = self.assigned.get(variable)
        v = now if now is not None else self.entry_value(variable)
        self.read_owner.setdefault(v, variable)
        return Tensor(v, self)

    def assign(self, variable, value):
        from graphdist.ops.array import broadcast_to, cast

        value = self.lift(value)
        if isinstance(value, Lit):
            value = self.lift(broadcast_to(cast(Tensor(value, self), variable.dtype),
                                           variable.shape))
        old = self.assigned.get(variable) or self.entry_value(variable)
        (new,) = self.emit_vars(state.assign_p, (old, value), {"var": variable.ref})
        self.assigned[variable] = new
        return variable

    def varying_inputs(self) -> set:
        """A body's arguments may vary (conservatively); a capture varies as what it
        captures does."""
        return set(self.arg_vars) | {inner for outer, inner in self.captures.items()
                                     if self.parent.per_replica(outer)}

    def set_state(self, variable, var: Var) -> None:
        self.entry_value(variable)
        self.assigned[variable] = var

    def finish(self, results: list) -> TracedBody:
        variables = list(self.assigned)
        captured = list(self.captures)
        g = Graph(inputs=tuple(self.arg_vars) + tuple(self.captures[v] for v in captured),
                  eqns=tuple(self.eqns),
                  outputs=tuple(results) + tuple(self.assigned[v] for v in variables))
        return TracedBody(g, captured, variables, dict(self.entry), len(self.arg_vars),
                          self.what)


@contextlib.contextmanager
def tracing(tracer: Tracer):
    push_tracer(tracer)
    try:
        yield tracer
    finally:
        pop_tracer(tracer)


@contextlib.contextmanager
def name_scope(name: str):
    """Prefix the nodes traced inside with `name` (nested scopes join with '/').

    >>> with gd.name_scope("dense1"): ...
    """
    tracer = current_tracer()
    if tracer is None:
        yield
        return
    tracer.scopes.append(str(name))
    try:
        yield
    finally:
        tracer.scopes.pop()


__all__ = ["Tensor", "Tracer", "name_scope", "tracing", "bind"]
