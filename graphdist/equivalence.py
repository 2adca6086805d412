"""gd.check_equivalence and `graphdist check`: does a step on N devices do what it does on
one? The same builder (the bench/simulate convention: `builder(n) -> (f, args)`, the same
initial values and global batch for every n) runs its step `steps` times on 1 device and on
each N; losses (the step's results), gradients and parameters are compared step by step.

Where N devices part from one, the step's graphs say where and why. Each replica's copy of
the placed graph (the "replicate" stage, before collectives are lowered) is interpreted on
numpy with the step's inputs, and its nodes are paired with the one-device graph's (both
are traces of the same code: aligned in order by op, source line and name scope). A
one-device value agrees with its replicas' values when one of these combinations, the
node's meaning on a data-parallel step, gives it back:

- "the same on every replica" (weights, reduced gradients, anything replicated);
- "concatenated" along the batch axis (per-example values of batch-split data);
- "summed" (partial sums: a gradient of a loss summed over the global batch);
- "weighted by the replicas' shares of the batch" (summed or concatenated, each replica's
  value times its share b_r / B: what a per-replica mean and its gradients are).

Values that depend on no argument or variable (constants such as 1/batch) are not compared.
The first one-device node (in trace order) whose value none of these gives back, or whose
replicas' inputs differ from its own through a collective, is where they part; its kind
and what the combinations showed name the likely cause.
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from graphdist import config
from graphdist.benchmark import BuilderError, device_counts
from graphdist.distribute.recipes import AVERAGE_LOSS_SCOPE, reduced_count
from graphdist.distribute.values import PerReplica
from graphdist.function import Function
from graphdist.ir import Lit, eqn_text
from graphdist.ir.types import is_float
from graphdist.ops.collectives import all_reduce_p, broadcast_p
from graphdist.ops.math import (abs_p, argmax_p, clip_p, compare_p, max_p, mean_p, min_p,
                                relu_grad_p, relu_p, rmax_p, rmin_p, sign_p, where_p)
from graphdist.ops.pool import max_pool2d_grad_p, max_pool2d_p
from graphdist.ops.special import gelu_p
from graphdist.ops.optim import adam_p, momentum_p, sgd_p, sparse_sgd_p
from graphdist.ops.random import random_p
from graphdist.ops.state import assign_p
from graphdist.pytree import flatten

# nodes whose output jumps where an input crosses a point: float32 rounding there can flip
# ops whose output jumps where an input crosses a point: float32 rounding there can flip it
KINK_OPS = (relu_p, relu_grad_p, max_p, min_p, abs_p, where_p, compare_p["greater"],
            compare_p["less"], compare_p["greater_equal"], compare_p["less_equal"],
            max_pool2d_p, max_pool2d_grad_p, rmax_p, rmin_p, argmax_p, clip_p, sign_p, gelu_p)
_UNIQUE_SUFFIX = re.compile(r"_\d+(?=/|$)")
UPDATE_OPS = (sgd_p, sparse_sgd_p, momentum_p, adam_p)   # whose last-but-one input is the gradient
CAUSES = {
    "uneven_mean": "per-replica mean loss on uneven shards: each replica's reduce_mean divides "
                   "by its own shard's size and the gradients are averaged, so a short shard's "
                   "examples weigh more than on one device. Use gd.nn.compute_average_loss("
                   "per_example_loss, global_batch_size=B) with gradient_reduction='sum', or "
                   "drop or pad the partial batch",
    "empty_mean": "per-replica mean loss on an empty shard: a replica with no examples takes "
                  "the mean of nothing (NaN) and the average carries it into every weight. Use "
                  "gd.nn.compute_average_loss(per_example_loss, global_batch_size=B) with "
                  "gradient_reduction='sum', or drop or pad the partial batch",
    "average_loss_mean": "compute_average_loss with mean gradient reduction: the loss is "
                         "already divided by the global batch, and the optimizer averages "
                         "the replicas' gradients again (each update 1/N of one device's). "
                         "Make the optimizer with gradient_reduction='sum'",
    "batch_norm": "unsynchronized batch norm: each replica normalizes with its own shard's "
                  "statistics, one device with the global batch's. Use "
                  "gd.nn.BatchNorm(synchronized=True)",
    "random": "per-replica random numbers: each replica draws its own stream for its shard, "
              "which are not the numbers one device draws for the global batch (expected "
              "for dropout; compare with training=False, or draw outside strategy.run)",
    "rounding": "float32 rounding at a kink: an input within rounding of the point where "
                "the node's output jumps lands on the other side on N devices (the sums run "
                "in another order)",
}


class EquivalenceError(BuilderError):
    """A builder the check cannot use (see BuilderError)."""


@dataclass
class Divergence:
    """Where N devices first part from one, and (when known) why."""

    devices: int
    step: int                 # 1-based
    what: str                 # "loss", "gradient" or "parameter"
    variable: str             # the variable (or result) that differs
    max_diff: float
    one_device: float         # the largest |value| on one device, for scale
    node: str = ""            # the first graph node whose replica values disagree
    source: str = ""
    detail: str = ""          # what the combinations showed there
    cause: str = ""           # a key of CAUSES, or ""
    float64: str = ""         # what the float64 rerun said, when asked
    others: list = field(default_factory=list)   # the other values differing at that step
    note: str = ""            # why no node or cause is given (across workers)

    def text(self) -> str:
        what = _what_text(self.what, self.variable)
        lines = [f"first difference: step {self.step}, {what}: max |diff| {self.max_diff:.3g}"
                 f" (one device's values up to {self.one_device:.3g})"]
        if self.others:
            more = f" and {len(self.others) - 4} more" if len(self.others) > 4 else ""
            lines.append(f"  also differing at step {self.step}: "
                         f"{', '.join(self.others[:4])}{more}")
        if self.node:
            lines.append(f"first node that differs: {self.node}")
            if self.source:
                lines.append(f"  traced at  {self.source}")
            if self.detail:
                lines.append(f"  {self.detail}")
        if self.note:
            lines.append(self.note)
        else:
            lines.append("likely cause: " + (CAUSES[self.cause] if self.cause else
                                             "none of the known ones"))
        if self.float64:
            lines.append(self.float64)
        return "\n".join(lines)


@dataclass
class CountResult:
    devices: int
    equivalent: bool
    max_diff: float = 0.0
    divergence: Divergence | None = None
    workers: int = 1          # > 1: across workers, where gradients are not compared


@dataclass
class EquivalenceReport:
    """What gd.check_equivalence found: one CountResult per device count beyond one."""

    results: list
    steps: int
    rtol: float
    atol: float
    dtype: str
    title: str = "gd.check_equivalence"
    notes: list = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return all(r.equivalent for r in self.results)

    @property
    def first_divergence(self) -> Divergence | None:
        return next((r.divergence for r in self.results if r.divergence is not None), None)

    def __str__(self) -> str:
        lines = [f"{self.title}: {self.steps} step(s) on 1 device and on "
                 f"{', '.join(str(r.devices) for r in self.results)}, rtol {self.rtol:g}, "
                 f"atol {self.atol:g}, {self.dtype}"]
        for r in self.results:
            if r.equivalent:
                compared = ("losses, gradients and parameters" if r.workers == 1 else
                            f"losses and parameters, across {r.workers} workers")
                lines.append(f"{r.devices} devices: equivalent ({compared} within "
                             f"tolerance; max |diff| {r.max_diff:.3g})")
            else:
                lines.append(f"{r.devices} devices: NOT equivalent")
                lines += ["  " + line for line in r.divergence.text().splitlines()]
        lines += self.notes
        return "\n".join(lines)


# ---------------------------------------------------------------- running a builder
@dataclass
class _Step:
    results: list             # the step's float results, flattened
    grads: dict               # variable name -> gradient (replica 0's, after any reduction)
    params: dict              # variable name -> value after the step (component 0)
    env: dict                 # placed graph Var -> value (this step, interpreted)


@dataclass
class _Run:
    devices: int
    graph: object             # the placed graph interpreted (one device's, or "replicate")
    replicas: list            # per replica: its eqns in order (collectives excluded)
    shares: list              # per replica: its share of the global batch
    steps: list
    workers: int = 1          # > 1: a multi-worker strategy, this process's replicas only


def _build(builder, n: int, dtype):
    try:
        built = builder(n, dtype=dtype) if dtype is not None else builder(n)
    except TypeError as e:
        if dtype is not None and "dtype" in str(e):
            raise EquivalenceError(f"check --float64: the builder takes no dtype= argument "
                                   f"({e}); give it one (builder(n, dtype=np.float32)) that "
                                   "sets its variables' and data's float dtype") from None
        raise
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], Function)):
        raise EquivalenceError(f"the builder must return (gd.function, args) for n={n}, got "
                               f"{type(built).__name__}")
    f, args = built
    return f, tuple(args) if isinstance(args, (list, tuple)) else (args,)


def _host(x) -> np.ndarray:
    return np.array(x.get() if hasattr(x, "get") else x)


def _float_leaves(result, per_replica: bool = True) -> list:
    """Each float result leaf as a list of arrays (one per replica for a PerReplica; those
    left out when `per_replica` is False: across workers a process holds only its own)."""
    leaves, _, _ = flatten(result, leaf_types=(PerReplica,))
    out = []
    for leaf in leaves:
        if isinstance(leaf, PerReplica) and not per_replica:
            continue
        values = leaf.values if isinstance(leaf, PerReplica) else (leaf,)
        arrays = [_host(v) for v in values]
        if all(is_float(a.dtype) for a in arrays):
            out.append(arrays)
    return out


def _run(builder, n: int, steps: int, dtype) -> _Run:
    f, args = _build(builder, n, dtype)
    stages = f.get_stages(*args)
    compiled = f._latest()
    placed = stages["replicate"] if "replicate" in stages else stages["place"]
    leaves, _ = f._signature(args, {})
    arrays = [np.asarray(_host(leaves[i])) for feed in compiled.feeds for i in feed]
    devices = placed.devices
    replicas = [[e for e in placed.eqns if e.device == d and not e.op.collective]
                for d in devices] if len(devices) > 1 else [list(placed.eqns)]
    per = len(arrays) // max(len(compiled.feeds), 1)
    rows = [arrays[r * per].shape[0] if per and arrays[r * per].ndim else 1
            for r in range(len(compiled.feeds))]
    total = sum(rows) or 1
    run = _Run(n, placed, replicas, [b / total for b in rows], [],
               _workers(compiled.variables.values()))
    by_name = {ref.name: v for ref, v in compiled.variables.items()}
    for _ in range(steps):
        env = {}
        if run.workers == 1:   # across workers this process holds only its own replicas
            state = [_component(s, compiled.variables[ref])
                     for s, ref in zip(placed.inputs[placed.num_args:], placed.variables)]
            env = _interpret(placed, arrays, state)
        result = f(*args)
        run.steps.append(_Step(_float_leaves(result, run.workers == 1),
                               _gradients(placed, env, devices) if env else {},
                               {name: _host(v.values[0]) for name, v in by_name.items()
                                if is_float(v.dtype)}, env))
    return run


def _workers(variables) -> int:
    """How many worker processes the step's strategy spans (MultiWorkerMirroredStrategy)."""
    for v in variables:
        group = getattr(v._strategy, "_group", None)
        if group is not None:
            return group.size
    return 1


