"""A program's first calls run the numpy forms of its kernels while the kernels load in the
background (runtime/warmup.py). The claim that makes it safe: either form gives the same
bits. Each model here trains a few steps on the numpy forms (warm-up held back) and a few
on the kernels, from the same start, and the variables must be equal bit for bit; the ops
covered are every op of kernel_table.exact_ops()."""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest

import graphdist as gd
from graphdist import pipeline
from graphdist.ir.types import ArrayType
from graphdist.runtime import kernel_table, warmup


# about the fused all-reduce + update, which runs where collectives are inline
pytestmark = pytest.mark.usefixtures("inline_collectives")

STEPS = 3
COVERED: set = set()        # the ops whose two forms these tests compared


@pytest.fixture(autouse=True)
def _background_compile(monkeypatch):
    monkeypatch.setattr(warmup, "_loaded", set())     # every test starts as a fresh process
    old = gd.config.background_compile()
    yield
    gd.config.set_background_compile(old)
    warmup.wait()


def programs(f):
    return [p for compiled in f._cache.values() for p in compiled.executable.programs]


def train(make, background: bool):
    """Variables after STEPS steps: on the numpy forms (background=True, warm-up held back
    for the whole run) or on the kernels (background compile off)."""
    gd.config.set_background_compile(background)
    step, variables, batch = make()
    losses = []
    if background:
        with warmup.paused():
            for _ in range(STEPS):
                losses.append(_host(step(*batch)))
            ran = programs(step)
            assert any(getattr(p, "warming", False) for p in ran), "nothing was deferred"
            for p in ran:       # the ops these numpy forms stood in for
                calls = getattr(p, "warming", False) and p.deferred_calls or []
                COVERED.update(c.op for c in calls if c.op in kernel_table.exact_ops())
    else:
        for _ in range(STEPS):
            losses.append(_host(step(*batch)))
        assert not any(getattr(p, "warming", False) for p in programs(step))
    return [v.numpy() for v in variables], losses


def _host(result):
    """A step's result as arrays (a mirrored one: every replica's copy)."""
    values = getattr(result, "values", None)
    return np.stack([np.asarray(v) for v in values]) if values else np.asarray(result)


def assert_same_bits(make):
    kernels, kernel_losses = train(make, background=False)
    numpy_forms, numpy_losses = train(make, background=True)
    for a, b in zip(kernels, numpy_forms):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kernel_losses, numpy_losses)


def mlp(optimizer, devices, activation=gd.relu, sizes=(64, 256, 256, 10), zero_stage=0):
    def make():
        rng = np.random.default_rng(0)
        strategy = (gd.MirroredStrategy(devices, zero_stage=zero_stage) if len(devices) > 1
                    else gd.OneDeviceStrategy(devices[0]))
        with strategy.scope():
            ws = [gd.Variable((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
                  for a, b in itertools.pairwise(sizes)]
            opt = optimizer()
        x = rng.standard_normal((128, 64)).astype(np.float32)
        y = rng.integers(0, 10, 128).astype(np.int32)

        @gd.function
        def step(x, y):
            def replica_fn(x, y):
                with gd.GradientTape() as tape:
                    h = x
                    for w in ws[:-1]:
                        h = activation(h @ w)
                    loss = gd.reduce_mean(
                        gd.nn.sparse_softmax_cross_entropy(y, h @ ws[-1]))
                opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
                return loss
            if len(devices) == 1:
                return replica_fn(x, y)
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x, y)))

        return step, ws, (x, y)
    return make


def leaky(h):   # `where` with a big output: its select kernel
    return gd.where(h > 0, h, h * 0.1)


OPTIMIZERS = {
    "sgd": lambda: gd.optimizers.SGD(0.05),
    "momentum": lambda: gd.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: gd.optimizers.Adam(1e-3),
    "adamw": lambda: gd.optimizers.AdamW(1e-3, weight_decay=0.01),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]])
