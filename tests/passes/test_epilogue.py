"""passes/epilogue.py: matmul / conv2d + bias + activation folded into one node, relu_grad +
the bias gradient's sum into one, each program against the same program compiled without
the stage (forward values and every gradient, 1 and 2 replicas); the patterns left alone
where an intermediate is read elsewhere; the fused nodes and their members in the views."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist import pipeline
from graphdist.passes.epilogue import fold_epilogues

ACTS = {"none": lambda v: v, "relu": gd.relu,
        "gelu": lambda v: gd.nn.gelu(v), "gelu_tanh": lambda v: gd.nn.gelu(v, approximate=True)}


@pytest.fixture
def without_epilogues(monkeypatch):
    """Compile with the epilogues stage left out (everything else as usual)."""
    def off():
        monkeypatch.setattr(pipeline, "epilogues", lambda: [])
    return off


def _conv_layer(x, k, b, act):
    v = gd.nn.conv2d(x, k, 1, "VALID")
    return ACTS[act](v + b if b is not None else v)


def _dense_layer(x, w, b, act):
    v = x @ w
    return ACTS[act](v + b if b is not None else v)


def _params(kind, channels, bias, seed=0):
    """(input, weight, bias or None) in float32: the tutorial's NHWC shapes scaled down, or
    a 2-D / 3-D matmul."""
    rng = np.random.default_rng(seed)
    if kind == "conv":
        x = rng.standard_normal((4, 10, 10, channels))
        w = rng.standard_normal((3, 3, channels, 8)) / 3
        b = rng.standard_normal(8)
    else:
        x = rng.standard_normal((6, 20) if kind == "dense2d" else (3, 5, 20))
        w = rng.standard_normal((20, 8)) / 4
        b = rng.standard_normal(8)
    return tuple(None if a is None else a.astype(np.float32)
                 for a in (x, w, b if bias else None))


def _grads_step(kind, act, arrays):
    """A gd.function returning the layer's output, loss and the gradients of the loss with
    respect to the input, weight and bias (all Variables)."""
    layer = _conv_layer if kind == "conv" else _dense_layer
    vs = [gd.Variable(a, name=n) for a, n in zip(arrays, "xwb") if a is not None]
    x, w, b = vs[0], vs[1], vs[2] if len(vs) == 3 else None

    @gd.function
    def step(t):
        with gd.GradientTape() as tape:
            y = layer(x, w, b, act)
            loss = gd.reduce_sum(y * t)
        return y, loss, tape.gradient(loss, vs)

    return step


def _ops(g) -> list:
    return [e.op.name for e in g.eqns]


CASES = [(kind, act, bias, c) for kind in ("conv", "dense2d", "dense3d")
         for act in ACTS for bias in (True, False)
         for c in ((1, 3) if kind == "conv" else (0,))]


@pytest.mark.parametrize("kind,act,bias,channels", CASES)
def test_fused_program_matches_unfused(kind, act, bias, channels, without_epilogues):
    arrays = _params(kind, channels, bias)
    results, graphs = [], []
    for stage_on in (True, False):
        if not stage_on:
            without_epilogues()
        step = _grads_step(kind, act, arrays)
        t_shape = _dense_layer(*arrays[:2], None, "none").shape if kind != "conv" else \
            (4, 8, 8, 8)
        t = np.random.default_rng(1).standard_normal(t_shape).astype(np.float32)
        y, loss, grads = step(t)
        results.append((y, loss, grads))
        graphs.append(_ops(step.replicated_graph))
    fused_op = "conv2d_bias_act" if kind == "conv" else "matmul_bias_act"
    folds_forward = bias or act != "none"
    assert (fused_op in graphs[0]) == folds_forward
    assert fused_op not in graphs[1]
    assert ("relu_grad_bias_sum" in graphs[0]) == (act == "relu" and bias)
    (y1, l1, g1), (y0, l0, g0) = results
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-4)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def _trained(strategy, kind, act, steps=2):
    """Variables after `steps` SGD steps of a two-layer model under `strategy`."""
    rng = np.random.default_rng(3)
    if kind == "conv":
        x = rng.standard_normal((8, 10, 10, 1)).astype(np.float32)
        shapes = [(3, 3, 1, 8), (8,), (3, 3, 8, 4), (4,)]
    else:
        x = rng.standard_normal((8, 12)).astype(np.float32)
        shapes = [(12, 16), (16,), (16, 4), (4,)]
    t = rng.standard_normal((8, 4)).astype(np.float32)
    with strategy.scope():
        ps = [gd.Variable((rng.standard_normal(s) / 3).astype(np.float32), name=f"p{i}")
              for i, s in enumerate(shapes)]
        opt = gd.optimizers.SGD(0.05)
    layer = _conv_layer if kind == "conv" else _dense_layer

    @gd.function
    def step(batch):
        def replica_fn(x, t):
            with gd.GradientTape() as tape:
                h = layer(x, ps[0], ps[1], act)
                h = layer(h, ps[2], ps[3], act)
                if kind == "conv":
                    h = gd.reduce_mean(h, axis=(1, 2))
                loss = gd.reduce_mean((h - t) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, ps), ps))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    batch = (x, t) if strategy.num_replicas_in_sync == 1 else \
        next(iter(strategy.experimental_distribute_dataset([(x, t)])))
    for _ in range(steps):
        step(batch)
    return [p.numpy() for p in ps], _ops(step.replicated_graph)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kind,act", [("conv", "relu"), ("conv", "gelu_tanh"),
                                      ("dense", "relu"), ("dense", "gelu")])
def test_training_on_replicas_matches_unfused(replicas, kind, act, without_epilogues):
    def strategy():
        return gd.OneDeviceStrategy("cpu:0") if replicas == 1 else \
            gd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])

    fused, ops = _trained(strategy(), kind, act)
    without_epilogues()
    plain, plain_ops = _trained(strategy(), kind, act)
    base = "conv2d_bias_act" if kind == "conv" else "matmul_bias_act"
    assert ops.count(base) == 2 * replicas and base not in plain_ops
    assert ops.count("relu_grad_bias_sum") == (2 * replicas if act == "relu" else 0)
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_merged_replicas_fold_the_conv_and_route_the_pool_by_its_argmax(without_epilogues):
    """Merged replicas convolve every replica's batch at once and add each replica's bias on
    a (replicas, N, ...) view: the bias and relu still fold into the convolution (through
    that reshape), and the pool, whose input and output its gradient reads through
    reshapes, still keeps its argmax. Training matches the program without epilogues."""
    def trained():
        rng = np.random.default_rng(8)
        strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            ps = [gd.Variable((rng.standard_normal(s) / 3).astype(np.float32))
                  for s in ((3, 3, 1, 8), (8,), (4 * 4 * 8, 3))]
            opt = gd.optimizers.SGD(0.05)
        x = rng.standard_normal((8, 10, 10, 1)).astype(np.float32)
        t = rng.standard_normal((8, 3)).astype(np.float32)

        @gd.function
        def step(batch):
            def replica_fn(x, t):
                with gd.GradientTape() as tape:
                    h = gd.nn.max_pool2d(_conv_layer(x, ps[0], ps[1], "relu"), 2, 2, "VALID")
                    h = gd.reshape(h, (h.shape[0], -1)) @ ps[2]
                    loss = gd.reduce_mean((h - t) ** 2.0)
                opt.apply_gradients(zip(tape.gradient(loss, ps), ps))
                return loss
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

        gd.config.set_device_concurrency("merged")
        try:
            batch = next(iter(strategy.experimental_distribute_dataset([(x, t)])))
            for _ in range(2):
                step(batch)
        finally:
            gd.config.set_device_concurrency("auto")
        assert step.replicated_graph.merged
        return [p.numpy() for p in ps], _ops(step.replicated_graph)

    fused, ops = trained()
    assert ops.count("conv2d_bias_act") == 1 and "conv2d" not in ops and "relu" not in ops
    assert ops.count("max_pool2d_argmax") == ops.count("max_pool2d_grad_argmax") == 1
    without_epilogues()
    plain, _ = trained()
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- what is not folded


def _logical(fn, *args):
    f = gd.function(fn)
    f(*args)
    return f.replicated_graph


def test_not_folded_when_the_gemm_result_is_read_elsewhere():
    x, w, b = _params("conv", 1, True)

    def fn(x, w, b):
        v = gd.nn.conv2d(x, w, 1, "VALID")
        return gd.relu(v + b), gd.reduce_sum(v)          # v read by the sum too

    g = _logical(fn, x, w, b)
    assert "conv2d_bias_act" not in _ops(g)
    assert fold_epilogues(g) is g
    got = gd.function(fn)(x, w, b)
    ref = np.einsum("nhwcpq,pqco->nhwo", np.lib.stride_tricks.sliding_window_view(
        x, (3, 3), axis=(1, 2)), w)
    np.testing.assert_allclose(got[0], np.maximum(ref + b, 0), rtol=1e-5, atol=1e-5)


def test_activation_stays_apart_when_the_pre_activation_is_read_elsewhere():
    x, w, b = _params("dense2d", 0, True)

    def fn(x, w, b):
        z = x @ w + b
        return gd.relu(z), z * 2.0                        # z read by a mul too

    g = _logical(fn, x, w, b)
    ops = _ops(g)
    assert "matmul_bias_act" in ops and "relu" in ops and "add" not in ops
    fused = next(e for e in g.eqns if e.op.name == "matmul_bias_act")
    assert dict(fused.params)["act"] == "none"
    assert dict(fused.params)["members"] == ("matmul", "add")
    y, z2 = gd.function(fn)(x, w, b)
    np.testing.assert_allclose(z2, 2 * (x @ w + b), rtol=1e-6)
    np.testing.assert_allclose(y, np.maximum(x @ w + b, 0), rtol=1e-6)


def test_gelu_keeps_its_pre_activation_for_the_gradient():
    arrays = _params("dense2d", 0, True)
    step = _grads_step("dense2d", "gelu", arrays)
    step(np.ones((6, 8), np.float32))
    (fused,) = [e for e in step.replicated_graph.eqns if e.op.name == "matmul_bias_act"]
    params = dict(fused.params)
    assert params["keep"] and len(fused.outputs) == 2
    grad = [e for e in step.replicated_graph.eqns if e.op.name == "gelu_grad"]
    assert grad and grad[0].inputs[1] is fused.outputs[0]


def test_relu_gradient_reads_the_fused_output():
    arrays = _params("conv", 3, True)
    step = _grads_step("conv", "relu", arrays)
    step(np.ones((4, 8, 8, 8), np.float32))
    g = step.replicated_graph
    (fused,) = [e for e in g.eqns if e.op.name == "conv2d_bias_act"]
    (back,) = [e for e in g.eqns if e.op.name == "relu_grad_bias_sum"]
    assert back.inputs[1] is fused.outputs[0]
    assert "add" not in _ops(g) and "relu" not in _ops(g)


def test_bias_sum_not_fused_over_other_axes():
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)

    def fn(ct, y):
        dz = gd.relu(y)                         # forward only: no relu_grad at all
        return gd.reduce_sum(dz, axis=1)

    g = _logical(fn, x, x)
    assert "relu_grad_bias_sum" not in _ops(g)


def test_off_with_fused_kernels_off():
    gd.config.set_fused_kernels(False)
    try:
        arrays = _params("conv", 1, True)
        step = _grads_step("conv", "relu", arrays)
        step(np.ones((4, 8, 8, 8), np.float32))
        assert "epilogues" not in step.stages
        assert "conv2d_bias_act" not in _ops(step.replicated_graph)
    finally:
        gd.config.set_fused_kernels(True)


# ---------------------------------------------------------------- views


def test_views_show_the_fused_nodes_and_their_members(tmp_path):
    arrays = _params("conv", 1, True)
    step = _grads_step("conv", "relu", arrays)
    step(np.ones((4, 8, 8, 8), np.float32))
    g = step.replicated_graph
    assert "epilogues" in step.stages
    text = str(g)
    assert "conv2d_bias_act[act=relu" in text and "members=(conv2d,add,relu)" in text
    assert "relu_grad_bias_sum[members=(relu_grad,reduce_sum)]" in text
    summary = g.summary()
    assert "conv2d_bias_act x1: conv2d + add + relu" in summary
    assert "relu_grad_bias_sum x1: relu_grad + reduce_sum" in summary
    html = g.to_html(tmp_path / "g.html")
    page = (tmp_path / "g.html").read_text() if html is None or len(html) < 200 else html
    assert "members=(conv2d,add,relu)" in page


def _pooled_conv_step(x, w, b, pool, t_shape, seed):
    """((loss, gradients of x, w and b), replicated graph) of sum(max_pool(relu(conv(x, w)
    + b)) * t) for a random t of t_shape; pool: (ksize, stride, padding)."""
    ksize, stride, padding = pool
    vs = [gd.Variable(a, name=n) for a, n in zip((x, w, b), "xwb")]

    @gd.function
    def step(t):
        with gd.GradientTape() as tape:
            h = gd.nn.max_pool2d(_conv_layer(vs[0], vs[1], vs[2], "relu"), ksize, stride,
                                 padding)
            loss = gd.reduce_sum(h * t)
        return loss, tape.gradient(loss, vs)

    t = np.random.default_rng(seed).standard_normal(t_shape).astype(np.float32)
    return step(t), step.replicated_graph


@pytest.mark.parametrize("pool", [(2, 2, "VALID"), (3, 2, "SAME")])
def test_relu_gradient_moves_before_the_pool_gradient(pool, without_epilogues):
    """conv + bias + relu + max pool: relu's gradient and the bias gradient's sum run on the
    pooled gradient (masked where the window's max is not > 0), then the pool's gradient
    routes it; gradients as the unfused program's, overlapping windows included."""
    ksize, stride, padding = pool
    x, w, b = _params("conv", 3, True, seed=4)
    x[0, :3, :3, :] = -5.0                       # some windows all negative after relu

    def run():
        return _pooled_conv_step(x, w, b, pool, (4, 4, 4, 8), seed=5)

    (loss1, g1), fused = run()
    without_epilogues()
    (loss0, g0), _ = run()
    (back,) = [e for e in fused.eqns if e.op.name == "relu_grad_bias_sum"]
    (route,) = [e for e in fused.eqns if e.op.name.startswith("max_pool2d_grad")]
    assert route.inputs[-1] is back.outputs[0]               # routed after the mask
    assert back.outputs[0].ty.shape == (4, 4, 4, 8)           # on the pooled gradient
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b0 in zip(g1, g0):
        np.testing.assert_allclose(a, b0, rtol=1e-5, atol=1e-5)


def test_only_host_devices_fold():
    """The fused forms' fast paths are CPU kernels: eqns placed on a GPU keep their ops."""
    from dataclasses import replace

    from graphdist.passes.epilogue import on_host

    step = _grads_step("conv", "relu", _params("conv", 1, True))
    step(np.ones((4, 8, 8, 8), np.float32))
    placed = step.stages["place"]
    assert on_host("cpu:0") and not on_host("gpu:0") and not on_host(None)
    assert fold_epilogues(placed) is not placed
    on_gpu = replace(placed, eqns=tuple(replace(e, device="gpu:0") for e in placed.eqns))
    assert fold_epilogues(on_gpu) is on_gpu



@pytest.mark.parametrize("pool", [(2, 2, "VALID"), (3, 3, "SAME"), (3, 2, "SAME")])
def test_a_pool_whose_windows_do_not_overlap_routes_its_gradient_by_its_argmax(
        pool, monkeypatch):
    """max_pool2d and its gradient -> max_pool2d_argmax and max_pool2d_grad_argmax for
    windows that do not overlap: the backward pass no longer reads the pool's input, and
    the loss and gradients are the bits of the program without that rewrite (overlapping
    windows keep their ops)."""
    from graphdist.passes import epilogue

    ksize, stride, padding = pool
    x, w, b = _params("conv", 1, True, seed=6)
    x = np.round(x * 2)                          # ties in the windows

    def run():
        out_hw = -(-8 // stride) if padding == "SAME" else (8 - ksize) // stride + 1
        return _pooled_conv_step(x, w, b, pool, (4, out_hw, out_hw, 8), seed=7)

    (loss1, g1), rewritten = run()
    monkeypatch.setattr(epilogue, "_pool_argmax", lambda g: g)
    (loss0, g0), kept = run()
    ops = _ops(rewritten)
    if ksize > stride:
        assert ops == _ops(kept) and "max_pool2d_argmax" not in ops
        return
    assert "max_pool2d" not in ops and "max_pool2d_grad" not in ops
    # (a 2x2 pool of stride 2 runs in its convolution's output pass: conv2d_bias_act_pool)
    (fwd,) = [e for e in rewritten.eqns
              if e.op.name in ("max_pool2d_argmax", "conv2d_bias_act_pool")]
    assert (fwd.op.name == "conv2d_bias_act_pool") == (pool == (2, 2, "VALID"))
    (back,) = [e for e in rewritten.eqns if e.op.name == "max_pool2d_grad_argmax"]
    assert back.inputs[0] is fwd.outputs[1] and fwd.inputs[0] not in back.inputs
    assert fwd.outputs[1].ty.dtype == np.int8
    np.testing.assert_array_equal(loss1, loss0)
    for a, b0 in zip(g1, g0):
        np.testing.assert_array_equal(a, b0)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_a_first_layer_s_filter_gradient_reads_the_pool_s_argmax(channels, monkeypatch):
    """conv + bias + relu + 2x2 max pool on the inputs (no input gradient): the pool's
    routed gradient, read only by the filter gradient, fuses into it
    (conv2d_backprop_filter_pooled)
    where the filter gradient runs as kernels/conv_filter.py's groups (fewer than four
    input channels); the same bits as without that fusion. Four channels: the GEMM form,
    no fusion."""
    from graphdist.passes import epilogue

    x, w, b = _params("conv", channels, True, seed=11)

    def run():
        vs = [gd.Variable(a, name=n) for a, n in zip((w, b), "wb")]

        @gd.function
        def step(x, t):
            with gd.GradientTape() as tape:
                h = gd.nn.max_pool2d(_conv_layer(x, vs[0], vs[1], "relu"), 2, 2, "VALID")
                loss = gd.reduce_sum(h * t)
            return loss, tape.gradient(loss, vs)

        t = np.random.default_rng(12).standard_normal((4, 4, 4, 8)).astype(np.float32)
        return step(x, t), step.replicated_graph

    (loss1, g1), fused = run()
    monkeypatch.setattr(epilogue, "_pool_grad_into_filter_grad", lambda g: g)
    (loss0, g0), kept = run()
    ops = _ops(fused)
    if channels >= 4:
        assert "conv2d_backprop_filter_pooled" not in ops and ops == _ops(kept)
        return
    (node,) = [e for e in fused.eqns if e.op.name == "conv2d_backprop_filter_pooled"]
    assert "max_pool2d_grad_argmax" not in ops and "max_pool2d_grad_argmax" in _ops(kept)
    assert dict(node.params)["members"] == ("max_pool2d_grad_argmax", "conv2d_backprop_filter")
    assert node.inputs[1].ty.dtype == np.int8                # the forward pass's argmax
    np.testing.assert_array_equal(loss1, loss0)
    for a, b0 in zip(g1, g0):
        np.testing.assert_array_equal(a, b0)
