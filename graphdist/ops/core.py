"""Op and the OPS registry, plus bind(): the one door through which every op is applied.

bind() sends an op to the active tracer when any argument is symbolic (a gd.Tensor or a
Variable inside a trace) and otherwise runs it eagerly on numpy, checking the same rules.
"""

from __future__ import annotations

import numbers
import threading

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import DEFAULT_FLOAT, LOW_PRECISION, ArrayType, as_dtype, is_float

OPS: dict[str, Op] = {}


class Symbolic:
    """Base of values an op must route to the tracer (gd.Tensor, gd.Variable)."""

    __slots__ = ()


# What the simulator's calibrated model prices an op as (simulate/costs.py `eqn_seconds`):
# by its FLOPs at a GEMM's rate, or by the bytes it touches at a reduction's or a pass's.
COST_KINDS = ("elementwise", "reduce", "matmul")


class Op:
    """What one op means: shape rule, impl, vjp, batching and cost rules. Which kernel runs
    it on which device is the runtime's business (runtime/kernel_table.py).

    Graph code asks an op's declared flags or compares op objects (`eqn.op is reshape_p`),
    never its name: an Op equals only itself. Every attribute an op carries is declared
    here (__slots__), so a flag set from outside by a misspelt name fails at import."""

    __slots__ = ("name", "num_outputs", "elementwise", "collective", "stateful", "view",
                 "alias_input", "inplace", "differentiable", "ufunc", "accumulates",
                 "shape_rule", "impl", "out_impl", "out_may_alias", "vjp", "cost_rule",
                 "batch_rule", "cost_kind", "foldable", "multi_tensor", "orders_own_streams",
                 "overwrites_state", "__weakref__")

    def __init__(self, name: str, *, num_outputs: int | None = 1, elementwise: bool = False,
                 collective: bool = False, stateful: bool = False, view: bool = False,
                 differentiable: bool = True, ufunc: str | None = None,
                 alias_input: int | None = None, inplace=None, cost_kind: str = "elementwise",
                 foldable: bool | None = None, multi_tensor=None,
                 orders_own_streams: bool = False, overwrites_state: bool = False):
        if name in OPS:
            raise ValueError(f"op {name!r} is already registered")
        if cost_kind not in COST_KINDS:
            raise ValueError(f"op {name!r}: cost_kind {cost_kind!r} is not one of {COST_KINDS}")
        self.name = name
        self.num_outputs = num_outputs
        self.elementwise = elementwise
        self.collective = collective
        self.stateful = stateful      # reads or writes variable state: never merged or dropped
        self.view = view              # output may alias its first input's buffer
        # the input whose buffer the output shares (a view's first input by default)
        self.alias_input = alias_input if alias_input is not None else 0 if view else None
        # output -> input a kernel updates in place: a dict, or params -> dict
        self.inplace = inplace if inplace is not None else {}
        self.differentiable = differentiable
        self.ufunc = ufunc            # numpy/cupy ufunc name: lets the lowering pass out=
        self.accumulates = False      # float16/bfloat16 operands run the impl in float32
        self.cost_kind = cost_kind    # one of COST_KINDS: how the simulator prices it
        # may constant folding (passes/simplify.py) run it at compile time when its inputs
        # are known? Never for state or collectives; ops that say so themselves (a value
        # that only exists after replication, or an op that makes a constant) opt out
        self.foldable = (not stateful and not collective) if foldable is None else foldable
        # the per-variable update this multi-tensor op fuses (ops/optim.py MultiTensor)
        self.multi_tensor = multi_tensor
        # queues work on its devices' streams and orders them itself: the lowering adds
        # no events around it (runtime/streams.py)
        self.orders_own_streams = orders_own_streams
        # its first input is the variable's old state, read for order only: the op replaces
        # it (assign_var), so liveness does not count that read as a use of its buffer
        self.overwrites_state = overwrites_state
        self.shape_rule = None
        self.impl = None
        self.out_impl = None          # impl(xp, out, *ins, **params) writing into `out`
        # may `out` be a dying input's buffer? ufuncs handle that; an out_impl must say so
        self.out_may_alias = ufunc is not None
        self.vjp = None
        self.cost_rule = None
        # batch_rule(bx, *ins, **params): the op on all replicas at once, stacked on a
        # leading axis (passes/merge.py); elementwise ops need none
        self.batch_rule = None
        OPS[name] = self

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Op({self.name!r})"

    def __eq__(self, other) -> bool:
        """Identity only: `eqn.op == "reshape"` is False for every op, so graph code compares
        op objects or flags (a name string compared here would be a typo waiting to happen)."""
        return self is other

    def __hash__(self) -> int:
        return hash(self.name)

    def def_shape(self, fn):
        self.shape_rule = fn
        return fn

    def def_inplace(self, fn):
        """Register params -> {output: input} for an op whose in-place pairs depend on its
        params (a multi-tensor update over n variables)."""
        self.inplace = fn
        return fn

    def def_impl(self, fn):
        self.impl = fn
        return fn

    def def_out(self, fn=None, *, may_alias: bool = False):
        """Register impl(xp, out, *ins) writing into `out`; may_alias=True promises it is
        correct when `out` is one of the inputs (the lowering may then donate one)."""
        def register(f):
            self.out_impl = f
            self.out_may_alias = self.out_may_alias or may_alias
            return f
        return register(fn) if fn is not None else register

    def def_vjp(self, fn):
        self.vjp = fn
        return fn

    def def_cost(self, fn):
        self.cost_rule = fn
        return fn

    def def_batch(self, fn):
        self.batch_rule = fn
        return fn

    def out_types(self, *in_types: ArrayType, **params) -> tuple[ArrayType, ...]:
        out = self.shape_rule(*in_types, **params)
        return out if isinstance(out, tuple) else (out,)

    def cost(self, in_types, out_types, params) -> tuple[int, int]:
        """(FLOPs, bytes touched) of one application; used by summaries and profiles."""
        if self.cost_rule is not None:
            return self.cost_rule(in_types, out_types, **params)
        moved = sum(t.nbytes for t in (*in_types, *out_types))
        if self.view:
            return 0, 0
        return (sum(t.size for t in out_types) if self.elementwise else 0), moved


