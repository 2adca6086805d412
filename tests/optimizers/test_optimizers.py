"""Tests for graphdist.optimizers: SGD (momentum, Nesterov, coupled decay), Adam and AdamW
against float64 numpy references written from the formulas of docs/api.md, traced and eager."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist import config

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6


@pytest.fixture(params=[False, True], ids=["numpy", "fused"])
def fused(request):
    old = config.fused_kernels()
    config.set_fused_kernels(request.param)
    yield request.param
    config.set_fused_kernels(old)


# ---------------------------------------------------------------- numpy references


def sgd_ref(p, g, m, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD: coupled decay before momentum; returns new (p, m)."""
    g = g + weight_decay * p
    if momentum:
        m = momentum * m + g
        step = g + momentum * m if nesterov else m
    else:
        step = g
    return p - lr * step, m


def adam_ref(p, g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.0):
    """TF Adam (epsilon outside the bias correction), AdamW decay first; returns (p, m, v)."""
    p = p - lr * weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    return p - lr_t * m / (np.sqrt(v) + eps), m, v


def linreg_grads(w, b, x, y):
    """Analytic gradients of mean((x @ w + b - y)^2)."""
    r = x @ w + b - y
    scale = 2.0 / r.size
    return scale * x.T @ r, scale * r.sum(axis=0)


def _data(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 3)).astype(dtype)
    y = rng.normal(size=(8, 2)).astype(dtype)
    w0 = rng.normal(size=(3, 2)).astype(dtype)
    b0 = rng.normal(size=(2,)).astype(dtype)
    return x, y, w0, b0


def _linreg_step(opt, w, b):
    @gd.function
    def step(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(x @ w + b - y))
        gw, gb = tape.gradient(loss, [w, b])
        n = opt.apply_gradients(zip([gw, gb], [w, b]))
        return loss, n, gw, gb

    return step


def _close(actual, expected, what, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol,
                               err_msg=what)


# ---------------------------------------------------------------- SGD

SGD_CASES = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "weight_decay": {"weight_decay": 0.05},
    "momentum_wd": {"momentum": 0.8, "weight_decay": 0.05},
    "nesterov_wd": {"momentum": 0.7, "nesterov": True, "weight_decay": 0.1},
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_reference(case, fused):
    kw = SGD_CASES[case]
    x, y, w0, b0 = _data()
    w, b = gd.Variable(w0, name="w"), gd.Variable(b0, name="b")
    opt = gd.optimizers.SGD(learning_rate=0.1, **kw)
    step = _linreg_step(opt, w, b)
    pw, pb = w0.astype(np.float64), b0.astype(np.float64)
    mw, mb = np.zeros_like(pw), np.zeros_like(pb)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for t in range(1, STEPS + 1):
        gw_ref, gb_ref = linreg_grads(pw, pb, x64, y64)
        loss, n, gw, gb = step(x, y)
        _close(loss, np.mean((x64 @ pw + pb - y64) ** 2), f"loss at step {t}")
        _close(gw, gw_ref, f"grad w at step {t}")
        _close(gb, gb_ref, f"grad b at step {t}")
        pw, mw = sgd_ref(pw, gw_ref, mw, 0.1, **kw)
        pb, mb = sgd_ref(pb, gb_ref, mb, 0.1, **kw)
        assert n == t and opt.iterations.numpy() == t
        _close(w.numpy(), pw, f"w after step {t}")
        _close(b.numpy(), pb, f"b after step {t}")
        if kw.get("momentum"):
            _close(opt.slot(w, "momentum").numpy(), mw, f"momentum(w) after step {t}")
            _close(opt.slot(b, "momentum").numpy(), mb, f"momentum(b) after step {t}")
    assert w.dtype == np.float32 and b.dtype == np.float32
    assert step.trace_count == 1
    if not kw.get("momentum"):
        assert opt.slots() == {}, "plain SGD needs no slots"


def test_sgd_without_momentum_differs_from_nesterov():
    # guards the reference itself: the cases above must really exercise different formulas
    p, g, m = np.ones(2), np.full(2, 0.5), np.full(2, 0.2)
    a = sgd_ref(p, g, m, 0.1, momentum=0.9)[0]
    b = sgd_ref(p, g, m, 0.1, momentum=0.9, nesterov=True)[0]
    assert not np.allclose(a, b)


# ---------------------------------------------------------------- Adam / AdamW

ADAM_CASES = {
    "adam_default": ("Adam", {}),
    "adam_betas_big_eps": ("Adam", {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 0.05}),
    "adamw": ("AdamW", {"weight_decay": 0.2}),
    "adamw_betas": ("AdamW", {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3,
                              "weight_decay": 0.05}),
}


