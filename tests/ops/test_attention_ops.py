"""The transformer ops: einsum, stack, arange, sin, cos, gelu, layer_norm (and their gradient
ops), softmax with a mask and the causal mask. Each against an independent numpy formula
(math.erf for gelu), eagerly and inside gd.function, every vjp against central finite
differences in float64, the Numba kernels against their references and the fused-kernel
path against gd.config.set_fused_kernels(False), and the errors. SWEEP feeds
tests/ops/test_ops.py (shape rules, dtypes, float32 gradients)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_conv import fd_check

import graphdist as gd
from graphdist.ops import OPS, bind
from graphdist.ops.einsum import canonical
from graphdist.ops.layer_norm import layer_norm_grad
from graphdist.ops.special import erfc

F64 = np.float64
_erf = np.vectorize(math.erf, otypes=[F64])


def _example(args, params, fn, ref, **more):
    """One sweep example, as test_ops.Case's keyword arguments."""
    return {"args": args, "params": params, "fn": fn, "ref": ref, **more}


# ---------------------------------------------------------------- independent references


def gelu_formula(x, approximate):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_derivative(x, approximate):
    if approximate:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2)
    return 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi)


def layer_norm_formula(x, gamma, beta, naxes, epsilon=1e-5):
    axes = tuple(range(x.ndim - naxes, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + epsilon)
    return y * (1 if gamma is None else gamma) + (0 if beta is None else beta)


def layer_norm_grad_formula(ct, x, gamma, naxes, scale, center, epsilon=1e-5):
    """The textbook backward: dx = (N g - sum g - xhat sum(g xhat)) / (N sigma), g = gamma ct."""
    axes = tuple(range(x.ndim - naxes, x.ndim))
    lead = tuple(range(x.ndim - naxes))
    n = math.prod(x.shape[a] for a in axes)
    sigma = np.sqrt(x.var(axis=axes, keepdims=True) + epsilon)
    xhat = (x - x.mean(axis=axes, keepdims=True)) / sigma
    g = ct * gamma if scale else ct
    dx = (n * g - g.sum(axis=axes, keepdims=True)
          - xhat * (g * xhat).sum(axis=axes, keepdims=True)) / (n * sigma)
    return ((dx,) + (((ct * xhat).sum(axis=lead),) if scale else ())
            + ((ct.sum(axis=lead),) if center else ()))


# ---------------------------------------------------------------- the sweep

EINSUMS = [("ij,jk->ik", (3, 4), (4, 5)), ("ij,jk", (3, 4), (4, 5)),
           ("bqhd,bkhd->bhqk", (2, 3, 2, 4), (2, 5, 2, 4)),
           ("bhqk,bkhd->bqhd", (2, 2, 3, 5), (2, 5, 2, 4)),
           ("btd,dhk->bthk", (2, 3, 4), (4, 2, 3)), ("bthv,hvo->bto", (2, 3, 2, 3), (2, 3, 4)),
           ("...ij,...jk->...ik", (2, 3, 4), (4, 5)), ("ij->j", (3, 4)), ("ii->i", (3, 3)),
           ("ii", (3, 3)), ("i,j->ij", (3,), (4,)), ("ijk,jl->l", (2, 3, 4), (3, 5)),
           ("i,i,i->", (4,), (4,), (4,)), ("ij,ij->ij", (3, 4), (3, 4)),
           ("Ba,aC", (2, 3), (3, 4))]


def _einsum_examples(rng):
    out = []
    for spec, *shapes in EINSUMS:
        args = tuple(rng.standard_normal(s) for s in shapes)
        out.append(_example(args, {"subscripts": canonical(spec, list(shapes))},
                            lambda *a, s=spec: gd.einsum(s, *a),
                            lambda *a, s=spec: np.einsum(s, *a)))
    return out


def _arange_examples(rng):
    cases = [((5,), {}, np.int32), ((2, 11, 3), {}, np.int32), ((5, 0, -2), {}, np.int32),
             ((3, 1), {}, np.int32), ((0.5, 3.0, 0.5), {}, np.float32),
             ((0, 1, 0.1), {"dtype": "float64"}, F64), ((1, 4), {"dtype": "int64"}, np.int64)]
    out = []
    for args, kw, dtype in cases:
        start, limit, delta = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
        cast = int if np.dtype(dtype).kind == "i" else float
        params = {"start": cast(start), "limit": cast(limit), "delta": cast(delta),
                  "dtype": np.dtype(dtype)}
        out.append(_example((), params, lambda a=args, k=kw: gd.arange(*a, **k),
                            lambda s=start, li=limit, d=delta, t=dtype: np.arange(s, li, d,
                                                                                dtype=t)))
    return out


def _elementwise_examples(fn, ref):
    def make(rng):
        return [_example((rng.uniform(-4, 4, s),), {}, fn, ref)
                for s in [(3, 4), (5,), (), (48, 50)]]
    return make


def _gelu_examples(rng):
    out = []
    for approximate in (False, True):
        for shape in [(3, 4), (), (48, 50)]:
            x = rng.uniform(-5, 5, shape)
            out.append(_example((x,), {"approximate": approximate},
                                lambda x, a=approximate: gd.nn.gelu(x, approximate=a),
                                lambda x, a=approximate: gelu_formula(x, a)))
    return out


def _gelu_grad_examples(rng):
    return [_example((rng.standard_normal((4, 5)), rng.uniform(-4, 4, (4, 5))),
                     {"approximate": a},
                     lambda ct, x, a=a: bind(OPS["gelu_grad"], ct, x, approximate=a),
                     lambda ct, x, a=a: ct * gelu_derivative(x, a)) for a in (False, True)]


def softmax_formula(x, mask):
    """softmax over the last axis by the definition, per row, in float64: 0 where masked
    and in a row with nothing kept."""
    x = np.asarray(x, np.float64)
    keep = np.broadcast_to(mask, x.shape).reshape(-1, x.shape[-1])
    out = np.zeros(keep.shape)
    for r, (row, k) in enumerate(zip(x.reshape(keep.shape), keep)):
        if k.any():
            e = np.exp(row[k] - row[k].max())
            out[r, k] = e / e.sum()
    return out.reshape(x.shape)


def _softmax_examples(rng):
    causal = np.tril(np.ones((4, 6), bool))
    causal[1] = False                                   # a row with nothing kept
    rows = rng.uniform(size=(3, 7)) > 0.4
    cases = [((3, 5), None), ((2, 3, 4, 6), causal), ((3, 7), rows), ((3, 7), rows[:, :1]),
             ((64, 103), None)]
    out = []
    for shape, mask in cases:
        x = rng.standard_normal(shape) * 3
        if mask is None:
            out.append(_example((x,), {}, lambda x: gd.nn.softmax(x),
                                lambda x: softmax_formula(x, True)))
        else:
            out.append(_example((x, mask), {}, lambda x, m: gd.nn.softmax(x, mask=m),
                                softmax_formula))
    return out


def _softmax_grad_examples(rng):
    y = softmax_formula(rng.standard_normal((5, 6)), True)
    return [_example((rng.standard_normal((5, 6)), y), {},
                     lambda g, y: bind(OPS["softmax_grad"], g, y),
                     lambda g, y: y * g - y * (g * y).sum(-1, keepdims=True))]


_NORMS = [((4, 6), 1, True, True), ((2, 3, 4), 2, True, True), ((3, 5), 1, True, False),
          ((3, 5), 1, False, True), ((3, 5), 1, False, False), ((64, 40), 1, True, True)]


def _layer_norm_examples(rng):
    out = []
    for shape, naxes, scale, center in _NORMS:
        x = rng.standard_normal(shape) * 2 + 1
        norm = shape[len(shape) - naxes:]
        gamma, beta = rng.uniform(0.5, 1.5, norm), rng.standard_normal(norm)
        affine = ((gamma,) if scale else ()) + ((beta,) if center else ())
        axis = tuple(range(-naxes, 0))

        def fn(x, *ab, s=scale, c=center, axis=axis):
            g, b = (ab[0] if s else None), (ab[-1] if c else None)
            return gd.nn.layer_norm(x, g, b, axis=axis)

        def ref(x, *ab, s=scale, c=center, n=naxes):
            return layer_norm_formula(x, ab[0] if s else None, ab[-1] if c else None, n)
        out.append(_example((x, *affine), {"naxes": naxes, "epsilon": 1e-5, "scale": scale,
                                           "center": center}, fn, ref))
    return out


def _layer_norm_grad_examples(rng):
    out = []
    for shape, naxes, scale, center in _NORMS[:5]:
        x, ct = rng.standard_normal(shape), rng.standard_normal(shape)
        gamma = (rng.uniform(0.5, 1.5, shape[len(shape) - naxes:]),) if scale else ()
        p = {"naxes": naxes, "epsilon": 1e-5, "scale": scale, "center": center}
        out.append(_example((ct, x, *gamma), p,
                            lambda ct, x, *g, p=p: layer_norm_grad(ct, x, *g, **p),
                            lambda ct, x, *g, p=p: layer_norm_grad_formula(
                                ct, x, g[0] if g else None, p["naxes"], p["scale"],
                                p["center"])))
    return out


# op name -> rng -> examples (test_ops.Case keyword arguments)
SWEEP = {
    "einsum": _einsum_examples,
    "arange": _arange_examples,
    "sin": _elementwise_examples(gd.sin, np.sin),
    "cos": _elementwise_examples(gd.cos, np.cos),
    "gelu": _gelu_examples,
    "gelu_grad": _gelu_grad_examples,
    "layer_norm": _layer_norm_examples,
    "layer_norm_grad": _layer_norm_grad_examples,
    "softmax": _softmax_examples,
    "softmax_grad": _softmax_grad_examples,
}

EXAMPLES = [pytest.param(name, i, id=f"{name}-{i}") for name, make in SWEEP.items()
            for i in range(len(make(np.random.default_rng(0))))]


def _case(name, i):
    return SWEEP[name](np.random.default_rng(0))[i]


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize("name,i", EXAMPLES)
def test_eager_and_compiled_match_numpy(name, i):
    ex = _case(name, i)
    want = [np.asarray(w) for w in _as_list(ex["ref"](*ex["args"]))]
    for got in (ex["fn"](*ex["args"]), gd.function(ex["fn"])(*ex["args"])):
        got = _as_list(got)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            g = np.asarray(g)
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape)
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,i", [p for p in EXAMPLES if OPS[p.values[0]].differentiable])
def test_gradients_match_finite_differences(name, i):
    ex = _case(name, i)
    floats = tuple(k for k, a in enumerate(ex["args"]) if np.asarray(a).dtype.kind == "f")

    def flat(*args):          # every output in one vector: fd_check takes one
        return gd.concat([gd.reshape(o, (-1,)) for o in _as_list(ex["fn"](*args))], 0)
    fd_check(flat, ex["args"], floats, seed=i)


