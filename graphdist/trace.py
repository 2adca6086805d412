"""Tracing: gd.Tensor, the Tracer that records eqns, and name scopes. gd.function (the
signature cache that traces and compiles) is graphdist/function.py."""

from __future__ import annotations

import contextlib

import numpy as np

from graphdist.errors import TraceError, user_frame_text
from graphdist.ir import ArrayType, Eqn, Graph, Lit, Var, as_dtype
from graphdist.ops import state
from graphdist.ops.array import Const, constant_p
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
