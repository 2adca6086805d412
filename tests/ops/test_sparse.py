"""gather, embedding lookups and their sparse gradients (gd.IndexedSlices): forward against
numpy, gradients against one-hot matmuls and finite differences, the sparse all-gather
across replicas against dense training and one device, and the bytes it moves."""

import numpy as np
import pytest

import graphdist as gd
from graphdist.distribute.sparse import dense_bytes, gathered_bytes
from graphdist.viz.summary import stats

F64 = np.float64


def devices(n):
    return [f"cpu:{i}" for i in range(n)]


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("shape,indices,axis", [
    ((5, 3), [4, 0, 4], 0), ((5, 3), [[1, 2], [0, 0]], 0), ((2, 5, 3), [4, 1], 1),
    ((2, 5, 3), [[2], [0]], -1), ((6,), [5, 5, 0], 0)])
def test_gather_matches_numpy_take_eagerly_and_traced(shape, indices, axis):
    rng = np.random.default_rng(0)
    params = rng.standard_normal(shape).astype(np.float32)
    indices = np.asarray(indices, np.int32)
    want = np.take(params, indices, axis=axis)
    np.testing.assert_array_equal(gd.gather(params, indices, axis=axis), want)
    traced = gd.function(lambda p, i: gd.gather(p, i, axis=axis))
    np.testing.assert_array_equal(traced(params, indices), want)


def test_out_of_range_indices_raise_eagerly_and_when_the_step_runs():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match=r"gather: index 4 .* out of range for 4 rows"):
        gd.gather(table, np.array([0, 4]))
    with pytest.raises(IndexError, match=r"index -1"):
        gd.gather(table, np.array([-1]))      # numpy would wrap it to the last row
    step = gd.function(lambda i: gd.gather(table, i))
    step(np.array([3, 0]))
    with pytest.raises(IndexError, match="out of range"):
        step(np.array([7, 0]))


def test_bad_gather_arguments_name_the_op():
    with pytest.raises(TypeError, match="gather: indices must be integers"):
        gd.gather(np.zeros((3, 2)), np.array([0.0]))
    with pytest.raises(gd.ShapeError, match="gather: params must have rank >= 1"):
        gd.gather(np.float32(1.0), np.array([0]))
    with pytest.raises(TypeError, match="Embedding .*ids must be integers"):
        gd.nn.Embedding(10, 2)(np.zeros((2,), np.float32))


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_gradient_matches_finite_differences(axis):
    rng = np.random.default_rng(1)
    params = rng.standard_normal((4, 5))
    indices = np.array([[3, 1, 3], [0, 3, 1]])
    ct = rng.standard_normal(np.shape(np.take(params, indices, axis=axis)))
    _, grad = gd.value_and_grad(lambda p: gd.reduce_sum(gd.gather(p, indices, axis) * ct))(
        params)
    t = rng.standard_normal(params.shape)
    eps = 1e-6
    f = lambda p: float(np.vdot(np.take(p, indices, axis=axis), ct))  # noqa: E731
    fd = (f(params + eps * t) - f(params - eps * t)) / (2 * eps)
    assert isinstance(grad, np.ndarray)          # dense for a tensor argument
    assert abs(float(np.vdot(t, grad)) - fd) < 1e-6 * max(1.0, abs(fd))


def test_variable_gradient_is_indexed_slices_equal_to_the_dense_gradient():
    rng = np.random.default_rng(2)
    table = gd.Variable(rng.standard_normal((6, 3)).astype(np.float32))
    ids = np.array([[5, 1], [5, 5]])
    weights = rng.standard_normal((2, 2, 3)).astype(np.float32)

    @gd.function
    def grads(ids):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.nn.embedding_lookup(table, ids) * weights)
        return tape.gradient(loss, table)

    g = grads(ids)
    assert isinstance(g, gd.IndexedSlices) and g.dense_shape == (6, 3)
    np.testing.assert_array_equal(g.indices, ids.reshape(-1))
    want = np.zeros((6, 3), np.float32)
    np.add.at(want, ids.reshape(-1), weights.reshape(-1, 3))     # the one-hot matmul's grad
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