def _component(state_var, variable) -> np.ndarray:
    values = variable.values
    k = variable.devices.index(state_var.device) if state_var.device in variable.devices else 0
    return _host(values[k])


def _interpret(g, args, state) -> dict:
    """Every value of the placed graph `g` on numpy, N-way collectives included."""
    env = dict(zip(g.inputs, list(args) + list(state)))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the mean of an empty shard
        for eqn in g.eqns:
            ins = [np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]
                   for v in eqn.inputs]
            params = dict(eqn.params)
            if eqn.op is all_reduce_p:
                total = ins[0].copy()
                for x in ins[1:]:
                    total = total + x
                if params.get("op") == "mean":
                    total = (total / len(ins)).astype(total.dtype)
                outs = [total] * len(ins)
            elif eqn.op is broadcast_p:
                outs = [ins[params.get("source", 0)]] * len(ins)
            else:
                out = eqn.op.impl(np, *ins, **params)
                outs = (out,) if eqn.op.num_outputs == 1 else out
            env.update((v, np.asarray(x)) for v, x in zip(eqn.outputs, outs))
    return env


def _gradients(g, env, devices) -> dict:
    """Variable name -> the gradient its optimizer update took (replica 0's)."""
    producer = {v: e for e in g.eqns for v in e.outputs}
    grads = {}
    for eqn in g.eqns:
        if eqn.op is not assign_p or (len(devices) > 1 and eqn.device != devices[0]):
            continue
        update = producer.get(eqn.inputs[-1])
        if update is not None and update.op in UPDATE_OPS and \
                eqn.inputs[-1] is update.outputs[0]:       # the weight, not a slot
            grads[dict(eqn.params)["var"].name] = env[update.inputs[-2]]
    return grads


