"""gd.config.check_numerics on GPU devices: a NaN in one logical GPU's shard raises
gd.NumericsError naming that GPU, the step leaves the device-resident variables and slots
as they were, and the next good step trains as a twin that never saw the bad batch.

On a machine with a GPU these run on CuPy; tests/runtime/test_check_numerics.py runs them
on the stand-in of fake_cupy.py (which also checks stream ordering)."""

import numpy as np
import pytest

import graphdist as gd
from graphdist import config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gd.devices("gpu"), reason="needs a GPU (CuPy + CUDA)")]


@pytest.fixture
def two_logical_gpus():
    before = dict(config._state["logical_devices"])
    config.set_logical_device_count("gpu", 2)
    gd.config.check_numerics(True)
    yield ["gpu:0", "gpu:1"]
    gd.config.check_numerics(False)
    config._state["logical_devices"].clear()
    config._state["logical_devices"].update(before)


def _setup(devices, optimizer):
    strategy = gd.MirroredStrategy(devices)
    with strategy.scope():
        w = gd.Variable(np.linspace(-1, 1, 6).reshape(3, 2).astype(np.float32), name="w")
        opt = gd.optimizers.Adam(0.1) if optimizer == "adam" else gd.optimizers.SGD(1e38)

    @gd.function
    def step(batch):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.square(x @ w))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=(batch,)))

    def run(x):
        return step(next(iter(strategy.experimental_distribute_dataset([x]))))

    return run, [w] + list(opt.variables())


def _host(variables) -> list:
    out = []
    for v in variables:
        for x in v.values:
            out.append(np.array(x.get() if hasattr(x, "get") else x))
    return out


def _batch(seed):
    return np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)


def test_a_nan_on_one_gpu_names_it_and_changes_no_device_state(two_logical_gpus):
    run, state = _setup(two_logical_gpus, "adam")
    twin, twin_state = _setup(two_logical_gpus, "adam")
    run(_batch(1))
    twin(_batch(1))
    before = _host(state)
    bad = _batch(2)
    bad[2, 0] = np.nan                              # rows 2-3: gpu:1's shard
    with pytest.raises(gd.NumericsError, match=r"matmul.*on gpu:1 \(replica 1\)"):
        run(bad)
    assert all(np.array_equal(a, b) for a, b in zip(_host(state), before))
    assert float(run(_batch(3))) == float(twin(_batch(3)))
    assert all(np.array_equal(a, b) for a, b in zip(_host(state), _host(twin_state)))


# numba's CUDA simulator runs the kernel as Python on numpy scalars, which warn on overflow
@pytest.mark.filterwarnings("ignore:.*overflow encountered:RuntimeWarning")
def test_an_inf_written_in_place_on_a_gpu_is_put_back(two_logical_gpus):
    run, state = _setup(two_logical_gpus, "sgd")
    before = _host(state)
    with pytest.raises(gd.NumericsError, match="Inf"):
        run(_batch(1) * 100)
    assert all(np.array_equal(a, b) for a, b in zip(_host(state), before))
