"""Ports of TF's cross-device ops tests through the public API: a strategy built with each
cross_device_ops reduces and broadcasts per-replica values (strategy.reduce, a reduce of a
structure as TF's batch_reduce, ReplicaContext.all_reduce, merge_call results) to the
expected values on every replica (cross_device_ops_test.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN

CROSS_DEVICE_OPS = {
    "default": lambda: None,
    "ReductionToOneDevice": gd.ReductionToOneDevice,
    "ReductionToCPUDevice": lambda: gd.ReductionToOneDevice(reduce_to_device="cpu:0"),
    "RingAllReduce": gd.RingAllReduce,
    "HierarchicalCopy": lambda: gd.HierarchicalCopyAllReduce(num_groups=8),
}


def _strategy(cross_device_ops, n):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                               cross_device_ops=CROSS_DEVICE_OPS[cross_device_ops]())


def _per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: fn(ctx.replica_id_in_sync_group))



@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("cross_device_ops", list(CROSS_DEVICE_OPS))
def test_reduction_and_broadcast(cross_device_ops, n):
    # TF: cross_device_ops_test.py SingleWorkerCrossDeviceOpsTest.testReductionAndBroadcast
    # (_testReductionAndBroadcast): reduce, batch_reduce and broadcast
    strategy = _strategy(cross_device_ops, n)
    per_replica = _per_replica(strategy, lambda d: np.float32(d))
    per_replica_2 = _per_replica(strategy, lambda d: np.float32(d + 1.0))
    mean = (n - 1.0) / 2.0
    mean_2 = mean + 1.0

    @gd.function
    def reduce():
        return (strategy.reduce(MEAN, per_replica), strategy.reduce(MEAN, per_replica_2),
                strategy.reduce(SUM, per_replica), strategy.reduce(SUM, per_replica_2))

    np.testing.assert_allclose(reduce(), [mean, mean_2, mean * n, mean_2 * n], rtol=1e-6)

    @gd.function
    def batch_reduce():
        return (strategy.reduce(MEAN, (per_replica, per_replica_2)),
                strategy.reduce(SUM, [per_replica, per_replica_2]))

    means, sums = batch_reduce()
    np.testing.assert_allclose(means, [mean, mean_2], rtol=1e-6)
    np.testing.assert_allclose(sums, [mean * n, mean_2 * n], rtol=1e-6)

    @gd.function
    def broadcast():
        return strategy.run(
            lambda: gd.get_replica_context().merge_call(lambda _: np.float32(1.0)) * 1.0)

    np.testing.assert_allclose(_local(broadcast(), n), [1.0] * n)


@pytest.mark.parametrize("n, op, expect", [(1, SUM, 1.0), (1, MEAN, 1.0), (2, SUM, 3.0),
                                           (2, MEAN, 1.5), (4, SUM, 10.0), (4, MEAN, 2.5)])
@pytest.mark.parametrize("cross_device_ops", list(CROSS_DEVICE_OPS))
def test_all_reduce_dense(cross_device_ops, n, op, expect):
    # TF: cross_device_ops_test.py CollectiveOpsTest.testAllReduceDense (inputs 1, 2, 3, 4):
    # every replica gets the result
    strategy = _strategy(cross_device_ops, n)
    inputs = _per_replica(strategy, lambda d: np.float32(d + 1.0))
    run = gd.function(lambda x: strategy.run(
        lambda v: gd.get_replica_context().all_reduce(op, v), args=(x,)))
    np.testing.assert_allclose(_local(run(inputs), n), [expect] * n)


@pytest.mark.parametrize("n, op, expect", [(1, SUM, [1.0, 2.0]), (2, SUM, [4.0, 6.0]),
                                           (2, MEAN, [2.0, 3.0]), (4, SUM, [16.0, 20.0]),
                                           (4, MEAN, [4.0, 5.0])])
@pytest.mark.parametrize("cross_device_ops", ["default", "ReductionToOneDevice",
                                              "RingAllReduce", "HierarchicalCopy"])
def test_batch_all_reduce_dense(cross_device_ops, n, op, expect):
    # TF: cross_device_ops_test.py CollectiveOpsTest.testBatchAllReduceDense
    # (inputs [[1, 2], [3, 4], [5, 6], [7, 8]], two values reduced in one call)
    strategy = _strategy(cross_device_ops, n)
    data = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
    a = _per_replica(strategy, lambda d: np.float32(data[d][0]))
    b = _per_replica(strategy, lambda d: np.float32(data[d][1]))
    run = gd.function(lambda x, y: strategy.run(
        lambda u, v: gd.get_replica_context().all_reduce(op, [u, v]), args=(x, y)))
    got = run(a, b)
    assert [list(_local(g, n)) for g in got] == [[e] * n for e in expect]


@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 3), (4097,)])
@pytest.mark.parametrize("cross_device_ops", ["default", "ReductionToOneDevice",
                                              "RingAllReduce", "HierarchicalCopy"])
def test_all_reduce_matches_numpy_any_size(cross_device_ops, shape):
    # TF: cross_device_ops_test.py testAllReduceDense, over buffer sizes that do not divide by
    # the replica count (docs/api.md "Collectives": the same sums as numpy for any buffer size)
    n = 3
    strategy = _strategy(cross_device_ops, n)
    rng = np.random.default_rng(len(shape) + sum(shape))
    parts = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    inputs = gd.PerReplica(parts)
    run = gd.function(lambda x: strategy.run(
        lambda v: (gd.get_replica_context().all_reduce(SUM, v),
                   gd.get_replica_context().all_reduce(MEAN, v)), args=(x,)))
    total, mean = run(inputs)
    expected = np.sum(parts, axis=0, dtype=np.float64)
    for got in _local(total, n):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for got in _local(mean, n):
        np.testing.assert_allclose(got, expected / n, rtol=1e-5, atol=1e-5)
    t = _local(total, n)
    assert all(np.array_equal(t[0], x) for x in t[1:]), "every replica gets the same bits"