# ---------------------------------------------------------------- comparing
def _close(a, b, rtol, atol) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def _diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    with np.errstate(all="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.nanmax(d)) if d.size and not np.isnan(d).all() else (
        0.0 if np.array_equal(np.isnan(a), np.isnan(b)) else float("nan"))


def combinations(one, parts, shares) -> list:
    """[(name, combined value)] of the replicas' values `parts` that fit `one`'s shape."""
    out = []
    same = all(p.shape == one.shape for p in parts)
    with np.errstate(all="ignore"):
        if same:
            out.append(("the same on every replica", None))
            out.append(("summed", sum(p.astype(np.float64) for p in parts)))
            out.append(("weighted by the replicas' shares of the batch",
                        sum(s * p.astype(np.float64) for s, p in zip(shares, parts))))
        axis = _batch_axis(one, parts)
        if axis is not None:
            out.append(("concatenated", np.concatenate(parts, axis=axis)))
            out.append(("concatenated, each weighted by its replica's share of the batch",
                        np.concatenate([s * p.astype(np.float64)
                                        for s, p in zip(shares, parts)], axis=axis)))
    return out


def _batch_axis(one, parts):
    """The axis along which the replicas' values concatenate to `one`'s shape (the batch
    axis, wherever a transpose moved it), or None."""
    if not one.ndim or any(p.ndim != one.ndim for p in parts):
        return None
    for axis in range(one.ndim):
        rest = one.shape[:axis] + one.shape[axis + 1:]
        if all(p.shape[:axis] + p.shape[axis + 1:] == rest for p in parts) and \
                sum(p.shape[axis] for p in parts) == one.shape[axis]:
            return axis
    return None


