"""fuse_reduce_update and its kernels: the gradient all-reduce fused with every replica's
optimizer update on host devices gives the same bits as the two apart, and is only made
where nothing else reads the reduced gradient."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from graphdist.kernels import adam, reduce, reduce_update, sgd

import graphdist as gd
from graphdist.ops import OPS
from graphdist.passes.fuse import fuse_reduce_update


# about the fused all-reduce + update, which runs where collectives are inline
pytestmark = pytest.mark.usefixtures("inline_collectives")

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
SHAPES = [(300, 7), (5,), (70000,), (1,)]      # 70000 spans two 64K chunks


def _buffers(rng, replicas=4):
    sizes = [int(np.prod(s)) for s in SHAPES]
    offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]
    bufs = [rng.standard_normal(sum(sizes)).astype(np.float32) for _ in range(replicas)]
    return bufs, offsets, sizes


def _per_replica(rng, replicas=4, fill=None):
    return [rng.standard_normal(s).astype(np.float32) if fill is None
            else np.full(s, fill, np.float32) for _ in range(replicas) for s in SHAPES]


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adamw"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_kernels_match_the_all_reduce_then_the_updates_bit_for_bit(kind, op):
    rng = np.random.default_rng(0)
    bufs, offsets, sizes = _buffers(rng)
    ps, ms, vs = _per_replica(rng), _per_replica(rng, fill=0.1), _per_replica(rng, fill=0.2)
    want = [x.copy() for x in ps], [x.copy() for x in ms], [x.copy() for x in vs]
    n = len(SHAPES)
    before = ps[n + 1].copy(), ms[n + 1].copy(), vs[n + 1].copy()
    reduced = [np.empty_like(bufs[0]) for _ in bufs]
    reduce.all_reduce_cpu(bufs, op, outs=reduced)
    for k in range(4):
        gs = [reduced[k][o:o + s].reshape(sh) for o, s, sh in zip(offsets, sizes, SHAPES)]
        part = slice(k * n, (k + 1) * n)
        if kind == "adamw":
            adam.adam_multi_cpu(want[0][part], want[1][part], want[2][part], gs,
                                np.float32(3e-3), 0.9, 0.999, 1e-7, 1e-4)
        else:
            sgd.sgd_multi_cpu(want[0][part], want[1][part] if kind == "momentum" else None, gs,
                              0.01, 0.9 if kind == "momentum" else 0.0, True, 1e-4)
    if kind == "adamw":
        reduce_update.reduce_adam_cpu(bufs, offsets, ps, ms, vs, [np.float32(3e-3)] * 4, op,
                                      0.9, 0.999, 1e-7, 1e-4)
    else:
        reduce_update.reduce_sgd_cpu(bufs, offsets, ps, ms if kind == "momentum" else None, op,
                                     0.01, 0.9 if kind == "momentum" else 0.0, True, 1e-4)
    for got, expected in zip((ps, ms, vs), want):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
    # and both are the closed-form update on the numpy sum (replica 1, tensor 1)
    total = ((bufs[0] + bufs[1]) + bufs[2]) + bufs[3]
    g = total[offsets[1]:offsets[1] + sizes[1]] / np.float32(4 if op == "mean" else 1)
    p0, m0, v0 = before
    if kind == "adamw":
        expected = adam.adam_ref(p0, m0, v0, g, 3e-3, 0.9, 0.999, 1e-7, 1e-4)[0]
    else:
        momentum = 0.9 if kind == "momentum" else 0.0
        expected = sgd.sgd_ref(p0, m0, g, 0.01, momentum, True, 1e-4)[0]
    np.testing.assert_allclose(ps[n + 1], expected, rtol=1e-5, atol=1e-7)


def test_the_node_reference_matches_its_kernel():
    rng = np.random.default_rng(1)
    bufs, offsets, _ = _buffers(rng, replicas=2)
    n = len(SHAPES)
    ps, ms = _per_replica(rng, 2), _per_replica(rng, 2, fill=0.0)
    ins = list(bufs)
    for k in range(2):
        for j in range(n):
            ins += [ps[k * n + j], ms[k * n + j]]
        ins.append(np.array([0.1, 0.9, 0.01]))          # replica k's [lr, momentum, wd]
    params = {"update": "sgd_momentum_multi_update", "reduce": "mean", "offsets": tuple(offsets),
              "replicas": 2, "n": n, "nesterov": False}
    node = OPS["host_reduce_update"]
    before = ps[n + 1].copy(), ms[n + 1].copy()
    want = node.impl(np, *ins, **params)                 # numpy: reduce, then update
    from graphdist.runtime.adapters.collectives import reduce_update_cpu

    reduce_update_cpu(*ins, **params)             # in place on ins
    per = 2 * n + 1                               # a replica's inputs: p, m per tensor, hyper
    got = [ins[2 + k * per + j * 2 + o] for k in range(2) for j in range(n) for o in range(2)]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert node.inplace(tuple(params.items()))[0] == 2   # replica 0's p' is written over p
    # the hyper vector's numbers are the ones used: torch's formula on the numpy mean
    g = ((bufs[0] + bufs[1]) / np.float32(2))[offsets[1]:offsets[1] + SHAPES[1][0]]
    p_ref, m_ref = sgd.sgd_ref(*before[:2], g, 0.1, 0.9, False, 0.01)
    np.testing.assert_allclose(ps[n + 1], p_ref, rtol=1e-6)
    np.testing.assert_allclose(ms[n + 1], m_ref, rtol=1e-6)


def _model(strategy, make_opt):
    rng = np.random.default_rng(0)
    with strategy.scope():
        ws = [gd.Variable(rng.standard_normal(s).astype(np.float32), name=f"w{i}")
              for i, s in enumerate([(8, 16), (16,), (16, 4), (4,)])]
        opt = make_opt()

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                out = gd.tanh(x @ ws[0] + ws[1]) @ ws[2] + ws[3]
                loss = gd.reduce_mean((out - y) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, ws


def _unfused():
    """The pipeline without fuse_reduce_update: the all-reduce and the updates apart."""
    from graphdist import pipeline

    def fuse_reduce_update(g):
        return g

    return mock.patch.object(pipeline, "fuse_reduce_update", fuse_reduce_update)


@contextlib.contextmanager
def _one_program():
    """Replicas as one program, where fuse_reduce_update runs (not with a thread each)."""
    gd.config.set_device_concurrency("sequential")
    try:
        yield
    finally:
        gd.config.set_device_concurrency("auto")


def _train(fused, make_opt, steps=4):
    with _one_program(), contextlib.nullcontext() if fused else _unfused():
        strategy = gd.MirroredStrategy(DEVICES)
        step, ws = _model(strategy, make_opt)
        rng = np.random.default_rng(1)
        data = [(rng.standard_normal((32, 8)).astype(np.float32),
                 rng.standard_normal((32, 4)).astype(np.float32)) for _ in range(steps)]
        losses = [step(b) for b in strategy.experimental_distribute_dataset(data)]
    return step, ws, losses


@pytest.mark.parametrize("make_opt", [lambda: gd.optimizers.SGD(0.1),
                                      lambda: gd.optimizers.SGD(0.1, momentum=0.9),
                                      lambda: gd.optimizers.Adam(0.01),
                                      lambda: gd.optimizers.AdamW(0.01, weight_decay=0.1)],
                         ids=["sgd", "momentum", "adam", "adamw"])
def test_fused_training_matches_the_unfused_bit_for_bit(make_opt):
    fused_step, fused_ws, fused_losses = _train(True, make_opt)
    plain_step, plain_ws, plain_losses = _train(False, make_opt)
    assert any(e.op.name == "host_reduce_update" for e in fused_step.replicated_graph.eqns)
    assert not any(e.op.name == "host_reduce_update"
                   for e in plain_step.replicated_graph.eqns)
    np.testing.assert_array_equal(fused_losses, plain_losses)
    for a, b in zip(fused_ws, plain_ws):
        for ca, cb in zip(a.values, b.values):
            np.testing.assert_array_equal(ca, cb)
        assert all(np.array_equal(a.values[0], c) for c in a.values[1:])


def test_not_fused_when_the_reduced_gradient_is_read_elsewhere():
    step, _, _ = _train(False, lambda: gd.optimizers.SGD(0.1, momentum=0.9), steps=1)
    placed = step.replicated_graph
    bucket = next(e for e in placed.eqns if e.op.name == "host_all_reduce"
                  and e.outputs[0].ty.size > 1)
    fused = fuse_reduce_update(placed)
    assert sum(e.op.name == "host_reduce_update" for e in fused.eqns) == 1
    returned = replace(placed, outputs=placed.outputs + (bucket.outputs[2],))
    assert fuse_reduce_update(returned) is returned     # a result reads it: left alone


def test_an_update_spread_over_several_buckets_is_fused_per_bucket():
    def train(fused):
        with _one_program(), contextlib.nullcontext() if fused else _unfused():
            strategy = gd.MirroredStrategy(DEVICES, bucket_bytes=300)   # several buckets
            step, ws = _model(strategy, lambda: gd.optimizers.Adam(0.01))
            rng = np.random.default_rng(2)
            data = [(rng.standard_normal((32, 8)).astype(np.float32),
                     rng.standard_normal((32, 4)).astype(np.float32)) for _ in range(3)]
            for b in strategy.experimental_distribute_dataset(data):
                step(b)
        return step, ws

    fused_step, fused_ws = train(True)
    plain_step, plain_ws = train(False)
    buckets = sum(e.op.name == "host_all_reduce" and e.outputs[0].ty.size > 1
                  for e in plain_step.replicated_graph.eqns)
    nodes = [e for e in fused_step.replicated_graph.eqns if e.op.name == "host_reduce_update"]
    assert buckets > 1 and len(nodes) == buckets
    assert sum(dict(e.params)["n"] for e in nodes) == len(fused_ws)
    for a, b in zip(fused_ws, plain_ws):
        for ca, cb in zip(a.values, b.values):
            np.testing.assert_array_equal(ca, cb)
