"""Epilogues: work folded into the output pass of the GEMM-backed ops and of the passes
around them, so each activation is read and written fewer times (the tutorial CNN's first
layer: 22 MB per pass at batch 256).

Runs on the placed graph (after place / replicate / merge, so forward and backward are
both there), with fused kernels on, on host devices (those running the CPU kernels):

1. Forward, per matmul (x (..., K) @ w (K, O): one GEMM over x's rows, traced with reshapes
   around it) or conv2d -> matmul_bias_act / conv2d_bias_act (ops/epilogue.py):
   - its result read only by an `add` of a bias of shape (O,) (either operand order): the
     add folds in; read by anything else (or returned), nothing folds;
   - the (bias-added) pre-activation read by one relu or gelu and otherwise only by that
     activation's gradient: the activation folds in. relu_grad(ct, pre) then reads the
     relu's output (relu(v) > 0 exactly where v > 0, NaN included); gelu_grad needs the
     pre-activation, which the fused node also returns (keep=True). Read by anything else,
     the activation stays a node of its own (reading the fused node's output).
2. relu_grad(max_pool2d_grad(x, y, dy), x) -> max_pool2d_grad(x, y, relu_grad(dy, y)): the
   mask on the pooled gradient (a quarter of the size for 2x2 windows).
3. relu_grad(ct, y) summed by a reduce_sum over every axis but the last (the bias gradient)
   -> relu_grad_bias_sum, both in one pass; other readers of the result read it as before.
4. y = max_pool2d(x) and max_pool2d_grad(x, y, dy), windows that do not overlap ->
   y, idx = max_pool2d_argmax(x) and max_pool2d_grad_argmax(idx, dy): the forward pass
   writes each window's first max as an int8 tap index and the gradient reads that, not x
   (22 MB at batch 256 for the tutorial CNN's first layer, which x's last use then frees
   after the forward pass). The same bits.
5. conv2d_backprop_filter(x, max_pool2d_grad_argmax(idx, dy)) for a 2x2 pool of stride 2,
   the pool's gradient read by nothing else (a first layer: no input gradient), where the
   filter gradient runs as kernels/conv_filter.py's groups (ops/conv.py
   filter_grad_groups_fit) -> conv2d_backprop_filter_pooled: the routed gradient is never
   written. The same bits as the two ops.
6. max_pool2d_argmax(conv2d_bias_act(x, f, b)) for a 2x2 pool of stride 2, the conv's
   output (relu or no activation) read by nothing else -> conv2d_bias_act_pool: each block
   of images pooled in cache as it is made, the activation never written whole. The same
   bits.

Merged replicas (passes/merge.py) convolve every replica's batch at once and add each
replica's bias on a (replicas, N, ...) view of the result: step 1 folds through that
reshape, and step 4 follows the views a pool's input and output are read through.

Every fused node lists the ops it replaced in its `members` param (text IR, HTML viewer,
g.summary()). Results are those of the unfused ops up to the GEMMs' blocking and the sums'
order (tests/passes/test_epilogue.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.device.backends import on_host
from graphdist.ir import Eqn, Graph, Var
from graphdist.ops.array import reshape_p
from graphdist.ops.conv import conv2d_backprop_filter_p, conv2d_p, filter_grad_groups_fit
from graphdist.ops.core import normalize_axis
from graphdist.ops.epilogue import (GELU_FORMS, POOL, conv2d_backprop_filter_pooled_p,
                                    conv2d_bias_act_p, conv2d_bias_act_pool_p,
                                    matmul_bias_act_p, relu_grad_bias_sum_p)
from graphdist.ops.math import add_p, matmul_p, relu_grad_p, relu_p, sum_p
from graphdist.ops.pool import (argmax_fits, max_pool2d_argmax_p, max_pool2d_grad_argmax_p,
                                max_pool2d_grad_p, max_pool2d_p)
from graphdist.ops.special import gelu_grad_p, gelu_p
from graphdist.passes.core import in_bodies
from graphdist.passes.fuse import spliced, stable_topological

# dtypes the fused kernels run (float16/bfloat16 matmuls accumulate in float32 apart)
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def fold_epilogues(g: Graph) -> Graph:
    """`g` with each bias + activation folded into its matmul / conv2d, and each relu_grad
    + bias-gradient sum fused (see the module docstring); `g` itself when none applies."""
    g = in_bodies(g, fold_epilogues)      # control-flow bodies fold on their own
    ops = {eqn.op for eqn in g.eqns}     # each fold scans only a graph holding its ops
    if ops & {add_p, relu_p, gelu_p} and ops & {matmul_p, conv2d_p}:
        g = _fold_forward(g)
    if relu_grad_p in ops and max_pool2d_grad_p in ops:
        g = _relu_grad_before_pool(g)
    if relu_grad_p in ops and sum_p in ops:
        g = _fold_backward(g)
    if max_pool2d_grad_p in ops:
        g = _pool_argmax(g)
        if conv2d_backprop_filter_p in ops:
            g = _pool_grad_into_filter_grad(g)
    if max_pool2d_argmax_p in {eqn.op for eqn in g.eqns}:
        g = _pool_into_conv(g)
    return g


# ---------------------------------------------------------------- reading the graph


class _Uses:
    """Who reads each Var: (eqn index, input position) pairs, and the graph's outputs."""

    def __init__(self, g: Graph):
        self.readers: dict = {}
        for i, eqn in enumerate(g.eqns):
            for k, v in enumerate(eqn.inputs):
                if isinstance(v, Var):
                    self.readers.setdefault(v, []).append((i, k))
        self.returned = {v for v in g.outputs if isinstance(v, Var)}

    def of(self, v) -> list:
        return self.readers.get(v, [])

    def only_reader(self, v):
        """The index of the one eqn reading `v` once, if nothing else (nor the graph's
        outputs) does."""
        uses = self.of(v)
        if v in self.returned or len(uses) != 1:
            return None
        return uses[0][0]


