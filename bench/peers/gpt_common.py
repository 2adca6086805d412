"""The two GPTs every contender builds (bench/gpt.py and bench/gpt2.py), at the same sizes:
token and position embeddings, 2 pre-norm blocks of causal 4-head attention and an MLP of 4x
the width, a final layer norm and a dense head; mean next-token cross-entropy; Adam lr 1e-3
(no clipping, no schedule).

GPT_MODEL is examples/gpt_chars.py's model (vocabulary 103, exact GELU, separate q/k/v
kernels, the causal mask as jnp.where(causal, scores, -inf)). Its parameters are a dict of
numpy arrays in graphdist's (Keras's) layouts: q/k/v kernels [width, heads, key_dim] with
biases [heads, key_dim], the output kernel [heads, key_dim, width], dense kernels [in, out];
each framework reshapes them to its own ops.

GPT2_MODEL is the GPT-2-style step of issue 29, written as GPT-2's (and nanoGPT's) code
writes it: vocabulary 128, one fused qkv kernel [width, 3 * width] split into q, k, v,
scaled scores plus an additive causal mask (0 on and below the diagonal, -1e9 above), GELU
in its tanh form, a head without bias, GPT-2's initialization (gpt2_init)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, BATCH = 103, 64, 128, 2, 4, 32
KEY_DIM = WIDTH // HEADS
LN_EPS = 1e-5                          # graphdist's LayerNorm default


def token_windows(vocab: int, seed: int):
    """ids [BATCH, CONTEXT] below `vocab` and their next tokens."""
    seq = np.random.default_rng(seed).integers(0, vocab, (BATCH, CONTEXT + 1))
    return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def gpt_data(seed: int = 1):
    """The GPT's batch: ids [BATCH, CONTEXT] and their next tokens."""
    return token_windows(VOCAB, seed)


def block_shapes(i: int) -> dict:
    d, h, k = WIDTH, HEADS, KEY_DIM
    shapes = {"ln1.g": (d,), "ln1.b": (d,), "ln2.g": (d,), "ln2.b": (d,),
              "fc.w": (d, 4 * d), "fc.b": (4 * d,), "proj.w": (4 * d, d), "proj.b": (d,),
              "o.w": (h, k, d), "o.b": (d,)}
    for p in "qkv":
        shapes.update({f"{p}.w": (d, h, k), f"{p}.b": (h, k)})
    return {f"h{i}.{name}": shape for name, shape in shapes.items()}


SHAPES = {"wte": (VOCAB, WIDTH), "wpe": (CONTEXT, WIDTH),
          **{k: v for i in range(LAYERS) for k, v in block_shapes(i).items()},
          "lnf.g": (WIDTH,), "lnf.b": (WIDTH,), "head.w": (WIDTH, VOCAB), "head.b": (VOCAB,)}


def gpt_init(seed: int = 0) -> dict:
    """Kernels N(0, 1/fan_in), embeddings N(0, 0.02^2); biases and layer-norm offsets small
    and random (not zero), so a parameter mapped to the wrong place changes the loss."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in SHAPES.items():
        z = rng.standard_normal(shape)
        if name in ("wte", "wpe"):
            p = 0.02 * z
        elif name.endswith(".g"):
            p = 1 + 0.1 * z
        elif name.endswith(".b"):
            p = 0.02 * z
        else:                           # o.w contracts heads x key_dim
            p = z / np.sqrt(WIDTH if name.endswith("o.w") else shape[0])
        params[name] = p.astype(np.float32)
    return params


# ---------------------------------------------------------------- GPT-2-style (issue 29)
GPT2 = dict(vocab=128, context=CONTEXT, width=WIDTH, layers=LAYERS, heads=HEADS, batch=BATCH)


def gpt2_data(seed: int = 1):
    """The GPT-2-style step's batch: ids [BATCH, CONTEXT] and their next tokens."""
    return token_windows(GPT2["vocab"], seed)


