"""gd.config.check_numerics: the first NaN or Inf of a compiled step raises gd.NumericsError
naming the op, the device, the user's line and which inputs were finite; the step changes
no state, and the next good step runs as if the bad one had never been called."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd


@pytest.fixture
def checking():
    gd.config.check_numerics(True)
    yield
    gd.config.check_numerics(False)


def _setup(lr=0.1, optimizer="adam"):
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(0)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((3, 2)).astype(np.float32), name="w")
        opt = (gd.optimizers.Adam(lr) if optimizer == "adam"
               else gd.optimizers.SGD(lr))

    @gd.function
    def step(batch):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                h = x @ w                                   # the line the error names
                loss = gd.reduce_mean(h * h)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(batch,)))

    def distribute(x):
        return next(iter(strategy.experimental_distribute_dataset([x])))

    return step, w, opt, distribute


def _state(w, opt):
    return [np.array(v) for v in w.values] + [np.array(v.numpy()) for v in opt.variables()]


def _batch(seed=1):
    return np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)


def test_a_nan_in_one_replicas_shard_names_op_device_line_and_changes_nothing(checking):
    step, w, opt, distribute = _setup()
    twin_step, twin_w, twin_opt, twin_distribute = _setup()
    step(distribute(_batch()))
    twin_step(twin_distribute(_batch()))
    before = _state(w, opt)
    bad = _batch(2)
    bad[3, 1] = np.nan                      # row 3: replica 1's shard (rows 2 and 3)
    with pytest.raises(gd.NumericsError) as info:
        step(distribute(bad))
    message = str(info.value)
    assert "matmul" in message and info.value.op == "matmul"
    assert "cpu:1 (replica 1)" in message and "cpu:0" not in message
    assert "h = x @ w" in message and "test_check_numerics.py" in message
    assert "batch (f32[2,3]) has NaN (1 of 6 elements)" in message   # the argument's name
    assert "(f32[3,2]) finite" in message                           # w

    after = _state(w, opt)
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(after, before))
    assert int(opt.iterations.numpy()) == 1
    # the next good step runs as on a twin that never saw the bad batch
    loss = step(distribute(_batch(3)))
    twin_loss = twin_step(twin_distribute(_batch(3)))
    assert np.isfinite(loss) and loss == twin_loss
    assert all(np.array_equal(a, b) for a, b in zip(_state(w, opt), _state(twin_w, twin_opt)))
    assert int(opt.iterations.numpy()) == 2


def test_an_inf_made_by_an_in_place_update_is_put_back(checking):
    """SGD updates the weights in place; a learning rate that overflows them is caught
    after the kernel wrote them, and the guard restores the old values."""
    step, w, opt, distribute = _setup(lr=1e38, optimizer="sgd")
    before = _state(w, opt)
    with pytest.raises(gd.NumericsError) as info:
        step(distribute(_batch() * 100))
    assert "Inf" in str(info.value)
    assert all(np.array_equal(a, b) for a, b in zip(_state(w, opt), before))


def test_the_checks_cost_nothing_when_off_and_need_no_retrace():
    step, w, opt, distribute = _setup()
    bad = _batch()
    bad[0, 0] = np.inf
    loss = step(distribute(bad))               # unchecked: the NaN trains silently
    assert not np.isfinite(loss)
    assert "N" not in "".join(line.split("(")[0] for line in
                              step.program_source().splitlines() if "(" in line
                              and not line.startswith(("def", "#")))
    gd.config.check_numerics(True)
    try:
        with pytest.raises(gd.NumericsError):
            step(distribute(bad))
        assert step.trace_count == 1         # the checked program reuses the trace
    finally:
        gd.config.check_numerics(False)


def test_the_environment_variable_turns_the_checks_on():
    code = "import graphdist as gd; print(gd.config.numerics_checked())"
    env = dict(os.environ, GRAPHDIST_CHECK_NUMERICS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize("physical", [1, 2])
def test_the_gpu_checks_run_on_the_simulated_gpu(physical):
    """tests/gpu/test_check_numerics_gpu.py on fake_cupy's stand-in (1 or 2 physical GPUs
    under 2 logical ones): the checks of a collective's outputs on the other device, the
    snapshot and restore through each device's backend, and stream order all hold."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", GRAPHDIST_FAKE_CUPY=str(physical))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu",
           "tests/gpu/test_check_numerics_gpu.py"]
    proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "2 passed" in summary and "skipped" not in summary, summary