def _param(eqn, key):
    return dict(eqn.params)[key]


# ---------------------------------------------------------------- forward


def _base(eqn) -> bool:
    """A GEMM-backed op on a host device whose output pass can take an epilogue."""
    if not on_host(eqn.device):
        return False
    if eqn.op is conv2d_p:
        return eqn.outputs[0].ty.dtype in FLOATS
    if eqn.op is matmul_p:
        x, w = eqn.inputs
        return (isinstance(x, Var) and isinstance(w, Var) and x.ty.ndim >= 2
                and w.ty.ndim == 2 and x.ty.dtype in FLOATS)
    return False


def _bias_of(eqn, v):
    """The bias operand of `eqn` if it is add(v, b) or add(b, v) with b of shape (O,)."""
    if eqn.op is not add_p or len(eqn.inputs) != 2 or eqn.outputs[0].ty != v.ty:
        return None
    a, b = eqn.inputs
    other = b if a is v else a if b is v else None
    if (isinstance(other, Var) and other is not v and other.ty.shape == v.ty.shape[-1:]
            and other.ty.dtype == v.ty.dtype):
        return other
    return None


def _activation(g: Graph, uses: _Uses, pre):
    """(act eqn index, act name, gradient eqn indices) when `pre` is read by one relu /
    gelu and otherwise only by its gradient (relu_grad's y, gelu_grad's x), else None."""
    if pre in uses.returned:
        return None
    act, grads = None, []
    for i, k in uses.of(pre):
        e = g.eqns[i]
        if e.op in (relu_p, gelu_p) and act is None:
            act = i
        elif e.op is relu_grad_p and k == 1 and e.inputs[0] is not pre:
            grads.append(i)
        elif e.op is gelu_grad_p and k == 1 and e.inputs[0] is not pre:
            grads.append(i)
        else:
            return None
    if act is None:
        return None
    e = g.eqns[act]
    name = "relu" if e.op is relu_p else \
        {v: k for k, v in GELU_FORMS.items()}[bool(_param(e, "approximate"))]
    want = relu_grad_p if name == "relu" else gelu_grad_p
    if any(g.eqns[i].op is not want or want is gelu_grad_p and
           bool(_param(g.eqns[i], "approximate")) != GELU_FORMS[name] for i in grads):
        return None
    return act, name, grads