def agreement(one, parts, shares, rtol, atol, replicated: bool = False):
    """The name of the first combination of `parts` that gives back `one`, or None.
    `replicated`: the parts are meant to be one value held by every replica (a collective's
    result, a weight): only "the same on every replica" counts."""
    for name, combined in combinations(one, parts, shares)[:1 if replicated else None]:
        if combined is None:
            if all(_close(p, one, rtol, atol) for p in parts):
                return name
        elif _close(combined.astype(one.dtype) if one.dtype.kind == "f" else combined,
                    one, rtol, atol):
            return name
    return None


def _signature(eqn) -> tuple:
    """What pairs a one-device node with a replica's: its op, the user's line and its name
    scope without layer-name suffixes (a model built again names its layers dense_1...)."""
    return (eqn.op.name, eqn.source, _UNIQUE_SUFFIX.sub("", eqn.scope))


def _pairs(one_eqns, replica_eqns) -> dict:
    """one-device eqn -> the replica's eqn it corresponds to (aligned in trace order)."""
    matcher = difflib.SequenceMatcher(None, [_signature(e) for e in one_eqns],
                                      [_signature(e) for e in replica_eqns], autojunk=False)
    pairs = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            pairs[one_eqns[block.a + k]] = replica_eqns[block.b + k]
    return pairs