def test_a_table_used_densely_too_gets_a_dense_gradient():
    # tied embeddings: the table is looked up and also multiplies the outputs
    rng = np.random.default_rng(3)
    t0 = rng.standard_normal((5, 3))
    table = gd.Variable(t0)
    ids = np.array([0, 4, 4])

    @gd.function
    def grads(ids):
        with gd.GradientTape() as tape:
            h = gd.nn.embedding_lookup(table, ids)
            loss = gd.reduce_sum(gd.square(gd.matmul(h, gd.transpose(table))))
        return tape.gradient(loss, table)

    g = grads(ids)
    assert isinstance(g, np.ndarray)
    eps, t = 1e-6, rng.standard_normal(t0.shape)
    f = lambda w: float(np.sum((w[ids] @ w.T) ** 2))  # noqa: E731
    fd = (f(t0 + eps * t) - f(t0 - eps * t)) / (2 * eps)
    assert abs(float(np.vdot(t, g)) - fd) < 1e-6 * max(1.0, abs(fd))


def test_sum_duplicates_merges_rows_and_pads_with_zero_rows():
    indices = np.array([7, 2, 7, 7, 0])
    rows = np.arange(10.0).reshape(5, 2)
    s = gd.function(lambda i, r: gd.IndexedSlices(*gd.ops.sparse.sum_duplicates(
        gd.IndexedSlices(i, r, (8, 2))).tree_children(), (8, 2)))(indices, rows)
    np.testing.assert_array_equal(s.indices, [7, 2, 0, 0, 0])      # first occurrences
    np.testing.assert_array_equal(s.values, [[0 + 4 + 6, 1 + 5 + 7], [2, 3], [8, 9], [0, 0],
                                             [0, 0]])
    dense = np.zeros((8, 2))
    np.add.at(dense, indices, rows)
    np.testing.assert_array_equal(np.asarray(s), dense)


# ---------------------------------------------------------------- across replicas

V, D = 4000, 8


def _train(n, lookup, make_opt, ids, targets, steps=3):
    """`steps` steps of an embedding regression on n replicas; returns the table and step."""
    strategy = gd.MirroredStrategy(devices(n))
    rng = np.random.default_rng(4)
    with strategy.scope():
        table = gd.Variable(rng.standard_normal((V, D)).astype(np.float32))
        opt = make_opt()

    def replica_fn(ids, targets):
        with gd.GradientTape() as tape:
            e = lookup(table, ids)
            loss = gd.reduce_mean(gd.reduce_sum(gd.square(e - targets), axis=-1))
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return loss

    step = gd.function(lambda i, t: strategy.run(replica_fn, args=(i, t)))
    split = (lambda a: strategy.experimental_distribute_values_from_function(
        lambda c: a[c.replica_id_in_sync_group::n])) if n > 1 else (lambda a: a)
    for _ in range(steps):
        step(split(ids), split(targets))
    return table.numpy(), step


def _sparse(table, ids):
    return gd.nn.embedding_lookup(table, ids)


def _one_hot(table, ids):
    return gd.matmul(gd.one_hot(ids, V), table)


OPTIMIZERS = {"sgd": lambda: gd.optimizers.SGD(0.5),
              "momentum": lambda: gd.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: gd.optimizers.Adam(0.01)}


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, size=(16,)).astype(np.int64)
    ids[[4, 9]] = ids[0]           # duplicates across replicas (strided shards: 0, 1, 1)
    ids[8] = ids[0]                # and within replica 0's shard
    return ids, rng.standard_normal((16, D)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_training_on_4_replicas_equals_dense_and_one_device(name, batch):
    ids, targets = batch
    one, _ = _train(1, _sparse, OPTIMIZERS[name], ids, targets)
    sparse, step = _train(4, _sparse, OPTIMIZERS[name], ids, targets)
    dense, _ = _train(4, _one_hot, OPTIMIZERS[name], ids, targets)
    np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sparse, one, rtol=1e-5, atol=1e-6)
    ops = {e.op.name for e in step.replicated_graph.eqns}
    assert "host_all_gather" in ops and "sum_duplicates" in ops
    # plain SGD scatters the rows; with slots the update is dense (every row decays)
    assert ("sparse_sgd_update" in ops) == (name == "sgd")
    assert ("scatter_rows" in ops) == (name != "sgd")


