"""gd.clip_by_global_norm against TF's documented formula, eagerly and traced; and the
pattern it enables on 4 replicas: all-reduce the gradients once, clip the reduced ones, apply
them with all_reduce=False, which must equal one device on the global batch with exactly one
gradient all-reduce in the replicated graph (and likewise the optimizer's global_clipnorm)."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd


def clip_ref(ts, clip_norm, use_norm=None):
    """TF: t * clip_norm / max(global_norm, clip_norm), global_norm = sqrt(sum ||t||^2)."""
    norm = np.sqrt(sum(np.sum(np.square(t, dtype=np.float64)) for t in ts if t is not None)) \
        if use_norm is None else use_norm
    return [None if t is None else t * clip_norm / max(norm, clip_norm) for t in ts], norm


def _tensors(rng, dtype=np.float64):
    return [rng.normal(size=(3, 4)).astype(dtype), None, rng.normal(size=(5,)).astype(dtype)]


@pytest.mark.parametrize("clip_norm", [0.5, 2.0, 1e3])
@pytest.mark.parametrize("traced", [False, True])
def test_matches_the_formula_and_passes_none_through(clip_norm, traced):
    ts = _tensors(np.random.default_rng(0))
    fn = (gd.function(lambda ts: gd.clip_by_global_norm(ts, clip_norm)) if traced
          else lambda ts: gd.clip_by_global_norm(ts, clip_norm))
    clipped, norm = fn(ts)
    want, want_norm = clip_ref(ts, clip_norm)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-12)
    assert clipped[1] is None and len(clipped) == 3
    for got, expected in zip(clipped[::2], want[::2]):
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    if clip_norm > want_norm:        # unclipped: the very same values (scale exactly 1)
        for got, t in zip(clipped[::2], ts[::2]):
            np.testing.assert_array_equal(got, t)
    else:
        total = np.sqrt(sum(np.sum(np.square(c)) for c in clipped[::2]))
        np.testing.assert_allclose(total, clip_norm, rtol=1e-12)


def test_use_norm_a_tensor_clip_norm_and_dtypes():
    rng = np.random.default_rng(1)
    ts = [rng.normal(size=4).astype(np.float32), rng.normal(size=(2, 2))]   # f32 and f64
    clipped, norm = gd.clip_by_global_norm(ts, 0.5, use_norm=np.float64(10.0))
    assert float(norm) == 10.0
    assert [c.dtype for c in clipped] == [np.float32, np.float64]
    np.testing.assert_allclose(clipped[1], ts[1] * 0.05, rtol=1e-12)
    np.testing.assert_allclose(clipped[0], ts[0] * np.float32(0.05), rtol=1e-6)

    @gd.function
    def traced(ts, limit):
        return gd.clip_by_global_norm(ts, limit)

    got, norm = traced(ts, np.float64(1.0))        # the limit as a tensor
    want, want_norm = clip_ref([t.astype(np.float64) for t in ts], 1.0)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_non_finite_norm_gives_nan_as_tf():
    with np.errstate(invalid="ignore"):                    # inf - inf, on purpose
        clipped, norm = gd.clip_by_global_norm([np.array([np.inf, 1.0]), np.array([2.0])], 1.0)
    assert np.isinf(norm) and all(np.isnan(c).all() for c in clipped)


def test_sparse_entries_are_clipped_through_their_rows_with_repeats_summed():
    # rows 0 and 2, row 0 twice: the dense value is [[3+1], [0], [2], [0]], norm sqrt(20+16)
    s = gd.IndexedSlices(np.array([0, 2, 0]), np.array([[3.0], [2.0], [1.0]]), (4, 1))
    (clipped, dense), norm = gd.clip_by_global_norm([s, np.array([4.0])], 1.0)
    want_norm = np.sqrt(16.0 + 4.0 + 16.0)          # TF's sum of the rows' squares: sqrt(30)
    assert float(norm) == pytest.approx(want_norm, rel=1e-12)
    assert isinstance(clipped, gd.IndexedSlices) and clipped.dense_shape == (4, 1)
    np.testing.assert_allclose(np.asarray(clipped), [[4 / want_norm], [0], [2 / want_norm],
                                                     [0]], rtol=1e-12)
    np.testing.assert_allclose(dense, [4 / want_norm], rtol=1e-12)


def test_bad_arguments():
    with pytest.raises(TypeError, match="sequence"):
        gd.clip_by_global_norm(np.ones(3), 1.0)
    with pytest.raises(ValueError, match="positive"):
        gd.clip_by_global_norm([np.ones(3)], 0.0)
    with pytest.raises(ValueError, match="None"):
        gd.clip_by_global_norm([None], 1.0)


# ---------------------------------------------------------------- on 4 replicas

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
CLIP = 0.3


def _problem():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 5))
    y = rng.normal(size=(16, 3))
    return x, y, rng.normal(size=(5, 3)), rng.normal(size=(3,))


def _loss(x, y, w, b):
    return gd.reduce_mean(gd.square(x @ w + b - y))


def _one_device_reference(steps: int) -> list:
    """Plain SGD with momentum on the whole batch, gradients clipped by the formula."""
    x, y, w0, b0 = _problem()
    w, b = w0.copy(), b0.copy()
    mw, mb = np.zeros_like(w), np.zeros_like(b)
    for _ in range(steps):
        r = x @ w + b - y
        gw, gb = 2 * x.T @ r / r.size, 2 * r.sum(axis=0) / r.size
        (gw, gb), _ = clip_ref([gw, gb], CLIP)
        mw, mb = 0.9 * mw + gw, 0.9 * mb + gb
        w, b = w - 0.1 * mw, b - 0.1 * mb
    return [w, b]


def _gradient_all_reduces(step) -> tuple[int, int]:
    logical = sum(e.op.name == "all_reduce" for e in step.graph.eqns)
    placed = sum(bool(e.op.collective) for e in step.replicated_graph.eqns)
    return logical, placed


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("where", ["by_hand", "global_clipnorm"])
def test_clipped_reduced_gradients_on_4_replicas_equal_one_device(where, fused):
    gd.config.set_fused_kernels(fused)
    try:
        strategy = gd.MirroredStrategy(DEVICES)
        x, y, w0, b0 = _problem()
        with strategy.scope():
            w, b = gd.Variable(w0), gd.Variable(b0)
            opt = gd.optimizers.SGD(0.1, momentum=0.9,
                                    global_clipnorm=CLIP if where == "global_clipnorm" else None)

        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = _loss(x, y, w, b)
            gw, gb = tape.gradient(loss, [w, b])
            if where == "global_clipnorm":
                opt.apply_gradients([(gw, w), (gb, b)])
                return
            # a list all-reduces as one packed buffer (TF's batch all-reduce)
            gw, gb = gd.get_replica_context().all_reduce("mean", [gw, gb])
            (gw, gb), _ = gd.clip_by_global_norm([gw, gb], CLIP)
            opt.apply_gradients([(gw, w), (gb, b)], all_reduce=False)

        step = gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
        batches = strategy.experimental_distribute_dataset([(x, y)] * 3)
        for batch in batches:
            step(*batch)
        for var, expected in zip((w, b), _one_device_reference(3)):
            for component in var.values:
                np.testing.assert_allclose(component, expected, rtol=1e-10, atol=1e-12)
        assert _gradient_all_reduces(step) == (1, 1)
        assert "collectives: 1 (" in step.replicated_graph.summary()   # "1 (n nodes),"
        assert step.trace_count == 1
    finally:
        gd.config.set_fused_kernels(True)


def test_the_clipping_really_bites_in_that_problem():
    """Guards the test above: the unclipped and the per-replica-clipped updates differ."""
    x, y, w0, b0 = _problem()
    r = x @ w0 + b0 - y
    grads = [2 * x.T @ r / r.size, 2 * r.sum(axis=0) / r.size]
    assert clip_ref(grads, CLIP)[1] > 2 * CLIP
    shards = np.split(np.arange(16), 4)
    per_replica = []
    for rows in shards:
        rr = x[rows] @ w0 + b0 - y[rows]
        g = clip_ref([2 * x[rows].T @ rr / rr.size, 2 * rr.sum(axis=0) / rr.size], CLIP)[0]
        per_replica.append(g[1])
    assert not np.allclose(np.mean(per_replica, axis=0), clip_ref(grads, CLIP)[0][1])
