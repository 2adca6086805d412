"""gd.metrics against numpy: every metric eagerly, inside strategy.run (compiled and not), in
cross-replica traced code, and its result read as the global value; AUC against an exact
ROC AUC (pairs counted by sorting) within the bound of its thresholds."""

import numpy as np
import pytest

import graphdist as gd

rng = np.random.default_rng(7)
N = 23                                        # uneven on 2 and 4 replicas
LABELS = rng.integers(0, 4, N)
PROBS = rng.dirichlet(np.ones(4), N).astype(np.float32)
BINARY = rng.integers(0, 2, (N, 1)).astype(np.float32)
SCORES = rng.random((N, 1)).astype(np.float32)
TARGET = rng.normal(size=(N, 3)).astype(np.float32)
PRED = rng.normal(size=(N, 3)).astype(np.float32)


def _precision(y, s):
    p = s > 0.5
    return np.sum(p & (y == 1)) / np.sum(p)


def _recall(y, s):
    p = s > 0.5
    return np.sum(p & (y == 1)) / np.sum(y == 1)


# (metric factory, (y_true, y_pred), numpy reference)
CASES = {
    "sparse_categorical_accuracy": (gd.metrics.SparseCategoricalAccuracy, (LABELS, PROBS),
                                    np.mean(np.argmax(PROBS, -1) == LABELS)),
    "categorical_accuracy": (gd.metrics.CategoricalAccuracy,
                             (np.eye(4, dtype=np.float32)[LABELS], PROBS),
                             np.mean(np.argmax(PROBS, -1) == LABELS)),
    "binary_accuracy": (gd.metrics.BinaryAccuracy, (BINARY, SCORES),
                        np.mean((SCORES > 0.5) == (BINARY == 1))),
    "mean_squared_error": (gd.metrics.MeanSquaredError, (TARGET, PRED),
                           np.mean(np.mean((TARGET - PRED) ** 2, axis=-1))),
    "precision": (gd.metrics.Precision, (BINARY, SCORES), _precision(BINARY, SCORES)),
    "recall": (gd.metrics.Recall, (BINARY, SCORES), _recall(BINARY, SCORES)),
}


def _strategy(n):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_update_matches_numpy_and_reset_zeroes(name):
    make, args, expected = CASES[name]
    metric = make()
    metric.update_state(*(a[:10] for a in args))
    metric.update_state(*(a[10:] for a in args))
    np.testing.assert_allclose(metric.result(), expected, rtol=1e-6)
    metric.reset_state()
    assert metric.result() == 0


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_update_in_replicas_reads_the_global_value(name, compiled, n):
    make, args, expected = CASES[name]
    strategy = _strategy(n)
    with strategy.scope():
        metric = make()
    batch = next(iter(strategy.experimental_distribute_dataset([args])))

    def run(b):
        strategy.run(metric.update_state, args=b)

    (gd.function(run) if compiled else run)(batch)
    np.testing.assert_allclose(metric.result(), expected, rtol=1e-6)
    # each replica holds only its shard's counts: no replica stands for the others
    first = [v.values[0] for v in metric.variables]
    assert any(not np.array_equal(f, v.numpy()) for f, v in zip(first, metric.variables))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cross_replica_updates_eager_and_traced(name):
    """TF's SyncOnReadVariable refuses assign_add in cross-replica context; here it adds
    to the global total."""
    make, args, expected = CASES[name]
    strategy = _strategy(3)
    with strategy.scope():
        metric = make()
        metric.update_state(*(a[:10] for a in args))                   # eagerly

        @gd.function
        def update(*b):
            metric.update_state(*b)                                     # traced

        update(*(a[10:] for a in args))
    np.testing.assert_allclose(metric.result(), expected, rtol=1e-6)


def test_mean_and_sum_with_sample_weight():
    values = rng.normal(size=12).astype(np.float32)
    weights = rng.random(12).astype(np.float32)
    mean, total = gd.metrics.Mean(), gd.metrics.Sum()
    mean.update_state(values, sample_weight=weights)
    total.update_state(values, sample_weight=weights)
    np.testing.assert_allclose(mean.result(), np.sum(values * weights) / np.sum(weights),
                               rtol=1e-5)
    np.testing.assert_allclose(total.result(), np.sum(values * weights), rtol=1e-5)


