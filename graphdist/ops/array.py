"""Shape and layout ops (reshape, transpose, concat, split, indexing...), casts and fills."""

from __future__ import annotations

import math

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType, as_dtype, is_float
from graphdist.ops.core import Op, bind, normalize_axis, same_dtype
from graphdist.ops.naming import user_op

# ---------------------------------------------------------------- reshape family (views)

reshape_p = Op("reshape", view=True)


def resolve_shape(op_name: str, ty: ArrayType, shape) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"{op_name}: at most one -1 allowed, got {shape}")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known == 0 or ty.size % known:
            raise ShapeError(f"{op_name}: cannot reshape {ty} to {shape}")
        shape = tuple(ty.size // known if d == -1 else d for d in shape)
    if math.prod(shape) != ty.size or any(d < 0 for d in shape):
        raise ShapeError(f"{op_name}: cannot reshape {ty} ({ty.size} elements) to {shape}")
    return shape


reshape_p.def_shape(lambda x, *, shape: ArrayType(resolve_shape("reshape", x, shape), x.dtype))
reshape_p.def_impl(lambda xp, x, *, shape: xp.reshape(x, shape))
reshape_p.def_vjp(lambda ct, x, *, shape: (reshape(ct, x.ty.shape),))
reshape_p.def_batch(lambda bx, x, *, shape: bx.add(
    reshape_p, x, shape=(bx.n,) + resolve_shape("reshape", bx.logical(x), shape)))

transpose_p = Op("transpose", view=True)


def _perm(x: ArrayType, perm):
    if perm is None:
        return tuple(reversed(range(x.ndim)))
    axes = tuple(p + x.ndim if -x.ndim <= p < 0 else p for p in perm)   # numpy: -1 is last
    if sorted(axes) != list(range(x.ndim)):
        raise ShapeError(f"transpose: perm {perm} is not a permutation of the axes of {x}")
    return axes


@transpose_p.def_shape
def _transpose_shape(x, *, perm):
    return ArrayType(tuple(x.shape[p] for p in _perm(x, perm)), x.dtype)


transpose_p.def_impl(lambda xp, x, *, perm: xp.transpose(x, perm))
transpose_p.def_vjp(lambda ct, x, *, perm: (
    transpose(ct, tuple(int(i) for i in np.argsort(_perm(x.ty, perm)))),))
transpose_p.def_batch(lambda bx, x, *, perm: bx.add(
    transpose_p, x, perm=(0,) + tuple(p + 1 for p in _perm(bx.logical(x), perm))))

broadcast_p = Op("broadcast_to", view=True)


@broadcast_p.def_shape
def _broadcast_shape(x, *, shape):
    try:
        if tuple(np.broadcast_shapes(x.shape, shape)) != tuple(shape):
            raise ValueError
    except ValueError:
        raise ShapeError(f"broadcast_to: cannot broadcast x:{x} to {tuple(shape)}") from None
    return ArrayType(tuple(shape), x.dtype)


broadcast_p.def_impl(lambda xp, x, *, shape: xp.broadcast_to(x, shape))
broadcast_p.def_batch(lambda bx, x, *, shape: bx.add(
    broadcast_p, bx.with_rank(x, len(shape)), shape=(bx.n,) + tuple(shape)))


@broadcast_p.def_vjp
def _broadcast_vjp(ct, x, *, shape):
    from graphdist.ops.math import unbroadcast

    return (unbroadcast(ct, x.ty),)


stop_gradient_p = Op("stop_gradient", view=True, differentiable=False)
stop_gradient_p.def_shape(lambda x: x)
stop_gradient_p.def_impl(lambda xp, x: x)
stop_gradient_p.def_batch(lambda bx, x: bx.add(stop_gradient_p, x))

# ---------------------------------------------------------------- concat / split

concat_p = Op("concat")


@concat_p.def_shape
def _concat_shape(*xs, axis):
    if not xs:
        raise ShapeError("concat: needs at least one value")
    dtype = same_dtype("concat", *xs)
    (ax,) = normalize_axis("concat", axis, xs[0].ndim, xs[0].shape)
    for x in xs:
        if x.ndim != xs[0].ndim or any(a != b for i, (a, b) in enumerate(zip(x.shape, xs[0].shape))
                                       if i != ax):
            raise ShapeError(f"concat: shapes differ off axis {axis}: "
                             + ", ".join(str(t) for t in xs))
    shape = list(xs[0].shape)
    shape[ax] = sum(x.shape[ax] for x in xs)
    return ArrayType(tuple(shape), dtype)


concat_p.def_impl(lambda xp, *xs, axis: xp.concatenate(xs, axis=axis))
concat_p.def_out(lambda xp, out, *xs, axis: xp.concatenate(xs, axis=axis, out=out))
concat_p.def_batch(lambda bx, *xs, axis: bx.add(
    concat_p, *(bx.stacked(x) for x in xs),
    axis=normalize_axis("concat", axis, bx.logical(xs[0]).ndim)[0] + 1))


@concat_p.def_vjp
def _concat_vjp(ct, *xs, axis):
    (ax,) = normalize_axis("concat", axis, xs[0].ty.ndim)
    return split(ct, [x.ty.shape[ax] for x in xs], axis)


split_p = Op("split", num_outputs=None, view=True)   # every output is a view of x


@split_p.def_shape
def _split_shape(x, *, sizes, axis):
    (ax,) = normalize_axis("split", axis, x.ndim, x.shape)
    if sum(sizes) != x.shape[ax] or any(s < 0 for s in sizes):
        raise ShapeError(f"split: sizes {sizes} do not add up to axis {axis} of {x}")
    return tuple(ArrayType(x.shape[:ax] + (s,) + x.shape[ax + 1:], x.dtype) for s in sizes)


split_p.def_impl(lambda xp, x, *, sizes, axis: tuple(
    xp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis)))
