"""ir.evaluate, the reference interpreter: it agrees with eager numpy and with formulas
derived by hand on traced graphs, and it holds the passes to their promise: a graph means
the same before and after each one (bitwise where a pass does not reorder float math)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import ArrayType, Eqn, Graph, Var, evaluate
from graphdist.ops import OPS
from graphdist.passes import eliminate_common_subexpressions, eliminate_dead_code
from graphdist.passes.fuse import fuse_optimizer
from graphdist.passes.simplify import simplify

F64 = np.dtype("float64")


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- against eager and numpy

def test_mlp_loss_and_gradients_match_eager_numpy_and_hand_derived_gradients():
    rng = _rng()
    w = gd.Variable(rng.standard_normal((4, 3)), name="w")
    b = gd.Variable(rng.standard_normal(3), name="b")

    @gd.function
    def step(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean((gd.relu(x @ w + b) - y) ** 2)
        return (loss, *tape.gradient(loss, [w, b]))

    x, y = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    step(x, y)
    w0, b0 = w.numpy(), b.numpy()
    (loss, gw, gb), new_state = evaluate(step.stages["trace"], x, y,
                                         state={w.ref: w0, b.ref: b0})
    eager = gd.reduce_mean((gd.relu(x @ w0 + b0) - y) ** 2)   # the same impls, run by bind
    np.testing.assert_array_equal(loss, eager)
    z = x @ w0 + b0
    dz = 2 * (np.maximum(z, 0) - y) / y.size * (z > 0)
    np.testing.assert_allclose(loss, np.mean((np.maximum(z, 0) - y) ** 2), rtol=1e-12)
    np.testing.assert_allclose(gw, x.T @ dz, rtol=1e-12)
    np.testing.assert_allclose(gb, dz.sum(0), rtol=1e-12)
    np.testing.assert_array_equal(new_state[w.ref], w0)      # read only: state unchanged


def _conv_reference(x, f):
    """VALID cross-correlation, NHWC x HWIO, one output pixel at a time."""
    n, h, wd, _ = x.shape
    kh, kw, _, co = f.shape
    out = np.zeros((n, h - kh + 1, wd - kw + 1, co))
    for i in range(h - kh + 1):
        for j in range(wd - kw + 1):
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", x[:, i:i + kh, j:j + kw, :], f)
    return out


def test_conv_matches_eager_and_a_direct_sum():
    rng = _rng(1)
    x, f = rng.standard_normal((2, 6, 5, 3)), rng.standard_normal((3, 2, 3, 4))
    conv = gd.function(lambda x, f: gd.nn.conv2d(x, f, padding="VALID"))
    conv(x, f)
    (out,) = evaluate(conv.graph, x, f)
    np.testing.assert_array_equal(out, gd.nn.conv2d(x, f, padding="VALID"))
    np.testing.assert_allclose(out, _conv_reference(x, f), rtol=1e-12, atol=1e-12)


def test_softmax_cross_entropy_and_its_gradient_match_numpy():
    rng = _rng(2)
    logits = rng.standard_normal((5, 7))
    labels = rng.dirichlet(np.ones(7), size=5)

    @gd.function
    def xent(labels, logits):
        return gd.value_and_grad(lambda z: gd.reduce_mean(
            gd.nn.softmax_cross_entropy(labels, z)))(logits)

    xent(labels, logits)
    loss, grad = evaluate(xent.stages["trace"], labels, logits)
    np.testing.assert_array_equal(loss, gd.reduce_mean(gd.nn.softmax_cross_entropy(
        labels, logits)))
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(loss, -(labels * log_p).sum(-1).mean(), rtol=1e-12)
    np.testing.assert_allclose(grad, (np.exp(log_p) - labels) / len(logits), rtol=1e-10,
                               atol=1e-15)


# ---------------------------------------------------------------- passes keep the meaning

def _mlp_adam():
    rng = _rng(3)
    w = gd.Variable(rng.standard_normal((4, 3)), name="w")
    b = gd.Variable(np.zeros(3), name="b")
    opt = gd.optimizers.Adam(learning_rate=0.1)

    def train(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean((gd.relu(x @ w + b) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        return loss

    return train, (rng.standard_normal((8, 4)), rng.standard_normal((8, 3)))


def _conv_momentum():
    rng = _rng(4)
    f = gd.Variable(rng.standard_normal((3, 3, 2, 4)), name="f")
    v = gd.Variable(rng.standard_normal((4, 3)), name="v")
    opt = gd.optimizers.SGD(learning_rate=0.1, momentum=0.9)

    def train(x, y):
        with gd.GradientTape() as tape:
            h = gd.reduce_mean(gd.relu(gd.nn.conv2d(x, f)), axis=(1, 2))
            loss = gd.reduce_mean(gd.nn.softmax_cross_entropy(y, h @ v))
        opt.apply_gradients(zip(tape.gradient(loss, [f, v]), [f, v]))
        return loss

    y = np.eye(3)[[0, 2]]
    return train, (rng.standard_normal((2, 5, 5, 2)), y)


MODELS = {"mlp_adam": _mlp_adam, "conv_momentum": _conv_momentum}
LOGICAL = ["trace", "dce", "cse", "simplify", "cse.2", "dce.2", "fuse_optimizer"]
REORDERS_FLOAT_MATH = {"fuse_optimizer"}


def _stages(model):
    fn, args = MODELS[model]()
    step = gd.function(fn)
    step(*args)
    return step.stages


def _random_value(ty: ArrayType, rng, positive: bool):
    if ty.dtype.kind == "f":   # state (betas, epsilon, Adam's v...) in (0, 1)
        x = rng.uniform(0.1, 0.9, ty.shape) if positive else rng.standard_normal(ty.shape)
        return np.asarray(x, ty.dtype)
    if ty.dtype.kind in "iu":
        return rng.integers(1, 5, ty.shape).astype(ty.dtype)
    return rng.random(ty.shape) < 0.5


def _run(g: Graph, seed: int):
    rng = _rng(seed)
    args = [_random_value(v.ty, rng, False) for v in g.inputs[: g.num_args]]
    state = {ref: _random_value(v.ty, rng, True)
             for ref, v in zip(g.variables, g.inputs[g.num_args:])}
    results, new_state = evaluate(g, *args, state=state)
    return [*results, *(new_state[ref] for ref in g.variables)]


def _assert_same_meaning(before: Graph, after: Graph, exact: bool):
    for seed in range(3):
        for x, y in zip(_run(before, seed), _run(after, seed), strict=True):
            if exact:
                np.testing.assert_array_equal(x, y)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_logical_pass_of_the_pipeline_keeps_the_graph_meaning(model):
    stages = _stages(model)
    assert list(stages)[: len(LOGICAL)] == LOGICAL
    assert stages["fuse_optimizer"] is not stages["dce.2"]   # the fused update is compared
    for before, name in zip(LOGICAL, LOGICAL[1:]):
        _assert_same_meaning(stages[before], stages[name], name not in REORDERS_FLOAT_MATH)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("pass_", [eliminate_dead_code, eliminate_common_subexpressions,
                                   simplify, fuse_optimizer], ids=lambda p: p.__name__)
def test_each_pass_on_the_traced_graph_keeps_its_meaning(model, pass_):
    traced = _stages(model)["trace"]
    after = pass_(traced)
    _assert_same_meaning(traced, after, pass_ is not fuse_optimizer)


def test_a_pass_that_changes_the_meaning_is_caught():
    ty = ArrayType((3,), F64)
    x, a = Var(ty, "x"), Var(ty, "a")
    g = Graph((x,), (Eqn(OPS["tanh"], (x,), (a,)),), (a,))
    wrong = Graph((x,), (Eqn(OPS["exp"], (x,), (a,)),), (a,))
    with pytest.raises(AssertionError):
        _assert_same_meaning(g, wrong, exact=False)


# ---------------------------------------------------------------- errors

def _tanh_graph():
    x, a = Var(ArrayType((3,), F64), "x"), Var(ArrayType((3,), F64), "a")
    return x, a, Graph((x,), (Eqn(OPS["tanh"], (x,), (a,)),), (a,))


def test_an_op_without_impl_is_named_with_its_eqn():
    x, a, g = _tanh_graph()
    no_impl = copy.copy(OPS["tanh"])     # a copy: OPS keeps the real op
    no_impl.impl = None
    g = g.replace(eqns=(Eqn(no_impl, (x,), (a,)),))
    with pytest.raises(NotImplementedError, match=r"op 'tanh' has no numpy impl(.|\n)*"
                                                  r"a:f64\[3\] = tanh x"):
        evaluate(g, np.zeros(3))


def test_bad_arguments_and_missing_state_say_what_is_wrong():
    _, _, g = _tanh_graph()
    with pytest.raises(TypeError, match="takes 1 arguments, got 2"):
        evaluate(g, np.zeros(3), np.zeros(3))
    with pytest.raises(TypeError, match=r"argument 0 \(x\) is f32\[3\], the graph takes "
                                        r"f64\[3\]"):
        evaluate(g, np.zeros(3, np.float32))
    w = gd.Variable(np.zeros(2), name="weights")
    read = gd.function(lambda: w.read_value())
    read()
    with pytest.raises(TypeError, match="holds variables weights; pass state"):
        evaluate(read.graph)
    (value,), _ = evaluate(read.graph, state={w.ref: np.arange(2.0)})
    np.testing.assert_array_equal(value, [0.0, 1.0])


def test_a_replicated_graph_takes_and_gives_one_component_per_replica():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        w = gd.Variable(np.zeros((4, 3)), name="w")
        opt = gd.optimizers.SGD(learning_rate=0.1)

    @gd.function
    def step(x):
        def replica(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean((x @ w) ** 2)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss
        return strategy.run(replica, args=(x,))

    rng = _rng(5)
    step(rng.standard_normal((8, 4)))
    g = step.replicated_graph
    assert g.num_args == 2 and len(g.variables) == 2 * len(set(g.variables))
    xs = [rng.standard_normal(v.ty.shape) for v in g.inputs[:2]]
    w0 = rng.standard_normal((4, 3))
    values = {"w": w0, "SGD/iterations": 0, "SGD/learning_rate": 0.1,
              "SGD/weight_decay": 0.0}
    state: dict = {}
    for ref, v in zip(g.variables, g.inputs[g.num_args:]):
        state.setdefault(ref, []).append(np.asarray(values[ref.name], v.ty.dtype))
    losses, new_state = evaluate(g, *xs, state=state)
    np.testing.assert_allclose(losses, [np.mean((x @ w0) ** 2) for x in xs], rtol=1e-12)
    grads = [2 * x.T @ (x @ w0) / (len(x) * 3) for x in xs]       # mean over 8x3 values
    for component in new_state[w.ref]:                           # all-reduced: the same
        np.testing.assert_allclose(component, w0 - 0.1 * np.mean(grads, axis=0), rtol=1e-12)
