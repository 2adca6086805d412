"""The op sweep: every op in OPS is checked against an independent numpy formula, its shape
rule against its impl, and (when differentiable) its vjp against central finite differences
taken through the compiled value_and_grad path. Plus error messages and scalar weak typing."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from test_attention_ops import SWEEP as ATTENTION_SWEEP  # einsum, gelu, layer_norm...
from test_conv import SWEEP as CONV_SWEEP  # conv, pooling, pad...: loop references there

import graphdist as gd
from graphdist.ir.types import ArrayType
from graphdist.ops import OPS, bind
from graphdist.ops.array import Const, _index_param, getitem
from graphdist.ops.collectives import (all_gather, all_reduce, broadcast, reduce_scatter,
                                       replica_id)

F64 = np.float64


@dataclass
class Case:
    """One example: `fn(*args)` is the public call, `ref(*args)` the numpy formula, and
    `op_args` / `params` what the op itself sees (for the shape-rule check)."""

    args: tuple
    fn: object
    ref: object
    params: dict = field(default_factory=dict)
    op_args: tuple | None = None       # None: same as args
    diff: tuple | None = None          # argnums to differentiate; None: every float arg
    eps: float = 1e-6
    rtol: float = 1e-6

    def prim_args(self):
        return self.args if self.op_args is None else self.op_args


def _u(rng, *shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, size=shape)


def _away_from_zero(rng, *shape):
    # |x| >= 0.2: abs/relu/sign are smooth there, so finite differences are meaningful
    return rng.uniform(0.2, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def _sigmoid_ref(x):
    return 1.0 / (1.0 + np.exp(-x))


# ---------------------------------------------------------------- the table

def _binary_cases(fn, ref, positive_x=False, nonzero_y=False):
    def make(rng):
        def pair(a, b):
            x = _u(rng, *a, lo=0.5 if positive_x else -2.0)
            return x, (_away_from_zero(rng, *b) if nonzero_y else _u(rng, *b))
        shapes = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)),
                  ((5, 1), (1, 6)), ((2, 3), ()),
                  ((48, 50), (50,))]   # >= 16 KiB: lowered into arena buffers with out=
        return [Case(pair(a, b), fn, ref) for a, b in shapes]
    return make


def _division_cases(fn, ref):
    """Both signs; |y| >= 0.5, so the int retyping of the dtype sweep (|a| * 3) never makes a
    zero divisor; and an int case."""
    def make(rng):
        def signed(*shape):
            return rng.uniform(0.5, 4.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
        cases = [Case((signed(*a) * 3, signed(*b)), fn, ref)
                 for a, b in [((3, 4), (3, 4)), ((3, 4), (4,)), ((), (2, 3)), ((2, 3), ()),
                              ((48, 50), (50,))]]
        ints = rng.integers(-9, 10, (3, 4)), rng.choice([-3, -2, -1, 1, 2, 3], (4,))
        return cases + [Case(ints, fn, ref)]
    return make


def _compare_cases(fn, ref):
    def make(rng):
        # small integers as floats, so equality really happens
        a, b = rng.integers(-2, 3, (3, 4)).astype(F64), rng.integers(-2, 3, (4,)).astype(F64)
        return [Case((a, b), fn, ref), Case((a, a.copy()), fn, ref),
                Case((a, np.float64(1.0)), fn, ref)]
    return make


def _unary_cases(fn, ref, sample=_u):
    def make(rng):
        return [Case((sample(rng, 3, 4),), fn, ref), Case((sample(rng, 5),), fn, ref),
                Case((np.asarray(sample(rng, 1)[0]),), fn, ref),     # 0-d
                Case((sample(rng, 48, 50),), fn, ref)]                 # arena buffer path
    return make


def _positive(rng, *shape):
    return rng.uniform(0.3, 3.0, size=shape)


def _reduce_cases(fn, ref):
    def make(rng):
        cases = []
        for shape, axis in [((3, 4, 5), None), ((3, 4, 5), 0), ((3, 4, 5), -1), ((3, 4, 5), 1),
                            ((3, 4, 5), (0, 2)), ((3, 4, 5), (-1, 0)), ((3, 4, 5), (0, 1, 2)),
                            ((3, 4, 5), ()), ((7,), 0), ((), None), ((60, 50), 1),
                            ((3, 48, 50), 0)]:     # a >= 16 KiB output: the out= path
            for keepdims in (False, True):
                x = _u(rng, *shape)
                norm = (None if axis is None else
                        (axis,) if isinstance(axis, int) else axis)
                cases.append(Case(
                    (x,), lambda x, a=axis, k=keepdims: fn(x, a, k),
                    lambda x, a=norm, k=keepdims: ref(x, axis=a, keepdims=k),
                    params={"axis": axis, "keepdims": keepdims}))
        return cases
    return make


def _matmul(rng):
    pairs = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)),
             ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
             ((2, 3, 4), (4,)), ((64, 40), (40, 48))]
    cases = []
    for a, b in pairs:
        x, y = _u(rng, *a), _u(rng, *b)
        pa = x[None] if x.ndim == 1 else x
        pb = y[:, None] if y.ndim == 1 else y
        cases.append(Case((x, y), gd.matmul, np.matmul, op_args=(pa, pb)))
    return cases


def _reshape(rng):
    x = _u(rng, 2, 3, 4)
    return [Case((x,), lambda x, s=s: gd.reshape(x, s), lambda x, s=s: np.reshape(x, s),
                 params={"shape": r})
            for s, r in [((6, 4), (6, 4)), ((4, -1), (4, 6)), ((-1,), (24,)), (24, (24,)),
                         ((2, 1, 12), (2, 1, 12))]]


def _transpose(rng):
    x = _u(rng, 2, 3, 4)
    return [Case((x,), lambda x, p=p: gd.transpose(x, p), lambda x, p=p: np.transpose(x, p),
                 params={"perm": p})
            for p in [None, (1, 0, 2), (2, 0, 1), (0, 1, 2), (-1, 0, 1), (0, -1, -2)]]


def _broadcast_to(rng):
    return [Case((_u(rng, *a),), lambda x, s=s: gd.broadcast_to(x, s),
                 lambda x, s=s: np.broadcast_to(x, s), params={"shape": s})
            for a, s in [((3, 1), (2, 3, 4)), ((4,), (3, 4)), ((), (2, 2)), ((1, 1), (1, 5))]]


def _concat(rng):
    cases = []
    for shapes, axis in [(((2, 3), (4, 3)), 0), (((2, 3), (2, 1), (2, 2)), -1),
                         (((2, 3, 4), (2, 3, 4)), 1), (((5,),), 0)]:
        xs = tuple(_u(rng, *s) for s in shapes)
        cases.append(Case(xs, lambda *xs, a=axis: gd.concat(list(xs), a),
                          lambda *xs, a=axis: np.concatenate(xs, axis=a),
                          params={"axis": axis}))
    return cases


def _split(rng):
    cases = []
    for shape, spec, axis in [((6, 4), 3, 0), ((2, 6), [1, 2, 3], -1), ((2, 6), [6], 1),
                              ((4, 3, 2), 2, 0), ((2, 5), [2, 0, 3], 1)]:
        n = shape[axis]
        sizes = (n // spec,) * spec if isinstance(spec, int) else tuple(spec)
        cuts = np.cumsum(sizes)[:-1]
        cases.append(Case((_u(rng, *shape),), lambda x, s=spec, a=axis: gd.split(x, s, a),
                          lambda x, c=cuts, a=axis: np.split(x, c, axis=a),
                          params={"sizes": sizes, "axis": axis}))
    return cases


def _cast(rng):
    x = _u(rng, 3, 4)
    # f64 -> f32 loses precision, so a coarser step; the map is linear so that is exact
    return [Case((x,), lambda x: gd.cast(x, "float32"), lambda x: x.astype(np.float32),
                 params={"dtype": np.dtype("float32")}, eps=1e-2, rtol=1e-4),
            Case((x.astype(np.float32),), lambda x: gd.cast(x, np.float64),
                 lambda x: x.astype(F64), params={"dtype": np.dtype("float64")},
                 eps=1e-2, rtol=1e-4),
            Case((x * 3,), lambda x: gd.cast(x, "int32"), lambda x: x.astype(np.int32),
                 params={"dtype": np.dtype("int32")}, diff=()),
            Case((x,), lambda x: gd.cast(x > 0, "float64"), lambda x: (x > 0).astype(F64),
                 op_args=(x > 0,), params={"dtype": np.dtype("float64")}, diff=()),
            Case((_u(rng, 64, 80),), lambda x: gd.cast(x, "float32"),   # out= path
                 lambda x: x.astype(np.float32), params={"dtype": np.dtype("float32")},
                 eps=1e-2, rtol=1e-4)]


def _fill(rng):
    x = _u(rng, 3, 4)
    return [Case((x,), gd.zeros_like, np.zeros_like, op_args=(),
                 params={"shape": (3, 4), "dtype": np.dtype(F64), "value": 0}),
            Case((x,), gd.ones_like, np.ones_like, op_args=(),
                 params={"shape": (3, 4), "dtype": np.dtype(F64), "value": 1}),
            Case((x.astype(np.int32),), gd.ones_like, np.ones_like, op_args=(),
                 params={"shape": (3, 4), "dtype": np.dtype(np.int32), "value": 1})]


def _shape(rng):
    return [Case((_u(rng, *s),), gd.shape, lambda x: np.array(x.shape, np.int32))
            for s in [(3, 4), (), (2, 0, 5)]]


def _one_hot(rng):
    idx32 = rng.integers(0, 5, (4,)).astype(np.int32)
    idx64 = rng.integers(0, 3, (2, 3)).astype(np.int64)
    return [Case((idx32,), lambda i: gd.one_hot(i, 5), lambda i: np.eye(5, dtype=np.float32)[i],
                 params={"depth": 5, "dtype": np.dtype("float32")}),
            Case((idx64,), lambda i: gd.one_hot(i, 3, dtype="float64"),
                 lambda i: np.eye(3)[i], params={"depth": 3, "dtype": np.dtype(F64)})]


_INDICES = [(slice(1, 3), slice(None, None, 2)), (Ellipsis, 0), (None, 1), -1,
            (slice(None), slice(-2, None)), (1, 2, 3), (slice(None, None, -1), 0)]


def _getitem(rng):
    x = _u(rng, 4, 5, 6)
    return [Case((x,), lambda x, i=i: getitem(x, i), lambda x, i=i: x[i],
                 params={"index": _index_param(i)}) for i in _INDICES]


def _index_scatter(rng):
    cases = []
    for i in _INDICES:
        shape = (4, 5, 6)
        ct = _u(rng, *np.empty(shape)[i].shape)

        def ref(ct, i=i, shape=shape):
            out = np.zeros(shape)
            out[i] = ct
            return out
        p = {"index": _index_param(i), "shape": shape}
        cases.append(Case((ct,), lambda ct, p=p: bind(OPS["index_scatter"], ct, **p), ref,
                          params=p))
    return cases


def _constant(rng):
    a = _u(rng, 2, 3)
    return [Case((), lambda a=a: bind(OPS["constant"], value=Const(a)), lambda a=a: a.copy(),
                 params={"value": Const(a)})]


def _where(rng):
    cases = []
    for c, x, y in [((3, 4), (3, 4), (3, 4)), ((3, 1), (3, 4), (4,)), ((4,), (2, 1, 1), ()),
                    ((48, 50), (48, 50), (50,))]:
        cond = rng.random(c) > 0.5
        cases.append(Case((cond, _u(rng, *x), _u(rng, *y)), gd.where, np.where, diff=(1, 2)))
    cond = rng.random((3, 4)) > 0.5
    x = _u(rng, 3, 4)
    # Python scalars take the tensor's dtype
    cases.append(Case((cond, x), lambda c, x: gd.where(c, x, 0.0), lambda c, x: np.where(c, x, 0.0),
                      op_args=(cond, x, np.float64(0.0)), diff=(1,)))
    return cases


def _collective(fn, **params):
    def make(rng):
        return [Case((_u(rng, *s),), lambda x: fn(x, *params.values()), lambda x: x.copy(),
                     params=dict(params)) for s in [(3, 4), ()]]
    return make


def _replica_id(rng):
    return [Case((), replica_id, lambda: np.asarray(0, np.int32))]


def _sgd(rng):
    p, g = _u(rng, 3, 4), _u(rng, 3, 4)
    cases = []
    for lr, wd in [(0.1, 0.0), (0.05, 0.01)]:
        cases.append(Case((p, g, np.array([lr, wd])),
                          lambda p, g, h: bind(OPS["sgd_update"], p, g, h),
                          lambda p, g, h, lr=lr, wd=wd: p - lr * (g + wd * p)))
    return cases


def _sgd_momentum(rng):
    p, m, g = _u(rng, 3, 4), _u(rng, 3, 4), _u(rng, 3, 4)
    cases = []
    for nesterov in (False, True):
        for wd in (0.0, 0.1):
            params = {"nesterov": nesterov}

            def ref(p, m, g, h, nesterov=nesterov, wd=wd):   # torch.optim.SGD's formulas
                d = g + wd * p
                buf = 0.9 * m + d
                return p - 0.1 * (d + 0.9 * buf if nesterov else buf), buf
            cases.append(Case(
                (p, m, g, np.array([0.1, 0.9, wd])),
                lambda *a, k=params: bind(OPS["sgd_momentum_update"], *a, **k), ref,
                params=params))
    # momentum assigned 0 after construction: plain SGD, the buffer left as it is
    cases.append(Case((p, m, g, np.array([0.1, 0.0, 0.0])),
                      lambda *a: bind(OPS["sgd_momentum_update"], *a, nesterov=False),
                      lambda p, m, g, h: (p - 0.1 * g, m.copy()), params={"nesterov": False}))
    return cases


def _adam(rng):
    p, m, g = _u(rng, 3, 4), _u(rng, 3, 4), _u(rng, 3, 4)
    v = rng.uniform(0.0, 1.0, (3, 4))
    cases = []
    for wd in (None, 0.0, 0.004):      # Adam (4 entries), AdamW (5: lr * weight_decay)
        hyper = [0.01 * np.sqrt(1 - 0.999**3) / (1 - 0.9**3), 0.9, 0.999, 1e-7]
        hyper += [] if wd is None else [0.01 * wd]

        def ref(p, m, v, g, h, wd=wd or 0.0):
            p = p * (1 - 0.01 * wd)
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g ** 2
            return p - h[0] * m / (np.sqrt(v) + 1e-7), m, v
        cases.append(Case((p, m, v, g, np.array(hyper)),
                          lambda *a: bind(OPS["adam_update"], *a), ref))
    return cases


def _sparse_sgd(rng):
    p, rows = _u(rng, 5, 3), _u(rng, 4, 3)
    idx = np.array([3, 0, 3, 1])

    def ref(p, i, r, h):                       # the dense update of the scattered gradient
        g = np.zeros_like(p)
        np.add.at(g, i, r)
        return p - h[0] * (g + h[1] * p)
    return [Case((p, idx, rows, np.array(h)),
                 lambda *a: bind(OPS["sparse_sgd_update"], *a), ref, diff=())
            for h in ([0.1, 0.0], [0.05, 0.01])]


def _hyper(rng):
    return [Case((np.float64(0.5), np.float64(2.0), np.float64(-1e-7)),
                 lambda *a: bind(OPS["hyper"], *a), lambda *a: np.array(a)),
            Case((np.float64(3.0),), lambda a: bind(OPS["hyper"], a), lambda a: np.array([a]))]


def _gather(rng):
    table = _u(rng, 5, 3)
    return [Case((table, np.array(idx, np.int64)), gd.gather, lambda p, i: np.take(p, i, axis=0),
                 diff=(0,)) for idx in ([4, 0, 4], [[1], [2]], [])]


def _check_indices(rng):     # in range: the indices themselves (out of range: test_trust_ops)
    p = {"rows": 5, "checked_for": "gather"}
    return [Case((np.array(idx, np.int64),), lambda i: bind(OPS["check_indices"], i, **p),
                 lambda i: i.copy(), params=p, diff=()) for idx in ([4, 0, 4], [[1], [2]], 3)]


def _scatter_rows(rng):
    def ref(i, r):
        out = np.zeros((5, 3))
        np.add.at(out, i, r)
        return out
    idx = np.array([3, 0, 3, 4])
    return [Case((idx, _u(rng, 4, 3)), lambda i, r: bind(OPS["scatter_rows"], i, r,
                                                          shape=(5, 3)),
                 ref, params={"shape": (5, 3)}, diff=(1,))]


def _sum_duplicates(rng):
    def ref(i, r):                 # distinct indices in first-occurrence order, rows summed
        firsts = [k for k in range(len(i)) if i[k] not in i[:k]]
        rows = np.zeros_like(r)
        for slot, k in enumerate(firsts):
            rows[slot] = r[i == i[k]].sum(axis=0)
        return np.concatenate([i[firsts], np.zeros(len(i) - len(firsts), i.dtype)]), rows
    return [Case((np.array([7, 2, 7, 0], np.int32), _u(rng, 4, 2)),
                 lambda i, r: bind(OPS["sum_duplicates"], i, r), ref, diff=())]


def _all_gather(rng):       # one replica: the identity (tests/ops/test_sparse.py: n replicas)
    return [Case((_u(rng, 3, 2),), lambda x: all_gather(x, 1), lambda x: x.copy(),
                 params={"n": 1})]


def _reduce_scatter(rng):   # one replica: its one shard is the whole value, flattened
    # (n replicas: tests/passes/test_collective_lowerings.py)
    return [Case((_u(rng, 3, 2),), lambda x, op=op: reduce_scatter(x, op, 1),
                 lambda x: x.reshape(-1), params={"op": op, "n": 1}) for op in ("sum", "mean")]


def _logical_cases(fn, ref):
    def make(rng):
        a, b = rng.random((3, 4)) > 0.5, rng.random((4,)) > 0.5
        return [Case((a, b), fn, ref), Case((a, np.bool_(True)), fn, ref)]
    return make


def _not_integer(rng, *shape):      # away from the steps of floor/ceil/round
    return rng.integers(-3, 3, size=shape) + rng.uniform(0.1, 0.4, size=shape) * \
        rng.choice([1.0, 3.0], size=shape)


def _cumsum(rng):
    x = _u(rng, 3, 4)
    return [Case((x,), lambda x, a=a, r=r: gd.cumsum(x, a, reverse=r),
                 lambda x, a=a, r=r: np.flip(np.cumsum(np.flip(x, a), a), a) if r
                 else np.cumsum(x, a), params={"axis": a % 2, "reverse": r})
            for a, r in ((0, False), (1, True), (-1, False))] + [
        Case((np.arange(6, dtype=np.int32),), gd.cumsum, lambda x: np.cumsum(x, dtype=np.int32),
             params={"axis": 0, "reverse": False})]


_PHILOX = {"dist": "uniform", "shape": (3, 4), "dtype": np.dtype("float32")}

CASES = {
    "add": _binary_cases(gd.add, np.add),
    "sub": _binary_cases(gd.subtract, np.subtract),
    "mul": _binary_cases(gd.multiply, np.multiply),
    "div": _binary_cases(gd.divide, np.divide, nonzero_y=True),
    "pow": _binary_cases(gd.power, np.power, positive_x=True),
    "maximum": _binary_cases(gd.maximum, np.maximum),
    "minimum": _binary_cases(gd.minimum, np.minimum),
    "floor_divide": _division_cases(gd.floor_divide, np.floor_divide),
    "mod": _division_cases(gd.mod, np.remainder),
    "equal": _compare_cases(gd.equal, np.equal),
    "floor": _unary_cases(gd.floor, np.floor, _not_integer),
    "ceil": _unary_cases(gd.ceil, np.ceil, _not_integer),
    "round": _unary_cases(gd.round, np.round, _not_integer),
    "logical_and": _logical_cases(gd.logical_and, np.logical_and),
    "logical_or": _logical_cases(gd.logical_or, np.logical_or),
    "logical_not": lambda rng: [Case((rng.random((3, 4)) > 0.5,), gd.logical_not,
                                     np.logical_not)],
    "cumsum": _cumsum,
    "not_equal": _compare_cases(gd.not_equal, np.not_equal),
    "less": _compare_cases(gd.less, np.less),
    "less_equal": _compare_cases(gd.less_equal, np.less_equal),
    "greater": _compare_cases(gd.greater, np.greater),
    "greater_equal": _compare_cases(gd.greater_equal, np.greater_equal),
    "neg": _unary_cases(gd.negative, lambda x: -x),
    "exp": _unary_cases(gd.exp, np.exp),
    "log": _unary_cases(gd.log, np.log, _positive),
    "sqrt": _unary_cases(gd.sqrt, np.sqrt, _positive),
    "tanh": _unary_cases(gd.tanh, np.tanh),
    "square": _unary_cases(gd.square, lambda x: x * x),
    "abs": _unary_cases(gd.abs, np.abs, _away_from_zero),
    "sign": _unary_cases(lambda x: bind(OPS["sign"], x), np.sign, _away_from_zero),
    "sigmoid": _unary_cases(gd.sigmoid, _sigmoid_ref),
    "relu": _unary_cases(gd.relu, lambda x: x * (x > 0), _away_from_zero),
    "where": _where,
    # y only picks the positions (piecewise constant): the gradient is w.r.t. ct
    "relu_grad": lambda rng: [Case((_u(rng, *s), _away_from_zero(rng, *s)),
                                   lambda ct, y: bind(OPS["relu_grad"], ct, y),
                                   lambda ct, y: np.where(y > 0, ct, 0.0), diff=(0,))
                              for s in [(3, 4), (5,), (), (48, 50)]],
    "reduce_sum": _reduce_cases(gd.reduce_sum, np.sum),
    "reduce_mean": _reduce_cases(gd.reduce_mean, np.mean),
    "reduce_max": _reduce_cases(gd.reduce_max, np.amax),
    "reduce_min": _reduce_cases(gd.reduce_min, np.amin),
    "matmul": _matmul,
    "reshape": _reshape,
    "transpose": _transpose,
    "broadcast_to": _broadcast_to,
    "stop_gradient": _unary_cases(gd.stop_gradient, lambda x: x.copy()),
    "concat": _concat,
    "split": _split,
    "cast": _cast,
    "fill": _fill,
    "shape": _shape,
    "one_hot": _one_hot,
    "getitem": _getitem,
    "index_scatter": _index_scatter,
    "constant": _constant,
    "all_reduce": lambda rng: (_collective(all_reduce, op="sum")(rng)
                               + _collective(all_reduce, op="mean")(rng)),
    "broadcast": _collective(broadcast, source=0),
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "gather": _gather,
    "check_indices": _check_indices,
    "scatter_rows": _scatter_rows,
    "sum_duplicates": _sum_duplicates,
    "copy_to": _collective(lambda x, d: bind(OPS["copy_to"], x, device=d), device="cpu:0"),
    "replica_id": _replica_id,
    "sgd_update": _sgd,
    "sgd_momentum_update": _sgd_momentum,
    "adam_update": _adam,
    "hyper": _hyper,
    "sparse_sgd_update": _sparse_sgd,
    # c + a @ b (gradient accumulation's fused GEMM, passes/accumulate.py); not differentiable
    "matmul_accumulate": lambda rng: [Case(
        (_u(rng, 3, 4), _u(rng, 3, 2), _u(rng, 2, 4)),
        lambda c, a, b: bind(OPS["matmul_accumulate"], c, a, b), lambda c, a, b: c + a @ b,
        diff=())],
    "philox_random": lambda rng: [Case(     # the stream, pinned: numpy's Philox (ops/random.py)
        (np.array([2, 7, -9], np.int64), np.int32(0)),
        lambda s, r: bind(OPS["philox_random"], s, r, **_PHILOX),
        lambda s, r: np.random.Generator(np.random.Philox(
            key=np.array([7, 2**64 - 9], np.uint64), counter=np.array([0, 0, 2, 0], np.uint64),
        )).random((3, 4), np.float32), _PHILOX)],
}
CASES.update({name: lambda rng, make=make: [Case(**kw) for kw in make(rng)]
              for name, make in CONV_SWEEP.items()})
CASES.update({name: lambda rng, make=make: [Case(**kw) for kw in make(rng)]
              for name, make in ATTENTION_SWEEP.items()})

# Registered ops whose rules need a Variable as a parameter: covered by the variable and
# training-step tests, not by this sweep.
INTERNAL_TESTED_ELSEWHERE = {
    "read_var": "tests/test_variables.py (needs a gd.Variable param)",
    "assign_var": "tests/test_variables.py (needs a gd.Variable param)",
    "sgd_multi_update": "tests/passes/test_fuse.py (made by fuse_optimizer, checked vs unfused)",
    "sgd_momentum_multi_update": "tests/passes/test_fuse.py (made by fuse_optimizer)",
    "adam_multi_update": "tests/passes/test_fuse.py (made by fuse_optimizer)",
    "host_all_reduce": "tests/distribute/test_cross_device_ops.py (a lowering of all_reduce)",
    "host_all_gather": "tests/ops/test_sparse.py (a lowering of all_gather)",
    "host_reduce_scatter": "tests/passes/test_collective_lowerings.py (a lowering of reduce_scatter)",
    "mpi_reduce_scatter": "tests/passes/test_collective_lowerings.py (2 MPI workers)",
    "mpi_all_reduce": "tests/distribute/test_multi_worker.py (2 MPI workers; needs a process group)",
    "host_all_reduce_start": "tests/runtime/test_overlap.py (made by the overlap stage)",
    "mpi_all_reduce_start": "tests/runtime/test_overlap.py (2 MPI workers, tests/mpi/overlap.py)",
    "mpi_reduce_scatter_start": "tests/distribute/test_zero.py (2 MPI workers at zero_stage=1)",
    "collective_wait": "tests/runtime/test_overlap.py (made by the overlap stage)",
    "nccl_all_reduce_start": "tests/gpu/test_overlap_gpu.py (the overlap stage on simulated GPUs)",
    "mpi_all_gather": "tests/distribute/test_multi_worker.py (sparse gradients across 2 workers)",
    "mpi_broadcast": "tests/distribute/test_multi_worker.py (made by the mpi lowering of broadcast)",
    "nccl_all_reduce": "tests/distribute/test_cross_device_ops.py and tests/gpu/test_backend_gpu.py",
    "host_reduce_update": "tests/kernels/test_reduce_update.py (made by fuse_reduce_update)",
    "host_reduce_scatter_update_all_gather": "tests/kernels/test_sharded_update.py (made by "
                                             "fuse_sharded_update)",
    "matmul_bias_act": "tests/passes/test_epilogue.py, tests/kernels/test_conv_epilogue.py",
    "conv2d_bias_act": "tests/passes/test_epilogue.py, tests/kernels/test_conv_epilogue.py",
    "relu_grad_bias_sum": "tests/passes/test_epilogue.py, tests/kernels/test_conv_epilogue.py",
    "max_pool2d_argmax": "tests/kernels/test_pool_argmax.py, tests/passes/test_epilogue.py",
    "conv2d_bias_act_pool": "tests/kernels/test_conv_epilogue.py, tests/passes/test_epilogue.py",
    "conv2d_backprop_filter_pooled": "tests/kernels/test_conv_filter.py, "
                                     "tests/passes/test_epilogue.py",
    "max_pool2d_grad_argmax": "tests/kernels/test_pool_argmax.py, "
                              "tests/passes/test_epilogue.py",
    "fused_elementwise": "tests/passes/test_fuse_elementwise.py, "
                         "tests/kernels/test_fused_elementwise.py (made by fuse_elementwise)",
    "cond": "tests/ops/test_control_flow.py (holds sub-graphs; gradients vs finite differences)",
    "while": "tests/ops/test_control_flow.py (holds sub-graphs; gradients vs finite differences)",
    "scan": "tests/ops/test_scan.py (holds sub-graphs; gradients vs finite differences)",
}


def _all_cases():
    out = []
    for name, make in CASES.items():
        for i, case in enumerate(make(np.random.default_rng(0))):
            out.append(pytest.param(name, i, id=f"{name}-{i}"))
    return out


ALL = _all_cases()


def _case(name, i, seed=0):
    return CASES[name](np.random.default_rng(seed))[i]


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


# ---------------------------------------------------------------- (a) shape rule vs impl


@pytest.mark.parametrize("name,i", ALL)
def test_shape_rule_matches_impl(name, i):
    case, op = _case(name, i), OPS[name]
    args = [np.asarray(a) for a in case.prim_args()]
    types = [ArrayType(a.shape, a.dtype) for a in args]
    expect = op.out_types(*types, **case.params)
    got = _as_list(op.impl(np, *args, **case.params))
    if op.num_outputs is not None:
        assert len(expect) == op.num_outputs
    assert len(got) == len(expect)
    for ty, out in zip(expect, got):
        out = np.asarray(out)
        assert (tuple(out.shape), out.dtype) == (ty.shape, ty.dtype), (name, ty, out.shape)
    flops, moved = op.cost(tuple(types), expect, case.params)   # summaries and profiles
    assert int(flops) >= 0 and int(moved) >= 0


def _retyped(args, dtype):
    out = []
    for a in args:
        a = np.asarray(a)
        if a.dtype.kind == "f":
            a = (np.abs(a) * 3).astype(dtype) if np.dtype(dtype).kind == "i" else a.astype(dtype)
        out.append(a)
    return out


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
@pytest.mark.parametrize("name,i", [p for p in ALL if p.values[0] not in ("constant", "fill")])
def test_other_dtypes_keep_the_shape_rules_dtype(name, i, dtype):
    """float32 and int inputs: where the shape rule accepts them, the eager result (and the
    impl) has exactly the dtype it promises; numpy's own promotions must not leak through."""
    case, op = _case(name, i), OPS[name]
    args = _retyped(case.prim_args(), dtype)
    try:
        expect = op.out_types(*(ArrayType(a.shape, a.dtype) for a in args), **case.params)
    except TypeError:
        return                                   # the op refuses this dtype: fine
    for ty, out in zip(expect, _as_list(op.impl(np, *args, **case.params))):
        assert np.asarray(out).dtype == ty.dtype, (ty, np.asarray(out).dtype)
    if case.op_args is None:                     # the public call binds the op as is
        for ty, out in zip(expect, _as_list(case.fn(*_retyped(case.args, dtype)))):
            assert out.dtype == ty.dtype and out.shape == ty.shape, (ty, out.dtype, out.shape)