def test_mean_of_nothing_reads_zero():
    assert gd.metrics.Mean().result() == 0.0


def test_result_in_traced_cross_replica_code_is_global():
    strategy = _strategy(2)
    with strategy.scope():
        mean = gd.metrics.Mean()
    batch = next(iter(strategy.experimental_distribute_dataset([np.arange(5, dtype=np.float32)])))

    @gd.function
    def step(b):
        strategy.run(mean.update_state, args=(b,))
        return mean.result()

    assert float(step(batch)) == pytest.approx(2.0)


def _exact_auc(labels, scores) -> float:
    """P(score of a positive > score of a negative) + half the ties, from ranks."""
    labels, scores = labels.ravel(), scores.ravel().astype(np.float64)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):                       # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos, neg = np.sum(labels == 1), np.sum(labels == 0)
    return (np.sum(ranks[labels == 1]) - pos * (pos + 1) / 2) / (pos * neg)


def _shared_bucket_share(labels, scores, num_thresholds) -> float:
    """The share of (positive, negative) pairs whose scores fall between the same two of
    the metric's thresholds: the bound on how far the thresholded AUC may be off (x 1/2)."""
    labels, scores = labels.ravel(), scores.ravel()
    inner = np.array([i / (num_thresholds - 1) for i in range(1, num_thresholds - 1)],
                     np.float32)
    bucket = np.searchsorted(inner, scores, side="left")     # score > t  <=>  bucket past t
    pos, neg = bucket[labels == 1], bucket[labels == 0]
    return np.mean(pos[:, None] == neg[None, :])


@pytest.mark.parametrize("num_thresholds", [200, 50])
@pytest.mark.parametrize("n", [1, 3])
def test_auc_against_the_exact_roc_auc(num_thresholds, n):
    labels = rng.integers(0, 2, 600)
    scores = np.clip(rng.normal(0.5 + 0.15 * labels, 0.2), 0, 1).astype(np.float32)
    strategy = _strategy(n)
    with strategy.scope():
        auc = gd.metrics.AUC(num_thresholds=num_thresholds)
    for part in np.array_split(np.arange(600), 4):
        batch = next(iter(strategy.experimental_distribute_dataset(
            [(labels[part], scores[part])])))
        strategy.run(auc.update_state, args=batch)
    exact = _exact_auc(labels, scores)
    bound = 0.5 * _shared_bucket_share(labels, scores, num_thresholds)
    assert 0 < bound < 0.02
    assert abs(float(auc.result()) - exact) <= bound + 1e-6


def test_auc_of_well_separated_scores_is_exact():
    labels = np.array([0, 0, 1, 1, 0, 1])
    scores = np.array([0.1, 0.3, 0.7, 0.9, 0.2, 0.6], np.float32)
    assert float(gd.metrics.AUC()(labels, scores)) == pytest.approx(1.0)
    assert float(gd.metrics.AUC()(1 - labels, scores)) == pytest.approx(0.0)


def test_metric_state_is_sync_on_read_sum():
    for variable in gd.metrics.AUC().variables + gd.metrics.Mean().variables:
        assert variable.synchronization is gd.VariableSynchronization.ON_READ
        assert variable.aggregation is gd.VariableAggregation.SUM
        assert not variable.trainable


def test_compile_names():
    assert isinstance(gd.metrics.get("accuracy", "sparse_categorical_crossentropy"),
                      gd.metrics.SparseCategoricalAccuracy)
    assert isinstance(gd.metrics.get("acc", "binary_crossentropy"), gd.metrics.BinaryAccuracy)
    with pytest.raises(ValueError, match="say which accuracy"):
        gd.metrics.get("accuracy", "mse")
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        gd.metrics.get("f1")


def test_auc_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="curve='ROC'"):
        gd.metrics.AUC(curve="PR")
