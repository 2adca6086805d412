"""The compile pipeline: every stage from a traced graph to the placed graph that runs.

    traced graph
      -> logical passes      dce, cse, simplify, cse, dce, fuse_optimizer, fuse_accumulate
                             (the last two with fused kernels on)
      -> place               one device; or
         replicate           one copy per device, each collective one N-way node; or
         merge               opt-in ("merged"): logical CPU replicas as one batched program
      -> epilogues           bias + activation into each matmul / conv2d's output pass,
                             relu_grad + the bias gradient's sum in one (fused kernels on)
      -> lower_collectives   each N-way collective becomes what runs (passes/collectives)
      -> overlap             each host/MPI/NCCL all-reduce with compute to hide behind a
                             start and a wait (passes/overlap.py); the last stays inline
      -> fuse_reduce_update  an inline host all-reduce + every replica's optimizer update,
                             one pass
      -> fuse_sharded_update zero_stage > 0 on host devices: a bucket's reduce-scatter,
                             every replica's shard update and the all-gather, one pass
      -> fuse_elementwise    each cluster of elementwise ops one generated loop (fused
                             kernels on)
      -> schedule            order and buffer liveness
      => Plan: the placed graph and how the runtime issues it

Every stage is a Graph -> Graph function run through `passes.run_passes`, so
GRAPHDIST_CHECK=1, GRAPHDIST_DEBUG=2 and the stage timings see all of them, and a Plan keeps
the graph after each stage (`f.get_stages()`, `graphdist show --stages`). The decisions
about replication are made here; the runtime only runs the Plan it is handed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from graphdist import config
from graphdist.device.backends import kind_backends
from graphdist.errors import TraceError, first_use_text
from graphdist.ir import Graph
from graphdist.ops.control_flow import executed_nodes, graph_cost
from graphdist.passes import (eliminate_common_subexpressions, eliminate_dead_code, place,
                              run_passes, schedule)
from graphdist.passes.accumulate import fuse_accumulate
from graphdist.passes.collectives import lower_collectives, lowering_for
from graphdist.passes.core import Stage
from graphdist.passes.epilogue import fold_epilogues
from graphdist.passes.fuse import fuse_optimizer, fuse_reduce_update
from graphdist.passes.fuse_elementwise import fuse_elementwise
from graphdist.passes.fuse_zero import fuse_sharded_update
from graphdist.passes.merge import CannotMerge, merge_replicas
from graphdist.passes.overlap import overlap_collectives
from graphdist.passes.replicate import replicate
from graphdist.passes.simplify import simplify

# how a placed graph is issued: one device; per-device copies in one program or one thread
# each; or the replicas merged into one batched program (passes/merge.py)
MODES = ("one_device", "sequential", "threads", "merged")


@dataclass
class Plan:
    """What the runtime is handed: the placed graph, how to issue it, and how it was made."""

    graph: Graph
    mode: str
    stages: list[Stage] = field(default_factory=list)
    # merged plans: the per-device plan of the same step, built when a merged step fails
    # so that the error can name the failing replica
    per_device: object = None
    # on_failure(error): told when a step raises (a multi-worker strategy tells the other
    # workers, so that none of them waits in a collective for this one)
    on_failure: object = None


def stage(name: str, fn):
    """`fn` under the stage name that records, debug dumps and timings show."""
    def run(g: Graph) -> Graph:
        return fn(g)

    run.__name__ = name
    return run


def logical_passes() -> list:
    passes = [stage("dce", eliminate_dead_code), stage("cse", eliminate_common_subexpressions),
              simplify,
              stage("cse.2", eliminate_common_subexpressions),
              stage("dce.2", eliminate_dead_code)]
    if config.fused_kernels():
        passes += [fuse_optimizer, stage("fuse_accumulate", fuse_accumulate)]
    return passes


def epilogues() -> list:
    """With fused kernels on: each matmul / conv2d's bias add and activation folded into its
    output pass, relu's gradient and the bias gradient's sum into one (passes/epilogue.py).
    Runs on the placed graph, the forward and backward passes both there."""
    return [stage("epilogues", fold_epilogues)] if config.fused_kernels() else []


def elementwise_fusion() -> list:
    """With fused kernels on: each cluster of elementwise ops on one host device becomes one
    node running one generated loop (passes/fuse_elementwise.py), on the placed graph
    after every other fusion, right before the schedule."""
    return [stage("fuse_elementwise", fuse_elementwise)] if config.fused_kernels() else []


def logical(traced: Graph, stages: list | None = None, trace_seconds: float = 0.0) -> Graph:
    """The logical (one-replica) graph: the traced graph through the logical passes."""
    if stages is not None:
        stages.append(Stage("trace", traced, trace_seconds))
    return run_passes(traced, logical_passes(), record=stages)


def device_of(g: Graph, default: str) -> str:
    """The one device a step without a strategy runs on: its variables'."""
    devices = {v.devices for v in g.variables}
    if len(devices) > 1:
        names = ", ".join(f"{v.name} on {list(v.devices)}" for v in g.variables)
        raise TraceError(f"one step uses variables placed on different devices: {names}",
                         first_use_text(g, next(v for v in g.variables
                                                if v.devices != g.variables[0].devices)) or None)
    if devices:
        (devs,) = devices
        if len(devs) > 1:
            raise TraceError(f"variables {[v.name for v in g.variables]} are mirrored on "
                             f"{list(devs)}; run the step through that strategy's run()",
                             first_use_text(g, g.variables[0]) or None)
        return devs[0]
    return default