def _data_dependent(g) -> set:
    """Vars of `g` that depend on an argument or a variable."""
    seen = set(g.inputs)
    for eqn in g.eqns:
        if any(v in seen for v in eqn.inputs if not isinstance(v, Lit)):
            seen.update(eqn.outputs)
    return seen


def locate(one: _Run, many: _Run, step: int, rtol, atol) -> tuple:
    """(node text, source, detail, cause) of the first one-device node whose replicas'
    values disagree with it at `step` (0-based)."""
    one_env, many_env = one.steps[step].env, many.steps[step].env
    one_eqns = one.replicas[0]
    pairs = [_pairs(one_eqns, eqns) for eqns in many.replicas]
    producer = {v: e for e in many.graph.eqns for v in e.outputs}
    paired = {e for p in pairs for e in p.values()}
    dependent = _data_dependent(one.graph)
    agreed = _arguments_agreed(one, many, step, rtol, atol)
    for eqn in one_eqns:
        counterparts = [p.get(eqn) for p in pairs]
        if any(c is None for c in counterparts):
            continue
        for j, v in enumerate(eqn.inputs):           # a collective between producer and use
            if isinstance(v, Lit) or v not in dependent or not is_float(v.ty.dtype):
                continue
            theirs = [c.inputs[j] for c in counterparts]
            made = _collective_behind(theirs[0], producer, paired)
            if made is None:
                continue
            parts = [many_env[t] for t in theirs]
            if agreement(one_env[v], parts, many.shares, rtol, atol, replicated=True) is None:
                return _collective_finding(made, agreed.get(v), many)
        for k, v in enumerate(eqn.outputs):
            if v not in dependent or not is_float(v.ty.dtype):
                continue
            parts = [many_env[c.outputs[k]] for c in counterparts]
            how = agreement(one_env[v], parts, many.shares, rtol, atol)
            if how is None:
                return _node_finding(eqn, counterparts, agreed, one_env, many_env, many)
            agreed[v] = how
    return "", "", "", ""


def _arguments_agreed(one: _Run, many: _Run, step: int, rtol, atol) -> dict:
    """One-device argument Var -> how the replicas' arguments give it back (concatenated,
    for a batch split among them)."""
    g, n = many.graph, len(many.replicas)
    per = g.num_args // n if n else 0
    agreed = {}
    for j, v in enumerate(one.graph.inputs[:one.graph.num_args]):
        if j >= per or not is_float(v.ty.dtype):
            continue
        parts = [many.steps[step].env[g.inputs[r * per + j]] for r in range(n)]
        agreed[v] = agreement(one.steps[step].env[v], parts, many.shares, rtol, atol)
    return agreed


def _collective_behind(v, producer, paired, depth: int = 8):
    """The collective that made `v`, directly or through nodes of the N-device graph alone
    (a gradient bucket's concatenation and split), or None."""
    frontier = [v]
    for _ in range(depth):
        later = []
        for x in frontier:
            made = producer.get(x)
            if made is None or made in paired:
                continue
            if made.op.collective:
                return made
            later += [i for i in made.inputs if not isinstance(i, Lit)]
        frontier = later
    return None


def _collective_finding(made, how_inputs, many) -> tuple:
    params = ",".join(f"{k}={v}" for k, v in made.params)
    text = f"{made.op.name}[{params}] over {len(made.inputs)} replicas"
    op = dict(made.params).get("op")
    detail = (f"its inputs, {how_inputs}, give the one-device value; it "
              f"{'averages' if op == 'mean' else 'combines'} them" if how_inputs else "")
    cause = ""
    if made.op is all_reduce_p and op == "mean":
        if how_inputs == "summed" and _has_average_loss(many.graph):
            cause = "average_loss_mean"
        elif how_inputs and "weighted" in how_inputs and len(set(many.shares)) > 1:
            cause = "uneven_mean"
    return text, made.source, detail, cause