def _ref_step(cls: str, state, g, t: int, lr: float, kw) -> list:
    """One reference step of optimizer `cls` ("SGD" or Adam/AdamW) on [p, m, v]."""
    p, m, v = state
    if cls == "SGD":
        p, m = sgd_ref(p, g, m, lr, **kw)
    else:
        p, m, v = adam_ref(p, g, m, v, t, lr, **_ref_kwargs(kw))
    return [p, m, v]


def _ref_kwargs(kw):
    return {"b1": kw.get("beta_1", 0.9), "b2": kw.get("beta_2", 0.999),
            "eps": kw.get("epsilon", 1e-7), "weight_decay": kw.get("weight_decay", 0.0)}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_reference(case, fused):
    cls, kw = ADAM_CASES[case]
    lr = 0.05
    x, y, w0, b0 = _data(seed=1)
    w, b = gd.Variable(w0, name="w"), gd.Variable(b0, name="b")
    opt = getattr(gd.optimizers, cls)(learning_rate=lr, **kw)
    if cls == "AdamW" and "weight_decay" not in kw:
        kw = dict(kw, weight_decay=0.004)
    step = _linreg_step(opt, w, b)
    ref = _ref_kwargs(kw)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    state = {"w": [w0.astype(np.float64), 0.0, 0.0], "b": [b0.astype(np.float64), 0.0, 0.0]}
    for t in range(1, STEPS + 1):
        gw_ref, gb_ref = linreg_grads(state["w"][0], state["b"][0], x64, y64)
        _, n, gw, gb = step(x, y)
        _close(gw, gw_ref, f"grad w at step {t}")
        _close(gb, gb_ref, f"grad b at step {t}")
        for key, g in (("w", gw_ref), ("b", gb_ref)):
            state[key] = list(adam_ref(*state[key][:1], g, *state[key][1:], t, lr, **ref))
        assert n == t and opt.iterations.numpy() == t
        for key, var in (("w", w), ("b", b)):
            p, m, v = state[key]
            _close(var.numpy(), p, f"{key} after step {t}")
            _close(opt.slot(var, "m").numpy(), m, f"m({key}) after step {t}")
            _close(opt.slot(var, "v").numpy(), v, f"v({key}) after step {t}", atol=1e-9)
    assert sorted(opt.slots()) == ["b/m", "b/v", "w/m", "w/v"]


