"""gd.einsum: one op for every contraction (attention's 'bqhd,bkhd->bhqk' among them).

The public function rewrites the subscripts to one canonical explicit form (the implicit
output spelled out, each `...` replaced by letters of its own), so the op's only param is a
string of letters. Two-operand contractions run as one batched matmul (several times faster
than numpy's einsum loop on attention shapes); the vjp of each operand is einsum again.
"""

from __future__ import annotations

import math
import string

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, accumulate_in_float32, bind, same_dtype

LETTERS = string.ascii_letters


def _split(subscripts: str) -> tuple[list[str], str]:
    ins, out = subscripts.split("->")
    return ins.split(","), out


def _unused(subscripts: str, n: int) -> str:
    free = [c for c in LETTERS if c not in subscripts]
    if len(free) < n:
        raise ValueError(f"einsum: {subscripts!r} leaves too few unused letters ({n} needed)")
    return "".join(free[:n])


def canonical(subscripts: str, shapes: list[tuple]) -> str:
    """The explicit, ellipsis-free form of `subscripts` for operands of these shapes.

    >>> canonical("ij,jk", [(2, 3), (3, 4)])
    'ij,jk->ik'
    """
    spec = subscripts.replace(" ", "")
    ins, arrow, out = spec.partition("->")
    terms = ins.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"einsum: {subscripts!r} names {len(terms)} operand(s), got "
                         f"{len(shapes)}")
    for term in terms + ([out] if arrow else []):
        bad = set(term.replace("...", "")) - set(LETTERS)
        if bad or term.count("...") > 1:
            raise ValueError(f"einsum: {subscripts!r}: subscripts are letters and at most one "
                             f"'...' per operand, got {term!r}")
    ranks = []
    for term, shape in zip(terms, shapes):
        named = len(term.replace("...", ""))
        if len(shape) < named or ("..." not in term and len(shape) != named):
            raise ShapeError(f"einsum: operand {len(ranks)} has subscripts {term!r} but shape "
                             f"{tuple(shape)} (in {subscripts!r})")
        ranks.append(len(shape) - named)
    # `...` stands for the same trailing letters in every operand (numpy's right alignment)
    dots = _unused(spec, max(ranks, default=0))
    terms = [t.replace("...", dots[len(dots) - r:]) for t, r in zip(terms, ranks)]
    if arrow:
        out = out.replace("...", dots)
    else:            # implicit: the broadcast axes, then the letters used once, sorted
        counts = {c: "".join(terms).count(c) for c in "".join(terms)}
        out = dots + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in dots))
    return f"{','.join(terms)}->{out}"


def label_sizes(subscripts: str, tys) -> dict[str, int]:
    ins, out = _split(subscripts)
    sizes: dict[str, tuple[int, int]] = {}
    for k, (term, ty) in enumerate(zip(ins, tys)):
        if len(term) != ty.ndim:
            raise ShapeError(f"einsum: operand {k} has subscripts {term!r} but type {ty} "
                             f"(in {subscripts!r})")
        for c, d in zip(term, ty.shape):
            j, seen = sizes.setdefault(c, (k, d))
            if seen != d:
                raise ShapeError(f"einsum: label {c!r} has size {seen} in operand {j} "
                                 f"({tys[j]}) but {d} in operand {k} ({ty}) (in "
                                 f"{subscripts!r})")
    for c in out:
        if c not in sizes or out.count(c) > 1:
            raise ShapeError(f"einsum: output label {c!r} must appear once in the output and "
                             f"in some operand (in {subscripts!r})")
    return {c: d for c, (_, d) in sizes.items()}


einsum_p = Op("einsum", cost_kind="matmul")


@einsum_p.def_shape
def _einsum_shape(*xs, subscripts):
    dtype = same_dtype("einsum", *xs)
    if len(_split(subscripts)[0]) != len(xs):
        raise ShapeError(f"einsum: {subscripts!r} names another number of operands than "
                         f"{len(xs)}: " + ", ".join(map(str, xs)))
    sizes = label_sizes(subscripts, xs)
    return ArrayType(tuple(sizes[c] for c in _split(subscripts)[1]), dtype)


def _sum_lone(x, s: str, other: str, out: str):
    lone = tuple(i for i, c in enumerate(s) if c not in other and c not in out)
    if not lone:
        return x, s
    return x.sum(axis=lone, dtype=x.dtype), "".join(c for c in s if c in other or c in out)


