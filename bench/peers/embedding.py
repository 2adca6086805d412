"""The embedding-heavy step every contender runs: its sizes and data."""

from __future__ import annotations

import numpy as np

VOCAB, DIM = 50_000, 256
LOOKUPS = 4_096          # per replica
REPLICAS = 4
LR = 0.5


def embedding_data(seed: int = 0):
    """The initial table, the global batch of ids (4 x 4,096, Zipf-like: frequent ids repeat,
    as words do) and the regression targets."""
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((VOCAB, DIM)) * 0.05).astype(np.float32)
    ids = np.minimum(rng.zipf(1.3, REPLICAS * LOOKUPS) - 1, VOCAB - 1).astype(np.int64)
    targets = rng.standard_normal((REPLICAS * LOOKUPS, DIM)).astype(np.float32)
    return table, ids, targets
