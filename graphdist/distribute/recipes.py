"""Warnings for the two loss recipes that make N replicas silently train differently from one
device (what `graphdist check` diagnoses), said in ordinary runs once per function, after
its replicas were traced:

- `compute_average_loss` (the sum over the global batch) feeding an optimizer that
  averages the replicas' gradients (`gradient_reduction="mean"`, the default): every
  update is 1/N of one device's;
- a per-replica mean over the batch (`reduce_mean` of the local batch) when the shards are
  uneven or empty and the gradients are averaged: each replica's mean weighs its examples
  by 1 / its own shard's size, so the average weighs a short shard's examples more (and an
  empty shard's mean is NaN).

Both read the logical graphs: compute_average_loss traces its nodes under the name scope
AVERAGE_LOSS_SCOPE, the optimizer's gradient reduction is an all_reduce with op mean whose
result reaches a variable's assign_var, and a per-replica mean is a reduce_mean that
averages a different number of elements on some replica. Each warning is a UserWarning
located at the user's line (the mean's, or the optimizer's apply_gradients).
"""

from __future__ import annotations

import weakref
import warnings

from graphdist.ops.collectives import all_reduce_p
from graphdist.ops.math import mean_p
from graphdist.ops.state import assign_p

AVERAGE_LOSS_SCOPE = "compute_average_loss"
GUIDE = "see docs/guide.md, 'When N devices do not match one'; `graphdist check` compares"
_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # function -> keys said


def check_replicated_step(function, graphs) -> None:
    """`graphs`: each replica's logical graph of `function`'s new trace (the same graph for
    replicas of the same shard shapes). Warns of a recipe that N replicas break."""
    mean_reduce = gradient_mean_reduction(graphs[0])
    if mean_reduce is None:
        return
    average = average_loss_eqn(graphs[0])
    if average is not None:
        _warn_once(function, ("average_loss", average.source), (
            f"gd.function {function.__name__}: compute_average_loss at "
            f"{_where(average.source)} divides the loss by the global batch, and the optimizer "
            f"at {_where(mean_reduce.source)} averages the gradients of the {len(graphs)} "
            f"replicas (gradient_reduction='mean', the default): each update is "
            f"1/{len(graphs)} of one device's. Make the optimizer with "
            f"gradient_reduction='sum', or take gd.reduce_mean of the local batch instead "
            f"({GUIDE} the two)"), mean_reduce.source)
    if len({id(g) for g in graphs}) == 1:
        return
    for eqn, counts in uneven_means(graphs):
        empty = " (an empty shard's mean is NaN)" if 0 in counts else ""
        _warn_once(function, ("uneven", eqn.source), (
            f"gd.function {function.__name__}: reduce_mean at {_where(eqn.source)} averages "
            f"each replica's own shard, and the shards are uneven (it averages "
            f"{', '.join(map(str, counts))} elements on replicas 0..{len(counts) - 1}){empty}; "
            "the replicas' gradients are then averaged (gradient_reduction='mean'), which "
            "weighs a short shard's examples more than one device on the global batch "
            "would. Use gd.nn.compute_average_loss(per_example_loss, global_batch_size=...) "
            "with gradient_reduction='sum', or drop or pad the partial batch "
            f"({GUIDE} N devices with one)"), eqn.source)


def gradient_mean_reduction(graph):
    """The first all_reduce with op mean whose result reaches a variable's update (the
    optimizer's gradient reduction), or None."""
    averaged: dict = {}
    for eqn in graph.eqns:
        if eqn.op is all_reduce_p and dict(eqn.params).get("op") == "mean":
            averaged.update((v, eqn) for v in eqn.outputs)
            continue
        origin = next((averaged[v] for v in eqn.inputs if v in averaged), None)
        if origin is None:
            continue
        if eqn.op is assign_p:
            return origin
        averaged.update((v, origin) for v in eqn.outputs)
    return None


def average_loss_eqn(graph):
    """The first node compute_average_loss traced, or None."""
    return next((e for e in graph.eqns
                 if AVERAGE_LOSS_SCOPE in e.scope.split("/")), None)


def reduced_count(eqn) -> int:
    """How many elements a reduce_mean eqn averages into each of its results."""
    shape = eqn.inputs[0].ty.shape
    axis = dict(eqn.params).get("axis")
    axes = range(len(shape)) if axis is None else (
        [axis] if isinstance(axis, int) else list(axis))
    count = 1
    for a in axes:
        count *= shape[a % len(shape)]
    return count


def uneven_means(graphs) -> list:
    """[(eqn of replica 0's graph, every replica's count)] for each reduce_mean whose count
    differs between replicas or is 0 on one: a per-replica mean of uneven shards. The
    replicas' graphs come from one function traced on other shapes: their reduce_means
    pair up in order."""
    means = [[e for e in g.eqns if e.op is mean_p] for g in graphs]
    found = []
    for k, eqn in enumerate(means[0]):
        if not all(len(m) > k for m in means):
            break
        counts = tuple(reduced_count(m[k]) for m in means)
        if len(set(counts)) > 1 or 0 in counts:
            found.append((eqn, counts))
    return found


def _where(source: str) -> str:
    return source or "an unknown line"


def _warn_once(function, key, message: str, source: str) -> None:
    said = _warned.setdefault(function, set())
    if key in said:
        return
    said.add(key)
    location = _location(source)
    if location is None:
        warnings.warn(message, UserWarning, stacklevel=4)
        return
    filename, lineno = location
    warnings.warn_explicit(message, UserWarning, filename, lineno)


def _location(source: str):
    """(file name, line number) of an eqn's 'file.py:14  text' source, for warn_explicit."""
    name, _, line = source.split("  ")[0].rpartition(":")
    return (name, int(line)) if name and line.isdigit() else None
