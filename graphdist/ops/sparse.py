"""Row-sparse values: gather (embedding lookups) and the IndexedSlices its gradient is.

The gradient of `gather(params, indices)` with respect to `params` touches only the rows
it looked up. Written densely it would be a whole table of zeros per step, all-reduced
across replicas; as TF's IndexedSlices it is `indices` plus one row per index, and rows
with the same index add up. autodiff.py keeps it sparse on its way to a variable, the
strategy all-gathers it (distribute/sparse.py) and the optimizers scatter it.

Shapes are static, so merging duplicate rows (`sum_duplicates`) cannot shrink a value:
its result keeps the row count, the distinct indices first, then zero rows at index 0.
Every consumer adds rows (scatter with accumulation), so zero rows change nothing.
"""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.array import cast, concat, out_of_range, reshape, transpose
from graphdist.ops.core import Op, Symbolic, bind, normalize_axis
from graphdist.ops.naming import called_as, user_op


class IndexedSlices:
    """A sparse value of `dense_shape`: row `values[i]` at row `indices[i]`; repeated
    indices add. What `tape.gradient` returns for a variable read through `gd.gather`.

    >>> s = gd.IndexedSlices(np.array([0, 2, 0]), np.ones((3, 2)), (4, 2))
    >>> np.asarray(s)[0]
    array([2., 2.])
    """

    __slots__ = ("indices", "values", "dense_shape", "unique")

    def __init__(self, indices, values, dense_shape, unique: bool = False):
        self.indices = indices
        self.values = values
        self.dense_shape = tuple(int(d) for d in dense_shape)
        self.unique = unique     # each index at most once (zero rows aside): sum_duplicates' result
        if tuple(np.shape(values))[1:] != self.dense_shape[1:] or \
                len(np.shape(indices)) != 1 or np.shape(indices)[0] != np.shape(values)[0]:
            raise ShapeError(f"IndexedSlices: values {tuple(np.shape(values))} must be one row "
                             f"of {self.dense_shape} per index; indices "
                             f"{tuple(np.shape(indices))} must be 1-D")
        if isinstance(indices, np.ndarray):   # a traced one is checked where it is used
            check_slices(np, indices, self.dense_shape[0])

    shape = property(lambda self: self.dense_shape)
    dtype = property(lambda self: np.dtype(self.values.dtype))

    def __repr__(self) -> str:
        return (f"IndexedSlices({len(self.indices)} rows of dense shape {self.dense_shape}, "
                f"{self.dtype})")

    # a pytree node: returned from a gd.function it comes back with numpy children
    def tree_children(self) -> tuple:
        return (self.indices, self.values)

    def tree_aux(self):
        return self.dense_shape

    @classmethod
    def tree_rebuild(cls, children, aux):
        return cls(children[0], children[1], aux)

    def __array__(self, dtype=None, copy=None):
        if isinstance(self.values, Symbolic):
            raise TypeError("a traced IndexedSlices has no numpy value yet; return it from "
                            "the gd.function to get its value")
        dense = densify(self)
        return dense if dtype is None else dense.astype(dtype)


def _check_indices(op_name: str, indices: ArrayType) -> None:
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{op_name}: indices must be integers, got {indices}")


# ---------------------------------------------------------------- gather

gather_p = Op("gather")


@gather_p.def_shape
def _gather_shape(params, indices):
    _check_indices("gather", indices)
    if params.ndim == 0:
        raise ShapeError(f"gather: params must have rank >= 1, got {params}")
    return ArrayType(indices.shape + params.shape[1:], params.dtype)


def check_rows(op_name: str, xp, indices, rows: int) -> None:
    """Out-of-range indices raise IndexError, as TF does on CPU (numpy would wrap negative
    ones into the last rows)."""
    bad = out_of_range(xp, indices, rows)
    if bad is None:
        return
    value, at, count = bad
    where = f" at {at} of the indices {tuple(indices.shape)}" if indices.ndim else ""
    many = f"; {count} out of range" if indices.ndim else ""
    raise IndexError(f"{op_name}: index {value}{where} is out of range for {rows} rows "
                     f"(expected 0 <= index < {rows}{many})")


@gather_p.def_impl
def _gather_impl(xp, params, indices):
    check_rows("gather", xp, indices, params.shape[0])
    return xp.take(params, indices, axis=0)