def _fold_forward(g: Graph) -> Graph:
    uses = _Uses(g)
    replaced: dict = {}          # eqn index -> its replacement(s) (None: dropped)
    for i, eqn in enumerate(g.eqns):
        if not _base(eqn) or i in replaced:
            continue
        members, bias, pre, act = [i], None, eqn.outputs[0], (None, "none", [])
        rows = _rows_view(g, uses, eqn)
        if rows is not None:                 # x (..., K) @ w traced as reshapes around
            members.append(rows)             # a 2-D matmul: fold through the reshape
            pre = g.eqns[rows].outputs[0]
        j = uses.only_reader(pre)
        if j is not None and g.eqns[j].device == eqn.device:
            bias = _bias_of(g.eqns[j], pre)
            if bias is not None:
                members.append(j)
                pre = g.eqns[j].outputs[0]
        found = _activation(g, uses, pre)
        if found is not None and g.eqns[found[0]].device == eqn.device:
            act = found
            members.append(found[0])
        if len(members) == (2 if rows is not None else 1):
            continue
        _fuse_forward(g, replaced, eqn, members, bias, pre, act, rows is not None)
    if not replaced:
        return g
    return replace(g, eqns=tuple(stable_topological(spliced(g, replaced), g.inputs)))


def _rows_view(g: Graph, uses: _Uses, eqn):
    """The index of the reshape of a 2-D matmul's (R, O) result to (..., O), when it is the
    result's only reader (how x (..., K) @ w (K, O) is traced: one GEMM over x's rows); or
    of a conv2d's (N, H, W, O) result to (R, N / R, H, W, O) (merged replicas: the
    replicas' batches convolved as one, their bias adds per replica)."""
    base = eqn.outputs[0].ty
    if not (eqn.op is matmul_p and base.ndim == 2 or eqn.op is conv2d_p):
        return None
    r = uses.only_reader(eqn.outputs[0])
    if r is None or g.eqns[r].op is not reshape_p or g.eqns[r].device != eqn.device:
        return None
    out = g.eqns[r].outputs[0].ty
    if eqn.op is conv2d_p:
        split = out.ndim == 5 and out.shape[2:] == base.shape[1:] and \
            out.shape[0] * out.shape[1] == base.shape[0]
        return r if split else None
    return r if out.ndim >= 2 and out.shape[-1] == base.shape[-1] else None


def _fuse_forward(g: Graph, replaced: dict, base, members: list, bias, pre, act,
                  through_rows: bool) -> None:
    act_at, name, grads = act
    keep = name in GELU_FORMS and bool(grads)
    y = g.eqns[act_at].outputs[0] if act_at is not None else pre
    results = (pre, y) if keep else (y,)
    made = results
    if through_rows:                   # the GEMM's (R, O) outputs, then the reshapes back
        rows_ty = base.outputs[0].ty
        made = tuple(Var(rows_ty, v.hint, v.device) for v in results)
    params = dict(base.params) if base.op is conv2d_p else {}
    params.update(act=name, has_bias=bias is not None, keep=keep,
                  members=tuple(g.eqns[m].op.name for m in members))
    op = conv2d_bias_act_p if base.op is conv2d_p else matmul_bias_act_p
    fused = Eqn(op, tuple(base.inputs) + ((bias,) if bias is not None else ()), made,
                tuple(sorted(params.items())), device=base.device, scope=base.scope,
                source=base.source)
    views = [Eqn(reshape_p, (m,), (v,), (("shape", v.ty.shape),), device=base.device,
                 scope=base.scope, source=base.source)
             for m, v in zip(made, results) if m is not v]
    for m in members[:-1]:
        replaced[m] = None
    replaced[members[-1]] = [fused, *views]
    if name == "relu":               # relu_grad(ct, pre) -> relu_grad(ct, relu(pre))
        for i in grads:
            e = replaced.get(i, g.eqns[i])
            replaced[i] = replace(e, inputs=(e.inputs[0], y))


# ---------------------------------------------------------------- backward