def _node_finding(eqn, counterparts, agreed, one_env, many_env, many) -> tuple:
    text = eqn_text(eqn, device=False)
    if len(text) > 120:
        text = text[:117] + "..."
    ins = [agreed.get(v) for v in eqn.inputs if not isinstance(v, Lit)]
    detail = "no combination of its replicas' values (the same, summed, concatenated, " \
             "weighted by shares) gives the one-device value"
    if any(how and ("summed" in how or how.startswith("weighted")) for how in ins) and \
            any(how and how.startswith("concatenated") for how in ins):
        detail += ("; it applies a value that is one per replica (a statistic of its own "
                   "shard) to each example")
    cause = ""
    if eqn.op is mean_p and any(reduced_count(c) == 0 for c in counterparts):
        cause = "empty_mean"
    elif eqn.op is random_p or any(_random_ancestor(c, many.graph) for c in counterparts):
        cause = "random"
    elif eqn.op in KINK_OPS:
        cause = "rounding"
        nearest = _nearest_kink(eqn, counterparts, one_env, many_env)
        detail = (f"its inputs agree within tolerance, yet its output jumps: an input lies "
                  f"within rounding of the kink ({nearest})")
    elif any(how and ("summed" in how or how.startswith("weighted")) for how in ins) and \
            any(how and how.startswith("concatenated") for how in ins):
        cause = "batch_norm"       # a statistic of each shard applied to its examples
    return text, eqn.source, detail, cause


def _nearest_kink(eqn, counterparts, one_env, many_env) -> str:
    """The float inputs' values closest to zero, on one device and on the replicas."""
    def closest(arrays) -> float:
        return min((float(np.min(np.abs(a))) for a in arrays if a.size), default=np.inf)

    floats = [j for j, v in enumerate(eqn.inputs) if not isinstance(v, Lit)
              and is_float(v.ty.dtype)]
    one = closest(one_env[eqn.inputs[j]] for j in floats)
    theirs = closest(many_env[c.inputs[j]] for c in counterparts for j in floats)
    return f"closest to zero: {one:.3g} on one device, {theirs:.3g} on the replicas"


def _random_ancestor(eqn, g, depth: int = 6) -> bool:
    """Is a philox_random draw among the few nodes feeding `eqn`?"""
    producer = {v: e for e in g.eqns for v in e.outputs}
    frontier = [eqn]
    for _ in range(depth):
        nxt = []
        for e in frontier:
            for v in e.inputs:
                p = producer.get(v)
                if p is not None:
                    if p.op is random_p:
                        return True
                    nxt.append(p)
        frontier = nxt
    return False


def _has_average_loss(g) -> bool:
    return any(AVERAGE_LOSS_SCOPE in e.scope.split("/") for e in g.eqns)


def compare(one: _Run, many: _Run, rtol, atol) -> CountResult:
    """Step by step: results (losses), gradients, parameters; the first that differs."""
    worst = 0.0
    for k, (a, b) in enumerate(zip(one.steps, many.steps)):
        found = _first_difference(k, a, b, many.shares, rtol, atol)
        if isinstance(found, Divergence):
            found.devices = many.devices
            if many.workers > 1:
                found.note = (f"(the {many.devices} devices span {many.workers} worker "
                                 "processes: each holds only its own replicas, so the node "
                                 "and the cause are found on one process: run the builder "
                                 "with a MirroredStrategy of as many devices, without launch)")
                return CountResult(many.devices, False, divergence=found, workers=many.workers)
            node, source, detail, cause = locate(one, many, k, rtol, atol)
            found.node, found.source, found.detail, found.cause = node, source, detail, cause
            return CountResult(many.devices, False, divergence=found)
        worst = max(worst, found)
    return CountResult(many.devices, True, max_diff=worst, workers=many.workers)


def _what_text(what: str, name: str) -> str:
    return {"loss": f"the loss ({name})", "gradient": f"the gradient of {name}",
            "parameter": f"the value of {name} after the step"}[what]