# ---------------------------------------------------------------- (b) eager vs numpy


@pytest.mark.parametrize("name,i", ALL)
def test_eager_matches_numpy(name, i):
    case = _case(name, i)
    got, want = _as_list(case.fn(*case.args)), _as_list(case.ref(*case.args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray), type(g)
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,i", [p for p in ALL if p.values[0] in (
    "add", "mul", "tanh", "sigmoid", "reduce_sum", "reduce_max", "matmul", "getitem", "split",
    "concat", "where", "cast", "one_hot", "transpose", "broadcast_to", "all_reduce",
    "copy_to", "floor_divide", "mod")])
def test_compiled_matches_numpy(name, i):
    """The same formulas through gd.function (trace, passes, lowering)."""
    case = _case(name, i)
    got = _as_list(gd.function(case.fn)(*case.args))
    for g, w in zip(got, _as_list(case.ref(*case.args))):
        w = np.asarray(w)
        assert np.shape(g) == w.shape and np.asarray(g).dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- (c) vjp vs finite differences


def _float_argnums(case):
    if case.diff is not None:
        return case.diff
    return tuple(k for k, a in enumerate(case.args) if np.asarray(a).dtype.kind == "f")


def check_vjp(fn, args, argnums, rng, eps=1e-6, rtol=1e-6):
    """<t, vjp(ct)> == <(f(x + eps t) - f(x - eps t)) / (2 eps), ct> in a random direction t,
    with the vjp evaluated by the compiled gd.value_and_grad."""
    args = [np.asarray(a) for a in args]
    outs = _as_list(fn(*args))
    cts = [rng.standard_normal(np.shape(o)).astype(np.asarray(o).dtype) for o in outs]

    def loss(*xs):
        total = None
        for o, ct in zip(_as_list(fn(*xs)), cts):
            term = gd.reduce_sum(o * ct)
            total = term if total is None else total + term
        return total

    value, grads = gd.value_and_grad(loss, argnums=tuple(argnums))(*args)
    want_value = sum(np.sum(np.asarray(o) * ct) for o, ct in zip(outs, cts))
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-8)
    ts = [rng.standard_normal(args[k].shape) for k in argnums]
    lhs = 0.0
    for k, g, t in zip(argnums, grads, ts):
        assert g is not None, f"no gradient for argument {k}"
        g = np.asarray(g)
        assert g.shape == args[k].shape and g.dtype == args[k].dtype, (k, g.shape, g.dtype)
        lhs += float(np.vdot(t, g))

    def shifted(sign):
        xs = list(args)
        for k, t in zip(argnums, ts):
            xs[k] = (args[k] + sign * eps * t).astype(args[k].dtype)
        return _as_list(fn(*xs))

    plus, minus = shifted(+1), shifted(-1)
    rhs = sum(float(np.vdot((np.asarray(p, F64) - np.asarray(m, F64)) / (2 * eps), ct))
              for p, m, ct in zip(plus, minus, cts))
    scale = max(1.0, abs(lhs), abs(rhs))
    assert abs(lhs - rhs) <= rtol * scale, f"vjp {lhs!r} != finite differences {rhs!r}"


