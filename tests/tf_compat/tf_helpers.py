"""What several ports of TensorFlow's tests share: TF's experimental_local_results and its
AssertFlattenedMixin, on graphdist values."""

from __future__ import annotations

import numpy as np

import graphdist as gd


def local_results(result, n: int = 2) -> tuple:
    """TF's experimental_local_results: one entry per replica, for plain values too."""
    return tuple(result.values) if isinstance(result, gd.PerReplica) else (result,) * n


def flattened(results) -> list:
    """TF's AssertFlattenedMixin.assert_equal_flattened: each step's replica outputs joined."""
    return [np.concatenate([np.atleast_1d(v) for v in local_results(r)]).tolist()
            for r in results]