def test_an_mlp_trains_to_the_same_bits_on_either_form(optimizer, devices):
    assert_same_bits(mlp(OPTIMIZERS[optimizer], devices))


@pytest.mark.usefixtures("one_program")
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_replicas_in_one_program_train_to_the_same_bits_on_either_form(optimizer):
    """The fused all-reduce + every replica's update (host_reduce_update), its Numba
    kernel or its numpy twin."""
    assert_same_bits(mlp(OPTIMIZERS[optimizer], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]))


@pytest.mark.usefixtures("one_program")
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_sharded_optimizer_state_trains_to_the_same_bits_on_either_form(optimizer):
    """zero_stage=1: each bucket's reduce-scatter + shard update + all-gather in one node
    (passes/fuse_zero.py), its Numba kernel or its numpy twin."""
    assert_same_bits(mlp(OPTIMIZERS[optimizer], ["cpu:0", "cpu:1", "cpu:2"], zero_stage=1))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_single_variable_s_update_gives_the_same_bits_on_either_form(optimizer):
    assert_same_bits(mlp(OPTIMIZERS[optimizer], ["cpu:0"], sizes=(64, 4096)))


def test_an_all_reduce_returned_to_the_caller_gives_the_same_bits_on_either_form():
    def make():
        rng = np.random.default_rng(3)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
        with strategy.scope():
            w = gd.Variable(np.float32(1.0))
        xs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(3)]
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx: xs[ctx.replica_id_in_sync_group])

        @gd.function
        def step(x):
            def replica_fn(v):
                return gd.get_replica_context().all_reduce("mean", v * w)
            return strategy.run(replica_fn, args=(x,))

        return step, [w], (x,)
    assert_same_bits(make)


def test_where_gives_the_same_bits_on_either_form(monkeypatch):
    # where's own kernel: unfused (fused into a cluster, it is fused_elementwise's, which
    # the fused models below cover)
    monkeypatch.setattr(pipeline, "elementwise_fusion", lambda: [])
    assert_same_bits(mlp(OPTIMIZERS["adam"], ["cpu:0", "cpu:1"], activation=leaky))


def test_a_fused_elementwise_cluster_gives_the_same_bits_on_either_form():
    """leaky relu's where, comparison and scale as one fused_elementwise node and its
    gradient's where and scale as another (passes/fuse_elementwise.py)."""
    assert_same_bits(mlp(OPTIMIZERS["adam"], ["cpu:0", "cpu:1"], activation=leaky))


def test_a_cnn_with_max_pooling_trains_to_the_same_bits_on_either_form():
    def make():
        rng = np.random.default_rng(1)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            k = gd.Variable((rng.standard_normal((3, 3, 1, 16)) * 0.3).astype(np.float32))
            k2 = gd.Variable((rng.standard_normal((3, 3, 16, 8)) * 0.1).astype(np.float32))
            b2 = gd.Variable((rng.standard_normal(8) * 0.1).astype(np.float32))
            w = gd.Variable((rng.standard_normal((6 * 6 * 8, 10)) * 0.05)
                            .astype(np.float32))
            opt = gd.optimizers.Adam(1e-2)
        # integer-valued images make ties in the pooling windows: both forms pick alike
        x = rng.integers(0, 3, (32, 28, 28, 1)).astype(np.float32)
        y = rng.integers(0, 10, 32).astype(np.int32)

        @gd.function
        def step(x, y):
            def replica_fn(x, y):
                with gd.GradientTape() as tape:
                    h = gd.nn.max_pool2d(gd.relu(gd.nn.conv2d(x, k, 1, "VALID")), 2, 2,
                                         "VALID")
                    # its input gradient: col2im; its bias and relu: conv2d_bias_act
                    h = gd.relu(gd.nn.conv2d(h, k2, 1, "VALID") + b2)
                    h = gd.nn.max_pool2d(h, 3, 1, "SAME")   # overlapping: no argmax
                    h = gd.nn.max_pool2d(h, 2, 2, "SAME")   # padded: the general argmax
                    logits = gd.reshape(h, (h.shape[0], -1)) @ w
                    loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
                opt.apply_gradients(zip(tape.gradient(loss, [k, k2, b2, w]), [k, k2, b2, w]))
                return loss
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x, y)))

        return step, [k, k2, b2, w], (x, y)
    assert_same_bits(make)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_embedding_gradients_give_the_same_bits_on_either_form(optimizer):
    def make():
        rng = np.random.default_rng(2)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            table = gd.Variable(rng.standard_normal((2000, 32)).astype(np.float32))
            opt = OPTIMIZERS[optimizer]()
        ids = rng.integers(0, 200, (256,)).astype(np.int32)     # many repeats

        @gd.function
        def step(ids):
            def replica_fn(ids):
                with gd.GradientTape() as tape:
                    rows = gd.nn.embedding_lookup(table, ids)
                    loss = gd.reduce_sum(rows * rows) * 1e-3
                opt.apply_gradients([(tape.gradient(loss, table), table)])
                return loss
            return strategy.reduce(gd.ReduceOp.SUM, strategy.run(replica_fn, args=(ids,)))

        return step, [table], (ids,)
    assert_same_bits(make)