DIFFERENTIABLE = [p for p in ALL if OPS[p.values[0]].differentiable]


@pytest.mark.parametrize("name,i", DIFFERENTIABLE)
def test_vjp_matches_finite_differences(name, i):
    case = _case(name, i)
    argnums = _float_argnums(case)
    if not argnums:
        pytest.skip("no float inputs in this example")
    check_vjp(case.fn, case.args, argnums, np.random.default_rng(1 + i), case.eps, case.rtol)


@pytest.mark.parametrize("name,i", DIFFERENTIABLE)
def test_vjp_in_float32_keeps_float32(name, i):
    """The backward pass must not bring float64 constants into a float32 graph."""
    case = _case(name, i)
    argnums = _float_argnums(case)
    if not argnums or any(np.asarray(case.args[k]).dtype != F64 for k in argnums):
        pytest.skip("needs float64 inputs to compare with")
    args64 = [np.asarray(a) for a in case.args]
    args32 = [a.astype(np.float32) if a.dtype == F64 else a for a in args64]

    def loss(*xs):
        return sum(gd.reduce_sum(o) for o in _as_list(case.fn(*xs)))

    v32, g32 = gd.value_and_grad(loss, argnums=tuple(argnums))(*args32)
    _, g64 = gd.value_and_grad(loss, argnums=tuple(argnums))(*args64)
    assert np.asarray(v32).dtype == np.float32
    for a, b in zip(g32, g64):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_power_gradient_at_zero_and_negative_base():
    x, y = np.array([0.0, -2.0, 3.0]), np.array([2.0, 2.0, 2.0])
    _, (gx, gy) = gd.value_and_grad(lambda x, y: gd.reduce_sum(gd.power(x, y)), (0, 1))(x, y)
    np.testing.assert_allclose(gx, 2 * x)
    np.testing.assert_allclose(gy, [0.0, 0.0, 9 * np.log(3.0)])    # log taken as 0 at x <= 0


