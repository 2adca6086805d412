"""Reverse-mode autodiff over the IR, driven by each op's vjp rule: GradientTape and
value_and_grad. The backward pass is traced as ordinary eqns into the same graph.

A cotangent may be row-sparse (gd.IndexedSlices, from gather): it stays sparse while it
only meets other sparse ones (their rows are concatenated) and reaches a variable so; it is
made dense when it meets a dense one or flows into another op's vjp."""

from __future__ import annotations

import numpy as np

from graphdist import eager
from graphdist.errors import TraceError
from graphdist.ir import Graph, Var
from graphdist.ir.types import is_float
from graphdist.ops import control_flow
from graphdist.ops.array import ones_like, zeros_like
from graphdist.ops.core import Symbolic, current_tracer
from graphdist.ops.math import add
from graphdist.ops.sparse import IndexedSlices, concat_slices, densify
from graphdist.trace import Tensor, Tracer, tracing


def backward(tracer, eqns, seeds: dict) -> dict:
    """Cotangents of every Var reached from `seeds` (Var -> cotangent tensor)."""
    cts = dict(seeds)
    for eqn in reversed(eqns):
        out_cts = [densify(cts.get(v)) for v in eqn.outputs]
        if all(c is None for c in out_cts) or not eqn.op.differentiable:
            continue
        if eqn.op.vjp is None:
            raise TraceError(f"op '{eqn.op}' has no vjp rule; see docs/adding_an_op.md")
        ins = [Tensor(v, tracer) for v in eqn.inputs]
        ct = out_cts[0] if eqn.op.num_outputs == 1 else tuple(out_cts)
        params = dict(eqn.params)
        if getattr(eqn.op.vjp, "takes_outputs", False):     # control flow's rules
            params.update(outputs=[tracer.wrap(v) for v in eqn.outputs], source=eqn.source)
        in_cts = eqn.op.vjp(ct, *ins, **params)
        for v, c in zip(eqn.inputs, in_cts):
            if c is None or not isinstance(v, Var) or not is_float(v.ty.dtype):
                continue
            cts[v] = c if v not in cts else accumulate(cts[v], c)
    return cts


def body_vjp(body: Graph, out_mask, in_mask) -> Graph:
    """The reverse mode of a branch or loop body (ops/control_flow.py): a graph taking
    (*body's inputs, *a cotangent per output where out_mask) and giving a cotangent per
    input where in_mask (zeros where none reaches it). It recomputes the body's forward
    values; the passes drop those its backward does not read."""
    tracer = Tracer()
    tracer.eqns = list(body.eqns)
    ct_vars = [Var(v.ty, "ct") for v, m in zip(body.outputs, out_mask) if m]
    tracer.arg_vars = [*body.inputs, *ct_vars]
    with tracing(tracer):
        seeds: dict = {}
        for v, ct in zip([v for v, m in zip(body.outputs, out_mask) if m], ct_vars):
            if isinstance(v, Var):
                seeds[v] = Tensor(ct, tracer) if v not in seeds else add(seeds[v],
                                                                        Tensor(ct, tracer))
        cts = backward(tracer, list(body.eqns), seeds)
        results = []
        for v, m in zip(body.inputs, in_mask):
            if m:
                ct = densify(cts.get(v))
                results.append(tracer.lift(ct if ct is not None else zeros_like(
                    Tensor(v, tracer))))
    return Graph(tuple(tracer.arg_vars), tuple(tracer.eqns), tuple(results))


control_flow.register_body_vjp(body_vjp)


def accumulate(a, b):
    """a + b for cotangents; two sparse ones stay sparse."""
    if isinstance(a, IndexedSlices) and isinstance(b, IndexedSlices):
        return concat_slices(a, b)
    return add(densify(a), densify(b))


