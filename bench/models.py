"""The benchmark MLP (784-1024-1024-10, relu) as a graphdist step; the peers' versions of
the same model live in bench/peers/."""

from __future__ import annotations

import os

import numpy as np

import graphdist as gd
from bench.common import COLD
from bench.peers.common import LR, init
from bench.peers.gpt_common import GPT2, gpt2_init

B1, B2, EPS = 0.9, 0.999, 1e-7


def mlp_loss(ws, x, y):
    h = x
    for i in range(0, len(ws), 2):
        h = h @ ws[i] + ws[i + 1]
        if i + 2 < len(ws):
            h = gd.relu(h)
    return gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, h))


def make_step(strategy, optimizer: str = "adam", params=None):
    """(step, variables): step(batch) trains one step of the MLP under `strategy` and returns
    the mean loss; `optimizer` is "adam" (lr 1e-3) or "momentum" (SGD lr 0.01, momentum 0.9)."""
    with strategy.scope():
        ws = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(params or init())]
        opt = (gd.optimizers.Adam(LR, B1, B2, EPS) if optimizer == "adam"
               else gd.optimizers.SGD(0.01, momentum=0.9))

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = mlp_loss(ws, x, y)
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, ws


def cnn_logits(ps, x):
    """The tutorial CNN (bench/peers/common.py) on NHWC images, TF's VALID convolutions."""
    k1, b1, k2, b2, w3, b3, w4, b4 = ps
    h = gd.nn.max_pool2d(gd.relu(gd.nn.conv2d(x, k1, 1, "VALID") + b1), 2, 2, "VALID")
    h = gd.nn.max_pool2d(gd.relu(gd.nn.conv2d(h, k2, 1, "VALID") + b2), 2, 2, "VALID")
    h = gd.reshape(h, (h.shape[0], -1))
    return gd.relu(h @ w3 + b3) @ w4 + b4


def cnn_steps_with(key, forms: dict, repeat: int) -> dict:
    """The tutorial CNN's one-device step built once with each form of the CPU out-kernel
    `key` ((kind, op) of runtime/kernel_table's registry; None: the registry as it is),
    timed interleaved: what a kernel change does to the whole step."""
    from bench.common import interleaved
    from bench.peers.common import cnn_data
    from graphdist.runtime import kernel_table

    batch, made, listed = cnn_data(), {}, kernel_table.entry(*key)
    for name, form in forms.items():
        if form is not None:                           # read when the step is lowered
            kernel_table.register(listed.replace(out=form) if listed else
                                  kernel_table.KernelEntry(key[1], key[0], out=form),
                                  replace=True)
        try:
            step, _ = make_cnn_step(gd.OneDeviceStrategy("cpu:0"))
            step(batch)
        finally:
            if listed is None:
                kernel_table.ENTRIES.pop(key, None)
            else:
                kernel_table.ENTRIES[key] = listed
        made[name] = step
    return interleaved({k: (lambda s=s: s(batch)) for k, s in made.items()}, repeat,
                       label="CNN step")


def make_cnn_step(strategy, params=None):
    """(step, variables): one Adam step (lr 1e-3) of the tutorial CNN under `strategy`."""
    from bench.peers.common import cnn_init

    with strategy.scope():
        ps = [gd.Variable(p, name=f"c{i}") for i, p in enumerate(params or cnn_init())]
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, cnn_logits(ps, x)))
            opt.apply_gradients(zip(tape.gradient(loss, ps), ps))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, ps


def gpt_variables(model) -> dict:
    """The example GPT's variables by their names in bench/peers/gpt_common.py."""
    named = {"wte": model.tokens.embeddings, "wpe": model.positions.embeddings,
             "lnf.g": model.norm.gamma, "lnf.b": model.norm.beta,
             "head.w": model.head.kernel, "head.b": model.head.bias}
    for i, b in enumerate(model.blocks):
        a = b.attention
        layers = {"ln1": b.norm1, "ln2": b.norm2, "fc": b.fc, "proj": b.proj,
                  "q": a.query_dense, "k": a.key_dense, "v": a.value_dense,
                  "o": a.output_dense}
        for key, layer in layers.items():
            if key.startswith("ln"):
                named.update({f"h{i}.{key}.g": layer.gamma, f"h{i}.{key}.b": layer.beta})
            else:
                named.update({f"h{i}.{key}.w": layer.kernel, f"h{i}.{key}.b": layer.bias})
    return named


def make_gpt_step(strategy, params=None):
    """(step, variables): the example's own train step (examples/gpt_chars.py) of its GPT
    at bench/peers/gpt_common.py's sizes, from those initial weights, with Adam lr 1e-3
    (no clipping, no schedule, as the peers)."""
    from graphdist.examples.gpt_chars import GPT, make_train_step

    from bench.peers.gpt_common import CONTEXT, HEADS, LAYERS, VOCAB, WIDTH, gpt_init

    with strategy.scope():
        model = GPT(VOCAB, CONTEXT, WIDTH, LAYERS, HEADS)
        model(np.zeros((1, CONTEXT), np.int32))          # build under the strategy
        named = gpt_variables(model)
        for name, p in (params or gpt_init()).items():
            named[name].assign(p)
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)
    return make_train_step(strategy, model, opt), model.trainable_variables


