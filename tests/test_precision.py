"""Mixed precision: the float16/bfloat16 dtypes (ml_dtypes), casts against ml_dtypes/numpy
references, float32 accumulation in matmul/conv/reductions/softmax, the dtype policy of the
gd.nn layers (float32 master weights and slots), retracing on a policy change, and
checkpoints of bfloat16 variables."""

from __future__ import annotations

import io
import json
import logging
import math
import zipfile

import ml_dtypes
import numpy as np
import pytest

import graphdist as gd
from graphdist.ir.types import ArrayType, as_dtype, is_float

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
BIG = (128, 256)          # 32K elements: past the arena threshold, so out= impls run too


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    gd.config.set_precision("float32")


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- dtypes and casts


def test_dtype_names_and_ir_text():
    assert as_dtype("bfloat16") == BF16 and as_dtype(ml_dtypes.bfloat16) == BF16
    assert as_dtype("float16") == F16 and is_float(BF16) and is_float(F16)
    assert not is_float("int32")
    assert str(ArrayType((2, 3), BF16)) == "bf16[2,3]" and str(ArrayType((4,), F16)) == "f16[4]"
    f = gd.function(lambda x, y: (gd.cast(x, "float16"), gd.cast(y, "float32")))
    f(np.ones(3, np.float32), np.ones(3, BF16))
    text = str(f.graph)
    assert "x:f32[3], y:bf16[3]" in text and "f16[3] = cast[dtype=float16] x" in text
    assert "f32[3] = cast[dtype=float32] y" in text


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_cast_round_trip_matches_ml_dtypes(low, traced):
    x = (_rng().normal(size=BIG) * 100).astype(np.float32)
    x[0, :4] = [1 + 2**-8, 1 + 3 * 2**-8, 1e-30, -0.0]   # ties to even; tiny; signed zero
    if traced:
        down = gd.function(lambda a: gd.cast(a, low))
        up = gd.function(lambda a: gd.cast(a, "float32"))
    else:
        down, up = (lambda a: gd.cast(a, low)), (lambda a: gd.cast(a, "float32"))
    got = down(x)
    assert got.dtype == low
    reference = x.astype(low)                       # ml_dtypes' / numpy's rounding
    np.testing.assert_array_equal(got.view(np.uint16), reference.view(np.uint16))
    np.testing.assert_array_equal(up(got), reference.astype(np.float32))
    if low == BF16:                                 # round to nearest even, by hand
        assert float(got[0, 0]) == 1.0 and float(got[0, 1]) == 1 + 2**-6
        assert np.signbit(float(got[0, 3]))


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_representable_values_survive_exactly(low):
    finfo = ml_dtypes.finfo(low)
    values = np.array([0.0, 1.5, -2.0, 3.25, 256.0, 2.0**-10, float(finfo.max),
                       float(finfo.tiny), -float(finfo.max), np.inf, -np.inf], np.float32)
    low_values = values.astype(low)
    np.testing.assert_array_equal(low_values.astype(np.float32), values)   # representable
    np.testing.assert_array_equal(gd.cast(gd.cast(values, low), "float32"), values)
    other = F16 if low == BF16 else BF16            # between the two: as ml_dtypes casts
    np.testing.assert_array_equal(gd.cast(low_values, other).astype(np.float32),
                                  low_values.astype(other).astype(np.float32))


def test_mixing_float_dtypes_is_a_type_error():
    with pytest.raises(TypeError, match="bf16.*f32"):
        gd.add(np.ones(2, BF16), np.ones(2, np.float32))
    f = gd.function(lambda a, b: a * b)
    with pytest.raises(TypeError, match="f16.*bf16"):
        f(np.ones(2, F16), np.ones(2, BF16))
    with pytest.raises(TypeError):
        gd.matmul(np.ones((2, 2), BF16), np.ones((2, 2), np.float32))