# ---------------------------------------------------------------- binding

class _TraceContext(threading.local):
    """The tracers active in this thread, innermost last. Thread-local, as the strategy
    stack is (distribute/context.py): a trace in one thread never captures another
    thread's ops."""

    def __init__(self):
        self.tracers: list = []


_context = _TraceContext()


def current_tracer():
    tracers = _context.tracers
    return tracers[-1] if tracers else None


def push_tracer(tracer) -> None:
    _context.tracers.append(tracer)


def pop_tracer(tracer) -> None:
    tracers = _context.tracers
    assert tracers and tracers[-1] is tracer, "tracer stack out of order"
    tracers.pop()


def is_python_scalar(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def scalar_dtype(op_name: str, value, strong: list[np.dtype]) -> np.dtype:
    """The dtype a Python scalar takes next to typed operands (JAX-style weak typing)."""
    kind = "b" if isinstance(value, bool) else "i" if isinstance(value, numbers.Integral) else "f"
    for dt in strong:
        dt_kind = "f" if is_float(dt) else dt.kind    # numpy says "V" for bfloat16
        if dt_kind == "b" and kind != "b":
            continue
        if kind == "b" or dt_kind == kind or (kind == "i" and dt_kind == "f"):
            return dt
        if kind == "f" and dt_kind in "iub":
            raise TypeError(f"{op_name}: a Python float ({value!r}) meets a {dt} tensor; "
                            f"use gd.cast(x, 'float32') first")
    return np.dtype("bool") if kind == "b" else np.dtype("int32") if kind == "i" else DEFAULT_FLOAT


def dtype_of(x) -> np.dtype | None:
    dt = getattr(x, "dtype", None)
    return np.dtype(dt) if dt is not None else None


def resolve_scalars(op: Op, args: tuple) -> tuple:
    """Turn Python scalars into 0-d numpy arrays of the dtype their typed neighbours imply."""
    if not any(is_python_scalar(a) for a in args):
        return args
    strong = [dt for a in args if not is_python_scalar(a) and (dt := dtype_of(a)) is not None]
    return tuple(np.asarray(a, dtype=scalar_dtype(op.name, a, strong if op.elementwise else []))
                 if is_python_scalar(a) else a for a in args)


def bind(op: Op, /, *args, **params):
    """Apply `op`: record it in the active trace, or run it now on numpy arrays."""
    tracer = current_tracer()
    if tracer is not None and (not args or any(isinstance(a, Symbolic) for a in args)):
        return tracer.emit(op, resolve_scalars(op, args), params)
    return run_eagerly(op, args, params)


def run_eagerly(op: Op, args: tuple, params: dict):
    arrays = [a.eager_value() if isinstance(a, Symbolic) else a for a in args]
    arrays = resolve_scalars(op, tuple(arrays))
    try:                         # name the op whose argument is no array (a PerReplica, say)
        arrays = [np.asarray(a) for a in arrays]
        for a in arrays:
            as_dtype(a.dtype)
    except TypeError as e:
        raise TypeError(f"{op.name}: {e}") from None
    op.out_types(*(ArrayType(a.shape, a.dtype) for a in arrays), **params)
    out = op.impl(np, *arrays, **params)
    if op.num_outputs == 1:
        return np.asarray(out) if not isinstance(out, np.ndarray) else out
    return tuple(np.asarray(o) for o in out)


# ---------------------------------------------------------------- rule helpers


def _fmt(names, tys) -> str:
    return ", ".join(f"{n}:{t}" for n, t in zip(names, tys))


def same_dtype(op_name: str, *tys: ArrayType, names=None) -> np.dtype:
    dts = {t.dtype for t in tys}
    if len(dts) > 1:
        names = names or [f"x{i}" for i in range(len(tys))]
        raise TypeError(f"{op_name}: dtypes differ ({_fmt(names, tys)}); "
                        f"use gd.cast to make them agree")
    return tys[0].dtype


def broadcast_shapes(op_name: str, *tys: ArrayType, names=None) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*(t.shape for t in tys)))
    except ValueError:
        names = names or [f"x{i}" for i in range(len(tys))]
        raise ShapeError(f"{op_name}: shapes do not broadcast: {_fmt(names, tys)}") from None