def one_device(g: Graph, device: str, stages: list | None = None) -> Plan:
    stages = [] if stages is None else stages
    placed = run_passes(g, [stage("place", lambda g: place(g, device)), *epilogues(),
                            *elementwise_fusion(), schedule], record=stages)
    return Plan(placed, "one_device", stages)


def replicated(graphs: list[Graph], strategy, shared_args=(),
               stages: list | None = None) -> Plan:
    """graphs[d]: replica d's logical graph (they differ only where shards differ in shape).
    Per-device copies unless the user opted into merging and it applies."""
    stages = [] if stages is None else stages
    devices = tuple(strategy.devices)
    for v in graphs[0].variables:
        if tuple(v.devices) != devices:
            raise TraceError(f"variable '{v.name}' lives on {list(v.devices)} but the step runs "
                             f"on {list(devices)}; create it under strategy.scope()",
                             first_use_text(graphs[0], v) or None)
    mode = config.device_concurrency()
    backends = kind_backends(devices)
    across = lowering_for(strategy.cross_device_ops).crosses_processes
    if mode == "merged" and all(b.merges_replicas for b in backends) and not across:
        merged = _merged(graphs, devices, shared_args, stages)
        if merged is not None:
            merged.per_device = functools.partial(_per_device, graphs, strategy, "sequential")
            return merged
    # "auto": a thread per device where every device's kind can run one (host memory) and
    # the collectives stay in this process (docs/benchmarks.md, "A thread per device by
    # default"); across MPI workers, on GPUs, with sharded optimizer state (whose
    # reduce-scatter, shard updates and all-gather fuse into one node only in one program:
    # apart, stage 1 took 1.13-1.15x stage 0's step) and for a step of small nodes
    # (small_node_step) one program issues every device
    sharded = getattr(strategy, "zero_stage", 0) > 0
    threads = all(b.threads for b in backends) and (
        mode == "threads"
        or mode == "auto" and not across and not sharded and not small_node_step(graphs[0]))
    plan = _per_device(graphs, strategy, "threads" if threads else "sequential", stages)
    plan.on_failure = getattr(strategy, "_step_failed", None)
    return plan