@pytest.mark.parametrize("name", ["stop_gradient", "sign"])
def test_non_differentiable_ops_pass_no_gradient(name):
    fn = CASES[name](np.random.default_rng(0))[0].fn
    x = np.random.default_rng(0).standard_normal((3, 4))
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(fn(x) * x))(x)
    np.testing.assert_allclose(g, np.asarray(fn(x)), rtol=1e-12)   # only the direct x term


def test_reduce_max_ties_share_the_gradient():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(gd.reduce_max(x, axis=1)))(x)
    np.testing.assert_allclose(g, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])


def test_split_gradient_with_unused_parts():
    x = np.arange(6.0).reshape(2, 3)
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(gd.split(x, 3, axis=1)[1] * 2.0))(x)
    np.testing.assert_array_equal(g, [[0, 2, 0], [0, 2, 0]])


BINARY = {"add": (gd.add, np.add), "sub": (gd.subtract, np.subtract),
          "mul": (gd.multiply, np.multiply), "div": (gd.divide, np.divide),
          "pow": (gd.power, np.power), "maximum": (gd.maximum, np.maximum),
          "minimum": (gd.minimum, np.minimum), "floor_divide": (gd.floor_divide, np.floor_divide),
          "mod": (gd.mod, np.remainder)}


@pytest.mark.parametrize("name", sorted(BINARY))
@settings(max_examples=25, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
       seed=st.integers(0, 2**16))