def _relu_grad_before_pool(g: Graph) -> Graph:
    """relu_grad(max_pool2d_grad(x, y, dy), x) -> max_pool2d_grad(x, y, relu_grad(dy, y)):
    each window's gradient goes to its first max, where x equals y, so masking by y > 0
    before the routing is masking by x > 0 after it (NaN: not > 0 either way) - on the
    pooled tensor, a quarter of the size for 2x2 windows. A sum of the routed gradient
    over every axis but the last (the bias gradient) sums the pooled one instead (each
    window routes its value to one position); the backward fold then fuses that sum."""
    uses = _Uses(g)
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    replaced: dict = {}
    for r, eqn in enumerate(g.eqns):
        if eqn.op is not relu_grad_p or eqn.outputs[0].ty.dtype not in FLOATS \
                or not on_host(eqn.device):
            continue
        ct, x = eqn.inputs
        p = producer.get(ct)
        if p is None or p in replaced or uses.only_reader(ct) != r:
            continue
        pool = g.eqns[p]
        if pool.op is not max_pool2d_grad_p or pool.inputs[0] is not x or \
                pool.device != eqn.device or not isinstance(pool.inputs[2], Var):
            continue
        _, y, dy = pool.inputs
        masked = Var(dy.ty, _derived(dy.hint, "masked"), dy.device)
        replaced[p] = None
        replaced[r] = [replace(eqn, inputs=(dy, y), outputs=(masked,)),
                       replace(pool, inputs=(x, y, masked), outputs=eqn.outputs)]
        dz = eqn.outputs[0]
        for i, _ in uses.of(dz):
            e = g.eqns[i]
            if e.op is sum_p and not _param(e, "keepdims") and \
                    normalize_axis("reduce_sum", _param(e, "axis"), dz.ty.ndim) == \
                    tuple(range(dz.ty.ndim - 1)):
                replaced[i] = replace(e, inputs=(masked,))
    if not replaced:
        return g
    return replace(g, eqns=tuple(e for _, e in spliced(g, replaced)))


def _bias_sum(g: Graph, uses: _Uses, dz):
    """The index of a reduce_sum of `dz` over every axis but the last (keepdims False)."""
    for i, _ in uses.of(dz):
        e = g.eqns[i]
        if e.op is sum_p and not _param(e, "keepdims") and dz.ty.ndim >= 2 and \
                normalize_axis("reduce_sum", _param(e, "axis"), dz.ty.ndim) == \
                tuple(range(dz.ty.ndim - 1)) and e.device == g.eqns[uses.producer[dz]].device:
            return i
    return None


def _fold_backward(g: Graph) -> Graph:
    uses = _Uses(g)
    uses.producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    replaced: dict = {}
    for i, eqn in enumerate(g.eqns):
        if eqn.op is not relu_grad_p or eqn.outputs[0].ty.dtype not in FLOATS \
                or not on_host(eqn.device) or not all(isinstance(v, Var) for v in eqn.inputs) \
                or eqn.inputs[0].ty != eqn.inputs[1].ty:
            continue
        j = _bias_sum(g, uses, eqn.outputs[0])
        if j is None:
            continue
        replaced[i] = Eqn(relu_grad_bias_sum_p, eqn.inputs,
                          (eqn.outputs[0], g.eqns[j].outputs[0]),
                          (("members", (eqn.op.name, g.eqns[j].op.name)),),
                          device=eqn.device, scope=eqn.scope, source=eqn.source)
        replaced[j] = None
    if not replaced:
        return g
    eqns = [replaced.get(i, e) for i, e in enumerate(g.eqns)]
    return replace(g, eqns=tuple(e for e in eqns if e is not None))


def _pool_argmax(g: Graph) -> Graph:
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    replaced: dict = {}
    index_of: dict = {}          # the pool's eqn index -> its argmax output
    for i, grad in enumerate(g.eqns):
        if grad.op is not max_pool2d_grad_p or not on_host(grad.device) or \
                grad.outputs[0].ty.dtype not in FLOATS or \
                not all(isinstance(v, Var) for v in grad.inputs):
            continue
        x, y, dy = grad.inputs
        p = producer.get(_root(g, producer, y))
        pool = g.eqns[p] if p is not None else None
        params = dict(grad.params)
        if pool is None or pool.op is not max_pool2d_p or pool.outputs[0].ty != y.ty or \
                not _same_value(g, producer, pool.inputs[0], x) or \
                dict(pool.params) != params or pool.device != grad.device or \
                not argmax_fits(params["ksize"], params["strides"]):
            continue
        if p not in index_of:     # named after the pooled value: every replica prints alike
            y0 = pool.outputs[0]
            index_of[p] = Var(max_pool2d_argmax_p.out_types(x.ty, **params)[1],
                              _derived(y0.hint, "argmax"), y0.device)
            replaced[p] = replace(pool, op=max_pool2d_argmax_p,
                                  outputs=(pool.outputs[0], index_of[p]))
        replaced[i] = replace(grad, op=max_pool2d_grad_argmax_p, inputs=(index_of[p], dy),
                              params=tuple(sorted({**params, "input_size":
                                                   tuple(x.ty.shape[1:3])}.items())))
    if not replaced:
        return g
    return replace(g, eqns=tuple(replaced.get(i, e) for i, e in enumerate(g.eqns)))


