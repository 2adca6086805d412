"""The benchmark GPT every contender builds: examples/gpt_chars.py's model at its default
sizes. Token and position embeddings, 2 pre-norm blocks (causal 4-head attention with
Keras-shaped kernels, an exact-GELU MLP of 4x the width), a final layer norm and a dense
head; mean next-token cross-entropy; Adam lr 1e-3 (no clipping, no schedule).

The parameters are a dict of numpy arrays in graphdist's (Keras's) layouts: q/k/v kernels
[width, heads, key_dim] with biases [heads, key_dim], the output kernel [heads, key_dim,
width], dense kernels [in, out]; each framework reshapes them to its own ops."""

from __future__ import annotations

import numpy as np

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, BATCH = 103, 64, 128, 2, 4, 32
KEY_DIM = WIDTH // HEADS
LN_EPS = 1e-5                          # graphdist's LayerNorm default


def gpt_data(seed: int = 1):
    """ids [BATCH, CONTEXT] and their next tokens: windows of one random id sequence."""
    seq = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, CONTEXT + 1))
    return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


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