def test_stack_matches_numpy_and_its_gradient():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((2, 3)) for _ in range(3)]
    for axis in (0, 1, 2, -1, -3):
        np.testing.assert_array_equal(gd.stack(xs, axis), np.stack(xs, axis))
        got = gd.function(lambda *xs, a=axis: gd.stack(xs, a))(*xs)
        np.testing.assert_array_equal(got, np.stack(xs, axis))
    fd_check(lambda a, b: gd.stack([a, b * a], axis=1), xs[:2], (0, 1))
    with pytest.raises(gd.ShapeError, match=r"stack: .*\(2, 3\), \(3, 2\)"):
        gd.stack([xs[0], xs[1].T])


def test_einsum_gradient_of_a_repeated_label_lands_on_the_diagonal():
    x = np.arange(9.0).reshape(3, 3)
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(gd.einsum("ii->i", x) * [1.0, 2.0, 3.0]))(x)
    np.testing.assert_array_equal(g, np.diag([1.0, 2.0, 3.0]))
    _, g = gd.value_and_grad(lambda x: gd.einsum("iij->", x))(np.ones((2, 2, 3)))
    np.testing.assert_array_equal(g, np.eye(2)[:, :, None] * np.ones(3))


def test_einsum_cost_counts_the_contraction_flops():
    from graphdist.ir.types import ArrayType

    tys = (ArrayType((8, 16), np.dtype("float32")), ArrayType((16, 4), np.dtype("float32")))
    out = OPS["einsum"].out_types(*tys, subscripts="ij,jk->ik")
    flops, _ = OPS["einsum"].cost(tys, out, {"subscripts": "ij,jk->ik"})
    assert flops == 2 * 8 * 16 * 4 == OPS["matmul"].cost(tys, out, {})[0]


