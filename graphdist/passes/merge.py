"""merge_replicas: logical CPU devices share one host, so their N replicas of a logical graph
can run as ONE program over values stacked on a new leading replica axis.

Per-device copies cost a 2-core host twice: N GEMMs of b rows run slower than one of N*b
rows, and every replica applies the same optimizer update to its own copy of each mirrored
variable. Merged, each logical value is either *batched* (shape (N, *per-replica shape):
the replicas' values differ) or *shared* (one value all replicas agree on: mirrored
variables, constants, and whatever is computed from those alone):

- an op whose inputs are all shared runs once (the optimizer update, once for all replicas);
- an op with a batched input runs through its batching rule (`Op.batch_rule`, next to the
  op's other rules; elementwise ops share the one here); an op without a rule runs once
  per replica on slices and the results are stacked;
- a collective becomes a reduction over the replica axis. A sum over replicas looks
  through the ops that made its input (flatten, bucket concat, a weight gradient's
  transpose(x) @ dy, a bias gradient's row sum), so a weight gradient all-reduced across
  replicas is ONE GEMM over all N*b rows instead of N GEMMs and N-1 adds.

The result keeps the replicated graph's calling convention (every replica's arguments in,
each replica's results out) and updates component 0 of each mirrored variable; the other
components catch up when something reads them (`Variable.values`). A graph that cannot
merge (uneven shards, a per-replica value assigned to a mirrored variable) raises
CannotMerge and runs replicated instead. Sync-on-read variables enter once per replica
(their components differ) and are stacked.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.ir import ArrayType, Graph, Lit, Replication, Var
from graphdist.ops.array import (Const, broadcast_p as broadcast_to_p, concat_p, constant_p,
                                 getitem_p, reshape_p, transpose_p)
from graphdist.ops.collectives import all_reduce_p, broadcast_p, replica_id_p
from graphdist.ops.control_flow import (cond_p, graph_cost, holds_collective, scan_p,
                                         while_p)
from graphdist.ops.math import div_p, matmul_p, mul_p, sum_p, where_p
from graphdist.ir.bodies import bodies
from graphdist.ops.state import assign_p, read_p
from graphdist.ops.core import normalize_axis
from graphdist.ir.builder import Builder
from graphdist.passes.cse import eliminate_common_subexpressions
from graphdist.passes.dce import eliminate_dead_code



# a branch this cheap (FLOPs per replica, no state, loops or collectives) runs for every
# replica when merged replicas disagree on a cond's predicate: selecting beats N conds
CHEAP_BRANCH_FLOPS = 1 << 20


def cheap_branch(g: Graph) -> bool:
    return (all(not (e.op.stateful or e.op.collective or bodies(e)) for e in g.eqns)
            and graph_cost(g)[0] <= CHEAP_BRANCH_FLOPS)


class CannotMerge(Exception):
    """This graph must run as per-device copies (the message says why)."""


class Batcher:
    """Emits eqns on the merged device and remembers which values are batched: the helper
    every batching rule gets as `bx`."""

    def __init__(self, n: int, device: str):
        self.n = n
        self.device = device
        self.builder = Builder()
        self.batched_vars: set = set()

    def batched(self, v) -> bool:
        return isinstance(v, Var) and v in self.batched_vars

    def logical(self, v) -> ArrayType:
        """The per-replica type of a merged value."""
        return ArrayType(v.ty.shape[1:], v.ty.dtype) if self.batched(v) else v.ty

    def add(self, op, *ins, batched: bool | None = None, hint: str | None = None,
            **params) -> tuple:
        """Append `op[params] ins`; its outputs are batched when an input is (or as told)."""
        outs = self.builder.add(op, ins, self.device, hint, **params)
        if batched is None:
            batched = any(self.batched(v) for v in ins)
        if batched:
            self.batched_vars.update(outs)
        return outs

    def add1(self, op, *ins, **kw) -> Var:
        (out,) = self.add(op, *ins, **kw)
        return out

    def with_rank(self, v, rank: int):
        """A batched value seen as per-replica rank `rank`: 1s go after the replica axis, so
        numpy broadcasting lines the replica axes up."""
        shape = self.logical(v).shape
        if len(shape) >= rank:
            return v
        return self.add1(reshape_p, v, shape=(self.n,) + (1,) * (rank - len(shape)) + shape)

    def stacked(self, v):
        """A shared value as a batched one (every replica's copy: a broadcast view)."""
        if self.batched(v):
            return v
        return self.add1(broadcast_to_p, v, shape=(self.n,) + v.ty.shape, batched=True)

    def stack(self, parts: list, hint: str | None = None) -> Var:
        """One value per replica -> one batched value."""
        rows = [self.add1(reshape_p, p, shape=(1,) + p.ty.shape, batched=False)
                for p in parts]
        return self.add1(concat_p, *rows, axis=0, batched=True, hint=hint)

    def replica(self, v, k: int):
        """Replica k's part of a batched value (a view)."""
        return self.add1(getitem_p, v, index=(k,), batched=False)

    def per_replica(self, op, ins, params) -> tuple:
        """The rule of last resort: run the op once per replica on slices, then stack."""
        runs = [self.add(op, *(self.replica(v, k) if self.batched(v) else v for v in ins),
                         batched=False, **params) for k in range(self.n)]
        return tuple(self.stack([run[j] for run in runs]) for j in range(len(runs[0])))


def elementwise(bx: Batcher, op, ins, params) -> tuple:
    rank = max(bx.logical(v).ndim for v in ins)
    return bx.add(op, *(bx.with_rank(v, rank) if bx.batched(v) else v for v in ins), **params)


def merge_replicas(g: Graph, devices: tuple, shared_args=frozenset()) -> Graph:
    """The logical graph `g` run by len(devices) replicas as one program on devices[0].

    `shared_args`: indices of arguments every replica gets the same array for (plain
    arrays passed to strategy.run): used once instead of stacked.
    """
    return _Merge(g, tuple(devices), frozenset(shared_args)).graph()


class _Merge:
    def __init__(self, g: Graph, devices: tuple, shared_args: frozenset):
        self.g = g
        self.devices = devices
        self.n = len(devices)
        self.bx = Batcher(self.n, devices[0])
        self.producer = {v: e for e in g.eqns for v in e.outputs}
        self.env: dict = {}
        self.shared_args = shared_args

    def graph(self) -> Graph:
        g, bx, n, here = self.g, self.bx, self.n, self.devices[0]
        # every replica's arguments: one host's memory, so they are all read where they lie
        args = [[Var(v.ty, v.hint, here) for v in g.inputs[: g.num_args]] for _ in range(n)]
        for i, v in enumerate(g.inputs[: g.num_args]):
            self.env[v] = (args[0][i] if i in self.shared_args else
                           bx.stack([args[d][i] for d in range(n)], hint=v.hint))
        # a mirrored variable enters once (component 0); a sync-on-read one once per
        # replica (component k), stacked
        states, variables, components, per_variable = [], [], [], []
        for var, logical in zip(g.variables, g.inputs[g.num_args:]):
            ks = range(n) if var.on_read else (0,)
            mine = [Var(logical.ty, logical.hint, here) for _ in ks]
            per_variable.append(mine)
            states += mine
            variables += [var] * len(mine)
            components += list(ks)
            self.env[logical] = mine[0] if not var.on_read else bx.stack(
                [bx.add1(read_p, s, var=var, batched=False) for s in mine])
        for eqn in g.eqns:
            start = len(bx.builder.eqns)
            outs = self.merge_eqn(eqn, [self.env.get(v, v) if isinstance(v, Var) else v
                                        for v in eqn.inputs])
            self.env.update(zip(eqn.outputs, outs))
            eqns = bx.builder.eqns
            eqns[start:] = [replace(e, scope=eqn.scope, source=eqn.source)
                            for e in eqns[start:]]
        results = [self.env.get(v, v) if isinstance(v, Var) else v
                   for v in g.outputs[: g.num_results]]
        finals = []
        for var, state, logical, mine in zip(g.variables, g.inputs[g.num_args:],
                                             g.outputs[g.num_results:], per_variable):
            final = self.env[logical] if isinstance(logical, Var) else logical
            if logical is state:           # not written: each component stays as it is
                finals += mine
            elif var.on_read:
                finals += [bx.replica(final, k) if bx.batched(final) else final
                           for k in range(n)]
            elif bx.batched(final):
                raise CannotMerge(f"mirrored variable '{var.name}' would take per-replica "
                                  "values")
            else:
                finals.append(final)
        merged = Graph(inputs=tuple(v for per in args for v in per) + tuple(states),
                       eqns=tuple(bx.builder.eqns), outputs=tuple(results) + tuple(finals),
                       variables=tuple(variables), devices=self.devices,
                       replication=Replication(
                           n, g.num_args, g.num_results, merged=True,
                           components=tuple(components),
                           batched_results=tuple(bx.batched(v) for v in results)))
        return eliminate_dead_code(eliminate_common_subexpressions(eliminate_dead_code(merged)))

    def merge_eqn(self, eqn, ins) -> tuple:
        bx, op, params = self.bx, eqn.op, dict(eqn.params)
        if op.collective:
            return (self.collective(eqn, ins[0]),)
        if op in (while_p, scan_p) and any(holds_collective(g) is not None
                                           for g in bodies(eqn)):
            return self.lockstep_loop(eqn, ins)
        if op is replica_id_p:
            return bx.add(constant_p, batched=True,
                          value=Const(np.arange(self.n, dtype=np.int32)))
        if not any(bx.batched(v) for v in ins):
            return bx.add(op, *ins, batched=False, **params)
        if op is read_p:        # a sync-on-read variable: its stacked components
            return (ins[0],)
        if op is assign_p:
            if not dict(eqn.params)["var"].on_read:
                raise CannotMerge(f"mirrored variable '{dict(eqn.params)['var'].name}' "
                                  "would take per-replica values")
            return (bx.stacked(ins[1]),)
        if op.stateful:
            raise CannotMerge(f"{op} of a per-replica value")
        if op.elementwise:
            return elementwise(bx, op, ins, params)
        if op is cond_p and bx.batched(ins[0]) and all(map(cheap_branch, params["branches"])):
            return self.select_branches(params["branches"], ins)
        if op.batch_rule is not None:
            out = op.batch_rule(bx, *ins, **params)
            return out if isinstance(out, tuple) else (out,)
        return bx.per_replica(op, ins, params)

    def select_branches(self, branches, ins) -> tuple:
        """A cond whose predicate differs between replicas: both (cheap) branches run
        batched over every replica and each replica's result is selected, one `where`
        per output, instead of one cond per replica on slices."""
        pred, operands = ins[0], ins[1:]
        results = []
        for g in branches:
            env = dict(zip(g.inputs, operands))
            for e in g.eqns:
                outs = self.merge_eqn(e, [env.get(v, v) if isinstance(v, Var) else v
                                          for v in e.inputs])
                env.update(zip(e.outputs, outs))
            results.append([env.get(v, v) if isinstance(v, Var) else v for v in g.outputs])
        return tuple(elementwise(self.bx, where_p, [pred, a, b], {})[0]
                     for a, b in zip(*results))

    # ------------------------------------------------------------ loops in lock step
    def lockstep_loop(self, eqn, ins) -> tuple:
        """A while_loop or scan whose body holds a collective (its trip count the same on
        every replica, as the tracer checked): one loop over merged values, its body and
        predicate merged like the step (a carry is batched when it enters batched or the
        body makes it so; the collectives become reductions over the replica axis). A
        scan's batched xs and ys keep the replica axis second, behind the scanned one."""
        params = dict(eqn.params)
        nc, bx = params["num_carry"], self.bx
        if params["history"]:
            raise CannotMerge(f"a {eqn.op} holding a collective keeps its history")
        flags = [bx.batched(v) for v in ins]
        while True:
            body, out_flags = self.merged_body(params["body"], flags, flags[:nc])
            grown = [a or b for a, b in zip(flags[:nc], out_flags)]
            if grown == flags[:nc]:
                break
            flags[:nc] = grown
        new = {"body": body}
        if eqn.op is while_p:
            new["cond"], (pred_batched,) = self.merged_body(params["cond"], flags, [])
            if pred_batched:
                raise CannotMerge("a while_loop holding a collective has a per-replica "
                                  "predicate")
        ins = [bx.stacked(v) if f and not bx.batched(v) else v for v, f in zip(ins, flags)]
        xs = range(nc, nc + params.get("num_xs", 0))
        ins = [_swap01(bx, v) if k in xs and flags[k] else v for k, v in enumerate(ins)]
        outs = list(bx.add(eqn.op, *ins, batched=False, **{**params, **new}))
        out_flags = flags[:nc] + out_flags[nc:]
        outs = [_swap01(bx, v) if f and k >= nc else v      # a scan's ys: (T, N, ...)
                for k, (v, f) in enumerate(zip(outs, out_flags))]
        bx.batched_vars.update(v for v, f in zip(outs, out_flags) if f)
        return tuple(outs)

    def merged_body(self, g: Graph, flags: list, carried: list):
        """Body `g` merged, its inputs batched where `flags` say: (graph, which outputs
        are batched). Output k < len(carried) is batched where carried[k] is (the carry
        keeps its batching from one iteration to the next)."""
        sub = _Merge(g, self.devices, frozenset())
        inputs = []
        for v, batched in zip(g.inputs, flags):
            ty = ArrayType((self.n, *v.ty.shape), v.ty.dtype) if batched else v.ty
            new = Var(ty, v.hint, self.devices[0])
            if batched:
                sub.bx.batched_vars.add(new)
            sub.env[v] = new
            inputs.append(new)
        for e in g.eqns:
            outs = sub.merge_eqn(e, [sub.env.get(v, v) if isinstance(v, Var) else v
                                     for v in e.inputs])
            sub.env.update(zip(e.outputs, outs))
        outs = [sub.env.get(v, v) if isinstance(v, Var) else v for v in g.outputs]
        out_flags = [sub.bx.batched(v) for v in outs]
        outs = [sub.bx.stacked(v) if k < len(carried) and carried[k] else v
                for k, v in enumerate(outs)]
        merged = Graph(inputs=tuple(inputs), eqns=tuple(sub.bx.builder.eqns),
                       outputs=tuple(outs))
        return eliminate_dead_code(merged), out_flags

    # ------------------------------------------------------------ collectives
    def collective(self, eqn, x):
        bx, params = self.bx, dict(eqn.params)
        if eqn.op is broadcast_p:
            return bx.replica(x, params["source"]) if bx.batched(x) else x
        if eqn.op is not all_reduce_p:
            raise CannotMerge(f"no merged form of collective '{eqn.op}'")
        if x.ty.dtype == np.dtype(bool):
            raise CannotMerge("all_reduce of a bool value")
        if params["op"] == "mean" and not bx.batched(x):
            return x
        total = self.replica_sum(eqn.inputs[0])
        if params["op"] == "mean":
            total = bx.add1(div_p, total, _lit(self.n, total.ty.dtype))
        return total

    def replica_sum(self, v):
        """Sum over replicas of logical value v, looking through the linear ops that made
        it so the sum lands where it is cheapest (see the module docstring)."""
        bx = self.bx
        if not isinstance(v, Var):
            return bx.add1(mul_p, v, _lit(self.n, v.ty.dtype))
        merged = self.env[v]
        if not bx.batched(merged):
            return bx.add1(mul_p, merged, _lit(self.n, merged.ty.dtype))
        made = self.producer.get(v)
        if made is not None and made.op is concat_p:
            parts = [self.replica_sum(x) for x in made.inputs]
            return bx.add1(concat_p, *parts, **dict(made.params))
        if made is not None and made.op is reshape_p:
            return bx.add1(reshape_p, self.replica_sum(made.inputs[0]), shape=v.ty.shape)
        if made is not None and made.op is sum_p and not dict(made.params)["keepdims"]:
            x = self.env[made.inputs[0]]
            if bx.batched(x):
                axes = normalize_axis("reduce_sum", dict(made.params)["axis"],
                                      made.inputs[0].ty.ndim)
                return bx.add1(sum_p, x, axis=(0,) + tuple(a + 1 for a in axes),
                               keepdims=False, batched=False)
        if made is not None and made.op is matmul_p:
            gemm = self.contracted_gemm(made)
            if gemm is not None:
                return gemm
        return bx.add1(sum_p, merged, axis=(0,), keepdims=False, batched=False)

    def contracted_gemm(self, made):
        """sum_k transpose(x_k) @ y_k over replicas k, for per-replica matrices x_k (b, i)
        and y_k (b, j), is transpose(X) @ Y over the stacked (N*b)-row X and Y: one GEMM."""
        bx = self.bx
        a, b = made.inputs
        t = self.producer.get(a)
        if (t is None or t.op is not transpose_p or dict(t.params)["perm"] not in ((1, 0), None)
                or not isinstance(b, Var) or a.ty.ndim != 2 or b.ty.ndim != 2):
            return None
        x, y = self.env[t.inputs[0]], self.env[b]
        if not (bx.batched(x) and bx.batched(y)):
            return None
        rows = self.n * t.inputs[0].ty.shape[0]
        xs = bx.add1(reshape_p, x, shape=(rows, t.inputs[0].ty.shape[1]), batched=False)
        ys = bx.add1(reshape_p, y, shape=(rows, b.ty.shape[1]), batched=False)
        xt = bx.add1(transpose_p, xs, perm=(1, 0))
        return bx.add1(matmul_p, xt, ys)


def _swap01(bx: Batcher, v) -> Var:
    """v with its first two axes swapped: a batched scan operand (N, T, ...) as the scan
    reads it (T, N, ...), and a merged scan's ys back."""
    perm = (1, 0) + tuple(range(2, v.ty.ndim))
    return bx.add1(transpose_p, v, perm=perm, batched=False)


def _lit(value, dtype) -> Lit:
    dtype = np.dtype(dtype)
    return Lit(dtype.type(value), ArrayType((), dtype))