# A step of small nodes runs as one program under "auto": each node's Python then costs about
# what its numpy work does, and device threads contend for the interpreter lock. A recurrent
# layer's step (bench.lstm: 3,630 nodes of 46 KiB on average, mostly its scan's body): 4
# replicas 36.1 ms a thread each, 28.1 ms as one program (interleaved in one process); on 2
# cores, 2 threads of 2 devices each (executable.device_groups) 32.3 against 28.4. The
# digits MLP of bench.run_steps on 4 devices and 2 cores, by its batch (KiB a node: one
# program / 2 threads of 2 devices, ms): 128 (71 KiB) 1.47 / 1.78, 512 (96 KiB) 2.34 /
# 2.45, 1024 (130 KiB) 3.40 / 3.29. The GPT-2-style, CNN and MLP steps of bench/ (300-1,400
# KiB a node) take 0.7-0.9x the time with threads.
SMALL_NODE_BYTES = 128 << 10


def small_node_step(g: Graph) -> bool:
    """Does one run of `g` execute nodes of SMALL_NODE_BYTES or less on average (the cost
    model's bytes; a loop's body counts once a trip)?"""
    nodes, _ = executed_nodes(g)
    return graph_cost(g)[1] < SMALL_NODE_BYTES * nodes


def _per_device(graphs, strategy, mode: str, stages: list | None = None) -> Plan:
    stages = [] if stages is None else stages
    devices = tuple(strategy.devices)
    first = strategy._first_replica            # this process's first global replica
    passes = [stage("replicate", lambda _: replicate(graphs, devices, first)),
              *epilogues(),
              stage("lower_collectives",
                    lambda g: lower_collectives(g, strategy.cross_device_ops))]
    # the fused node reads every replica's buffers in one pass: devices in host memory run
    # as one program, where all of them are at hand
    host = all(b.shares_host_memory for b in kind_backends(devices))
    # overlap (passes/overlap.py) runs each bucket's all-reduce that has compute to hide
    # behind apart (a communication thread, MPI's non-blocking call, the GPUs' communication
    # streams), where the lowering's node can start early; the others (the last bucket)
    # stay inline, and fuse_reduce_update folds them into the optimizer's update
    if config.overlap() and lowering_for(strategy.cross_device_ops).splits_to_overlap:
        passes.append(stage("overlap", overlap_collectives))
    # (not with a thread per device: the fused node would run in the first device's thread
    # on the others' buckets and parameters, handed over through channels; measured 1.4-1.6x
    # the MLP's step, 1.07x the GPT-2-style one. Why: the node updates the other replicas'
    # parameters and slots in place, which that program does not own, so it updates fresh
    # copies of them (the MLP on 4 devices: 54 copies a step, 50 ms of the first device's
    # thread). Updating them where they lie needs each replica's reads of them ordered
    # before the node, which a device's program does not say today.)
    if config.fused_kernels() and mode == "sequential" and host:
        passes.append(fuse_reduce_update)
        # zero_stage > 0: a bucket's reduce-scatter, sharded update and all-gather, one node
        passes.append(fuse_sharded_update)
    passes += elementwise_fusion()
    passes.append(schedule)
    return Plan(run_passes(graphs[0], passes, record=stages), mode, stages)


def _merged(graphs, devices, shared_args, stages: list) -> Plan | None:
    """The merged plan, or None (logged) where the step cannot merge: uneven shards, or a
    per-replica value written to a mirrored variable."""
    if any(g is not graphs[0] for g in graphs):
        config.logger.info("running %d replicas as per-device copies: shards differ in shape",
                           len(devices))
        return None
    attempt: list = []
    try:
        merged = run_passes(graphs[0], [
            stage("merge", lambda g: merge_replicas(g, devices, shared_args)), *epilogues(),
            *elementwise_fusion(), schedule],
            record=attempt)
    except CannotMerge as e:
        config.logger.info("running %d replicas as per-device copies: %s", len(devices), e)
        return None
    stages += attempt
    return Plan(merged, "merged", stages)