def test_einsum_and_layer_norm_under_merged_replicas():
    """Their batch rules: the replica axis is one more einsum batch letter / leading axis."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5, 6)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3)).astype(np.float32)
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    gd.config.set_device_concurrency("merged")
    try:
        @gd.function
        def step(xs, w):
            def replica_fn(x, w):
                h = gd.einsum("btd,dhk->bthk", gd.nn.layer_norm(x), w)
                return gd.einsum("bqhk,bshk->bhqs", h, h)
            return strategy.run(replica_fn, args=(xs, w))

        got = step(gd.PerReplica(tuple(np.split(x, 4))), w)
        assert step.replicated_graph.merged
    finally:
        gd.config.set_device_concurrency("auto")
    for k, xs in enumerate(np.split(x, 4)):
        h = np.einsum("btd,dhk->bthk", layer_norm_formula(xs.astype(F64), None, None, 1), w)
        np.testing.assert_allclose(got.values[k], np.einsum("bqhk,bshk->bhqs", h, h),
                                   rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- erfc and gelu accuracy


def test_erfc_is_accurate_to_float64_precision():
    t = np.concatenate([np.linspace(-30, 30, 60001), [0.0, 1e-300, -0.46875, 0.46875, 4.0,
                                                      -4.0, 26.5, 27.5, np.inf, -np.inf]])
    want = np.array([math.erfc(v) for v in t])
    got = erfc(np, t)
    np.testing.assert_allclose(got, want, rtol=4e-15, atol=1e-315)    # subnormals: absolute
    np.testing.assert_array_equal(got[-3:], [0.0, 0.0, 2.0])      # erfc(27.5) underflows
    assert np.isnan(erfc(np, np.array([np.nan])))[0]


def test_gelu_keeps_the_negative_tail_that_one_plus_erf_loses():
    x = np.array([-12.0, -20.0, -30.0])
    want = x * 0.5 * np.array([math.erfc(-v / math.sqrt(2)) for v in x])
    assert np.all(want != 0) and np.all(gelu_formula(x, False) == 0)   # 1 + erf cancels
    # rtol: x / sqrt(2) rounds differently in the two; erfc(21) magnifies that 900-fold
    np.testing.assert_allclose(gd.nn.gelu(x), want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_gelu_and_layer_norm_keep_low_precision_dtypes(dtype):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 32)) + 1000.0).astype(dtype)     # var << mean^2
    y = gd.nn.layer_norm(x)
    assert y.dtype == np.dtype(dtype)
    # float32 statistics: a float16 sum of 32 values near 1000 would be off by a lot
    want = layer_norm_formula(x.astype(F64), None, None, 1)
    np.testing.assert_allclose(y.astype(F64), want, atol=0.05 if dtype != np.float32 else 1e-3)
    g = gd.nn.gelu(x - np.asarray(1000.0, dtype))
    assert g.dtype == np.dtype(dtype)
    xs = (x - np.asarray(1000.0, dtype)).astype(F64)
    np.testing.assert_allclose(g.astype(F64), gelu_formula(xs, False), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- kernels

DTYPES = [np.float32, F64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_kernels_match_their_references_and_the_op(dtype, approximate):
    from graphdist.kernels.gelu import gelu_cpu, gelu_grad_cpu, gelu_grad_ref, gelu_ref

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((30, 41)) * 4).astype(dtype)
    ct = rng.standard_normal((30, 41)).astype(dtype)
    tol = {"rtol": 1e-6 if dtype == np.float32 else 1e-13, "atol": 1e-13}
    # float32: a rational erf or tanh, 0.5 (1 + erf or tanh) (kernels/gelu.py): absolute error
    kernel_tol = {"rtol": 0, "atol": (4.5e-6 if approximate else 1.5e-6) * 4} \
        if dtype == np.float32 else tol
    np.testing.assert_allclose(gelu_ref(x, approximate), gelu_formula(x.astype(F64),
                                                                      approximate), **tol)
    out = np.full_like(x, np.nan)
    assert gelu_cpu(x, out, approximate)
    np.testing.assert_allclose(out, gelu_ref(x, approximate), **kernel_tol)
    np.testing.assert_allclose(out, gd.nn.gelu(x, approximate), **kernel_tol)
    aliased = x.copy()
    assert gelu_cpu(aliased, aliased, approximate)                 # out may be x
    np.testing.assert_array_equal(aliased, out)
    assert gelu_grad_cpu(ct, x, out, approximate)
    np.testing.assert_allclose(out, gelu_grad_ref(ct, x, approximate), **kernel_tol)
    np.testing.assert_allclose(out, ct * gelu_derivative(x.astype(F64), approximate),
                               **kernel_tol)
    assert not gelu_cpu(x[:, ::2], np.empty((30, 21), dtype), approximate)
    assert not gelu_cpu(x.astype(np.float16), x.astype(np.float16), approximate)


def _gelu_inputs(dtype, rng):
    """Normal values at several scales, the erf clamp's edges, extremes and random bit
    patterns (NaNs of every payload among them): more than one of the twins' chunks."""
    fi = np.finfo(dtype)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, fi.tiny, -fi.tiny, fi.max, -fi.max,
               fi.smallest_subnormal, -fi.smallest_subnormal, 4 * math.sqrt(2), 5.9, -5.9,
               -8.49, 6.0, -6.0, 1e30, -1e30, 0.5]
    normal = np.concatenate([rng.standard_normal(6000) * s for s in (0.01, 1, 3, 10, 1e3)])
    bits = np.frombuffer(rng.bytes(8000 * np.dtype(dtype).itemsize), dtype)
    return np.concatenate([special, normal, rng.uniform(-40, 40, 2000)]).astype(dtype), bits