split_p.def_batch(lambda bx, x, *, sizes, axis: bx.add(
    split_p, x, sizes=sizes, axis=normalize_axis("split", axis, bx.logical(x).ndim)[0] + 1))


@split_p.def_vjp
def _split_vjp(cts, x, *, sizes, axis):
    ax = normalize_axis("split", axis, x.ty.ndim)[0]
    parts = [ct if ct is not None else
             zeros(x.ty.shape[:ax] + (s,) + x.ty.shape[ax + 1:], x.ty.dtype)
             for ct, s in zip(cts, sizes)]
    return (concat(parts, axis),)


# ---------------------------------------------------------------- pad (and its gradient)

PAD_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC")


def _pad_check(op_name: str, x: ArrayType, paddings, mode, unpadded=None) -> None:
    """`unpadded`: the shape the reflection happens in (x's own for pad, the result's for
    pad_grad). TF's limits: REFLECT pads at most size - 1 per side, SYMMETRIC at most size."""
    if mode not in PAD_MODES:
        raise ValueError(f"{op_name}: mode must be one of {', '.join(PAD_MODES)}, got {mode!r}")
    if len(paddings) != x.ndim or any(len(p) != 2 or min(p) < 0 for p in paddings):
        raise ShapeError(f"{op_name}: paddings must be one non-negative [before, after] pair "
                         f"per axis of x:{x}, got {[list(p) for p in paddings]}")
    limit = {"REFLECT": 1, "SYMMETRIC": 0}.get(mode)
    for ax, ((b, a), n) in enumerate(zip(paddings, unpadded or x.shape)):
        if n < 0 or limit is not None and max(b, a) > n - limit:
            raise ShapeError(f"{op_name}: {mode} padding {[b, a]} does not fit axis {ax} "
                             f"(size {n}) of x:{x}" + (f" (at most {max(n - limit, 0)} per "
                                                       f"side)" if limit is not None else ""))


pad_p = Op("pad")


@pad_p.def_shape
def _pad_shape(x, *, paddings, mode, constant_values):
    _pad_check("pad", x, paddings, mode)
    return ArrayType(tuple(n + b + a for n, (b, a) in zip(x.shape, paddings)), x.dtype)


@pad_p.def_impl
def _pad_impl(xp, x, *, paddings, mode, constant_values):
    if x.ndim == 0:
        return x.copy()
    if mode == "CONSTANT":
        return xp.pad(x, paddings, mode="constant", constant_values=constant_values)
    return xp.pad(x, paddings, mode=mode.lower())


@pad_p.def_vjp
def _pad_vjp(ct, x, *, paddings, mode, constant_values):
    if mode == "CONSTANT":         # the middle of ct: a view
        return (getitem(ct, tuple(slice(b, b + n) for (b, _), n in zip(paddings,
                                                                        x.ty.shape))),)
    return (bind(pad_grad_p, ct, paddings=paddings, mode=mode),)