class GradientTape:
    """Records the ops run inside it so `gradient` can differentiate them (traced code only).

    >>> with gd.GradientTape() as tape:
    ...     loss = gd.reduce_sum(w * w)
    >>> (dw,) = tape.gradient(loss, [w])
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True):
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self._tracer = None
        self._start = self._end = 0
        self._watched: set = set()
        self._used = False

    def __enter__(self):
        self._tracer = current_tracer()
        if self._tracer is None:
            raise TraceError("GradientTape records traced code: use it inside a gd.function or "
                             "strategy.run (or use gd.value_and_grad, which also works eagerly)")
        self._start = len(self._tracer.eqns)
        self._end = None
        return self

    def __exit__(self, *exc):
        self._end = len(self._tracer.eqns)
        return False

    def watch(self, value) -> None:
        """Differentiate with respect to `value` too (tensors, non-trainable variables)."""
        for v in value if isinstance(value, (list, tuple)) else [value]:
            self._watched.add(v if isinstance(v, Symbolic) and not isinstance(v, Tensor)
                              else self._tracer.lift(v))

    def gradient(self, target, sources):
        """d(sum of target)/d(source) for each source, None where target does not depend on it."""
        tracer = self._tracer
        if tracer is None or current_tracer() is not tracer:
            raise TraceError("tape.gradient must be called inside the trace that recorded it")
        if self._used and not self.persistent:
            raise RuntimeError("tape.gradient was already called on this non-persistent "
                               "GradientTape; use GradientTape(persistent=True) to call it again")
        self._used = True
        end = len(tracer.eqns) if self._end is None else self._end
        eqns = tracer.eqns[self._start:end]
        targets = target if isinstance(target, (list, tuple)) else [target]
        seeds: dict = {}
        for t in targets:
            v = tracer.lift(t)
            if isinstance(v, Var):
                seed = ones_like(Tensor(v, tracer))
                seeds[v] = seed if v not in seeds else add(seeds[v], seed)
        cts = backward(tracer, eqns, seeds)
        produced = {o for e in eqns for o in e.outputs}
        single = not isinstance(sources, (list, tuple))
        grads = [self._grad_of(s, cts, produced) for s in ([sources] if single else sources)]
        return grads[0] if single else grads

    def _grad_of(self, source, cts, produced):
        tracer = self._tracer
        if isinstance(source, Symbolic) and not isinstance(source, Tensor):   # a Variable
            if not (source.trainable and self.watch_accessed_variables) and \
                    source not in self._watched:
                return None
            parts = [c for r, c in cts.items() if tracer.read_owner.get(r) is source]
            if not parts:
                return None
            total = parts[0]
            for p in parts[1:]:
                total = accumulate(total, p)
            return total
        v = tracer.lift(source)
        if v not in self._watched and v not in produced:
            return None
        return densify(cts.get(v))


def value_and_grad(fn, argnums=0):
    """fn -> a function returning (fn(*args), gradient of it w.r.t. args[argnums]).
    Works in traced code and eagerly (it then traces and compiles fn itself).

    >>> vg = gd.value_and_grad(lambda x: gd.reduce_sum(x * x))
    >>> vg(np.ones(3, np.float32))[1]
    array([2., 2., 2.], dtype=float32)
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    compiled: dict = {}          # traced -> its gd.function, made at the first eager call

    def traced(*args, **kwargs):
        with GradientTape() as tape:
            for i in nums:
                tape.watch(args[i])
            value = fn(*args, **kwargs)
        grads = tape.gradient(value, [args[i] for i in nums])
        return value, (grads[0] if isinstance(argnums, int) else tuple(grads))

    def wrapper(*args, **kwargs):
        args = list(args)
        for i in nums:
            if i >= len(args):
                raise ValueError(f"value_and_grad: argnums {argnums} but only {len(args)} "
                                 "positional arguments were given")
            if type(args[i]) is float:      # a Python float is data here, not a static value
                args[i] = np.float32(args[i])
            dtype = np.dtype(type(args[i])) if type(args[i]) in (int, bool) else getattr(
                args[i], "dtype", None)
            if dtype is not None and not is_float(dtype):
                raise TypeError(f"value_and_grad: argument {i} is {dtype}; gradients are "
                                "taken with respect to float arrays (cast it first)")
        if current_tracer() is not None:
            return traced(*args, **kwargs)
        return eager.compiled(compiled, traced, traced)(*args, **kwargs)

    return wrapper