def _assert_same_bits(got, want):
    """Equal bit for bit, a NaN's sign and payload aside (NaN * NaN keeps either operand's,
    as the compiler orders them); -0.0 is not 0.0 here."""
    as_int = np.dtype(f"u{want.dtype.itemsize}")
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(as_int), want[~nan].view(as_int))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # the reference on NaN, inf
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_numpy_twins_give_the_kernels_bits(dtype, approximate):
    """The numpy forms a program's first calls run (their kernel entries' numpy twins) against
    the Numba kernels, bit for bit: both must give the same training run."""
    from graphdist.runtime.adapters import nn

    rng = np.random.default_rng(11)
    x = np.concatenate(_gelu_inputs(dtype, rng)).reshape(-1, 5)
    ct = rng.standard_normal(x.shape).astype(dtype)
    ct.flat[:6] = [0.0, -0.0, np.inf, np.nan, 1e-30, -3.0]
    for args in ((x,), (ct, x)):
        kernel, twin = ((nn.gelu_cpu, nn.gelu_numpy) if len(args) == 1 else
                        (nn.gelu_grad_cpu, nn.gelu_grad_numpy))
        want, got = np.empty_like(x), np.full_like(x, 7.0)
        kernel(want, *args, approximate=approximate)
        twin(got, *args, approximate=approximate)
        _assert_same_bits(got, want)
        aliased = args[-1].copy()                      # out may be x
        twin(aliased, *args[:-1], aliased, approximate=approximate)
        _assert_same_bits(aliased, want)
    strided = np.empty((x.shape[0], 3), dtype)     # not the kernel's: both take the op's impl
    nn.gelu_numpy(strided, x[:, ::2], approximate=approximate)
    np.testing.assert_array_equal(strided, gd.nn.gelu(x[:, ::2], approximate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,naxes,scale,center", _NORMS)
def test_layer_norm_kernels_match_the_reference(dtype, shape, naxes, scale, center):
    from graphdist.kernels.layer_norm import (
        layer_norm_cpu,
        layer_norm_grad_cpu,
        layer_norm_grad_ref,
        layer_norm_ref,
    )

    rng = np.random.default_rng(6)
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    ct = rng.standard_normal(shape).astype(dtype)
    norm = shape[len(shape) - naxes:]
    gamma = rng.uniform(0.5, 1.5, norm).astype(dtype) if scale else None
    beta = rng.standard_normal(norm).astype(dtype) if center else None
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}
    want = layer_norm_formula(x.astype(F64), gamma, beta, naxes)
    rows = (-1, math.prod(norm))
    ref = layer_norm_ref(x.reshape(rows), None if gamma is None else gamma.reshape(-1),
                         None if beta is None else beta.reshape(-1), 1e-5)
    np.testing.assert_allclose(ref.reshape(shape), want, **tol)
    out = np.full_like(x, np.nan)
    assert layer_norm_cpu(x, gamma, beta, 1e-5, naxes, out)
    np.testing.assert_allclose(out, want, **tol)
    affine = [a for a in (gamma, beta) if a is not None]
    op = OPS["layer_norm"].impl(np, x, *affine, naxes=naxes, epsilon=1e-5, scale=scale,
                                center=center)
    np.testing.assert_allclose(out, op, **tol)                      # the op's numpy impl
    dx, dgamma, dbeta = (np.full_like(x, np.nan), np.full(norm, np.nan, dtype),
                         np.full(norm, np.nan, dtype))
    assert layer_norm_grad_cpu(ct, x, gamma, 1e-5, naxes, dx, dgamma, dbeta)
    grads = layer_norm_grad_formula(ct.astype(F64), x.astype(F64), gamma, naxes, scale, True)
    if not scale:
        grads = (grads[0], (ct.astype(F64) * layer_norm_formula(x.astype(F64), None, None, naxes)
                            ).sum(axis=tuple(range(x.ndim - naxes))), grads[1])
    for got, w in zip((dx, dgamma, dbeta), grads):
        np.testing.assert_allclose(got, w, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
    kernel_ref = layer_norm_grad_ref(ct.reshape(rows), x.reshape(rows),
                                     None if gamma is None else gamma.reshape(-1), 1e-5)
    np.testing.assert_allclose(kernel_ref[0].reshape(shape), dx, **tol)
    assert not layer_norm_cpu(np.asfortranarray(x), None, None, 1e-5, naxes, out)
    assert not layer_norm_cpu(x.astype(np.float16), None, None, 1e-5, naxes,
                              out.astype(np.float16))


def test_layer_norm_grad_kernel_is_the_same_bits_on_any_thread_count():
    """dgamma/dbeta sum per row block, a fixed number of blocks: the thread count changes
    nothing (300 rows: big enough to run in parallel, 64 blocks of 5 rows, some empty)."""
    import numba

    from graphdist.kernels.common import numba_threads
    from graphdist.kernels.layer_norm import layer_norm_grad_cpu, layer_norm_grad_ref

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((300, 1000)) * 3 + 2).astype(np.float32)
    ct = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 1000).astype(np.float32)
    runs = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        outs = (np.empty_like(x), np.empty_like(gamma), np.empty_like(gamma))
        with numba_threads(threads):
            assert layer_norm_grad_cpu(ct, x, gamma, 1e-5, 1, *outs)
        runs.append(outs)
    for got, want in zip(runs[0], layer_norm_grad_ref(ct, x, gamma, 1e-5)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)


