"""Kernel adapters of row-sparse values (kernels/sparse.py): whole rows at a time where
numpy goes element by element. Their numpy forms (the ops' impls) give the same bits."""

from __future__ import annotations

import numpy as np

from graphdist.runtime.adapters.registry import OP_IMPL, register_kernel


@register_kernel("scatter_rows", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def scatter_rows_cpu(out, indices, rows, *, shape):
    """Whole rows at a time (np.add.at goes element by element, ~20x slower)."""
    from graphdist.kernels.sparse import scatter_rows_cpu
    from graphdist.ops.sparse import check_slices

    check_slices(np, indices, shape[0])
    scatter_rows_cpu(out, indices, rows)


@register_kernel("sum_duplicates", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
def sum_duplicates_cpu(outs, indices, rows, *, divisor=1, table_rows=None):
    """One pass with a slot table (numpy: a sort and np.add.at, ~10x slower)."""
    from graphdist.kernels.sparse import sum_duplicates_cpu
    from graphdist.ops.sparse import check_slices

    check_slices(np, indices, table_rows)
    sum_duplicates_cpu(outs, indices, rows, divisor)