def gpt2_init(seed: int = 0) -> dict:
    """GPT-2's initialization: N(0, 0.02^2) weights (the residual projections scaled by
    1/sqrt(2 layers)), zero biases, unit layer-norm gains."""
    rng = np.random.default_rng(seed)
    v, t, d, layers = GPT2["vocab"], GPT2["context"], GPT2["width"], GPT2["layers"]
    normal = (lambda *shape, s=0.02: (s * rng.standard_normal(shape)).astype(np.float32))
    zeros = (lambda *shape: np.zeros(shape, np.float32))
    p = {"wte": normal(v, d), "wpe": normal(t, d, s=0.01), "lnf.g": np.ones(d, np.float32),
         "lnf.b": zeros(d), "head.w": normal(d, v)}
    residual = 0.02 / np.sqrt(2 * layers)
    for i in range(layers):
        p.update({f"h{i}.ln1.g": np.ones(d, np.float32), f"h{i}.ln1.b": zeros(d),
                  f"h{i}.qkv.w": normal(d, 3 * d), f"h{i}.qkv.b": zeros(3 * d),
                  f"h{i}.o.w": normal(d, d, s=residual), f"h{i}.o.b": zeros(d),
                  f"h{i}.ln2.g": np.ones(d, np.float32), f"h{i}.ln2.b": zeros(d),
                  f"h{i}.fc.w": normal(d, 4 * d), f"h{i}.fc.b": zeros(4 * d),
                  f"h{i}.proj.w": normal(4 * d, d, s=residual), f"h{i}.proj.b": zeros(d)})
    return p


def additive_causal_mask(t: int) -> np.ndarray:
    """GPT-2's mask, added to the scaled scores: 0 where a query may see a key (key <= query),
    -1e9 above the diagonal (softmax then gives those keys exactly 0)."""
    return np.triu(np.full((t, t), -1e9, np.float32), 1)


@dataclass(frozen=True)
class Model:
    """Where the two GPTs differ; the peer scripts (bench/peers/{tf,torch,jax}_gpt.py) build
    either from it, in each framework's plain ops."""
    name: str
    fused_qkv: bool         # one [width, 3 * width] projection split in 3, or q/k/v kernels
    additive_mask: bool     # scores * scale + additive_causal_mask, or where(causal, .., -inf)
    tanh_gelu: bool         # gelu(approximate=True) as GPT-2 and BERT, or the exact form
    head_bias: bool
    data: Callable
    init: Callable


GPT_MODEL = Model("GPT", fused_qkv=False, additive_mask=False, tanh_gelu=False,
                  head_bias=True, data=gpt_data, init=gpt_init)
GPT2_MODEL = Model("GPT-2-style", fused_qkv=True, additive_mask=True, tanh_gelu=True,
                   head_bias=False, data=gpt2_data, init=gpt2_init)


def parameter_count(shapes) -> int:
    """How many numbers these parameters hold (each peer counts its own variables' shapes,
    so a layer built at the wrong size shows)."""
    return sum(int(np.prod(shape)) for shape in shapes)


# The per-op breakdown's groups, by op name: graphdist's ops (step.profile) and PyTorch's
# aten ops (torch.profiler) alike; the first group whose key the name contains.
OP_GROUPS = {"adam update": ("adam", "foreach", "hyper"),
             "matmul/einsum": ("matmul", "einsum", "mm"),
             "layer_norm": ("layer_norm",),
             "gelu": ("gelu",),
             "softmax, mask, cross-entropy": ("softmax", "where", "masked_fill", "reduce_max",
                                              "exp", "div", "log", "nll", "one_hot"),
             "embedding": ("gather", "scatter", "embedding", "index", "sum_duplicates")}


def op_group(name: str) -> str:
    name = name.removeprefix("aten::")
    return next((g for g, keys in OP_GROUPS.items() if any(k in name for k in keys)),
                "other")