def graphdist_side_by_side(make, batch, repeat: int) -> tuple[dict, float]:
    """graphdist's step from `make(strategy) -> (step, variables)` on one device, on 4
    logical CPU devices as it runs by default (per device) and merged (opt-in), timed side
    by side (with the losses of their first three steps); also the largest parameter
    difference, 4 devices against one, after those three steps."""
    from bench.common import interleaved

    one = gd.OneDeviceStrategy("cpu:0")
    four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch4 = next(iter(four.experimental_distribute_dataset([batch])))
    s1, w1 = make(one)
    s4, w4 = make(four)
    gd.config.set_device_concurrency("merged")
    try:
        s4m, _ = make(four)
        s4m(batch4)
    finally:
        gd.config.set_device_concurrency("auto")
    assert not s4.get_replicated_graph(batch4).merged and s4m.replicated_graph.merged
    losses = [(float(s1(batch)), float(s4(batch4))) for _ in range(3)]  # the same 3 steps
    diff = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(w1, w4))
    t = interleaved({"graphdist 1 device": lambda: s1(batch),
                     "graphdist Mirrored x4 (default: per-device)": lambda: s4(batch4),
                     "graphdist Mirrored x4 merged (opt-in)": lambda: s4m(batch4)},
                    repeat=repeat)
    for k, name in enumerate(list(t)[:2]):
        t[name]["losses"] = [pair[k] for pair in losses]
    return t, diff


def own_process(make, batch, devices: int, optimizer: str = "adam") -> dict:
    """What a graphdist peer script (bench/peers/graphdist_*.py) reports from its fresh
    process: `make(strategy) -> (step, variables)` on `devices` logical CPU devices, timed as
    the peers time themselves (its first call included), with its first three losses."""
    from bench.common import settle
    from bench.peers.common import time_steps

    strategy = (gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) if devices > 1
                else gd.OneDeviceStrategy("cpu:0"))
    step, _ = make(strategy)
    if devices > 1:
        batch = next(iter(strategy.experimental_distribute_dataset([batch])))
    losses = []
    r = time_steps(lambda: step(batch), sync=lambda loss: losses.append(float(loss)),
                   settle=settle)
    where = "1 device" if devices == 1 else f"Mirrored x{devices}"
    cold = ", cold Numba cache" if os.environ.get(COLD) else ""
    return {"peer": f"graphdist {where} (own process{cold})", "devices": devices,
            "optimizer": optimizer, "losses": losses[:3], **r}


# ---------------------------------------------------------------- GPT-2-style step (issue 29)
# As GPT-2 (and nanoGPT) write it: fused qkv projection, attention scores plus an additive
# causal mask (0 on and below the diagonal, -1e9 above) then softmax, GELU in its tanh form.
# Its sizes, data and initial weights (GPT2, gpt2_data, gpt2_init) are the peers' too:
# bench/peers/gpt_common.py.


def _linear(x, w, b, flat: bool):
    """x @ w + b as GPT-2's code writes it (flat=False: a 3-D x times a 2-D w), or as
    gd.nn.Dense runs it (flat=True: one 2-D GEMM over every row)."""
    if flat:
        rows = gd.reshape(x, (-1, x.shape[-1])) @ w
        y = gd.reshape(rows, x.shape[:-1] + (w.shape[-1],))
    else:
        y = x @ w
    return y if b is None else y + b


def gpt2_loss(p: dict, ids, targets, flat: bool = False):
    """Mean next-token cross-entropy of the GPT-2-style model (p: name -> variable)."""
    b, t = ids.shape
    d, heads = GPT2["width"], GPT2["heads"]
    k = d // heads
    mask = np.triu(np.full((t, t), -1e9, np.float32), 1)      # additive causal mask
    h = gd.gather(p["wte"], ids) + p["wpe"]
    split_heads = (lambda z: gd.transpose(gd.reshape(z, (b, t, heads, k)), (0, 2, 1, 3)))
    for i in range(GPT2["layers"]):
        a = gd.nn.layer_norm(h, p[f"h{i}.ln1.g"], p[f"h{i}.ln1.b"])
        q, kk, v = gd.split(_linear(a, p[f"h{i}.qkv.w"], p[f"h{i}.qkv.b"], flat), 3, axis=-1)
        scores = split_heads(q) @ gd.transpose(split_heads(kk), (0, 1, 3, 2))
        att = gd.nn.softmax(scores * float(1.0 / np.sqrt(k)) + mask)
        o = gd.reshape(gd.transpose(att @ split_heads(v), (0, 2, 1, 3)), (b, t, d))
        h = h + _linear(o, p[f"h{i}.o.w"], p[f"h{i}.o.b"], flat)
        m = gd.nn.layer_norm(h, p[f"h{i}.ln2.g"], p[f"h{i}.ln2.b"])
        m = gd.nn.gelu(_linear(m, p[f"h{i}.fc.w"], p[f"h{i}.fc.b"], flat), approximate=True)
        h = h + _linear(m, p[f"h{i}.proj.w"], p[f"h{i}.proj.b"], flat)
    h = gd.nn.layer_norm(h, p["lnf.g"], p["lnf.b"])
    logits = _linear(h, p["head.w"], None, flat)
    return gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(targets, logits))


def make_gpt2_step(strategy, params=None, flat: bool = False):
    """(step, variables): one Adam step (lr 1e-3, no clipping) of the GPT-2-style model
    (flat: its dense layers as one 2-D GEMM each, see _linear)."""
    with strategy.scope():
        p = {name: gd.Variable(value, name=name)
             for name, value in (params or gpt2_init()).items()}
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)
    variables = list(p.values())

    @gd.function
    def step(batch):
        def replica_fn(ids, targets):
            with gd.GradientTape() as tape:
                loss = gpt2_loss(p, ids, targets, flat)
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, variables