def test_adamw_default_weight_decay_and_is_decoupled():
    # one step on a zero gradient: Adam leaves p alone, AdamW shrinks it by lr * wd exactly
    p0 = np.array([1.0, -2.0, 4.0], np.float32)
    for cls, expected in ((gd.optimizers.Adam, p0), (gd.optimizers.AdamW, p0 * (1 - 0.1 * 0.004))):
        v = gd.Variable(p0)
        cls(learning_rate=0.1).apply_gradients([(np.zeros(3, np.float32), v)])
        _close(v.numpy(), expected, cls.__name__, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- iterations, None, eager


def test_iterations_variable_and_return_value():
    opt = gd.optimizers.SGD(learning_rate=0.1)
    assert opt.iterations.dtype == np.int64 and opt.iterations.numpy() == 0
    assert not opt.iterations.trainable
    w = gd.Variable(np.ones(2, np.float32))

    @gd.function
    def step(g):
        return opt.apply_gradients([(g, w)])

    returned = [step(np.ones(2, np.float32)) for _ in range(3)]
    assert [int(r) for r in returned] == [1, 2, 3]
    assert np.asarray(returned[-1]).dtype == np.int64
    assert int(opt.apply_gradients([(np.ones(2, np.float32), w)])) == 4   # eager continues
    assert opt.iterations.numpy() == 4
    _close(w.numpy(), 1 - 4 * 0.1 * np.ones(2), "w")


@pytest.mark.parametrize("make", [lambda: gd.optimizers.SGD(0.1, momentum=0.9),
                                  lambda: gd.optimizers.Adam(0.1)], ids=["sgd", "adam"])
def test_none_gradients_skipped(make, fused):
    opt = make()
    w = gd.Variable(np.ones((2, 2), np.float32), name="w")
    b = gd.Variable(np.full(2, 3.0, np.float32), name="b")

    @gd.function
    def step(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(w * x)
        gw, gb = tape.gradient(loss, [w, b])
        assert gb is None
        return opt.apply_gradients([(gw, w), (gb, b)])

    assert step(np.ones((2, 2), np.float32)) == 1
    assert not np.allclose(w.numpy(), 1.0)
    np.testing.assert_array_equal(b.numpy(), np.full(2, 3.0, np.float32))
    assert all(not k.startswith("b/") for k in opt.slots()), opt.slots()
    # eager, with numpy gradients
    assert opt.apply_gradients([(None, w), (np.ones(2, np.float32), b)]) == 2
    assert not np.allclose(b.numpy(), 3.0)
    assert any(k.startswith("b/") for k in opt.slots())


@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW"])
def test_eager_apply_gradients_matches_reference(cls, fused):
    rng = np.random.default_rng(3)
    p0 = rng.normal(size=(4, 3)).astype(np.float32)
    v = gd.Variable(p0, name="p")
    kw = {"SGD": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
          "Adam": {"beta_1": 0.7}, "AdamW": {"weight_decay": 0.1}}[cls]
    opt = getattr(gd.optimizers, cls)(learning_rate=0.05, **kw)
    p, m, s = p0.astype(np.float64), np.zeros((4, 3)), np.zeros((4, 3))
    for t in range(1, STEPS + 1):
        g = rng.normal(size=(4, 3)).astype(np.float32)
        assert opt.apply_gradients([(g, v)]) == t
        if cls == "SGD":
            p, m = sgd_ref(p, g.astype(np.float64), m, 0.05, **kw)
        else:
            p, m, s = adam_ref(p, g.astype(np.float64), m, s, t, 0.05,
                               **_ref_kwargs(dict(kw, weight_decay=kw.get("weight_decay", 0.0))))
        _close(v.numpy(), p, f"p after eager step {t}")
    assert opt.iterations.numpy() == STEPS


@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW"])
def test_float64_variables(cls, fused):
    x, y, w0, b0 = (a.astype(np.float64) for a in _data(seed=4))
    w, b = gd.Variable(w0), gd.Variable(b0)
    kw = {"SGD": {"momentum": 0.5, "weight_decay": 0.01}, "Adam": {},
          "AdamW": {"weight_decay": 0.1}}[cls]
    opt = getattr(gd.optimizers, cls)(learning_rate=0.05, **kw)
    step = _linreg_step(opt, w, b)
    pw, pb = w0.copy(), b0.copy()
    sw = [np.zeros_like(pw), np.zeros_like(pw)]
    sb = [np.zeros_like(pb), np.zeros_like(pb)]
    for t in range(1, STEPS + 1):
        gw, gb = linreg_grads(pw, pb, x, y)
        step(x, y)
        if cls == "SGD":
            pw, sw[0] = sgd_ref(pw, gw, sw[0], 0.05, **kw)
            pb, sb[0] = sgd_ref(pb, gb, sb[0], 0.05, **kw)
        else:
            ref = _ref_kwargs(kw)
            pw, *sw = adam_ref(pw, gw, *sw, t, 0.05, **ref)
            pb, *sb = adam_ref(pb, gb, *sb, t, 0.05, **ref)
        assert w.dtype == np.float64 and w.numpy().dtype == np.float64
        _close(w.numpy(), pw, f"w after step {t}", rtol=1e-12, atol=1e-14)
        _close(b.numpy(), pb, f"b after step {t}", rtol=1e-12, atol=1e-14)
    for s in opt.slots().values():
        assert s.dtype == np.float64


def test_several_variables_of_different_shapes_and_dtypes(fused):
    rng = np.random.default_rng(5)
    inits = [np.float32(0.5), rng.normal(size=4).astype(np.float32),
             rng.normal(size=(2, 3, 2)).astype(np.float32), rng.normal(size=(3, 1))]
    variables = [gd.Variable(a, name=f"v{i}") for i, a in enumerate(inits)]
    opt = gd.optimizers.Adam(learning_rate=0.1, beta_1=0.6)

    @gd.function
    def step(grads):
        return opt.apply_gradients(zip(grads, variables))

    refs = [[np.asarray(a, np.float64), 0.0, 0.0] for a in inits]
    for t in range(1, 4):
        grads = [rng.normal(size=np.shape(a)).astype(np.asarray(a).dtype) for a in inits]
        assert step(grads) == t
        for i, (r, g) in enumerate(zip(refs, grads)):
            refs[i] = list(adam_ref(r[0], g.astype(np.float64), r[1], r[2], t, 0.1, b1=0.6))
            tol = {"rtol": 1e-12, "atol": 1e-14} if g.dtype == np.float64 else {}
            _close(variables[i].numpy(), refs[i][0], f"v{i} after step {t}", **tol)
            assert variables[i].shape == np.shape(inits[i])
            assert opt.slot(variables[i], "v").shape == np.shape(inits[i])


def test_gradient_reduction_sum_on_one_device_is_plain_update():
    w = gd.Variable(np.ones(3, np.float32))
    gd.optimizers.SGD(0.5, gradient_reduction="sum").apply_gradients([(np.ones(3, np.float32), w)])
    _close(w.numpy(), np.full(3, 0.5), "w")


# ---------------------------------------------------------------- clipping


def clip_ref(grads, clipnorm=None, global_clipnorm=None):
    """Keras: clipnorm clips each gradient's L2 norm, global_clipnorm all of them together."""
    if clipnorm is not None:
        return [g * clipnorm / max(np.linalg.norm(g), clipnorm) for g in grads]
    if global_clipnorm is not None:
        norm = np.sqrt(sum(np.sum(g * g) for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    return grads


@pytest.mark.parametrize("clip", [{"clipnorm": 0.5}, {"clipnorm": 100.0},
                                  {"global_clipnorm": 0.7}, {"global_clipnorm": 100.0}],
                         ids=["norm", "norm_unclipped", "global", "global_unclipped"])
@pytest.mark.parametrize("cls, kw", [("SGD", {"momentum": 0.9}), ("Adam", {}),
                                     ("AdamW", {"weight_decay": 0.1})])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clipping_after_the_reduction_matches_reference(cls, kw, clip, dtype, fused):
    # two replicas with different gradients: the mean is clipped, not each replica's part
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(3)
    w0, b0 = rng.normal(size=(3, 2)).astype(dtype), rng.normal(size=(2,)).astype(dtype)
    gw = [rng.normal(size=(3, 2)).astype(dtype) for _ in range(2)]
    gb = [rng.normal(size=(2,)).astype(dtype) * 3 for _ in range(2)]
    with strategy.scope():
        w, b = gd.Variable(w0), gd.Variable(b0)
        opt = getattr(gd.optimizers, cls)(learning_rate=0.1, **kw, **clip)
    step = gd.function(lambda gw, gb: strategy.run(
        lambda x, y: opt.apply_gradients([(x, w), (y, b)]), args=(gw, gb)))
    ref = {"w": [w0.astype(np.float64), 0.0, 0.0], "b": [b0.astype(np.float64), 0.0, 0.0]}
    mean = [(gw[0] + gw[1]) / 2.0, (gb[0] + gb[1]) / 2.0]
    clipped = clip_ref([g.astype(np.float64) for g in mean], **clip)
    if min(clip.values()) < 1:   # the case really clips; clipping each replica would differ
        assert not np.allclose(clipped[1], mean[1])
        per_replica = [clip_ref([gw[r], gb[r]], **clip) for r in range(2)]
        assert not np.allclose((per_replica[0][1] + per_replica[1][1]) / 2, clipped[1])
    for t in range(1, 4):
        step(gd.PerReplica(gw), gd.PerReplica(gb))
        for key, g in zip(("w", "b"), clipped):
            ref[key] = _ref_step(cls, ref[key], g, t, 0.1, kw)
        for var, key in ((w, "w"), (b, "b")):
            assert var.dtype == dtype
            for component in var.values:
                _close(component, ref[key][0], f"{key} after step {t}")


@pytest.mark.parametrize("clip", [{"clipnorm": 1.0}, {"global_clipnorm": 1.0}])
def test_clipping_eagerly_on_one_device(clip):
    w = gd.Variable(np.array([3.0, 4.0], np.float32))
    b = gd.Variable(np.array([0.0], np.float32))
    gd.optimizers.SGD(1.0, **clip).apply_gradients([(np.array([3.0, 4.0], np.float32), w),
                                                     (np.array([12.0], np.float32), b)])
    expected = clip_ref([np.array([3.0, 4.0]), np.array([12.0])], **clip)
    _close(w.numpy(), np.array([3.0, 4.0]) - expected[0], "w")
    _close(b.numpy(), -expected[1], "b")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("make", [
    lambda: gd.optimizers.SGD(learning_rate=-0.1),
    lambda: gd.optimizers.SGD(learning_rate=float("nan")),
    lambda: gd.optimizers.SGD(0.1, momentum=-0.5),
    lambda: gd.optimizers.SGD(0.1, weight_decay=-1.0),
    lambda: gd.optimizers.SGD(0.1, nesterov=True),
    lambda: gd.optimizers.SGD(0.1, gradient_reduction="max"),
    lambda: gd.optimizers.Adam(learning_rate=-1e-3),
    lambda: gd.optimizers.Adam(beta_1=1.0),
    lambda: gd.optimizers.Adam(beta_2=1.5),
    lambda: gd.optimizers.Adam(beta_1=-0.1),
    lambda: gd.optimizers.Adam(epsilon=-1e-7),
    lambda: gd.optimizers.Adam(gradient_reduction="MEAN"),
    lambda: gd.optimizers.AdamW(learning_rate=-1.0),
    lambda: gd.optimizers.AdamW(beta_2=1.0),
    lambda: gd.optimizers.AdamW(weight_decay=-0.1),
    lambda: gd.optimizers.AdamW(gradient_reduction=None),
    lambda: gd.optimizers.SGD(0.1, clipnorm=0.0),
    lambda: gd.optimizers.Adam(global_clipnorm=-1.0),
    lambda: gd.optimizers.AdamW(clipnorm=1.0, global_clipnorm=1.0),
], ids=["sgd_neg_lr", "sgd_nan_lr", "sgd_neg_momentum", "sgd_neg_wd", "sgd_nesterov_no_m",
        "sgd_reduction", "adam_neg_lr", "adam_b1_1", "adam_b2_gt1", "adam_neg_b1", "adam_neg_eps",
        "adam_reduction", "adamw_neg_lr", "adamw_b2_1", "adamw_neg_wd", "adamw_reduction",
        "sgd_zero_clipnorm", "adam_neg_global_clipnorm", "adamw_both_clips"])
def test_bad_constructor_args(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("cls", ["SGD", "Adam"])
@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_gradient_shape_mismatch_changes_nothing(cls, mode):
    opt = getattr(gd.optimizers, cls)(learning_rate=0.1)
    w = gd.Variable(np.ones((2, 3), np.float32), name="weights")
    b = gd.Variable(np.ones(3, np.float32), name="bias_var")
    good, bad = np.ones((2, 3), np.float32), np.ones(4, np.float32)
    grads_and_vars = [(good, w), (bad, b)]
    if mode == "eager":
        apply = opt.apply_gradients
    else:
        apply = gd.function(lambda gv: opt.apply_gradients(gv))
    with pytest.raises(ValueError, match="bias_var") as info:
        apply(grads_and_vars)
    assert "(4,)" in str(info.value) and "(3,)" in str(info.value)
    np.testing.assert_array_equal(w.numpy(), np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(b.numpy(), np.ones(3, np.float32))
    assert opt.iterations.numpy() == 0
    for s in opt.slots().values():
        assert not s.numpy().any()
    # the optimizer still works afterwards
    assert opt.apply_gradients([(good, w)]) == 1


def test_gradient_dtype_mismatch_in_trace_names_variable():
    opt = gd.optimizers.Adam(0.1)
    w = gd.Variable(np.ones(2, np.float32), name="w32")
    step = gd.function(lambda g: opt.apply_gradients([(g, w)]))
    with pytest.raises(TypeError, match="w32"):
        step(np.ones(2, np.float64))
    np.testing.assert_array_equal(w.numpy(), np.ones(2, np.float32))
    assert opt.iterations.numpy() == 0


def test_eager_python_number_gradient_for_scalar_variable():
    v = gd.Variable(np.float32(1.0))
    assert gd.optimizers.SGD(0.5).apply_gradients([(1.0, v)]) == 1
    _close(v.numpy(), 0.5, "v")


def test_apply_gradients_rejects_non_variable():
    opt = gd.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="Variable"):
        opt.apply_gradients([(np.ones(2, np.float32), np.ones(2, np.float32))])


# ---------------------------------------------------------------- buffers and aliasing


@pytest.mark.parametrize("cls, kw", [("SGD", {"momentum": 0.9, "nesterov": True}),
                                     ("AdamW", {"weight_decay": 0.1})], ids=["sgd", "adamw"])
def test_large_model_matches_reference(cls, kw, fused):
    # 64x80 float32 = 20 KiB per array: gradients and updates go through arena buffers,
    # and results may be computed straight into the variables' storage
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 64)).astype(np.float32)
    y = rng.normal(size=(16, 80)).astype(np.float32)
    w0 = (rng.normal(size=(64, 80)) * 0.1).astype(np.float32)
    b0 = np.zeros(80, np.float32)
    w, b = gd.Variable(w0), gd.Variable(b0)
    opt = getattr(gd.optimizers, cls)(learning_rate=0.01, **kw)
    step = _linreg_step(opt, w, b)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    ref = {"w": [w0.astype(np.float64), 0.0, 0.0], "b": [b0.astype(np.float64), 0.0, 0.0]}
    for t in range(1, 4):
        gw, gb = linreg_grads(ref["w"][0], ref["b"][0], x64, y64)
        step(x, y)
        for key, g in (("w", gw), ("b", gb)):
            ref[key] = _ref_step(cls, ref[key], g, t, 0.01, kw)
        _close(w.numpy(), ref["w"][0], f"w after step {t}")
        _close(b.numpy(), ref["b"][0], f"b after step {t}")


@pytest.mark.parametrize("n", [3, 5000])
@pytest.mark.parametrize("cls", ["SGD", "Adam"])
def test_reads_around_apply_gradients(n, cls, fused):
    w0 = np.linspace(-1, 1, n).astype(np.float32)
    w = gd.Variable(w0)
    opt = getattr(gd.optimizers, cls)(0.1, **({"momentum": 0.9} if cls == "SGD" else {}))

    @gd.function
    def step(g):
        before = w.read_value()
        opt.apply_gradients([(g, w)])
        return before * 1, w * 1, before - w

    before, after, diff = step(np.ones(n, np.float32))
    np.testing.assert_array_equal(before, w0)
    np.testing.assert_array_equal(after, w.numpy())
    _close(diff, w0.astype(np.float64) - w.numpy(), "before - after")
    first_step = 0.1 if cls == "SGD" else 0.1 * np.sqrt(1e-3) / (np.sqrt(1e-3) + 1e-7)
    _close(w.numpy(), w0 - first_step, "w")


@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW"])
def test_gradient_aliasing_the_variable(cls, fused):
    # the gradient is the variable's own read: an in-place update must not clobber it
    w0 = np.linspace(-1, 1, 5000).astype(np.float32)
    kw = {"SGD": {"momentum": 0.5, "weight_decay": 0.5}, "Adam": {},
          "AdamW": {"weight_decay": 0.5}}[cls]
    w = gd.Variable(w0)
    opt = getattr(gd.optimizers, cls)(0.1, **kw)
    step = gd.function(lambda: opt.apply_gradients([(w.read_value(), w)]))
    p, m, v = w0.astype(np.float64), np.zeros(5000), np.zeros(5000)
    for t in (1, 2):
        step()
        if cls == "SGD":
            p, m = sgd_ref(p, p, m, 0.1, **kw)
        else:
            p, m, v = adam_ref(p, p, m, v, t, 0.1, **_ref_kwargs(kw))
        _close(w.numpy(), p, f"w after step {t}")


def test_eager_apply_gradients_checks_like_the_traced_path():
    w = gd.Variable(np.ones(2, np.float32), name="w")
    opt = gd.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="float64.*'w'.*float32"):
        opt.apply_gradients([(np.ones(2, np.float64), w)])
    with pytest.raises(ValueError, match="no gradients provided.*'w'"):
        opt.apply_gradients([(None, w)])
    np.testing.assert_array_equal(w.numpy(), [1, 1])           # nothing changed
    assert int(opt.iterations.numpy()) == 0
    opt.apply_gradients([([1.0, 2.0], w)])                     # Python data: w's dtype
    np.testing.assert_allclose(w.numpy(), [0.9, 0.8], rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_a_scalar_variable_trains_with_fused_kernels_too(fused, devices):
    """A 0-d variable's gradient comes out of numpy as a numpy scalar; the fused kernels
    take it as a 0-d array. Reference: SGD(0.1) with momentum 0.9 on loss u*u + sum(w*w)."""
    gd.config.set_fused_kernels(fused)
    try:
        strategy = gd.MirroredStrategy(devices)
        with strategy.scope():
            u = gd.Variable(1.5, name="u")
            w = gd.Variable(np.array([1.0, -2.0], np.float32), name="w")
            opt = gd.optimizers.SGD(0.1, momentum=0.9)

        @gd.function
        def step():
            def replica_fn():
                with gd.GradientTape() as tape:
                    loss = u * u + gd.reduce_sum(w * w)
                opt.apply_gradients(zip(tape.gradient(loss, [u, w]), [u, w]))
            strategy.run(replica_fn)

        for _ in range(3):
            step()
    finally:
        gd.config.set_fused_kernels(True)
    p = [np.float32(1.5), np.array([1.0, -2.0], np.float32)]
    m = [np.float32(0.0), np.zeros(2, np.float32)]
    for _ in range(3):
        for k in range(2):
            m[k] = np.float32(0.9) * m[k] + 2 * p[k]
            p[k] = p[k] - np.float32(0.1) * m[k]
    np.testing.assert_allclose(u.numpy(), p[0], rtol=1e-6)
    np.testing.assert_allclose(w.numpy(), p[1], rtol=1e-6)


# ---------------------------------------------------------------- hyper-parameters as state

HYPER_CASES = {   # optimizer, constructor args, assignments made before steps 2, 3, 4
    "sgd": ("SGD", {"learning_rate": 0.1, "weight_decay": 0.01},
            [{"learning_rate": 0.05}, {"weight_decay": 0.2}, {"learning_rate": 0.3}]),
    "momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
                 [{"momentum": 0.5}, {"learning_rate": 0.02, "weight_decay": 0.1},
                  {"momentum": 0.0}]),
    "adam": ("Adam", {"learning_rate": 0.05},
             [{"learning_rate": 0.01}, {"beta_1": 0.5, "beta_2": 0.9}, {"epsilon": 0.1}]),
    "adamw": ("AdamW", {"learning_rate": 0.05, "weight_decay": 0.1},
              [{"weight_decay": 0.5}, {"learning_rate": 0.2}, {"beta_1": 0.0}]),
}


def _hyper_ref(cls: str, state, g, t: int, hp: dict) -> list:
    """One reference step with the hyper-parameters in force; SGD with momentum 0 is plain
    SGD that leaves the buffer as it is."""
    p, m, v = state
    if cls == "SGD":
        if hp.get("momentum", 0.0) == 0.0:
            return [sgd_ref(p, g, None, hp["learning_rate"],
                            weight_decay=hp.get("weight_decay", 0.0))[0], m, v]
        p, m = sgd_ref(p, g, m, hp["learning_rate"], hp["momentum"], hp.get("nesterov", False),
                       hp.get("weight_decay", 0.0))
        return [p, m, v]
    return list(adam_ref(p, g, m, v, t, hp["learning_rate"], hp.get("beta_1", 0.9),
                         hp.get("beta_2", 0.999), hp.get("epsilon", 1e-7),
                         hp.get("weight_decay", 0.0)))


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("case", sorted(HYPER_CASES))
def test_assigned_hyperparameters_take_effect_without_a_retrace(case, devices, fused):
    cls, kw, changes = HYPER_CASES[case]
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)])
    rng = np.random.default_rng(11)
    p0 = rng.normal(size=(4, 3)).astype(np.float32)
    with strategy.scope():
        w = gd.Variable(p0, name="w")
        opt = getattr(gd.optimizers, cls)(**kw)

    @gd.function
    def step(g):
        return strategy.run(lambda: opt.apply_gradients([(g, w)]))

    hp = dict(kw)
    state = [p0.astype(np.float64), np.zeros((4, 3)), np.zeros((4, 3))]
    for t in range(1, len(changes) + 2):
        if t > 1:
            for name, value in changes[t - 2].items():
                setattr(opt, name, value)
                hp[name] = value
                assert float(getattr(opt, name).numpy()) == value
        g = rng.normal(size=(4, 3)).astype(np.float32)
        step(g)
        state = _hyper_ref(cls, state, g.astype(np.float64), t, hp)
        for component in w.values:
            _close(component, state[0], f"{case}: w after step {t}")
    assert step.trace_count == 1