def test_binary_broadcasting(name, shapes, seed):
    fn, ref = BINARY[name]
    rng = np.random.default_rng(seed)
    a, b = shapes.input_shapes
    lo = 0.5 if name in ("pow", "div") else -2.0
    x, y = rng.uniform(lo, 2.0, a), rng.uniform(0.5, 2.0, b) * rng.choice([-1, 1], b)
    if name == "pow":
        y = rng.uniform(-2.0, 2.0, b)
    ty = OPS[name].out_types(ArrayType(a, np.dtype(F64)), ArrayType(b, np.dtype(F64)))[0]
    want = ref(x, y)
    assert ty.shape == shapes.result_shape == np.shape(want)
    got = fn(x, y)
    assert got.shape == ty.shape and got.dtype == ty.dtype == F64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if name in ("maximum", "minimum") and np.min(np.abs(x - y), initial=1.0) < 1e-3:
        return                                  # a near tie: finite differences are off
    check_vjp(fn, (x, y), (0, 1), rng)


# ---------------------------------------------------------------- (d) completeness


def test_every_op_has_shape_rule_and_impl():
    for name, op in OPS.items():
        assert op.shape_rule is not None, f"op {name!r} has no shape rule"
        assert op.impl is not None, f"op {name!r} has no impl"
        if op.differentiable:
            assert op.vjp is not None, f"differentiable op {name!r} has no vjp rule"