def _one_device_step(dense, opt, table):
    def step(ids, targets):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.reduce_sum(gd.square(_sparse(table, ids) - targets), -1))
        grad = tape.gradient(loss, table)
        opt.apply_gradients([(gd.ops.sparse.densify(grad) if dense else grad, table)])
    return gd.function(step)


@pytest.mark.parametrize("fused", [True, False])
def test_sparse_sgd_is_bit_identical_to_the_dense_update_and_weight_decay_applies(fused,
                                                                                  batch):
    ids, targets = batch
    rng = np.random.default_rng(7)
    init = rng.standard_normal((V, D)).astype(np.float32)
    results = []
    gd.config.set_fused_kernels(fused)
    try:
        for dense in (False, True):
            table, opt = gd.Variable(init.copy()), gd.optimizers.SGD(0.5)
            step = _one_device_step(dense, opt, table)
            step(ids, targets)
            opt.weight_decay = 0.01           # every row decays from now on: no retrace
            step(ids, targets)
            assert step.trace_count == 1
            results.append(table.numpy())
    finally:
        gd.config.set_fused_kernels(True)
    # the first step: sum_duplicates' sums are the dense gradient's; the second step's
    # weight decay makes the sparse update dense, with the same float operations
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0][1], init[1])      # decay reached an unlooked-up row


def test_the_sparse_collective_moves_fewer_bytes_than_the_dense_one(batch):
    ids, targets = batch
    _, sparse = _train(4, _sparse, OPTIMIZERS["sgd"], ids, targets, steps=1)
    _, dense = _train(4, _one_hot, OPTIMIZERS["sgd"], ids, targets, steps=1)
    moved_sparse = stats(sparse.replicated_graph)["moved"]
    moved_dense = stats(dense.replicated_graph)["moved"]
    assert 0 < 20 * moved_sparse < moved_dense, (moved_sparse, moved_dense)


def test_a_small_table_is_densified_when_that_moves_fewer_bytes():
    # 4 replicas x 64 lookups x (4 x 4 + 8) B gathered > the 16 x 4 x 4 B table
    strategy = gd.MirroredStrategy(devices(4))
    with strategy.scope():
        table = gd.Variable(np.ones((16, 4), np.float32))
        opt = gd.optimizers.SGD(0.1)
    ids = np.arange(256) % 16

    def replica_fn(ids):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.nn.embedding_lookup(table, ids))
        g = tape.gradient(loss, table)
        assert gathered_bytes(g, 4) > dense_bytes(g)
        opt.apply_gradients([(g, table)])

    step = gd.function(lambda i: strategy.run(replica_fn, args=(i,)))
    step(strategy.experimental_distribute_values_from_function(
        lambda c: ids[c.replica_id_in_sync_group::4]))
    ops = {e.op.name for e in step.replicated_graph.eqns}
    assert "host_all_reduce" in ops and "host_all_gather" not in ops
    # every lookup adds 1 to its row's gradient: 16 per row, summed over 4 replicas / 4
    np.testing.assert_allclose(table.numpy(), 1 - 0.1 * 4.0, rtol=1e-6)