def test_hyperparameters_are_mirrored_float64_state_in_variables():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        opt = gd.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)
    names = ["learning_rate", "beta_1", "beta_2", "epsilon", "weight_decay"]
    for name in names:
        var = getattr(opt, name)
        assert isinstance(var, gd.Variable) and not var.trainable
        assert var.dtype == np.float64 and var.shape == () and len(var.values) == 2
        assert any(var is v for v in opt.variables())
    assert opt.variables()[0] is opt.iterations
    _close(opt.learning_rate.numpy(), 0.01, "learning_rate")
    opt.learning_rate = 0.5
    assert all(float(c) == 0.5 for c in opt.learning_rate.values)   # every replica's copy
    assert gd.optimizers.Adam().weight_decay == 0.0
    with pytest.raises(AttributeError, match="AdamW"):
        gd.optimizers.Adam().weight_decay = 0.1


def test_eager_apply_gradients_sees_assignments():
    w = gd.Variable(np.ones(2))
    opt = gd.optimizers.SGD(0.5)
    opt.apply_gradients([(np.ones(2), w)])
    opt.learning_rate = 0.25
    opt.apply_gradients([(np.ones(2), w)])
    _close(w.numpy(), 1 - 0.5 - 0.25, "w")
    assert len(opt._eager_steps) == 1 and next(iter(opt._eager_steps.values())).trace_count == 1