@gather_p.def_out
def _gather_out(xp, out, params, indices):
    """Into a planned buffer: a large gather (zero_stage > 0's own chunk of a parameter)
    becomes a buffer of the step's that an in-place update may then take over, where a
    fresh array cost it a copy first."""
    check_rows("gather", xp, indices, params.shape[0])
    xp.take(params, indices, axis=0, out=out)


@gather_p.def_vjp
def _gather_vjp(ct, params, indices):
    rows = ct if indices.ty.ndim == 1 else reshape(ct, (-1,) + params.ty.shape[1:])
    flat = indices if indices.ty.ndim == 1 else reshape(indices, (-1,))
    return IndexedSlices(flat, rows, params.ty.shape), None


gather_p.def_cost(lambda ins, outs, **_: (0, 2 * outs[0].nbytes + ins[1].nbytes))

# ---------------------------------------------------------------- checked indices
# gather's indices, checked against the table's rows where the user gave them: the same
# indices (a view) or an IndexError naming the op the user called (`checked_for`: gather,
# embedding_lookup). The gradient's row indices are this op's output, so the check runs
# whenever the gradient does, also when the forward gather is dead code (a step that only
# applies the gradient): the first, numpy calls of a step and its kernels, fused or not,
# raise the same error before any variable or slot changes.
check_indices_p = Op("check_indices", view=True, differentiable=False)


@check_indices_p.def_shape
def _check_indices_shape(indices, *, rows, checked_for):
    _check_indices(checked_for, indices)
    return indices


@check_indices_p.def_impl
def _check_indices_impl(xp, indices, *, rows, checked_for):
    check_rows(checked_for, xp, indices, rows)
    return indices


check_indices_p.def_batch(lambda bx, indices, **params: bx.add(check_indices_p, indices,
                                                                **params))
check_indices_p.def_cost(lambda ins, outs, **_: (ins[0].size, ins[0].nbytes))

# ---------------------------------------------------------------- densify: rows -> table

scatter_rows_p = Op("scatter_rows")   # zeros of `shape` plus each row added at its index


@scatter_rows_p.def_shape
def _scatter_rows_shape(indices, rows, *, shape):
    _check_indices("scatter_rows", indices)
    if indices.ndim != 1 or rows.shape != indices.shape + tuple(shape[1:]):
        raise ShapeError(f"scatter_rows: expected 1-D indices and one row of {tuple(shape)} "
                         f"per index, got indices:{indices}, rows:{rows}")
    return ArrayType(tuple(shape), rows.dtype)


def check_slices(xp, indices, rows: int | None) -> None:
    """An IndexedSlices' indices against the `rows` of the table it stands for (None: only
    that none is negative), where it is densified, merged or applied. gather's indices are
    checked where the user gave them (check_indices), so this catches a user-built
    IndexedSlices, on every path: the numpy impls here and the kernels' wrappers in
    runtime/kernel_table.py raise the same error before anything changes."""
    limit = int(rows) if rows is not None else int(np.iinfo(indices.dtype).max)
    check_rows("IndexedSlices", xp, indices, limit)


@scatter_rows_p.def_impl
def _scatter_rows_impl(xp, indices, rows, *, shape):
    check_slices(xp, indices, shape[0])
    out = xp.zeros(shape, rows.dtype)
    _add_at(xp, out, indices, rows)
    return out


scatter_rows_p.def_vjp(lambda ct, indices, rows, *, shape: (None, gather(ct, indices)))
scatter_rows_p.def_cost(lambda ins, outs, **_: (ins[1].size, outs[0].nbytes + 2 * ins[1].nbytes))


def _add_at(xp, out, indices, rows) -> None:
    """out[indices] += rows, repeated indices accumulating (in index order)."""
    if xp is np:
        np.add.at(out, indices, rows)
    else:                                   # CuPy: scatter_add is its add.at
        import cupyx

        cupyx.scatter_add(out, indices, rows)


# ---------------------------------------------------------------- merging duplicate rows

sum_duplicates_p = Op("sum_duplicates", num_outputs=2, differentiable=False,
                      cost_kind="reduce")