def _contract(xp, a, b, sa: str, sb: str, out: str):
    """One batched matmul: (batch, left, inner) @ (batch, inner, right)."""
    (a, sa), (b, sb) = _sum_lone(a, sa, sb, out), _sum_lone(b, sb, sa, out)
    size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
    batch = [c for c in out if c in sa and c in sb]
    left = [c for c in sa if c not in sb]
    right = [c for c in sb if c not in sa]
    inner = [c for c in sa if c in sb and c not in out]
    if list(out) == batch + right + left != batch + left + right:
        return _contract(xp, b, a, sb, sa, out)           # b's letters first: no transpose

    def prod(labels):
        return math.prod(size[c] for c in labels)

    def arrange(x, s, first, second):            # -> (batch, first, second)
        x = xp.transpose(x, [s.index(c) for c in batch + first + second])
        return x.reshape((prod(batch), prod(first), prod(second)))

    y = xp.matmul(arrange(a, sa, left, inner), arrange(b, sb, inner, right))
    made = batch + left + right
    y = y.reshape(tuple(size[c] for c in made))
    return xp.transpose(y, [made.index(c) for c in out])


@einsum_p.def_impl
def _einsum_impl(xp, *xs, subscripts):
    ins, out = _split(subscripts)
    if len(xs) == 2 and all(len(set(t)) == len(t) for t in ins):
        y = _contract(xp, *xs, *ins, out)
    else:
        y = xp.einsum(subscripts, *xs, optimize=len(xs) > 2)
    # a new C-contiguous array, as every op that is no view gives: numpy's einsum may return
    # a view of an operand ('ij->ji'), and kernels (the fused updates) need C order
    y = xp.ascontiguousarray(y) if y.ndim else xp.asarray(y)    # (ascontiguousarray: >= 1-d)
    return y.copy() if any(xp.may_share_memory(y, x) for x in xs) else y


accumulate_in_float32(einsum_p)        # float16/bfloat16: in float32, cast back


@einsum_p.def_vjp
def _einsum_vjp(ct, *xs, subscripts):
    ins, out = _split(subscripts)
    grads = []
    for k, (x, term) in enumerate(zip(xs, ins)):
        others = [t for j, t in enumerate(ins) if j != k]
        seen = out + "".join(others)
        labels = "".join(dict.fromkeys(term))               # each letter once, in order
        kept = "".join(c for c in labels if c in seen)
        g = bind(einsum_p, ct, *(xs[j] for j in range(len(xs)) if j != k),
                 subscripts=f"{','.join([out] + others)}->{kept}")
        sizes = dict(zip(term, x.ty.shape))
        if kept != labels:     # letters only this operand had were summed: broadcast back
            from graphdist.ops.array import broadcast_to, reshape

            g = reshape(g, tuple(sizes[c] if c in kept else 1 for c in labels))
            g = broadcast_to(g, tuple(sizes[c] for c in labels))
        if labels != term:     # a repeated letter reads a diagonal: write onto it
            g = _onto_diagonal(g, labels, term, sizes, subscripts)
        grads.append(g)
    return tuple(grads)


def _onto_diagonal(g, labels: str, term: str, sizes: dict, subscripts: str):
    """g (letters `labels`) placed on the diagonals of `term` ('ii'): each repeat gets a
    fresh letter tied to the first by an identity matrix."""
    fresh = iter(_unused(subscripts, len(term) - len(labels)))
    renamed, ties = "", []
    for c in term:
        d = next(fresh) if c in renamed else c
        if d != c:
            ties.append(c + d)
        renamed += d
    eyes = [np.eye(sizes[t[0]], dtype=g.dtype) for t in ties]
    return bind(einsum_p, g, *eyes, subscripts=f"{','.join([labels] + ties)}->{renamed}")


@einsum_p.def_cost
def _einsum_cost(ins, outs, *, subscripts):
    # one multiply per extra operand and one add for every point of the label space
    points = math.prod(label_sizes(subscripts, ins).values())
    return len(ins) * points, sum(t.nbytes for t in (*ins, *outs))


@einsum_p.def_batch
def _einsum_batch(bx, *xs, subscripts):
    # the replica axis is one more batch letter of every batched operand and the output
    ins, out = _split(subscripts)
    z = _unused(subscripts, 1)
    terms = [z + t if bx.batched(x) else t for t, x in zip(ins, xs)]
    return bx.add(einsum_p, *xs, subscripts=f"{','.join(terms)}->{z}{out}")


def einsum(subscripts: str, *operands):
    """Einstein summation as numpy's: explicit ('ij,jk->ik') or implicit ('ij,jk') output,
    `...` for broadcast axes (which must agree in size); differentiable in every operand.

    >>> gd.einsum("bqhd,bkhd->bhqk", np.ones((2, 3, 4, 5)), np.ones((2, 6, 4, 5))).shape
    (2, 4, 3, 6)
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum: subscripts must be a string, got {subscripts!r}")
    shapes = [tuple(getattr(x, "shape", np.shape(x))) for x in operands]
    return bind(einsum_p, *operands, subscripts=canonical(subscripts, shapes))