@pytest.mark.parametrize("name, bad", [
    ("learning_rate", -0.1), ("learning_rate", float("nan")), ("learning_rate", float("inf")),
    ("weight_decay", -1.0), ("momentum", -0.5), ("beta_1", 1.0), ("beta_2", 1.5),
    ("epsilon", -1e-8)])
def test_bad_assignments_raise_and_change_nothing(name, bad):
    cls = "Adam" if name.startswith(("beta", "eps")) else "SGD"
    kw = {"momentum": 0.9} if name == "momentum" else {}
    opt = (gd.optimizers.AdamW if name == "weight_decay" else getattr(gd.optimizers, cls))(**kw)
    before = float(getattr(opt, name).numpy())
    with pytest.raises(ValueError, match=name):
        setattr(opt, name, bad)
    assert float(getattr(opt, name).numpy()) == before
    with pytest.raises(TypeError, match=name):
        setattr(opt, name, "fast")


def test_momentum_is_fixed_at_construction_in_kind_not_in_value():
    plain = gd.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="momentum > 0"):
        plain.momentum = 0.9
    plain.momentum = 0.0                                     # still plain: fine
    assert plain.slots() == {}
    heavy = gd.optimizers.SGD(0.1, momentum=0.9)
    w = gd.Variable(np.ones(3))
    heavy.apply_gradients([(np.ones(3), w)])
    buffer = heavy.slot(w, "momentum").numpy()
    heavy.momentum = 0.0                                     # plain SGD steps from now on
    heavy.apply_gradients([(np.full(3, 2.0), w)])
    _close(w.numpy(), np.ones(3) - 0.1 - 0.2, "w")
    np.testing.assert_array_equal(heavy.slot(w, "momentum").numpy(), buffer)