pad_p.def_batch(lambda bx, x, *, paddings, **params: bx.add(
    pad_p, x, paddings=((0, 0),) + paddings, **params))

# pad's adjoint: the middle of ct, plus (REFLECT, SYMMETRIC) the mirrored borders folded back
pad_grad_p = Op("pad_grad")


@pad_grad_p.def_shape
def _pad_grad_shape(ct, *, paddings, mode):
    shape = tuple(n - b - a for n, (b, a) in zip(ct.shape, paddings))
    _pad_check("pad_grad", ct, paddings, mode, shape)
    return ArrayType(shape, ct.dtype)


@pad_grad_p.def_impl
def _pad_grad_impl(xp, ct, *, paddings, mode):
    g = ct
    for ax, (b, a) in enumerate(paddings):
        def at(lo, hi, ax=ax):
            return (slice(None),) * ax + (slice(lo, hi),)
        n = g.shape[ax] - b - a
        mid = g[at(b, b + n)].copy()
        if mode != "CONSTANT":
            s = 1 if mode == "REFLECT" else 0      # REFLECT mirrors around the edge element
            if b:
                mid[at(s, s + b)] += xp.flip(g[at(0, b)], axis=ax)
            if a:
                mid[at(n - s - a, n - s)] += xp.flip(g[at(b + n, b + n + a)], axis=ax)
        g = mid
    return g if g is not ct else ct.copy()


pad_grad_p.def_vjp(lambda ct, g, *, paddings, mode: (
    bind(pad_p, ct, paddings=paddings, mode=mode, constant_values=0),))
pad_grad_p.def_batch(lambda bx, ct, *, paddings, mode: bx.add(
    pad_grad_p, ct, paddings=((0, 0),) + paddings, mode=mode))


# ---------------------------------------------------------------- dtype, fills, shape

cast_p = Op("cast", elementwise=True)
cast_p.def_shape(lambda x, *, dtype: ArrayType(x.shape, dtype))
cast_p.def_impl(lambda xp, x, *, dtype: x.astype(dtype))
cast_p.def_out(lambda xp, out, x, *, dtype: xp.copyto(out, x, casting="unsafe"))
cast_p.def_vjp(lambda ct, x, *, dtype: (
    cast(ct, x.ty.dtype) if is_float(x.ty.dtype) and is_float(dtype) else None,))

fill_p = Op("fill", differentiable=False)
fill_p.def_shape(lambda *, shape, dtype, value: ArrayType(tuple(shape), dtype))
fill_p.def_impl(lambda xp, *, shape, dtype, value: xp.full(shape, value, dtype=dtype))

shape_p = Op("shape", differentiable=False, foldable=False)
shape_p.def_shape(lambda x: ArrayType((x.ndim,), np.dtype("int32")))
shape_p.def_impl(lambda xp, x: xp.asarray(x.shape, dtype=np.int32))
shape_p.def_cost(lambda ins, outs: (0, outs[0].nbytes))
shape_p.def_batch(lambda bx, x: bx.add(    # every replica's shape: a shared constant
    constant_p, batched=False, value=Const(np.asarray(bx.logical(x).shape, np.int32))))

# checked_for="<op>": the indices are the class labels of <op> (sparse_softmax_cross_entropy),
# so an index outside [0, depth) is an error, raised when the step runs on the actual labels
# (as TF does), rather than an all-zero row and a silent loss of -0
one_hot_p = Op("one_hot", differentiable=False)


@one_hot_p.def_shape
def _one_hot_shape(indices, *, depth, dtype, checked_for=""):
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{checked_for or 'one_hot'}: indices must be integers, got {indices}")
    if depth < 0:           # TF's one_hot raises too; depth 0 is an empty last axis
        raise ValueError(f"{checked_for or 'one_hot'}: depth must be >= 0, got {depth}")
    return ArrayType(indices.shape + (depth,), dtype)


def out_of_range(xp, indices, limit: int):
    """(the first index outside [0, limit), where it is, how many are), or None. Two
    O(n) reductions when all are in range. A 0-d index is at ()."""
    if not indices.size or (int(indices.min()) >= 0 and int(indices.max()) < limit):
        return None
    bad = (indices < 0) | (indices >= limit)
    if not indices.ndim:
        return int(indices), (), 1
    at = tuple(int(k[0]) for k in xp.nonzero(bad))
    return int(indices[at]), (at[0] if len(at) == 1 else at), int(bad.sum())