def test_layer_norm_kernels_keep_float64_precision_far_from_zero():
    """Rows with mean 1e4 and std 1: the kernels' one-pass variance (shifted by each row's
    first element) must not cancel; unshifted, mean(x^2) - mean^2 loses 8 digits here."""
    from graphdist.kernels.layer_norm import layer_norm_cpu, layer_norm_grad_cpu

    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 300)) + 1e4
    ct, gamma, beta = rng.standard_normal(x.shape), rng.uniform(0.5, 1.5, 300), np.ones(300)
    out = np.empty_like(x)
    assert layer_norm_cpu(x, gamma, beta, 1e-5, 1, out)
    np.testing.assert_allclose(out, layer_norm_formula(x, gamma, beta, 1), rtol=1e-11, atol=1e-11)
    got = (np.empty_like(x), np.empty_like(gamma), np.empty_like(gamma))
    assert layer_norm_grad_cpu(ct, x, gamma, 1e-5, 1, *got)
    for g, w in zip(got, layer_norm_grad_formula(ct, x, gamma, 1, True, True)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def _counting(monkeypatch, names):
    from graphdist.runtime import kernel_table

    calls = []
    for name in names:
        entry = kernel_table.ENTRIES[("cpu", name)]
        monkeypatch.setitem(kernel_table.ENTRIES, ("cpu", name), entry.replace(
            out=lambda *a, k=entry.out, n=name, **kw: (calls.append(n), k(*a, **kw))))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_step_runs_the_kernels_and_equals_the_unfused_path(dtype, monkeypatch):
    calls = _counting(monkeypatch, ["layer_norm", "layer_norm_grad", "gelu", "gelu_grad"])
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 96)).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, 96).astype(dtype)
    beta = rng.standard_normal(96).astype(dtype)
    w = rng.standard_normal((96, 96)).astype(dtype)

    def loss(x, gamma, beta):
        h = gd.nn.gelu(gd.nn.layer_norm(x, gamma, beta)) @ w
        return gd.reduce_sum(gd.nn.layer_norm(h) * h)

    results = {}
    try:
        for fused in (True, False):
            gd.config.set_fused_kernels(fused)
            step = gd.function(lambda *a: gd.value_and_grad(loss, argnums=(0, 1, 2))(*a))
            results[fused] = step(x, gamma, beta)
            assert sorted(set(calls)) == (["gelu", "gelu_grad", "layer_norm", "layer_norm_grad"]
                                          if fused else [])
            calls.clear()
    finally:
        gd.config.set_fused_kernels(True)
    (v1, g1), (v0, g0) = results[True], results[False]
    tol = 1e-4 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(v1, v0, rtol=tol)
    for a, b in zip(g1, g0):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    # and the float64 gradient against the formulas
    if dtype == F64:
        fd_check(loss, (x, gamma, beta), (0, 1, 2))