def test_switching_between_a_number_and_a_schedule_is_a_type_error():
    sched = gd.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    opt = gd.optimizers.SGD(learning_rate=sched)
    assert opt.learning_rate is sched
    assert all(v is not sched for v in opt.variables())
    for value in (0.1, gd.optimizers.schedules.ExponentialDecay(0.2, 10, 0.5)):
        with pytest.raises(TypeError, match="schedule"):
            opt.learning_rate = value
    numeric = gd.optimizers.Adam(0.1)
    with pytest.raises(TypeError, match="number"):
        numeric.learning_rate = sched
    with pytest.raises(TypeError, match="number"):
        numeric.learning_rate = lambda step: 0.1
    assert opt.learning_rate is sched and float(numeric.learning_rate.numpy()) == 0.1


def test_a_variable_learning_rate_is_shared_state():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        lr = gd.Variable(np.float32(0.5), name="lr", trainable=False)
        w = gd.Variable(np.zeros(2))
        opt = gd.optimizers.SGD(learning_rate=lr)
    assert opt.learning_rate is lr
    step = gd.function(lambda: strategy.run(
        lambda: opt.apply_gradients([(gd.ones_like(w), w)])))
    step()
    lr.assign(np.float32(0.125))                  # the user's variable, assigned directly
    step()
    opt.learning_rate = 0.25                      # or through the optimizer
    step()
    _close(w.numpy(), -np.full(2, 0.5 + 0.125 + 0.25), "w")
    assert step.trace_count == 1
    with pytest.raises(TypeError, match="scalar"):
        gd.optimizers.SGD(learning_rate=gd.Variable(np.ones(2)))
    outside = gd.Variable(0.1)                                   # on cpu:0 only
    with strategy.scope(), pytest.raises(ValueError, match="strategy scope"):
        gd.optimizers.SGD(learning_rate=outside)


