"""Sharded optimizer state (ZeRO stages 1 and 2, Rajbhandari et al. 2020) for the strategies'
`zero_stage=1|2`.

Layout. Every variable is flattened and padded with zeros to n * L elements, L =
ceil(size / n); replica r owns the flat elements [r L, (r + 1) L) (the last replicas' chunks
hold the padding). Each slot (momentum, Adam's m and v) is a `ShardedSlot`: one per-replica
variable of L elements (sync on read, aggregation NONE), so each replica keeps 1/N of every
slot.

The step. The gradients are packed into buckets (`bucket_bytes` per dtype, as the all-reduce
buckets) laid out replica-major: the bucket is the (n, sum of L) matrix whose row r is every
member's chunk r side by side, flattened, so one `reduce_scatter` hands replica r its row:
its chunk of every member's reduced gradient, already split per variable. A gradient of 1
MiB or more (`SOLO_BYTES`) gets a bucket of its own: interleaving it would cost a copy of
it into the bucket and of its gathered parameter out of it (the 4-replica MLP's sharded
collectives and update: 35 ms with one bucket, 7 ms so; its fused stage-0 all-reduce +
update: 5 ms). Each replica runs
the optimizer's own fused update kernel (`Optimizer._updated`: the same kernel and formula
as stage 0) on its chunk of the parameter (read from its full copy), its slot shards and its
gradient chunk, then one `all_gather` per bucket gives every replica every updated chunk,
and the parameters are written whole. Elementwise, the update sees the same numbers as at
stage 0, so where the reduce-scatter adds in the same order as the all-reduce (every
lowering adds in replica order) the parameters are bit-identical; clipping computes its norm
from per-shard sums of squares (one extra scalar all-reduce for global_clipnorm, one vector
for clipnorm), which rounds differently from stage 0's sum over whole tensors (equal within
float32 rounding, not bit for bit).

Stage 2 differs from stage 1 in the paper by freeing the full reduced gradient; here the
reduced gradient never exists whole at either stage (the reduce-scatter yields only the
shard, and the buffer planner frees each local gradient bucket at its reduce-scatter), so
both stages run the same program; `graphdist simulate --memory` keeps the paper's
arithmetic apart for them. Sparse gradients are densified before the reduce-scatter.
"""

from __future__ import annotations

import math

import numpy as np

from graphdist.distribute.buckets import plan_buckets
from graphdist.distribute.values import VariableAggregation, VariableSynchronization
from graphdist.ops.array import cast, concat, pad, reshape, split
from graphdist.ops.clip import clip_by_global_norm, norm_dtype
from graphdist.ops.collectives import all_gather, all_reduce, reduce_scatter, replica_id
from graphdist.ops.math import add, reduce_sum, sqrt, square
from graphdist.ops.sparse import densify, gather
from graphdist.optimizers.roles import with_role
from graphdist.variables import Variable

ZERO_STAGES = (0, 1, 2)
SOLO_BYTES = 2**20      # a gradient this large gets a reduce-scatter of its own


def check_zero_stage(owner: str, stage) -> int:
    """The strategies' `zero_stage` argument, checked."""
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"{owner}: zero_stage must be 0, 1 or 2, got {stage!r}")
    return int(stage)