# ---------------------------------------------------------------- masked softmax


def _np_masked_softmax(x, mask):
    e = np.where(mask, np.exp(x - np.where(mask, x, -np.inf).max(-1, keepdims=True)), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def test_softmax_with_a_bool_mask():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 4, 5)) * 3
    mask = rng.random((4, 5)) > 0.4               # (T, S), broadcast over batch and heads
    mask[1] = False                               # a fully masked row
    want = _np_masked_softmax(x, mask)
    for fn in (gd.nn.softmax, gd.function(gd.nn.softmax)):
        got = fn(x, -1, mask)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert np.all(got[..., ~mask] == 0.0) and np.all(got[:, :, 1] == 0.0)
    log = gd.nn.log_softmax(x, mask=mask)
    assert np.all(np.isneginf(log[..., ~mask]))
    np.testing.assert_allclose(np.exp(log), want, rtol=1e-12, atol=1e-15)
    # gradients: finite everywhere (no NaN from the fully masked row), right where kept
    ct = rng.standard_normal(x.shape)
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(gd.nn.softmax(x, mask=mask) * ct))(x)
    assert np.all(np.isfinite(g)) and np.all(g[..., ~mask] == 0)
    fd_check(lambda x: gd.nn.softmax(x, mask=mask), (x,))
    _, g = gd.value_and_grad(lambda x: gd.reduce_sum(
        gd.where(mask, gd.nn.log_softmax(x, mask=mask), 0.0) * ct))(x)
    assert np.all(np.isfinite(g))
    fd_check(lambda x: gd.where(mask, gd.nn.log_softmax(x, mask=mask), 0.0), (x,))