@sum_duplicates_p.def_shape
def _sum_duplicates_shape(indices, rows, *, divisor=1, table_rows=None):
    _check_indices("sum_duplicates", indices)
    if indices.ndim != 1 or rows.ndim < 1 or rows.shape[0] != indices.shape[0]:
        raise ShapeError(f"sum_duplicates: expected 1-D indices and one row per index, got "
                         f"indices:{indices}, rows:{rows}")
    return indices, rows


@sum_duplicates_p.def_impl
def _sum_duplicates_impl(xp, indices, rows, *, divisor=1, table_rows=None):
    """TF's _deduplicate_indexed_slices at a static size: the distinct indices in the order
    they first occur, each with the sum of its rows in their order (divided by `divisor`,
    a mean's replica count), then zero rows at index 0. `table_rows`: the rows of the
    table the indices address, checked (None: only that none is negative)."""
    check_slices(xp, indices, table_rows)
    unique, first, inverse = xp.unique(indices, return_index=True, return_inverse=True)
    order = xp.argsort(first)                    # the distinct indices by first occurrence
    slot = xp.empty_like(order)
    slot[order] = xp.arange(order.shape[0])
    out_rows = xp.zeros_like(rows)
    _add_at(xp, out_rows, slot[inverse.reshape(-1)], rows)
    if divisor != 1:
        xp.divide(out_rows, rows.dtype.type(divisor), out=out_rows)
    out_indices = xp.zeros_like(indices)
    out_indices[:order.shape[0]] = unique[order]
    return out_indices, out_rows


sum_duplicates_p.def_cost(lambda ins, outs, **_: (ins[1].size, 2 * sum(t.nbytes for t in ins)))

# ---------------------------------------------------------------- public functions


@user_op("gather")
def gather(params, indices, axis=0):
    """Rows (or slices along `axis`) of `params` at `indices`: shape
    params.shape[:axis] + indices.shape + params.shape[axis+1:], as tf.gather. With respect
    to params (axis 0) the gradient is an IndexedSlices: one row per index. An index
    outside [0, rows) raises IndexError (eagerly now, in traced code when the step runs),
    as TF does on CPU; numpy would wrap a negative one.

    >>> gd.gather(np.arange(6.0).reshape(3, 2), np.array([2, 0]))
    array([[4., 5.],
           [0., 1.]])
    """
    shape = tuple(getattr(params, "shape", np.shape(params)))
    rank = len(shape)
    if rank == 0:
        raise ShapeError("gather: params must have rank >= 1, got shape ()")
    (axis,) = normalize_axis("gather", int(axis), rank, shape)
    indices = bind(check_indices_p, indices, rows=shape[axis],
                   checked_for=called_as("gather"))
    if axis == 0:
        return bind(gather_p, params, indices)
    front = transpose(params, (axis,) + tuple(d for d in range(rank) if d != axis))
    out = bind(gather_p, front, indices)
    k = len(np.shape(indices))            # out: indices dims, then params' dims but `axis`
    rest = list(range(k, k + rank - 1))
    return transpose(out, tuple(rest[:axis]) + tuple(range(k)) + tuple(rest[axis:]))


def densify(value):
    """An IndexedSlices as the dense tensor it stands for (anything else unchanged)."""
    if not isinstance(value, IndexedSlices):
        return value
    return bind(scatter_rows_p, value.indices, value.values, shape=value.dense_shape)


def sum_duplicates(value: IndexedSlices, divisor: int = 1) -> IndexedSlices:
    """The same sparse value with each index once (rows summed, then divided by `divisor`),
    padded with zero rows."""
    if value.unique and divisor == 1:
        return value
    indices, rows = bind(sum_duplicates_p, value.indices, value.values, divisor=int(divisor),
                         table_rows=value.dense_shape[0])
    return IndexedSlices(indices, rows, value.dense_shape, unique=True)


def concat_slices(a: IndexedSlices, b: IndexedSlices) -> IndexedSlices:
    """a + b for two sparse values: their rows side by side (duplicates add later)."""
    idx_dtype = np.promote_types(a.indices.dtype, b.indices.dtype)
    return IndexedSlices(concat([cast(a.indices, idx_dtype), cast(b.indices, idx_dtype)]),
                         concat([a.values, b.values]), a.dense_shape)