@one_hot_p.def_impl
def _one_hot_impl(xp, i, *, depth, dtype, checked_for=""):
    bad = out_of_range(xp, i, depth) if checked_for else None
    if bad is not None:
        value, at, count = bad
        raise ValueError(f"{checked_for}: expected labels in [0, {depth}) (the logits have "
                         f"{depth} classes), got {value} at index {at} of the "
                         f"labels of shape {tuple(i.shape)} ({count} out of range)")
    return (i[..., None] == xp.arange(depth, dtype=i.dtype)).astype(dtype)


one_hot_p.def_batch(lambda bx, i, **params: bx.add(one_hot_p, i, **params))

# ---------------------------------------------------------------- indexing


FULL_SLICE = ("slice", None, None, None)   # `:` in the hashable index form below


def _index_param(index) -> tuple:
    """Hashable form of a basic numpy index (ints, slices, None, Ellipsis)."""
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for it in items:
        if isinstance(it, slice):
            out.append(("slice", it.start, it.stop, it.step))
        elif it is None or it is Ellipsis or isinstance(it, (int, np.integer)):
            out.append(int(it) if isinstance(it, (int, np.integer)) else it)
        else:
            raise TypeError(f"getitem: only ints, slices, None and ... index a tensor, got "
                            f"{type(it).__name__}; use gd.where or gd.one_hot for the rest")
    return tuple(out)


def _index_value(param: tuple) -> tuple:
    return tuple(slice(*it[1:]) if isinstance(it, tuple) else it for it in param)


def _index_shape(ty: ArrayType, index: tuple) -> tuple[int, ...]:
    try:
        return np.empty(ty.shape, dtype=np.bool_)[_index_value(index)].shape  # uses no data
    except IndexError as e:
        raise ShapeError(f"getitem: {e} (indexing {ty})") from None


getitem_p = Op("getitem", view=True)
getitem_p.def_shape(lambda x, *, index: ArrayType(_index_shape(x, index), x.dtype))
getitem_p.def_impl(lambda xp, x, *, index: x[_index_value(index)])
getitem_p.def_vjp(lambda ct, x, *, index: (bind(scatter_p, ct, index=index, shape=x.ty.shape),))
# the replica axis leads: index every replica alike behind a `:`
getitem_p.def_batch(lambda bx, x, *, index: bx.add(
    getitem_p, x, index=(FULL_SLICE,) + index))

scatter_p = Op("index_scatter")  # zeros of `shape` with ct written at `index`: getitem's vjp
scatter_p.def_shape(lambda ct, *, index, shape: ArrayType(tuple(shape), ct.dtype))


@scatter_p.def_impl
def _scatter_impl(xp, ct, *, index, shape):
    out = xp.zeros(shape, dtype=ct.dtype)
    out[_index_value(index)] = ct
    return out


scatter_p.def_vjp(lambda ct, g, *, index, shape: (getitem(ct, index),))
scatter_p.def_batch(lambda bx, ct, *, index, shape: bx.add(
    scatter_p, ct, index=(FULL_SLICE,) + index, shape=(bx.n,) + tuple(shape)))

# ---------------------------------------------------------------- constants