def test_softmax_with_an_additive_mask_and_errors():
    rng = np.random.default_rng(9)
    x, bias = rng.standard_normal((3, 4)), np.where(rng.random((3, 4)) > 0.5, 0.0, -1e9)
    np.testing.assert_allclose(gd.nn.softmax(x, mask=bias), gd.nn.softmax(x + bias),
                               rtol=1e-12)
    np.testing.assert_allclose(gd.nn.log_softmax(x, mask=bias), gd.nn.log_softmax(x + bias),
                               rtol=1e-12)
    with pytest.raises(gd.ShapeError, match=r"softmax: mask of shape \(5,\).*\(3, 4\)"):
        gd.nn.softmax(x, mask=np.ones(5, bool))
    with pytest.raises(TypeError, match="softmax: mask must be bool .* got int32"):
        gd.nn.softmax(x, mask=np.ones(4, np.int32))


def test_causal_mask():
    np.testing.assert_array_equal(gd.nn.causal_mask(4), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(gd.nn.causal_mask(3, "float32"),
                                  np.tril(np.ones((3, 3), np.float32)))
    got = gd.function(lambda x: gd.nn.softmax(x, mask=gd.nn.causal_mask(3)))(np.zeros((3, 3)))
    np.testing.assert_allclose(got, np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None])


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("call,pattern", [
    (lambda: gd.einsum("ij,jk->ik", np.ones((3, 4)), np.ones((5, 6))),
     (r"einsum: label 'j' has size 4 in operand 0 \(f64\[3,4\]\) but 5 in operand 1 "
      r"\(f64\[5,6\]\)")),
    (lambda: gd.einsum("ij,jk->ik", np.ones((3, 4))), r"einsum: .* names 2 operand\(s\), got 1"),
    (lambda: gd.einsum("ijk->i", np.ones((3, 4))), r"einsum: operand 0 .*'ijk'.*\(3, 4\)"),
    (lambda: gd.einsum("ij->iq", np.ones((3, 4))), r"einsum: output label 'q'"),
    (lambda: gd.einsum("i1->i", np.ones((3, 4))), r"einsum: .*letters"),
    (lambda: gd.nn.layer_norm(np.ones((2, 3)), np.ones(4)),
     (r"layer_norm: gamma must have the normalized shape \(3,\), got x:f64\[2,3\], "
      r"gamma:f64\[4\]")),
    (lambda: gd.nn.layer_norm(np.ones((2, 3, 4)), axis=1),
     r"layer_norm: axis must be the last axis .* got axis=1 .*\(2, 3, 4\)"),
    (lambda: gd.nn.layer_norm(np.ones((2, 3)), axis=2), r"layer_norm: axis 2 is out of range"),
    (lambda: gd.arange(0, 3, 0), r"arange: delta must not be 0"),
])
def test_bad_inputs_raise_errors_naming_the_op(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("call,pattern", [
    (lambda: gd.nn.layer_norm(np.ones((2, 3), np.int32)), "layer_norm: expected a float"),
    (lambda: gd.nn.gelu(np.ones(3, np.int32)), "gelu: expected a float"),
    (lambda: gd.sin(np.ones(3, np.int64)), "sin: expected a float"),
    (lambda: gd.einsum("i,i", np.ones(3, np.float32), np.ones(3)), "einsum: dtypes differ"),
    (lambda: gd.arange(np.ones(3)), "arange: start, limit and delta must be numbers"),
    (lambda: gd.arange(0.5, 2, dtype="int32"), "arange: integer dtype int32"),
])
def test_bad_dtypes_raise_type_errors(call, pattern):
    with pytest.raises(TypeError, match=pattern):
        call()


def test_a_trace_error_names_the_op_the_shapes_and_the_line():
    @gd.function
    def attend(q, k):
        return gd.einsum("bqd,bkd->bqk", q, k)

    with pytest.raises(gd.ShapeError) as info:
        attend(np.ones((2, 3, 4), np.float32), np.ones((2, 5, 6), np.float32))
    msg = str(info.value)
    assert "einsum: label 'd'" in msg and "f32[2,3,4]" in msg and "f32[2,5,6]" in msg
    assert "test_attention_ops.py" in msg


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_kernels_match_the_formula_and_any_thread_count(dtype):
    from graphdist.kernels.common import numba_threads
    from graphdist.kernels.softmax import softmax_cpu, softmax_grad_cpu

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 2, 5, 6)) * 4).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    causal = np.tril(np.ones((5, 6), bool))
    causal[2] = False                                        # nothing kept: zeros
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-15}
    for mask in (None, causal, causal[:, :1], rng.uniform(size=x.shape) > 0.3):
        y = np.full_like(x, np.nan)
        assert softmax_cpu(x, mask, y)
        np.testing.assert_allclose(y, softmax_formula(x, True if mask is None else mask), **tol)
        dx = np.full_like(x, np.nan)
        assert softmax_grad_cpu(g, y, dx)
        y64 = y.astype(F64)
        np.testing.assert_allclose(dx, y64 * (g - (g * y64).sum(-1, keepdims=True)), **tol)
        with numba_threads(1):
            one, done = np.empty_like(x), np.empty_like(x)
            softmax_cpu(x, mask, one)
            softmax_grad_cpu(g, y, done)
        np.testing.assert_array_equal(one, y)
        np.testing.assert_array_equal(done, dx)
    assert not softmax_cpu(x[..., ::2], None, np.empty((3, 2, 5, 3), dtype))
    assert not softmax_grad_cpu(g, y.astype(np.float16), dx)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 103])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "random"])