def _first_difference(k, a: _Step, b: _Step, shares, rtol, atol):
    worst = 0.0
    checks = [("loss", f"result {i}", r1[0], r2) for i, (r1, r2) in
              enumerate(zip(a.results, b.results))]
    checks += [("gradient", name, g, [b.grads[name]]) for name, g in a.grads.items()
               if name in b.grads]
    checks += [("parameter", name, p, [b.params[name]]) for name, p in a.params.items()
               if name in b.params]
    differing = [_what_text(what, name) for what, name, one, parts in checks
                 if agreement(one, parts, shares, rtol, atol, replicated=len(parts) == 1) is None]
    for what, name, one, parts in checks:
        if agreement(one, parts, shares, rtol, atol, replicated=len(parts) == 1) is None:
            diff = max(_diff(one, p) if p.shape == one.shape else float("inf") for p in parts)
            if len(parts) > 1 and all(p.shape != one.shape for p in parts):
                diff = _diff(one, np.concatenate(parts)) if one.ndim else float("inf")
            scale = float(np.nanmax(np.abs(one))) if one.size else 0.0
            return Divergence(0, k + 1, what, name, diff, scale, others=differing[1:])
        worst = max([worst] + [_diff(one, p) for p in parts if p.shape == one.shape])
    return worst


# ---------------------------------------------------------------- the check
def check_equivalence(builder, devices=(1, 2), steps: int = 3, rtol: float = 1e-5,
                      atol: float = 1e-6, float64: bool = False) -> EquivalenceReport:
    """Run `builder`'s step `steps` times on 1 device and on each other count of `devices`
    and compare losses, gradients and parameters step by step; for a count that differs,
    find the first node whose replicas part from one device and the likely cause. With
    `float64=True` a count that differs is checked again in float64 (the builder takes
    `dtype=`): equivalent there means float32 rounding, not a bug.

    The builder takes n (and, for float64, `dtype=`) and returns `(f, args)`: a
    gd.function on a strategy over n devices and its arguments, built from the same initial
    values and the same global batch for every n (split among the replicas, as
    `strategy.experimental_distribute_dataset` does). Every call builds afresh; the
    compared runs use the numpy forms of the ops (fused kernels off) and one program in the
    calling thread.

    >>> report = gd.check_equivalence(build, devices=(1, 2), steps=3)   # doctest: +SKIP
    >>> report.equivalent, report.first_divergence
    """
    counts = device_counts(devices)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"check_equivalence: steps must be an integer >= 1, got {steps!r}")
    others = [n for n in counts if n != 1]
    if not others:
        raise ValueError(f"check_equivalence: devices must list a count other than 1 to "
                         f"compare with one device, got {devices!r}")
    results = _check(builder, others, steps, rtol, atol, None)
    report = EquivalenceReport(results, steps, rtol, atol, "float32")
    if float64:
        _float64_verdicts(builder, report, steps, rtol, atol)
    return report


def _check(builder, others, steps, rtol, atol, dtype) -> list:
    fused, concurrency = config.fused_kernels(), config.device_concurrency()
    config.set_fused_kernels(False)
    config.set_device_concurrency("sequential")
    try:
        with warnings.catch_warnings():
            # the recipe warnings (distribute/recipes.py): the report says it itself
            warnings.filterwarnings("ignore", message=r"gd\.function .*: (reduce_mean|"
                                    r"compute_average_loss) at ", category=UserWarning)
            warnings.filterwarnings("ignore", message="Mean of empty slice",
                                    category=RuntimeWarning)
            one = _run(builder, 1, steps, dtype)
            return [compare(one, _run(builder, n, steps, dtype), rtol, atol) for n in others]
    finally:
        config.set_fused_kernels(fused)
        config.set_device_concurrency(concurrency)


def _float64_verdicts(builder, report, steps, rtol, atol) -> None:
    differing = [r for r in report.results if not r.equivalent]
    if not differing:
        return
    again = {r.devices: r for r in _check(builder, [r.devices for r in differing], steps,
                                          rtol, atol, np.float64)}
    for r in differing:
        d = r.divergence
        if again[r.devices].equivalent:
            d.cause = "rounding"
            d.float64 = ("float64 rerun: equivalent, so the difference is float32 rounding "
                         "(not a bug in the recipe)")
        else:
            d.float64 = ("float64 rerun: still differs, so it is not float32 rounding")
            if d.cause == "rounding":
                d.cause = ""

