"""gd.nn.LayerNorm and gd.nn.MultiHeadAttention: against hand-written numpy with the layers'
own weights (Keras's shapes and names), masks (attention_mask, causal: the output at
position t does not depend on inputs after t), dropout, variables made mid-trace under a
strategy, a transformer block training on 2 replicas equal to 1 device on the global batch,
checkpoints, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_attention_ops import layer_norm_formula
from test_conv import fd_check

import graphdist as gd

DEV2 = ["cpu:0", "cpu:1"]


def _data(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def np_softmax(s, mask):
    s = np.where(mask, s, -np.inf) if mask is not None else s
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def np_attention(mha, query, value, key, mask=None):
    """Keras's MultiHeadAttention in numpy, with `mha`'s weights; mask (B, T, S) bool."""
    def project(layer, x, spec):
        y = np.einsum(spec, x, layer.kernel.numpy())
        return y + layer.bias.numpy() if layer.use_bias else y

    q = project(mha.query_dense, query, "btd,dhk->bthk") / math.sqrt(mha.key_dim)
    k = project(mha.key_dense, key, "bsd,dhk->bshk")
    v = project(mha.value_dense, value, "bsd,dhv->bshv")
    probs = np_softmax(np.einsum("bthk,bshk->bhts", q, k),
                       None if mask is None else mask[:, None])
    return project(mha.output_dense, np.einsum("bhts,bshv->bthv", probs, v),
                   "bthv,hvo->bto")


def _randomize(layer, seed=1):
    rng = np.random.default_rng(seed)
    for v in layer.variables:
        v.assign(rng.normal(size=v.shape).astype(v.dtype))


# ---------------------------------------------------------------- LayerNorm


def test_layer_norm_layer_matches_numpy_with_keras_names():
    x = _data((2, 5, 8)) * 3 + 1
    ln = gd.nn.LayerNorm()
    np.testing.assert_allclose(ln(x), layer_norm_formula(x, None, None, 1), rtol=1e-12)
    assert [v.name for v in ln.variables] == [f"{ln.name}/gamma", f"{ln.name}/beta"]
    assert ln.gamma.shape == ln.beta.shape == (8,) and ln.gamma.dtype == np.float64
    _randomize(ln)
    want = layer_norm_formula(x, ln.gamma.numpy(), ln.beta.numpy(), 1)
    np.testing.assert_allclose(ln(x), want, rtol=1e-12)
    np.testing.assert_allclose(gd.function(lambda x: ln(x))(x), want, rtol=1e-12)
    wide = gd.nn.LayerNorm(axis=(-2, -1), epsilon=1e-3)
    np.testing.assert_allclose(wide(x), layer_norm_formula(x, None, None, 2, 1e-3), rtol=1e-12)
    assert wide.gamma.shape == (5, 8)
    bare = gd.nn.LayerNorm(center=False, scale=False)
    np.testing.assert_allclose(bare(x), layer_norm_formula(x, None, None, 1), rtol=1e-12)
    assert bare.variables == []
    y32 = gd.nn.LayerNorm()(x.astype(np.float32))
    assert y32.dtype == np.float32


def test_layer_norm_errors():
    with pytest.raises(gd.ShapeError, match=r"LayerNorm 'ln0': axis must be the last axis"):
        gd.nn.LayerNorm(axis=1, name="ln0")(np.ones((2, 3, 4)))
    ln = gd.nn.LayerNorm(name="ln1")
    ln(np.ones((2, 4)))
    with pytest.raises(gd.ShapeError, match=r"LayerNorm 'ln1': was built for inputs of shape "
                                            r"\(2, 4\)"):
        ln(np.ones((2, 5)))


# ---------------------------------------------------------------- MultiHeadAttention


def test_self_attention_matches_numpy_with_keras_shapes_and_names():
    x = _data((2, 5, 8))
    mha = gd.nn.MultiHeadAttention(num_heads=2, key_dim=3)
    y = mha(x)
    assert y.shape == (2, 5, 8) and y.dtype == np.float64
    n = mha.name
    assert [(v.name, v.shape) for v in mha.variables] == [
        (f"{n}/query/kernel", (8, 2, 3)), (f"{n}/query/bias", (2, 3)),
        (f"{n}/key/kernel", (8, 2, 3)), (f"{n}/key/bias", (2, 3)),
        (f"{n}/value/kernel", (8, 2, 3)), (f"{n}/value/bias", (2, 3)),
        (f"{n}/attention_output/kernel", (2, 3, 8)), (f"{n}/attention_output/bias", (8,))]
    assert mha.trainable_variables == mha.variables
    _randomize(mha)
    np.testing.assert_allclose(mha(x), np_attention(mha, x, x, x), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gd.function(lambda x: mha(x))(x), np_attention(mha, x, x, x),
                               rtol=1e-10, atol=1e-12)


def test_cross_attention_with_a_mask_value_dim_and_output_shape():
    rng = np.random.default_rng(2)
    query, key, value = _data((3, 4, 6), 1), _data((3, 7, 5), 2), _data((3, 7, 5), 3)
    mask = rng.random((3, 4, 7)) > 0.5
    mask[0, 2] = False                         # a query that may attend to nothing
    mha = gd.nn.MultiHeadAttention(3, key_dim=2, value_dim=4, output_shape=9, use_bias=False)
    y = mha(query, value, key, attention_mask=mask)
    assert y.shape == (3, 4, 9) and mha.output_dense.kernel.shape == (3, 4, 9)
    assert len(mha.variables) == 4                                  # no biases
    _randomize(mha)
    want = np_attention(mha, query, value, key, mask)
    np.testing.assert_allclose(mha(query, value, key, attention_mask=mask), want, rtol=1e-10,
                               atol=1e-12)
    assert np.all(want[0, 2] == 0)             # nothing attended, no bias: zeros, not NaN
    # a 0/1 integer mask means the same as the bool one (Keras accepts both)
    np.testing.assert_allclose(mha(query, value, key, attention_mask=mask.astype(np.int32)),
                               want, rtol=1e-10, atol=1e-12)


def test_causal_mask_makes_position_t_independent_of_later_inputs():
    x = _data((2, 6, 8))
    mha = gd.nn.MultiHeadAttention(2, key_dim=4)
    mha(x)
    _randomize(mha)
    causal = np.broadcast_to(np.tril(np.ones((6, 6), bool)), (2, 6, 6))
    y = mha(x, use_causal_mask=True)
    np.testing.assert_allclose(y, np_attention(mha, x, x, x, causal), rtol=1e-10, atol=1e-12)
    step = gd.function(lambda x: (mha(x, use_causal_mask=True), mha(x)))
    for t in range(5):
        later = x.copy()
        later[:, t + 1:] += 10.0 * _data((2, 5 - t, 8), t)
        causal_y, full_y = step(later)
        np.testing.assert_allclose(causal_y[:, :t + 1], y[:, :t + 1], rtol=1e-12, atol=1e-12)
        assert not np.allclose(causal_y[:, t + 1:], y[:, t + 1:])
        assert not np.allclose(full_y[:, :t + 1], mha(x)[:, :t + 1])   # without: it does
    # with an attention_mask too, and a query shorter than the keys (Keras's band_part)
    query, memory = _data((2, 3, 8), 4), _data((2, 5, 8), 5)
    pad = np.ones((2, 3, 5), bool)
    pad[1, :, 0] = False
    band = np.tril(np.ones((3, 5), bool))
    np.testing.assert_allclose(
        mha(query, memory, attention_mask=pad, use_causal_mask=True),
        np_attention(mha, query, memory, memory, pad & band), rtol=1e-10, atol=1e-12)


def test_dropout_drops_attention_probabilities_in_training_only():
    x = _data((4, 5, 8), dtype=np.float32)
    mha = gd.nn.MultiHeadAttention(2, key_dim=4, dropout=0.5, seed=3)
    inference = mha(x)
    np.testing.assert_allclose(inference, np_attention(mha, x, x, x), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(mha(x, training=False), inference)
    train = gd.function(lambda x: mha(x, training=True))
    first, second = train(x), train(x)
    assert np.all(np.isfinite(first)) and not np.allclose(first, inference, atol=1e-3)
    assert not np.array_equal(first, second)                 # the generator advanced
    assert mha.dropout_layer.generator is not None


def test_gradients_reach_every_weight_and_match_finite_differences():
    x = _data((2, 4, 6))
    mha = gd.nn.MultiHeadAttention(2, key_dim=3)
    ln = gd.nn.LayerNorm()
    mha(ln(x))
    _randomize(mha)

    @gd.function
    def grads(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.nn.gelu(mha(ln(x), use_causal_mask=True)) ** 2)
        return tape.gradient(loss, mha.trainable_variables + ln.trainable_variables)

    assert all(g is not None and np.any(g != 0) for g in grads(x))
    fd_check(lambda q, k: mha(ln(q), k, use_causal_mask=True), (x, _data((2, 4, 6), 7)),
             (0, 1))


# ---------------------------------------------------------------- under a strategy


class TinyTransformer(gd.nn.Layer):
    """A pre-norm block and a classifier over the mean position."""

    def __init__(self, dropout=0.0, name=None):
        super().__init__(name)
        self.ln1, self.ln2 = gd.nn.LayerNorm(), gd.nn.LayerNorm()
        self.mha = gd.nn.MultiHeadAttention(2, key_dim=4, dropout=dropout, seed=5)
        self.head = gd.nn.Dense(3)

    def call(self, x, training=False):
        h = x + self.mha(self.ln1(x), use_causal_mask=True, training=training)
        return self.head(gd.reduce_mean(gd.nn.gelu(self.ln2(h)), axis=1))


def _train(strategy, model, opt):
    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                logits = model(x, training=True)       # the local mean: gradients are
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
            variables = model.trainable_variables      # averaged over the replicas
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce("mean", strategy.run(replica_fn, args=batch), axis=None)

    return step


def _one_batch(strategy, *arrays):
    return next(iter(strategy.experimental_distribute_dataset([arrays])))


def test_variables_are_made_mid_trace_mirrored_on_every_replica():
    strategy = gd.MirroredStrategy(DEV2)
    model = TinyTransformer()
    with strategy.scope():
        opt = gd.optimizers.SGD(0.1)
    step = _train(strategy, model, opt)
    x, y = _data((8, 5, 8), dtype=np.float32), np.arange(8) % 3
    step(_one_batch(strategy, x, y))                       # built inside the trace
    assert len(model.variables) == 14          # 2 LayerNorms, attention, head
    for v in model.variables:
        assert len(v.values) == 2
        np.testing.assert_array_equal(v.values[0], v.values[1])
    step(_one_batch(strategy, x + 1, y))
    assert step.trace_count == 1


def test_transformer_block_on_2_replicas_equals_one_device():
    # in float64 (float64 weights), so the two may differ by summation order only
    x, y = _data((8, 5, 8), 1), np.arange(8) % 3
    runs = []
    for strategy in (gd.MirroredStrategy(DEV2), gd.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            model = TinyTransformer()
            model(x[:1])                           # build eagerly, to give both one set of weights
            opt = gd.optimizers.Adam(0.01)
        for v, w in zip(model.variables, runs[0][1].variables if runs else []):
            v.assign(w.numpy())
        runs.append((strategy, model, _train(strategy, model, opt)))
    losses = [[float(step(_one_batch(s, x, y))) for _ in range(4)] for s, _, step in runs]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-10)
    assert losses[0][-1] < losses[0][0] - 0.05
    (_, two, _), (_, one, _) = runs
    for v2, v1 in zip(two.variables, one.variables):
        assert len(v2.values) == 2 and v2.dtype == np.float64
        np.testing.assert_allclose(v2.numpy(), v1.numpy(), rtol=1e-8, atol=1e-10)
        np.testing.assert_array_equal(v2.values[0], v2.values[1])


def test_checkpoint_restores_into_a_fresh_model(tmp_path):
    x = _data((2, 5, 8), dtype=np.float32)
    model = TinyTransformer()
    with pytest.raises(gd.CheckpointError, match="has no variables yet"):
        gd.Checkpoint(model=model).save(tmp_path / "unbuilt.npz")
    model(x)
    _randomize(model)
    path = gd.Checkpoint(model=model).save(tmp_path / "block.npz")
    with np.load(path) as f:
        assert {"model/mha/query_dense/kernel", "model/mha/output_dense/bias",
                "model/ln1/gamma"} <= set(f.files)
    other = TinyTransformer()
    other(x)
    assert not np.allclose(other(x), model(x))
    gd.Checkpoint(model=other).restore(path)
    np.testing.assert_array_equal(other(x), model(x))


def test_attention_errors_name_the_layer_and_shapes():
    mha = gd.nn.MultiHeadAttention(2, key_dim=4, name="att")
    with pytest.raises(gd.ShapeError, match=r"MultiHeadAttention 'att': expected a rank-3 "
                                            r"query .* got shape \(4, 8\)"):
        mha(np.ones((4, 8)))
    with pytest.raises(gd.ShapeError, match=r"'att': .*key \(2, 3, 8\).*value \(2, 4, 8\)"
                       r"|'att': .*value \(2, 4, 8\).*key \(2, 3, 8\)"):
        mha(np.ones((2, 5, 8)), np.ones((2, 4, 8)), np.ones((2, 3, 8)))
    mha(np.ones((2, 5, 8)))
    with pytest.raises(gd.ShapeError, match=r"att/query'?: was built for inputs"):
        mha(np.ones((2, 5, 6)))
    with pytest.raises(ValueError, match="rate must be in"):
        gd.nn.MultiHeadAttention(2, 4, dropout=1.5)