def test_every_op_is_in_the_sweep_or_classified():
    covered, internal = set(CASES), set(INTERNAL_TESTED_ELSEWHERE)
    assert not covered & internal
    missing = set(OPS) - covered - internal
    assert not missing, f"ops with no example in tests/ops/test_ops.py CASES: {sorted(missing)}"
    stale = (covered | internal) - set(OPS)
    assert not stale, f"table names ops that are not registered: {sorted(stale)}"
    for name, make in CASES.items():
        assert make(np.random.default_rng(0)), f"{name} has no example"


def test_every_differentiable_op_gets_a_finite_difference_check():
    checked = {p.values[0] for p in DIFFERENTIABLE
               if _float_argnums(_case(*p.values))}
    assert checked == {n for n in CASES if OPS[n].differentiable}


# ---------------------------------------------------------------- (e) errors


def _f64(*shape):
    return np.ones(shape, F64)


@pytest.mark.parametrize("call,op,shapes", [
    (lambda: gd.add(_f64(3, 4), _f64(5)), "add", ("f64[3,4]", "f64[5]")),
    (lambda: gd.multiply(_f64(2, 3), _f64(3, 2)), "mul", ("f64[2,3]", "f64[3,2]")),
    (lambda: gd.maximum(_f64(2), _f64(3)), "maximum", ("f64[2]", "f64[3]")),
    (lambda: gd.less(_f64(2), _f64(3)), "less", ("f64[2]", "f64[3]")),
    (lambda: gd.where(_f64(2) > 0, _f64(3), _f64(3)), "where", ("[2]", "f64[3]")),
    (lambda: gd.matmul(_f64(2, 3), _f64(4, 5)), "matmul", ("f64[2,3]", "f64[4,5]")),
    (lambda: gd.matmul(_f64(2, 2, 3), _f64(3, 3, 4)), "matmul", ("f64[2,2,3]", "f64[3,3,4]")),
    (lambda: gd.concat([_f64(2, 3), _f64(2, 4)], 0), "concat", ("f64[2,3]", "f64[2,4]")),
    (lambda: gd.reshape(_f64(2, 3), (4, 2)), "reshape", ("f64[2,3]", "(4, 2)")),
    (lambda: gd.broadcast_to(_f64(3), (2, 4)), "broadcast_to", ("f64[3]", "(2, 4)")),
])
def test_shape_errors_name_op_and_shapes(call, op, shapes):
    with pytest.raises(gd.ShapeError) as info:
        call()
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert msg.startswith(op) or f"{op}:" in msg, msg
    for s in shapes:
        assert s in msg, (s, msg)