def broadcast_types(op_name: str, *tys: ArrayType, names=None) -> ArrayType:
    dtype = same_dtype(op_name, *tys, names=names)
    return ArrayType(broadcast_shapes(op_name, *tys, names=names), dtype)


def accumulate_in_float32(op: Op) -> Op:
    """Make `op` (one output) run float16/bfloat16 operands in float32 and cast the result
    back: float32 accumulation for GEMM-like ops, and numpy has no fast half-precision GEMM.
    Wraps the impl and out_impl defined so far; other dtypes run them unchanged."""
    impl, out_impl = op.impl, op.out_impl

    def low_dtype(xs):          # a plain loop: this runs on every call of a float32 matmul
        for x in xs:
            if x.dtype in LOW_PRECISION:
                return x.dtype
        return None

    def impl32(xp, *xs, **params):
        low = low_dtype(xs)
        if low is None:
            return impl(xp, *xs, **params)
        up = [x.astype(xp.float32) if x.dtype in LOW_PRECISION else x for x in xs]
        return impl(xp, *up, **params).astype(low)

    def out32(xp, out, *xs, **params):
        if low_dtype(xs) is None:
            out_impl(xp, out, *xs, **params)
        else:
            out[...] = impl32(xp, *xs, **params)

    op.def_impl(impl32)
    if out_impl is not None:
        op.def_out(out32)
    op.accumulates = True     # the lowering then skips op.ufunc for such operands
    return op


def require_float(op_name: str, ty: ArrayType) -> None:
    if not is_float(ty.dtype):
        raise TypeError(f"{op_name}: expected a float tensor, got {ty}; use gd.cast first")


def normalize_axis(op_name: str, axis, ndim: int, shape=None) -> tuple[int, ...]:
    """Axis argument -> sorted tuple of non-negative axes; None means all. `shape`, the
    operand's, goes into the error message."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    of = f"the operand of shape {tuple(shape)}" if shape is not None else f"rank {ndim}"
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            why = f" (the result has rank {ndim})" if shape is not None and len(shape) != ndim \
                else ""
            raise ShapeError(f"{op_name}: axis {a} is out of range for {of}: expected "
                             f"{-ndim} <= axis < {ndim}{why}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"{op_name}: repeated axis in {axis} for {of}")
    return tuple(sorted(out))