@pytest.mark.parametrize("approximate", [False, True])
def test_a_transformer_block_trains_to_the_same_bits_on_either_form(approximate):
    """layer_norm, gelu and causal softmax (their numpy twins: kernels/gelu_numpy.py,
    softmax_numpy.py) and matmuls, 2 replicas."""
    def make():
        rng = np.random.default_rng(4)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            gamma = gd.Variable(np.ones(64, np.float32))
            beta = gd.Variable(np.zeros(64, np.float32))
            w1 = gd.Variable((rng.standard_normal((64, 256)) / 8).astype(np.float32))
            w2 = gd.Variable((rng.standard_normal((256, 64)) / 16).astype(np.float32))
            opt = gd.optimizers.Adam(1e-2)
        x = (rng.standard_normal((2, 64, 64)) * 2 + 1).astype(np.float32)
        variables = [gamma, beta, w1, w2]

        @gd.function
        def step(x):
            def replica_fn(x):
                with gd.GradientTape() as tape:
                    h = gd.nn.layer_norm(x, gamma, beta)
                    scores = h @ gd.transpose(h, (0, 2, 1)) * 0.125
                    h = gd.nn.softmax(scores, mask=gd.nn.causal_mask(64)) @ h
                    h = gd.nn.gelu(h @ w1, approximate=approximate) @ w2
                    loss = gd.reduce_mean(gd.square(x + h))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x,)))

        return step, variables, (x,)
    assert_same_bits(make)


def test_dense_layers_with_epilogues_train_to_the_same_bits_on_either_form():
    """Bias + relu and bias + tanh gelu in the matmul's output pass, relu's gradient with the
    bias gradient's sum (passes/epilogue.py), and a gelu of the inputs alone."""
    def make():
        rng = np.random.default_rng(5)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            variables = [gd.Variable((rng.standard_normal(s) / 4).astype(np.float32))
                         for s in ((64, 48), (48,), (48, 16), (16,))]
            opt = gd.optimizers.Adam(1e-2)
        x = rng.standard_normal((128, 64)).astype(np.float32)   # 16 KiB a replica: kernels
        w1, b1, w2, b2 = variables

        @gd.function
        def step(x):
            def replica_fn(x):
                with gd.GradientTape() as tape:
                    h = gd.relu(gd.nn.gelu(x) @ w1 + b1)
                    h = gd.nn.gelu(h @ w2 + b2, approximate=True)
                    loss = gd.reduce_mean(gd.square(h))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=(x,)))

        return step, variables, (x,)
    assert_same_bits(make)