def test_python_scalars_take_the_low_precision_dtype():
    x = np.array([1.5, -2.0], BF16)
    y = gd.multiply(x, 2)
    assert y.dtype == BF16 and list(y.astype(np.float32)) == [3.0, -4.0]
    assert gd.add(np.array([1.0], F16), 0.5).dtype == F16
    f = gd.function(lambda a: a * 3.0 + 1)
    assert f(x).dtype == BF16 and list(f(x).astype(np.float32)) == [5.5, -5.0]


def test_low_precision_variables():
    v = gd.Variable(np.array([1.5, -2.0, 3.25], BF16), name="v")
    assert v.dtype == BF16 and v.numpy().dtype == BF16
    v.assign_add(1)
    np.testing.assert_array_equal(v.numpy().astype(np.float32), [2.5, -1.0, 4.25])
    h = gd.Variable(1.0, dtype="float16")
    assert h.dtype == F16

    @gd.function
    def step():
        v.assign(v * 2.0)
        return gd.cast(v, "float32")

    np.testing.assert_array_equal(step(), [5.0, -2.0, 8.5])
    with pytest.raises(TypeError):
        v.assign(np.zeros(3, np.float32))


# ---------------------------------------------------------------- float32 accumulation


@pytest.mark.parametrize("low,rtol", [(BF16, 1e-2), (F16, 1e-3)], ids=["bf16", "f16"])
def test_matmul_matches_float32_at_its_precision(low, rtol):
    a = _rng(1).normal(size=(64, 300)).astype(low)
    b = _rng(2).normal(size=(300, 128)).astype(low)
    reference = a.astype(np.float64) @ b.astype(np.float64)   # the same rounded inputs
    scale = np.abs(reference).max()
    for got in (gd.matmul(a, b), gd.function(lambda x, y: x @ y)(a, b)):
        assert got.dtype == low
        # one rounding of an accurately accumulated result: within half an ulp of the output
        np.testing.assert_allclose(got.astype(np.float64), reference, rtol=rtol,
                                   atol=rtol * scale * 1e-2)
    batched = gd.matmul(a.reshape(2, 32, 300), b)                # leading batch dimensions
    assert batched.dtype == low
    np.testing.assert_allclose(batched.reshape(64, 128).astype(np.float64), reference,
                               rtol=rtol, atol=rtol * scale * 1e-2)


def test_float32_accumulation_where_half_precision_accumulation_fails():
    # 20000 copies of 0.1 in float16: a float16 running sum stalls at 256 (0.1 is below half
    # the spacing of float16 there), the exact sum is ~2000
    x = np.full(20000, 0.1, F16)
    exact = math.fsum(x.astype(np.float64))
    half_running = np.cumsum(x, dtype=F16)[-1]                 # float16 accumulation
    assert abs(float(half_running) - exact) / exact > 0.5
    for got in (gd.reduce_sum(x), gd.function(gd.reduce_sum)(x)):
        assert got.dtype == F16 and abs(float(got) - exact) / exact < 1e-3
    np.testing.assert_allclose(float(gd.reduce_mean(x)), exact / x.size, rtol=1e-3)
    # bfloat16 (8 significant bits): numpy's own sum of 10000 ones stops at 256
    ones = np.ones((10000,), BF16)
    assert float(np.sum(ones)) == 256.0
    assert float(gd.reduce_sum(ones)) == float(np.float64(10000).astype(BF16))   # 9984
    assert float(gd.reduce_mean(ones)) == 1.0
    # a dot product of length 4096: float16 accumulation stalls at 2048
    row, col = np.ones((1, 4096), F16), np.ones((4096, 1), F16)
    assert float(gd.matmul(row, col)[0, 0]) == 4096.0
    sums = gd.function(lambda a: gd.reduce_sum(a, axis=0))(np.ones((4096, 8), F16))
    np.testing.assert_array_equal(sums, np.full(8, 4096.0, F16))   # the out= path too


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_softmax_and_losses_in_low_precision(low):
    logits32 = (_rng(3).normal(size=(8, 10)) * 4 + 30).astype(np.float32)   # exp overflows f16
    logits = logits32.astype(low)
    up = logits.astype(np.float32)
    labels = np.arange(8) % 10
    sm, lsm = gd.nn.softmax(logits), gd.nn.log_softmax(logits)
    assert sm.dtype == low and lsm.dtype == low and np.all(np.isfinite(sm.astype(np.float32)))
    ref_lsm = up - up.max(-1, keepdims=True)
    ref_lsm = ref_lsm - np.log(np.exp(ref_lsm).sum(-1, keepdims=True))
    np.testing.assert_array_equal(lsm, ref_lsm.astype(low))
    np.testing.assert_allclose(sm.astype(np.float32), np.exp(ref_lsm), rtol=1e-2, atol=1e-3)
    loss = gd.nn.sparse_softmax_cross_entropy(labels, logits)
    assert loss.dtype == np.float32                 # computed and returned in float32
    np.testing.assert_allclose(loss, -ref_lsm[np.arange(8), labels], rtol=1e-6)
    dense = gd.nn.softmax_cross_entropy(np.eye(10, dtype=low)[labels], logits)
    assert dense.dtype == np.float32
    np.testing.assert_allclose(dense, loss, rtol=1e-6)
    with pytest.raises(TypeError, match="labels"):
        gd.nn.softmax_cross_entropy(np.eye(10, dtype=np.float32)[labels], logits)