def _root(g: Graph, producer: dict, v):
    """The Var that `v` views through reshapes (itself if none)."""
    while v in producer and g.eqns[producer[v]].op is reshape_p:
        v = g.eqns[producer[v]].inputs[0]
    return v


def _same_value(g: Graph, producer: dict, a, b) -> bool:
    """a and b hold the same array: one Var, or views of one Var reshaped to one type
    (merged replicas reshape a value to (N, ...) once for each of its readers)."""
    return a is b or a.ty == b.ty and _root(g, producer, a) is _root(g, producer, b)


def _derived(hint, what: str):
    """The hint of a value a pass makes from another's: `h.what` (None without one)."""
    return f"{hint}.{what}" if hint else None


def _pool_grad_into_filter_grad(g: Graph) -> Graph:
    uses = _Uses(g)
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    replaced: dict = {}
    for i, eqn in enumerate(g.eqns):
        if eqn.op is not conv2d_backprop_filter_p or not on_host(eqn.device) or \
                not all(isinstance(v, Var) for v in eqn.inputs):
            continue
        x, dy = eqn.inputs
        p = producer.get(dy)
        if p is None or p in replaced or uses.only_reader(dy) != i:
            continue
        pool, params = g.eqns[p], dict(eqn.params)
        pool_params = dict(pool.params)
        if pool.op is not max_pool2d_grad_argmax_p or pool.device != eqn.device or \
                {k: pool_params[k] for k in POOL} != POOL or \
                filter_grad_groups_fit(x.ty.shape, dy.ty.shape[3], dtype=x.ty.dtype,
                                       **params) is None:
            continue
        replaced[p] = None
        replaced[i] = Eqn(conv2d_backprop_filter_pooled_p, (x, *pool.inputs), eqn.outputs,
                          tuple(sorted({**params, "input_size": pool_params["input_size"],
                                        "members": (pool.op.name, eqn.op.name)}.items())),
                          device=eqn.device, scope=eqn.scope, source=eqn.source)
    if not replaced:
        return g
    eqns = [replaced.get(i, e) for i, e in enumerate(g.eqns)]
    return replace(g, eqns=tuple(e for e in eqns if e is not None))


def _pool_into_conv(g: Graph) -> Graph:
    uses = _Uses(g)
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    replaced: dict = {}
    for i, pool in enumerate(g.eqns):
        if pool.op is not max_pool2d_argmax_p or dict(pool.params) != POOL or \
                not isinstance(pool.inputs[0], Var):
            continue
        a = pool.inputs[0]
        c = producer.get(a)
        if c is None or c in replaced or uses.only_reader(a) != i:
            continue
        conv, params = g.eqns[c], dict(g.eqns[c].params)
        if conv.op is not conv2d_bias_act_p or params["keep"] or \
                params["act"] not in ("none", "relu") or conv.device != pool.device:
            continue
        del params["keep"]
        params["members"] = (*params["members"], pool.op.name)
        replaced[c] = None
        replaced[i] = Eqn(conv2d_bias_act_pool_p, conv.inputs, pool.outputs,
                          tuple(sorted(params.items())), device=conv.device,
                          scope=conv.scope, source=conv.source)   # the conv layer's node
    if not replaced:
        return g
    eqns = [replaced.get(i, e) for i, e in enumerate(g.eqns)]
    return replace(g, eqns=tuple(e for e in eqns if e is not None))