def test_the_models_above_cover_every_exact_fallback():
    """Runs last in this file: an op given an exact kernel entry needs a model here."""
    if len(COVERED) < 3:
        pytest.skip("run with the rest of this file")
    assert kernel_table.exact_ops() - COVERED == set()


def test_the_program_switches_to_the_kernels_once_they_load(device_threads):
    gd.config.set_background_compile(True)
    step, variables, batch = mlp(OPTIMIZERS["adam"], ["cpu:0", "cpu:1"])()
    with warmup.paused():
        step(*batch)
        ran = programs(step)          # a thread per device: each device's program switches
        assert len(ran) == 2
        numpy_forms = [p.fn for p in ran]
        step(*batch)
        assert all(p.warming for p in ran) and [p.fn for p in ran] == numpy_forms
        assert step.program_source().startswith("# the Numba kernels below are still loading")
    assert warmup.wait(timeout=120)
    assert not any(p.warming for p in ran)
    assert all(p.fn is not fn for p, fn in zip(ran, numpy_forms))
    assert "still loading" not in step.program_source()
    before = [v.numpy() for v in variables]
    step(*batch)
    assert any(not np.array_equal(a, v.numpy()) for a, v in zip(before, variables))


def test_a_profile_and_a_second_program_of_loaded_kernels_run_the_kernels_at_once():
    gd.config.set_background_compile(True)
    step, _, batch = mlp(OPTIMIZERS["momentum"], ["cpu:0", "cpu:1"])()
    step(*batch)
    assert warmup.wait(timeout=120)
    trace = step.profile(*batch)
    assert trace["traceEvents"]
    assert not any(getattr(p, "warming", False) for p in step._cache[
        next(iter(step._cache))].profiled.programs)
    again, _, batch = mlp(OPTIMIZERS["momentum"], ["cpu:0", "cpu:1"])()
    again(*batch)           # the same kernels, already loaded: nothing to wait for
    assert not any(getattr(p, "warming", False) for p in programs(again))


def test_an_error_on_the_numpy_forms_names_the_node_as_the_kernels_would():
    gd.config.set_background_compile(True)
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        table = gd.Variable(np.ones((100, 8), np.float32))
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(ids):
        def replica_fn(ids):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(gd.nn.embedding_lookup(table, ids))
            opt.apply_gradients([(tape.gradient(loss, table), table)])
            return loss
        return strategy.run(replica_fn, args=(ids,))

    with warmup.paused():
        step(np.arange(64, dtype=np.int32))
        with pytest.raises(IndexError, match="gather|index|out of range") as info:
            step(np.full(64, 500, np.int32))
    assert "traced at" in str(info.value) or "while executing" in str(info.value)
    np.testing.assert_array_equal(table.numpy()[64:], 1.0)


def test_a_warm_up_that_fails_still_switches_to_the_kernels():
    calls = [warmup.KernelCall("relu_grad", functools.partial(_raises), warmup.OUT, (),
                               (ArrayType((2,), np.dtype(np.float32)),))]
    switched = []
    warmup._submit(calls, lambda: switched.append(True))
    assert warmup.wait(timeout=30) and switched == [True]


def _raises(*_):
    raise RuntimeError("no such signature")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_keeps_the_numpy_forms_and_does_not_wait_at_exit():
    """A child forked while a warm-up is pending must not wait for the parent's thread
    (at exit, it would wait forever) and keeps training on the numpy forms."""
    gd.config.set_background_compile(True)
    step, variables, batch = mlp(OPTIMIZERS["sgd"], ["cpu:0", "cpu:1"])()
    with warmup.paused():
        step(*batch)
        ran = programs(step)
        pid = os.fork()
        if pid == 0:                                   # the child
            ok = warmup.wait(timeout=5) and all(p.warming for p in ran)
            before = variables[0].numpy()
            step(*batch)
            ok = ok and all(p.warming for p in ran) and \
                not np.array_equal(before, variables[0].numpy())
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert warmup.wait(timeout=120) and not any(p.warming for p in ran)   # the parent goes on