def test_uneven_shards_pad_the_gathered_rows(batch):
    ids, targets = batch
    ids, targets = ids[:10], targets[:10]      # 3, 3, 2, 2 rows on 4 replicas
    strategy = gd.MirroredStrategy(devices(4))
    results = []
    for n, dist in ((1, None), (4, strategy)):
        with (dist.scope() if dist else gd.OneDeviceStrategy("cpu:0").scope()):
            table = gd.Variable(np.zeros((V, D), np.float32))
            opt = gd.optimizers.SGD(1.0, gradient_reduction="sum")

        def replica_fn(i, t, table=table, opt=opt):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(gd.square(gd.nn.embedding_lookup(table, i) - t)) / 10.0
            opt.apply_gradients([(tape.gradient(loss, table), table)])

        if dist is None:
            gd.function(replica_fn)(ids, targets)
        else:
            dist_ids, dist_t = (dist.experimental_distribute_dataset([(ids, targets)])
                                .__iter__().__next__())
            gd.function(lambda i, t: dist.run(replica_fn, args=(i, t)))(dist_ids, dist_t)
        results.append(table.numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6, atol=1e-7)
    assert np.abs(results[0]).sum() > 0


def test_an_indexed_slices_returned_from_a_function_keeps_its_dense_shape():
    table = gd.Variable(np.ones((9, 2), np.float32))

    @gd.function
    def grad(ids):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.gather(table, ids))
        return {"g": tape.gradient(loss, table)}

    g = grad(np.array([8, 1]))["g"]
    assert isinstance(g, gd.IndexedSlices) and g.dense_shape == (9, 2)
    assert isinstance(g.values, np.ndarray)
    assert np.asarray(g).sum() == 4


def test_embedding_layer_looks_up_its_table_and_checkpoints(tmp_path):
    layer = gd.nn.Embedding(50, 4)
    ids = np.array([[3, 49], [0, 3]])
    out = layer(ids)
    table = layer.embeddings.numpy()
    np.testing.assert_array_equal(out, table[ids])
    assert np.abs(table).max() <= 0.05 and table.std() > 0.01     # Keras's uniform(+-0.05)
    path = gd.Checkpoint(model=layer).save(str(tmp_path / "ckpt"))
    other = gd.nn.Embedding(50, 4)
    other(ids)
    gd.Checkpoint(model=other).restore(path)
    np.testing.assert_array_equal(other.embeddings.numpy(), table)


# ---------------------------------------------------------------- host kernels


@pytest.mark.parametrize("dtype,index_dtype", [(np.float32, np.int64), (np.float64, np.int32)])
def test_row_kernels_match_the_numpy_reference_bit_for_bit(dtype, index_dtype):
    from graphdist.kernels.sparse import (add_scaled_rows_cpu, scatter_rows_cpu,
                                          sum_duplicates_cpu)
    from graphdist.ops.optim import _sparse_sgd_impl
    from graphdist.ops.sparse import _scatter_rows_impl, _sum_duplicates_impl

    rng = np.random.default_rng(6)
    indices = rng.integers(0, 300, 1000).astype(index_dtype)
    indices[::5] = indices[3]                               # many repeats of one row
    rows = rng.standard_normal((1000, 3, 4)).astype(dtype)
    out = np.full((300, 3, 4), np.nan, dtype)
    scatter_rows_cpu(out, indices, rows)
    np.testing.assert_array_equal(out, _scatter_rows_impl(np, indices, rows, shape=out.shape))
    for divisor in (1, 4):
        outs = (np.empty_like(indices), np.full_like(rows, np.nan))
        sum_duplicates_cpu(outs, indices, rows, divisor)
        want = _sum_duplicates_impl(np, indices, rows, divisor=divisor)
        np.testing.assert_array_equal(outs[0], want[0])
        np.testing.assert_array_equal(outs[1], want[1])
    p = rng.standard_normal((300, 3, 4)).astype(dtype)
    want = _sparse_sgd_impl(np, p, indices, rows, np.array([0.1, 0.0]))
    add_scaled_rows_cpu(p, indices, rows, -dtype(0.1))
    np.testing.assert_array_equal(p, want)