def shard_length(size: int, n: int) -> int:
    return -(-int(size) // int(n))


def _padded_rows(x, n: int, length: int):
    """x flattened, zero-padded to n * length, as an (n, length) matrix: row r is replica
    r's chunk."""
    flat = reshape(x, (-1,))
    short = n * length - math.prod(x.shape)
    if short:
        flat = pad(flat, [[0, short]])
    return reshape(flat, (n, length))


def host_shards(value: np.ndarray, n: int) -> list:
    """Every replica's chunk of a whole (host) value, padded: what a ShardedSlot holds."""
    length = shard_length(value.size, n)
    flat = np.zeros(n * length, value.dtype)
    flat[:value.size] = value.reshape(-1)
    return [flat[r * length:(r + 1) * length].copy() for r in range(n)]


class ShardedSlot:
    """An optimizer slot of `var` kept as 1/N flat shards (zero_stage > 0): `shard` is the
    per-replica variable of ceil(size / N) elements. Reads and writes from outside a step
    (`numpy()`, checkpoints) see the whole slot, shaped as `var`, so a checkpoint holds whole
    slots and restores into any replica count and any stage."""

    def __init__(self, var: Variable, name: str):
        strategy = var._strategy
        self.n = strategy.num_replicas_in_sync
        self.name = name
        self.shape, self.dtype = tuple(var.shape), np.dtype(var.dtype)
        self.length = shard_length(math.prod(self.shape), self.n)
        self.shard = with_role("slot", Variable(
            np.zeros(self.length, self.dtype), trainable=False, name=name,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.NONE, _devices=var.devices, _strategy=strategy))

    synchronization = property(lambda self: self.shard.synchronization)
    aggregation = property(lambda self: self.shard.aggregation)
    devices = property(lambda self: self.shard.devices)
    _strategy = property(lambda self: self.shard._strategy)
    values = property(lambda self: self.shard.values, doc="this process's shards")

    def numpy(self) -> np.ndarray:
        """The whole slot: every replica's shard, unpadded and shaped as the variable (under
        a multi-worker strategy the other workers' shards are summed in, exactly, onto an
        additive identity)."""
        total, first = self.shard._replicas()
        flat = np.full(total * self.length, -0.0, self.dtype)    # x + -0.0 == x, bit for bit
        for k in range(len(self.shard.values)):
            at = (first + k) * self.length
            flat[at:at + self.length] = self.shard._host(k)
        if total > len(self.shard.values):
            flat = self.shard._strategy._sum_across_workers(flat)
        return flat[:math.prod(self.shape)].reshape(self.shape).copy()

    def components_for(self, value: np.ndarray) -> list:
        """This process's shards of a whole value (what a restore writes)."""
        total, first = self.shard._replicas()
        return host_shards(np.asarray(value, self.dtype), total)[
            first:first + len(self.shard.values)]

    def assign_components(self, arrays) -> None:
        self.shard.assign_components(arrays)

    def assign(self, value) -> None:
        """Set the whole slot from outside a step."""
        self.assign_components(self.components_for(np.asarray(value)))

    def __repr__(self) -> str:
        return (f"<gd.optimizers ShardedSlot '{self.name}' shape={self.shape} "
                f"dtype={self.dtype} shards={self.n}x{self.length}>")


def reduce_scatter_gradients(opt, pairs, ctx, bucket_bytes: int,
                             reduce: bool = True) -> "ShardedGradients":
    """This replica's chunk of every reduced gradient: one reduce_scatter per bucket. With
    `reduce=False` (apply_gradients(..., all_reduce=False): the gradients are already
    reduced, the same on every replica) each replica just takes its chunk."""
    n = ctx.num_replicas_in_sync
    grads = [densify(g) for g, _ in pairs]
    variables = [v for _, v in pairs]
    lengths = [shard_length(math.prod(v.shape), n) for v in variables]
    by_dtype: dict = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(np.dtype(g.dtype), []).append(i)
    buckets, shards = [], [None] * len(grads)
    for dtype, members in by_dtype.items():
        sizes = [n * lengths[i] * dtype.itemsize for i in members]
        # a large tensor goes alone: interleaving it into a bucket would copy its gradient
        # (the concat along axis 1) and its gathered value (a strided split) once more
        solo = [k for k, size in enumerate(sizes) if size >= SOLO_BYTES]
        small = [k for k in range(len(members)) if k not in solo]
        planned = [[k] for k in solo] + [[small[j] for j in b] for b in plan_buckets(
            [sizes[k] for k in small], bucket_bytes)]
        for bucket in sorted(planned):
            bucket = [members[k] for k in bucket]
            rows = [_padded_rows(grads[i], n, lengths[i]) for i in bucket]
            matrix = rows[0] if len(rows) == 1 else concat(rows, axis=1)
            if reduce:
                mine = reduce_scatter(reshape(matrix, (-1,)), opt.gradient_reduction, n)
            else:
                mine = reshape(gather(matrix, reshape(replica_id(), (1,))), (-1,))
            parts = [mine] if len(bucket) == 1 else split(mine, [lengths[i] for i in bucket])
            for i, part in zip(bucket, parts):
                shards[i] = part
            buckets.append(bucket)
    return ShardedGradients(opt, variables, shards, lengths, buckets, n)


class ShardedGradients:
    """What `Optimizer._reduce` returns under zero_stage > 0: this replica's gradient chunks
    (`gradients`, what LossScaleOptimizer checks), applied by `apply(step)`."""

    def __init__(self, opt, variables, shards, lengths, buckets, n):
        self.opt, self.variables, self.gradients = opt, variables, shards
        self.lengths, self.buckets, self.n = lengths, buckets, n

    def apply(self, step) -> None:
        """Clip, update this replica's chunks with the optimizer's fused kernel, all-gather
        the parameters bucket by bucket and write them whole."""
        opt, n = self.opt, self.n
        grads = self._clipped()
        hyper = opt._hyper_vector(step)
        me = replica_id()
        for bucket in self.buckets:
            new_chunks = []
            for i in bucket:
                v = self.variables[i]
                # row `me` (a 0-d index: no reshape after it), a buffer of its own that the
                # update then overwrites in place
                chunk = gather(_padded_rows(v.read_value(), n, self.lengths[i]), me)
                slots = [opt.slot(v, name) for name in opt.slot_names]
                new_v, *new_slots = opt._updated(chunk, [s.shard for s in slots], grads[i],
                                                 hyper)
                for slot, new in zip(slots, new_slots):
                    slot.shard.assign_synced(new)   # this replica's shard (sync on read)
                new_chunks.append(new_v)
            mine = new_chunks[0] if len(bucket) == 1 else concat(new_chunks, axis=0)
            width = sum(self.lengths[i] for i in bucket)
            everyone = reshape(all_gather(mine, n, total=n * width), (n, width))
            parts = [everyone] if len(bucket) == 1 else split(
                everyone, [self.lengths[i] for i in bucket], axis=1)
            for i, part in zip(bucket, parts):
                v = self.variables[i]
                size = math.prod(v.shape)
                flat = reshape(part, (-1,))
                if size < flat.shape[0]:
                    flat = split(flat, [size, flat.shape[0] - size])[0]
                v.assign_synced(reshape(flat, v.shape))

    def _clipped(self) -> list:
        """clipnorm / global_clipnorm from the shards: each replica's sums of squares,
        all-reduced (one scalar for the global norm, one per variable for clipnorm)."""
        opt, grads = self.opt, list(self.gradients)
        if opt.clipnorm is None and opt.global_clipnorm is None:
            return grads
        dtype = norm_dtype(g.dtype for g in grads)
        squares = [reduce_sum(square(cast(g, dtype))) for g in grads]
        if opt.global_clipnorm is not None:
            total = squares[0]
            for s in squares[1:]:
                total = add(total, s)
            norm = sqrt(all_reduce(total, "sum"))
            return clip_by_global_norm(grads, opt.global_clipnorm, use_norm=norm)[0]
        norms = sqrt(all_reduce(concat([reshape(s, (1,)) for s in squares]), "sum"))
        per = split(norms, [1] * len(grads)) if len(grads) > 1 else [norms]
        return [clip_by_global_norm([g], opt.clipnorm, use_norm=reshape(m, ()))[0][0]
                for g, m in zip(grads, per)]


__all__ = ["ShardedGradients", "ShardedSlot", "check_zero_stage", "host_shards",
           "reduce_scatter_gradients"]