def test_softmax_numpy_twins_give_the_kernels_bits(dtype, n, mask_kind):
    """A first call runs these twins while the kernels compile (runtime/warmup.py): they
    must give the same bits, tails (n % 4), a NaN logit and fully masked rows included,
    and rows of -inf only, of NaN only, with +-inf and with zeros of both signs (the kernel
    without a mask takes a path of its own)."""
    from graphdist.kernels import softmax as kernel
    from graphdist.kernels import softmax_numpy as twin

    rng = np.random.default_rng(n)
    x = (rng.standard_normal((6, n, n)) * 5).astype(dtype)
    x[1, 0, 0] = np.nan
    x[3, 0, :] = -np.inf
    x[3, n - 1, :] = np.nan
    x[4, 0, 0] = np.inf
    x[4, n - 1, -1] = -np.inf
    x[5, 0, :] = 0.0
    x[5, 0, ::2] = -0.0
    mask = {"none": None, "causal": np.tril(np.ones((n, n), bool)),
            "random": rng.random((6, n, n)) > 0.5}[mask_kind]
    if mask is not None and mask.ndim == 3:
        mask[2, 0] = False                                  # a row with no kept entry
    got, want = np.empty_like(x), np.empty_like(x)
    assert kernel.softmax_cpu(x, mask, want) and twin.softmax_cpu(x, mask, got)
    np.testing.assert_array_equal(got, want)
    y, g = np.nan_to_num(want), rng.standard_normal(x.shape).astype(dtype)
    assert kernel.softmax_grad_cpu(g, y, want) and twin.softmax_grad_cpu(g, y, got)
    np.testing.assert_array_equal(got, want)
