"""Losses that depend on the strategy: compute_average_loss scales by the global batch,
which it infers from the replica context (TF's tf.nn.compute_average_loss)."""

from __future__ import annotations

import numpy as np

from graphdist.distribute import recipes
from graphdist.distribute.context import get_replica_context
from graphdist.ops.array import cast
from graphdist.ops.math import multiply, reduce_sum
from graphdist.trace import name_scope


def compute_average_loss(per_example_loss, global_batch_size=None):
    """Sum of the per-example losses over the *global* batch size, so that *summing* the
    replicas' gradients matches one device on the global batch: pair it with optimizers made
    with `gradient_reduction="sum"` (their default MEAN divides by the replica count once
    more; with MEAN use reduce_mean of the local batch instead). The inferred size (local
    batch x replicas) is only right for even shards: pass `global_batch_size` when the last
    batch may be partial. A size of 0 (an empty shard) gives 0, as TF's div_no_nan does.

    >>> gd.nn.compute_average_loss(np.ones(4, np.float32), global_batch_size=8)
    array(0.5, dtype=float32)
    """
    if global_batch_size is None:
        ctx = get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        global_batch_size = per_example_loss.shape[0] * replicas
    # the scope marks its nodes: an optimizer that averages them again warns (recipes.py)
    with name_scope(recipes.AVERAGE_LOSS_SCOPE):
        loss = reduce_sum(per_example_loss)
        scale = 1.0 / global_batch_size if global_batch_size else 0.0
        return multiply(loss, cast(np.asarray(scale), loss.dtype))