def test_loss_gradient_reaches_low_precision_logits_and_float32_weights():
    x = _rng(4).normal(size=(16, 5)).astype(np.float32)
    w = gd.Variable(_rng(5).normal(size=(5, 3)).astype(np.float32), name="w")
    labels = np.arange(16) % 3

    @gd.function
    def grads(x):
        with gd.GradientTape() as tape:
            logits = gd.cast(x, "bfloat16") @ gd.cast(w, "bfloat16")
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(labels, logits))
        return loss, tape.gradient(loss, w)

    loss, g = grads(x)
    assert loss.dtype == np.float32 and g.dtype == np.float32
    xb, wb = x.astype(BF16).astype(np.float64), w.numpy().astype(BF16).astype(np.float64)
    logits = (xb @ wb).astype(BF16).astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    reference = xb.T @ ((p - np.eye(3)[labels]) / 16)
    np.testing.assert_allclose(g, reference, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_einsum_accumulates_in_float32(low):
    a = _rng(11).normal(size=(4, 8, 300)).astype(low)
    b = _rng(12).normal(size=(300, 16)).astype(low)
    reference = np.einsum("bij,jk->bik", a.astype(np.float64), b.astype(np.float64))
    got = gd.function(lambda x, y: gd.einsum("bij,jk->bik", x, y))(a, b)
    assert got.dtype == low
    tol = 1e-2 if low == BF16 else 1e-3
    np.testing.assert_allclose(got.astype(np.float64), reference, rtol=tol,
                               atol=tol * np.abs(reference).max() * 1e-2)
    ones = np.ones((2, 4096), low)                      # a half-precision sum stalls here
    assert float(gd.einsum("ij,kj->ik", ones, ones)[0, 1]) == 4096.0


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_cpu_kernels_step_aside_for_low_precision(low):
    # where, relu_grad and max_pool2d have Numba kernels for float32/float64 only: large
    # low-precision operands take the numpy impls, with the same results
    x = _rng(13).normal(size=(8, 16, 16, 32)).astype(low)         # 64K elements

    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            y = gd.nn.max_pool2d(gd.relu(x), 2, 2, "VALID")
            z = gd.where(y > 0.5, y, gd.zeros_like(y))
            total = gd.reduce_sum(gd.cast(z, "float32"))
        return z, tape.gradient(total, x)

    z, g = f(x)
    up = x.astype(np.float32)
    pooled = np.maximum(up, 0).reshape(8, 8, 2, 8, 2, 32).max(axis=(2, 4))
    np.testing.assert_array_equal(z.astype(np.float32), np.where(pooled > 0.5, pooled, 0))
    assert g.dtype == low and float(g.astype(np.float32).sum()) == np.count_nonzero(pooled > 0.5)


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_conv2d_in_low_precision_matches_float32(low):
    x = _rng(6).normal(size=(2, 9, 9, 3)).astype(low)
    f = _rng(7).normal(size=(3, 3, 3, 4)).astype(low)
    reference = gd.nn.conv2d(x.astype(np.float32), f.astype(np.float32))
    got = gd.function(lambda a, b: gd.nn.conv2d(a, b))(x, f)
    assert got.dtype == low
    tol = 1e-2 if low == BF16 else 1e-3
    np.testing.assert_allclose(got.astype(np.float32), reference, rtol=tol,
                               atol=tol * np.abs(reference).max())


# ---------------------------------------------------------------- the dtype policy


def test_policies_have_keras_names():
    p = gd.nn.DTypePolicy("mixed_bfloat16")
    assert (p.name, p.compute_dtype, p.variable_dtype) == ("mixed_bfloat16", "bfloat16",
                                                           "float32")
    assert gd.nn.DTypePolicy("mixed_float16").compute_dtype == "float16"
    assert gd.nn.DTypePolicy("float64").variable_dtype == "float64"
    with pytest.raises(ValueError):
        gd.nn.DTypePolicy("mixed_int8")
    with pytest.raises(ValueError):
        gd.config.set_precision("bfloat16")
    assert gd.config.precision() == "float32"
    gd.config.set_precision("mixed_float16")
    assert gd.config.precision() == "mixed_float16"
    assert gd.nn.Dense(2).dtype_policy == gd.nn.DTypePolicy("mixed_float16")


def test_dense_under_mixed_policy_keeps_float32_weights_and_computes_low():
    gd.config.set_precision("mixed_bfloat16")
    dense = gd.nn.Dense(4, activation="relu")
    head = gd.nn.Dense(3, dtype="float32")              # Keras's recipe for the last layer
    gd.config.set_precision("float32")                  # layers keep the policy they got
    x = _rng(8).normal(size=(6, 5)).astype(np.float32)
    h = dense(x)
    y = head(h)
    assert dense.compute_dtype == "bfloat16" and dense.variable_dtype == "float32"
    assert h.dtype == BF16 and y.dtype == np.float32
    assert all(v.dtype == np.float32 for v in dense.variables + head.variables)
    kernel, bias = dense.kernel.numpy(), dense.bias.numpy()
    acc = x.astype(BF16).astype(np.float32) @ kernel.astype(BF16).astype(np.float32)
    reference = np.maximum(acc.astype(BF16).astype(np.float32) + bias, 0).astype(BF16)
    np.testing.assert_allclose(h.astype(np.float32), reference.astype(np.float32),
                               rtol=1e-2, atol=1e-2)


def test_mixed_policy_model_of_every_layer_kind():
    gd.config.set_precision("mixed_float16")
    model = gd.nn.Sequential([gd.nn.Conv2D(4, 3, padding="same", activation="relu"),
                              gd.nn.BatchNorm(), gd.nn.MaxPool2D(), gd.nn.Flatten(),
                              gd.nn.Dropout(0.25, seed=1), gd.nn.Dense(3, dtype="float32")])
    x = _rng(9).normal(size=(4, 6, 6, 2)).astype(np.float32)
    f = gd.function(lambda x: model(x, training=True))
    y = f(x)
    assert y.dtype == np.float32 and np.all(np.isfinite(y))
    assert all(v.dtype == np.float32 for v in model.variables)
    assert "f16[4,6,6,4] = conv2d" in str(f.graph)
    bn = model.layers[1]
    assert bn.moving_mean.dtype == np.float32 and bn.compute_dtype == "float16"


def test_legacy_float32_policy_casts_nothing():
    dense = gd.nn.Dense(2)
    assert dense(np.ones((1, 3), np.float64)).dtype == np.float64   # weights follow the input
    assert dense.kernel.dtype == np.float64 and dense.compute_dtype == "float64"
    dense32 = gd.nn.Dense(2)
    dense32(np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match="matmul"):      # no silent cast of other floats
        dense32(np.ones((1, 3), BF16))


def test_a_precision_change_retraces(caplog):
    f = gd.function(lambda x: gd.cast(x, gd.nn.DTypePolicy(gd.config.precision())
                                      .compute_dtype))
    x = np.ones(3, np.float32)
    assert f(x).dtype == np.float32 and f.trace_count == 1
    gd.config.set_precision("mixed_bfloat16")
    gd.config.explain_retraces(True)
    try:
        with caplog.at_level(logging.WARNING, logger="graphdist"):
            assert f(x).dtype == BF16
    finally:
        gd.config.explain_retraces(False)
    assert f.trace_count == 2 and "precision: float32 -> mixed_bfloat16" in caplog.text
    gd.config.set_precision("float32")
    assert f(x).dtype == np.float32 and f.trace_count == 2     # the first trace, reused


def _mlp_losses(precision, steps=8):
    gd.config.set_precision(precision)
    rng = _rng(10)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    y = (x[:, :3].argmax(1)).astype(np.int64)
    model = gd.nn.Sequential([
        gd.nn.Dense(32, activation="relu", kernel_initializer=lambda s, dtype: rng_w(s, 0)),
        gd.nn.Dense(3, kernel_initializer=lambda s, dtype: rng_w(s, 1))])
    opt = gd.optimizers.Adam(1e-2)

    @gd.function
    def step(x, y):
        with gd.GradientTape() as tape:
            logits = gd.cast(model(x, training=True), "float32")
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    losses = [float(step(x, y)) for _ in range(steps)]
    return losses, model, opt


def rng_w(shape, seed):
    return (_rng(100 + seed).normal(size=shape) * 0.3).astype(np.float32)


def test_mlp_trains_under_mixed_bfloat16_like_float32():
    ref, ref_model, _ = _mlp_losses("float32")
    got, model, opt = _mlp_losses("mixed_bfloat16")
    assert got[-1] < got[0] * 0.8                       # it learns
    np.testing.assert_allclose(got, ref, rtol=3e-2)     # as float32 training does
    for a, b in zip(model.variables, ref_model.variables):
        assert a.dtype == np.float32                    # float32 master weights ...
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=3e-2)
    slots = list(opt.slots().values())
    assert len(slots) == 8 and all(s.dtype == np.float32 for s in slots)   # ... and slots


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_of_low_precision_variables(tmp_path):
    values = np.array([1.5, -2.0, 3.25, 1e-20, float(ml_dtypes.finfo(BF16).max)], np.float32)
    v = gd.Variable(values.astype(BF16), name="v")
    h = gd.Variable(np.array([0.1, 65504.0], F16), name="h")
    path = gd.Checkpoint(v=v, h=h).save(tmp_path / "ck.npz")
    saved_v, saved_h = v.numpy(), h.numpy()
    v.assign(np.zeros(5, BF16))
    h.assign(np.zeros(2, F16))
    gd.Checkpoint(v=v, h=h).restore(path)
    assert v.dtype == BF16 and h.dtype == F16
    np.testing.assert_array_equal(v.numpy().view(np.uint16), saved_v.view(np.uint16))
    np.testing.assert_array_equal(h.numpy(), saved_h)
    with zipfile.ZipFile(path) as zf:                    # bfloat16 stored as its bits
        raw = np.lib.format.read_array(io.BytesIO(zf.read("v.npy")))
        meta = json.loads(np.lib.format.read_array(io.BytesIO(zf.read("__meta__.npy")))
                          .tobytes())
    assert raw.dtype == np.uint16 and meta["entries"]["v"]["dtype"] == "bfloat16"
    np.testing.assert_array_equal(raw, values.astype(BF16).view(np.uint16))
    other = gd.Variable(np.zeros(5, np.float32), name="v")
    with pytest.raises(gd.CheckpointError, match="bfloat16"):   # dtypes must match
        gd.Checkpoint(v=other, h=h).restore(path)
