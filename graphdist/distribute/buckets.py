"""Gradient bucketing: many small all-reduces become a few large ones (fewer collective
launches, better link use). Gradients are flattened and concatenated into buckets of at most
`bucket_bytes` per dtype, all-reduced, then split and reshaped back."""

from __future__ import annotations

from graphdist.ops.array import concat, reshape, split
from graphdist.ops.collectives import all_reduce


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive indices into buckets of at most bucket_bytes (one oversized tensor
    gets a bucket of its own)."""
    buckets, current, used = [], [], 0
    for i, nbytes in enumerate(sizes_bytes):
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def bucketed_all_reduce(tensors: list, op: str, bucket_bytes: int) -> list:
    """all_reduce(t, op) for every tensor, packed into buckets."""
    out = [None] * len(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        sizes = [tensors[i].dtype.itemsize * max(1, _size(tensors[i])) for i in indices]
        for bucket in plan_buckets(sizes, bucket_bytes):
            members = [indices[k] for k in bucket]
            if len(members) == 1:
                out[members[0]] = all_reduce(tensors[members[0]], op)
                continue
            flat = concat([reshape(tensors[i], (-1,)) for i in members], axis=0)
            parts = split(all_reduce(flat, op), [_size(tensors[i]) for i in members])
            for i, part in zip(members, parts):
                out[i] = reshape(part, tensors[i].shape)
    return out


def _size(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n