@pytest.mark.parametrize("call", [
    lambda: gd.add(np.ones(3, np.float32), _f64(3)),
    lambda: gd.matmul(np.ones((2, 2), np.float32), _f64(2, 2)),
    lambda: gd.concat([np.ones(3, np.float32), _f64(3)]),
    lambda: gd.where(_f64(3) > 0, np.ones(3, np.float32), _f64(3)),
    lambda: gd.less(np.ones(3, np.float32), _f64(3)),
])
def test_mixing_float_dtypes_raises_type_error(call):
    with pytest.raises(TypeError, match="float32|f32"):
        call()


@pytest.mark.parametrize("call", [
    lambda: gd.reduce_sum(_f64(2, 3), axis=2),
    lambda: gd.reduce_mean(_f64(2, 3), axis=-3),
    lambda: gd.reduce_max(_f64(2, 3), axis=(0, -2)),
    lambda: gd.concat([_f64(2, 3), _f64(2, 3)], axis=2),
    lambda: gd.split(_f64(2, 3), 3, axis=2),
    lambda: gd.expand_dims(_f64(2, 3), 3),
    lambda: gd.squeeze(_f64(2, 3), axis=5),
    lambda: gd.squeeze(_f64(2, 3), axis=0),
    lambda: gd.transpose(_f64(2, 3), (0, 0)),
    lambda: gd.transpose(_f64(2, 3), (0, -2)),
    lambda: gd.transpose(_f64(2, 3), (0, 2)),
])
def test_bad_axis_raises(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("call,op,axis", [
    (lambda x: gd.reduce_sum(x, axis=3), "reduce_sum", "3"),
    (lambda x: gd.reduce_mean(x, axis=(0, -3)), "reduce_mean", "-3"),
    (lambda x: gd.reduce_max(x, axis=2), "reduce_max", "2"),
    (lambda x: gd.concat([x, x], axis=2), "concat", "2"),
    (lambda x: gd.split(x, 2, axis=-3), "split", "-3"),
    (lambda x: gd.squeeze(x, axis=5), "squeeze", "5"),
    (lambda x: gd.expand_dims(x, 3), "expand_dims", "3"),
    (lambda x: gd.expand_dims(x, -4), "expand_dims", "-4"),
])
@pytest.mark.parametrize("traced", [False, True])
def test_bad_axis_errors_state_the_operands_shape(call, op, axis, traced):
    with pytest.raises(gd.ShapeError) as info:
        (gd.function(call) if traced else call)(_f64(2, 3))
    msg = str(info.value)
    assert msg.startswith(f"{op}: axis {axis} is out of range"), msg
    assert "shape (2, 3)" in msg, msg
    assert not traced or "while tracing  test_ops.py:" in msg, msg


def test_errors_inside_function_name_the_user_line():
    line = {}

    def bad(x, y):
        line["n"] = inspect.currentframe().f_lineno + 1
        return gd.add(x, y)

    with pytest.raises(gd.ShapeError) as info:
        gd.function(bad)(_f64(3, 4), _f64(5))
    msg = str(info.value)
    assert "add" in msg and "f64[3,4]" in msg and "f64[5]" in msg, msg
    assert f"test_ops.py:{line['n']}" in msg, msg

    def mixed(x, y):
        line["n"] = inspect.currentframe().f_lineno + 1
        return x * y

    with pytest.raises(TypeError) as info:
        gd.function(mixed)(np.ones(3, np.float32), _f64(3))
    assert f"test_ops.py:{line['n']}" in str(info.value), str(info.value)

    def bad_axis(x):
        line["n"] = inspect.currentframe().f_lineno + 1
        return gd.reduce_sum(x, axis=4)

    with pytest.raises(ValueError) as info:
        gd.function(bad_axis)(_f64(3, 4))
    assert "reduce_sum" in str(info.value) and f"test_ops.py:{line['n']}" in str(info.value)


# ---------------------------------------------------------------- weak typing of scalars


def test_python_scalars_are_weakly_typed():
    x32 = np.arange(3, dtype=np.float32)
    f = gd.function(lambda x: (x * 2.0, 2.0 * x, x + 1, x / 2, x ** 2, 1.0 - x, x > 0.5))
    outs = f(x32)
    for o in outs[:-1]:
        assert o.dtype == np.float32, o.dtype
    assert outs[-1].dtype == np.bool_
    np.testing.assert_allclose(outs[0], x32 * 2)
    np.testing.assert_allclose(outs[5], 1 - x32)
    assert gd.multiply(x32, 2.0).dtype == np.float32            # eagerly too
    assert gd.add(np.arange(3, dtype=np.int32), 1).dtype == np.int32
    assert gd.add(np.arange(3, dtype=np.int64), 1).dtype == np.int64
    assert gd.multiply(np.ones(3), 2.0).dtype == F64


def test_numpy_float64_with_float32_tensor_raises():
    x32 = np.ones(3, np.float32)
    with pytest.raises(TypeError):
        gd.function(lambda x: x * np.ones(3, F64))(x32)
    with pytest.raises(TypeError):
        gd.function(lambda x: x + np.float64(1.0))(x32)       # a numpy scalar is strongly typed
    with pytest.raises(TypeError):
        gd.multiply(x32, np.ones(3))


def test_python_float_with_int_tensor_raises():
    with pytest.raises(TypeError):
        gd.function(lambda x: x * 0.5)(np.arange(3, dtype=np.int32))
