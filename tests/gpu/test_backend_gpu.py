"""The GPU backend end to end: devices, variables in device memory, compiled steps on one
and on several logical GPUs against the CPU backend and a numpy reference, every
cross-device op, fused and unfused optimizer updates, checkpoints across backends.

On a machine with a GPU these run on CuPy; in CI tests/device/test_gpu_sim.py runs them on the
stand-in of fake_cupy.py (which also checks stream ordering) with the CUDA kernels in
numba's simulator.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import graphdist as gd
from graphdist import config
from graphdist.device.names import physical_gpu_count, physical_gpu_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gd.devices("gpu"), reason="needs a GPU (CuPy + CUDA)")]

SIM = bool(numba.config.ENABLE_CUDASIM)     # the simulator runs each CUDA thread in Python
HIDDEN = 8 if SIM else 32


def _cupy():
    import cupy

    return cupy


def _init(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((16, HIDDEN)) * 0.5).astype(np.float32),
            (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
            (rng.standard_normal((HIDDEN, 4)) * 0.5).astype(np.float32),
            (rng.standard_normal(4) * 0.1).astype(np.float32)]


def _batches(n=2 if SIM else 3, batch=16 if SIM else 64, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 16)).astype(np.float32),
             rng.integers(0, 4, batch).astype(np.int32)) for _ in range(n)]


def _train(strategy, kind, batches):
    with strategy.scope():
        params = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(_init())]
        opt = (gd.optimizers.SGD(learning_rate=0.1, momentum=0.9) if kind == "sgd"
               else gd.optimizers.Adam(learning_rate=0.01))

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                w1, b1, w2, b2 = params
                logits = gd.tanh(x @ w1 + b1) @ w2 + b2
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
            opt.apply_gradients(zip(tape.gradient(loss, params), params))
            return loss

        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    losses = [step(b) for b in strategy.experimental_distribute_dataset(batches)]
    return params, opt, losses, step


def test_devices_map_round_robin_onto_physical_gpus(logical_gpus):
    assert gd.devices("gpu") == logical_gpus
    n = physical_gpu_count()
    assert [physical_gpu_of(d) for d in logical_gpus] == [i % n for i in range(4)]
    with pytest.raises(ValueError, match="gpu:4"):
        gd.MirroredStrategy(["gpu:4"])


def test_variables_live_in_device_memory():
    with gd.OneDeviceStrategy("gpu:0").scope():
        v = gd.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="v")
    assert isinstance(v.values[0], _cupy().ndarray)
    host = v.numpy()
    assert isinstance(host, np.ndarray) and host.tolist() == [[0, 1, 2], [3, 4, 5]]
    v.assign(np.ones((2, 3), np.float32))
    assert v.numpy().sum() == 6
    with pytest.raises(ValueError, match="shape"):
        v.assign(np.ones(3, np.float32))
    assert v.numpy().sum() == 6


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("fused", [True, False])
def test_one_gpu_trains_like_the_cpu(kind, fused):
    config.set_fused_kernels(fused)
    try:
        batches = _batches()
        gpu_params, _, gpu_losses, step = _train(gd.OneDeviceStrategy("gpu:0"), kind, batches)
        cpu_params, _, cpu_losses, _ = _train(gd.OneDeviceStrategy("cpu:0"), kind, batches)
    finally:
        config.set_fused_kernels(True)
    assert all(isinstance(loss, (np.ndarray, np.generic)) for loss in gpu_losses)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-5)
    for g, c in zip(gpu_params, cpu_params):
        np.testing.assert_allclose(g.numpy(), c.numpy(), rtol=1e-5, atol=1e-6)
    ops = {e.op.name for e in step.replicated_graph.eqns} if hasattr(
        step, "replicated_graph") else set()
    assert not fused or not ops or any(o.endswith("multi_update") for o in ops)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("cdo", [None, gd.RingAllReduce()], ids=repr)
def test_four_logical_gpus_match_one(logical_gpus, kind, cdo):
    batches = _batches()
    one, _, one_losses, _ = _train(gd.OneDeviceStrategy("gpu:0"), kind, batches)
    four, opt, four_losses, step = _train(gd.MirroredStrategy(logical_gpus, cdo), kind,
                                          batches)
    np.testing.assert_allclose(four_losses, one_losses, rtol=1e-5)
    for a, b in zip(four, one):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    for v in four + opt.variables():        # mirrored components stay bit-identical
        host = [c.get() for c in v.values]
        assert all(np.array_equal(host[0], h) for h in host[1:]), v.name
    placed = step.replicated_graph
    assert {e.device for e in placed.eqns} == set(logical_gpus)
    fused = any(e.op.name == "nccl_all_reduce" for e in placed.eqns)
    assert fused == (cdo is None)     # NcclAllReduce is what None means on GPUs


@pytest.mark.parametrize("cdo", [None, gd.RingAllReduce(num_chunks=2),
                                 gd.ReductionToOneDevice(), gd.HierarchicalCopyAllReduce()],
                         ids=repr)
@pytest.mark.parametrize("size", [1, 7, 300] if SIM else [1, 7, 1000, 4097])
def test_every_cross_device_op_sums_like_numpy(logical_gpus, cdo, size):
    strategy = gd.MirroredStrategy(logical_gpus, cross_device_ops=cdo)
    rng = np.random.default_rng(size)
    parts = [rng.standard_normal(size).astype(np.float32) for _ in logical_gpus]
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group])
    ctx_sum = gd.function(lambda x: strategy.run(
        lambda v: gd.get_replica_context().all_reduce("sum", v), args=(x,)))
    ctx_mean = gd.function(lambda x: strategy.run(
        lambda v: gd.get_replica_context().all_reduce("mean", v), args=(x,)))
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for out, expected in [(ctx_sum(x), want), (ctx_mean(x), want / np.float32(4))]:
        values = out.values if isinstance(out, gd.PerReplica) else [out]
        for got in values:
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_device_arrays_are_accepted_as_arguments():
    cp = _cupy()
    with gd.OneDeviceStrategy("gpu:0").scope():
        w = gd.Variable(np.full((3, 2), 2, np.float32), name="w")
    f = gd.function(lambda x: x @ w)
    with cp.cuda.Device(0):
        x = cp.asarray(np.ones((4, 3), np.float32))
    got = f(x)
    assert isinstance(got, np.ndarray) and np.all(got == 6)


def test_checkpoints_move_between_gpu_and_cpu(tmp_path, logical_gpus):
    path = tmp_path / "ckpt.npz"
    params, opt, _, _ = _train(gd.MirroredStrategy(logical_gpus), "adam", _batches())
    gd.Checkpoint(params=params, opt=opt).save(path)
    with gd.OneDeviceStrategy("cpu:0").scope():
        cpu_params = [gd.Variable(np.zeros_like(p), name=f"p{i}") for i, p in enumerate(_init())]
        cpu_opt = gd.optimizers.Adam(learning_rate=0.01)
    gd.Checkpoint(params=cpu_params, opt=cpu_opt).restore(path)
    for a, b in zip(cpu_params, params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(cpu_opt.iterations.numpy()) == len(_batches())
    cpu_params[0].assign(np.zeros((16, HIDDEN), np.float32))
    gd.Checkpoint(params=cpu_params, opt=cpu_opt).save(path)
    gd.Checkpoint(params=params, opt=opt).restore(path)     # and back onto four GPUs
    for component in params[0].values:
        assert not component.get().any()


def test_a_failed_step_leaves_gpu_variables_as_they_were():
    with gd.OneDeviceStrategy("gpu:0").scope():
        v = gd.Variable(np.ones(3, np.float32), name="v")

    @gd.function
    def bad(x):
        v.assign(v * 2)
        return gd.reshape(x, (5,))     # fails at trace time: 3 elements cannot become 5

    with pytest.raises(Exception, match="reshape"):
        bad(np.ones(3, np.float32))
    assert v.numpy().tolist() == [1, 1, 1]


def test_device_arrays_make_variables_and_assign():
    cp = _cupy()
    with cp.cuda.Device(0):
        init = cp.asarray(np.arange(3, dtype=np.float32))
    with gd.OneDeviceStrategy("gpu:0").scope():
        v = gd.Variable(init, name="v")
    v.assign(init * 2)
    assert v.numpy().tolist() == [0, 2, 4]


def test_profile_has_a_lane_per_logical_gpu(logical_gpus):
    _, _, _, step = _train(gd.MirroredStrategy(logical_gpus), "sgd", _batches())
    strategy_batch = next(iter(gd.MirroredStrategy(logical_gpus)
                               .experimental_distribute_dataset(_batches()[:1])))
    trace = step.profile(strategy_batch)
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert set(logical_gpus) <= lanes
    assert any(e.get("name", "").startswith("nccl_all_reduce") for e in trace["traceEvents"])


def test_the_demo_trains_on_logical_gpus_like_on_one(logical_gpus):
    from graphdist.examples import mlp_digits

    steps = 10 if SIM else 100
    two = mlp_digits.train(2, steps, kind="gpu", steps_per_call=1)     # a loss per step
    one = mlp_digits.train(1, steps, kind="gpu", steps_per_call=1)
    assert two["strategy"].devices == ("gpu:0", "gpu:1")
    for a, b in zip(two["params"], one["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert two["losses"][-1] < two["losses"][0]


@pytest.mark.parametrize("cdo", [None, gd.ReductionToOneDevice()], ids=repr)
def test_sync_on_read_and_first_replica_variables_on_gpus(logical_gpus, cdo):
    strategy = gd.MirroredStrategy(logical_gpus, cross_device_ops=cdo)
    with strategy.scope():
        seen = gd.Variable(0.0, name="seen", synchronization=gd.VariableSynchronization.ON_READ,
                           aggregation=gd.VariableAggregation.SUM)
        first = gd.Variable(0.0, name="first",
                            aggregation=gd.VariableAggregation.ONLY_FIRST_REPLICA)

    @gd.function
    def step(x):
        def replica_fn(x):
            seen.assign_add(gd.reduce_sum(x))
            rid = gd.get_replica_context().replica_id_in_sync_group
            first.assign(gd.cast(rid, "float32") + 10.0)
            return x
        strategy.run(replica_fn, args=(x,))
        return seen.read_value()

    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group + 1, np.float32))
    assert float(step(x)) == 30.0          # 3 * (1 + 2 + 3 + 4), summed over replicas
    assert float(step(x)) == 60.0
    assert seen.numpy() == 60.0
    assert [float(c.get()) for c in first.values] == [10.0] * 4   # replica 0's, everywhere


def test_a_strategy_over_cpus_and_gpus_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cpu:0.*gpu:0|mix CPUs and GPUs"):
        gd.MirroredStrategy(["cpu:0", "gpu:0"])


def test_a_cnn_trains_on_logical_gpus_like_on_the_cpu(logical_gpus):
    """Conv, pooling, relu and their gradient ops on the GPU backend (their impls use only
    the array API CuPy shares with numpy; the pooling kernels are CPU-only table entries)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int32)
    init = [rng.standard_normal((3, 3, 2, 4)).astype(np.float32) * 0.3,
            np.zeros(4, np.float32), rng.standard_normal((36, 3)).astype(np.float32) * 0.3]
    results = []
    for strategy in (gd.OneDeviceStrategy("cpu:0"), gd.MirroredStrategy(logical_gpus[:2])):
        with strategy.scope():
            k, b, w = (gd.Variable(v, name=n) for v, n in zip(init, ("k", "b", "w")))
            opt = gd.optimizers.SGD(0.1, momentum=0.9)

        @gd.function
        def step(batch, strategy=strategy, k=k, b=b, w=w, opt=opt):
            def replica_fn(xb, yb):
                with gd.GradientTape() as tape:
                    h = gd.relu(gd.nn.conv2d(xb, k, 1, "SAME") + b)
                    h = gd.nn.max_pool2d(h, 2, 2, "VALID")
                    logits = gd.reshape(h, (h.shape[0], -1)) @ w
                    loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(yb, logits))
                opt.apply_gradients(zip(tape.gradient(loss, [k, b, w]), [k, b, w]))
                return loss
            return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        losses = [float(step(batch)) for _ in range(3)]
        results.append((losses, [v.numpy() for v in (k, b, w)]))
    (cpu_losses, cpu_params), (gpu_losses, gpu_params) = results
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-5)
    for g, c in zip(gpu_params, cpu_params):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-5)