class Const:
    """A numpy array held as an op parameter; hashes by identity so params stay hashable."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __str__(self) -> str:
        v = self.value
        if v.size > 4:
            return f"<{ArrayType(v.shape, v.dtype)}>"
        return " ".join(np.array2string(v, precision=4, separator=",").split())   # one line


constant_p = Op("constant", differentiable=False, foldable=False)
constant_p.def_shape(lambda *, value: ArrayType(value.value.shape, value.value.dtype))
constant_p.def_impl(lambda xp, *, value: xp.asarray(value.value))
constant_p.def_cost(lambda ins, outs, **_: (0, 0))

# ---------------------------------------------------------------- public functions


def reshape(x, shape):
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    return bind(reshape_p, x, shape=shape)


def transpose(x, perm=None):
    return bind(transpose_p, x, perm=None if perm is None else tuple(int(p) for p in perm))


def swap_last(x):
    n = len(x.shape)
    return transpose(x, tuple(range(n - 2)) + (n - 1, n - 2))


def broadcast_to(x, shape):
    shape = tuple(int(d) for d in shape)
    if tuple(getattr(x, "shape", np.shape(x))) == shape:
        return x
    return bind(broadcast_p, x, shape=shape)


def expand_dims(x, axis):
    shape = list(getattr(x, "shape", np.shape(x)))
    (ax,) = normalize_axis("expand_dims", axis, len(shape) + 1, shape)
    shape.insert(ax, 1)
    return reshape(x, shape)


def squeeze(x, axis=None):
    shape = tuple(getattr(x, "shape", np.shape(x)))
    axes = (tuple(i for i, d in enumerate(shape) if d == 1) if axis is None
            else normalize_axis("squeeze", axis, len(shape), shape))
    for a in axes:
        if shape[a] != 1:
            raise ShapeError(f"squeeze: axis {a} of shape {shape} has size {shape[a]}, not 1")
    return reshape(x, [d for i, d in enumerate(shape) if i not in axes])


def concat(values, axis=0):
    return bind(concat_p, *values, axis=int(axis))


def split(x, num_or_sizes, axis=0):
    """Split along `axis` into equal parts (an int) or parts of the given sizes (a list)."""
    shape = tuple(getattr(x, "shape", np.shape(x)))
    n = shape[normalize_axis("split", axis, len(shape), shape)[0]]
    if isinstance(num_or_sizes, (int, np.integer)):
        if num_or_sizes <= 0 or n % num_or_sizes:
            raise ShapeError(f"split: axis {axis} of size {n} does not split into "
                             f"{num_or_sizes} equal parts")
        sizes = (n // int(num_or_sizes),) * int(num_or_sizes)
    else:
        sizes = tuple(int(s) for s in num_or_sizes)
    return list(bind(split_p, x, sizes=sizes, axis=int(axis)))


def pad(x, paddings, mode="CONSTANT", constant_values=0):
    """Pad `x` by `paddings`, one [before, after] pair per axis, as TF's tf.pad: mode
    "CONSTANT" (with `constant_values`), "REFLECT" or "SYMMETRIC".

    >>> gd.pad(np.array([[1.0, 2.0]]), [[0, 0], [1, 2]])
    array([[0., 1., 2., 0., 0.]])
    """
    try:
        paddings = tuple(tuple(int(v) for v in p) for p in np.asarray(paddings).tolist())
    except (TypeError, ValueError):
        raise ShapeError(f"pad: paddings must be one [before, after] pair per axis, got "
                         f"{paddings!r}") from None
    if isinstance(constant_values, np.ndarray | np.generic) and np.ndim(constant_values) == 0:
        constant_values = constant_values.item()
    if not isinstance(constant_values, (bool, int, float)):
        raise TypeError(f"pad: constant_values must be a number, got {constant_values!r}")
    return bind(pad_p, x, paddings=paddings, mode=str(mode).upper(),
                constant_values=constant_values)


@user_op("cast")
def cast(x, dtype):
    """x as `dtype` (x itself when it already has it).

    >>> gd.cast(np.array([1.7, -1.7]), "int32")
    array([ 1, -1], dtype=int32)
    """
    if dtype is None:           # np.dtype(None) would quietly mean float64
        raise TypeError("cast: dtype must be given, got None")
    dtype = as_dtype(dtype)
    own = getattr(x, "dtype", None)   # never compare None: np.dtype(None) is float64
    if own is not None and np.dtype(own) == dtype:
        return x
    return bind(cast_p, x, dtype=dtype)


def stop_gradient(x):
    return bind(stop_gradient_p, x)


def zeros(shape, dtype="float32"):
    return bind(fill_p, shape=tuple(int(d) for d in shape), dtype=as_dtype(dtype), value=0)


def zeros_like(x):
    return bind(fill_p, shape=tuple(x.shape), dtype=np.dtype(x.dtype), value=0)


def ones_like(x):
    return bind(fill_p, shape=tuple(x.shape), dtype=np.dtype(x.dtype), value=1)


def shape(x):
    return bind(shape_p, x)


@user_op("one_hot")
def one_hot(indices, depth, dtype="float32"):
    return bind(one_hot_p, indices, depth=int(depth), dtype=as_dtype(dtype))


def getitem(x, index):
    return bind(getitem_p, x, index=_index_param(index) if not _is_param(index) else index)


def _is_param(index) -> bool:
    return isinstance(index, tuple) and any(isinstance(i, tuple) for i in index)