def test_callable_learning_rates_of_the_step_or_of_nothing():
    scale = gd.Variable(np.float64(1.0), trainable=False)
    for lr, rates in [(lambda step: 0.1 * (gd.cast(step, "float64") + 1.0), [0.1, 0.2, 0.3]),
                      (lambda: scale * 0.5, [0.5, 1.0, 1.5]),
                      (lambda step: 0.25, [0.25, 0.25, 0.25])]:
        scale.assign(1.0)
        w = gd.Variable(np.zeros(1))
        opt = gd.optimizers.SGD(learning_rate=lr)
        step = gd.function(lambda opt=opt, w=w: opt.apply_gradients([(gd.ones_like(w), w)]))
        for t, rate in enumerate(rates):
            before = w.numpy()
            step()
            _close(before - w.numpy(), [rate], f"rate of step {t}")
            scale.assign(scale.numpy() + 1.0)
        assert step.trace_count == 1


@pytest.mark.parametrize("cls, kw", [("SGD", {}), ("SGD", {"momentum": 0.9}),
                                     ("Adam", {}), ("AdamW", {"weight_decay": 0.1})])
@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]])
def test_updates_are_bit_identical_to_the_kernel_specs(cls, kw, devices, fused, monkeypatch):
    """The hyper vector reaches every path (the ops' numpy impls, the multi-tensor kernels,
    the fused all-reduce + update on 4 replicas) as the float32 numbers the kernels' numpy
    specs take from Python floats, so the updates agree bit for bit with those specs on
    every path (a first call may run the numpy impls while the kernels load: the same
    bits either way, runtime/warmup.py). Overlap off: the fused all-reduce + update forms
    only where the all-reduce runs inline."""
    from graphdist.kernels import adam, sgd

    monkeypatch.setitem(gd.config._state, "overlap", False)   # restored after the test
    # the replicas as one program, where the fused all-reduce + update forms
    monkeypatch.setitem(gd.config._state, "device_concurrency", "sequential")

    strategy = gd.MirroredStrategy(devices)
    rng = np.random.default_rng(5)
    shapes = [(5, 3), (3,)]
    inits = [rng.normal(size=s).astype(np.float32) for s in shapes]
    with strategy.scope():
        ws = [gd.Variable(a) for a in inits]
        opt = getattr(gd.optimizers, cls)(learning_rate=0.03, gradient_reduction="sum", **kw)

    @gd.function
    def step(gs):
        return strategy.run(lambda *gs: opt.apply_gradients(zip(gs, ws)), args=gs)

    state = [[a.copy(), np.zeros_like(a), np.zeros_like(a)] for a in inits]
    for t in range(1, 4):
        gs = [rng.normal(size=s).astype(np.float32) for s in shapes]
        # replica 0 holds the gradient, the others zeros: the summed gradient is exact
        step([gd.PerReplica([g] + [np.zeros_like(g)] * (len(devices) - 1))
              if len(devices) > 1 else g for g in gs])
        for k, g in enumerate(gs):
            p, m, v = state[k]
            if cls == "SGD":
                p, m = sgd.sgd_ref(p, m if kw else None, g, 0.03, kw.get("momentum", 0.0))
            else:
                lr_t = 0.03 * np.sqrt(1 - 0.999 ** np.float64(t)) / (1 - 0.9 ** np.float64(t))
                decay = 0.03 * kw.get("weight_decay", 0.0)
                p, m, v = adam.adam_ref(p, m, v, g, lr_t, 0.9, 0.999, 1e-7, decay)
            state[k] = [p, m, v]
            for component in ws[k].values:
                np.testing.assert_array_equal(component, p)
    if fused and len(devices) > 1:
        assert any(e.op.name == "host_reduce_update" for e in step.replicated_graph.eqns)
