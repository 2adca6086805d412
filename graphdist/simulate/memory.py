"""Memory per replica at ZeRO stages 0, 1 and 2 (`graphdist simulate --memory`).

The arithmetic of Rajbhandari et al. 2020 (ZeRO, section 3 and figure 1): a model of Psi
parameters keeps, per replica, parameters (2 Psi bytes in float16), gradients (2 Psi) and
optimizer state (K Psi; mixed-precision Adam: float32 master parameters, momentum and
variance, K = 12). Stage 0 (plain data parallelism) keeps all of it on every replica:
(2 + 2 + K) Psi = 16 Psi. Stage 1 shards the optimizer state over N replicas:
2 Psi + 2 Psi + K Psi / N. Stage 2 also the gradients: 2 Psi + (2 + K) Psi / N. For 7.5B
parameters on 64 replicas: 120 GB, 31.4 GB and 16.6 GB.

From a builder's step the same three groups come from its traced graph: the bytes of its
trainable variables (parameters), as many bytes of gradients, and the bytes of its
optimizer slots (state inputs marked "slot"), plus the peak live bytes of the values the
step makes (activations and temporaries, from the schedule's liveness), which data
parallelism does not shard. graphdist's own stage 1 program already keeps only the shard of
each reduced gradient (optimizers/zero.py); the table follows the paper, where stage 1
keeps them whole.
"""

from __future__ import annotations

MIXED_PRECISION_ADAM = (2, 2, 12)   # bytes per parameter: float16 params, grads; fp32 state
GB = 1e9
ROWS = ("parameters_B", "gradients_B", "optimizer_slots_B", "activations_B")


def per_replica(parameters: float, gradients: float, slots: float, activations: float,
                n: int, stage: int) -> dict:
    """Bytes one of `n` replicas keeps at `stage`, from the unsharded totals."""
    if stage not in (0, 1, 2):
        raise ValueError(f"simulate --memory: zero stage must be 0, 1 or 2, got {stage}")
    if n < 1:
        raise ValueError(f"simulate --memory: device counts must be >= 1, got {n}")
    row = {"devices": n, "zero_stage": stage, "parameters_B": parameters,
           "gradients_B": gradients / n if stage >= 2 else gradients,
           "optimizer_slots_B": slots / n if stage >= 1 else slots,
           "activations_B": activations}
    row["total_B"] = sum(row[k] for k in ROWS)
    return row


def paper_rows(params: float, devices, stages=(0, 1, 2), bytes_per_param=MIXED_PRECISION_ADAM,
               activations: float = 0.0) -> list[dict]:
    """The ZeRO paper's per-replica bytes for a model of `params` parameters.

    >>> [round(r["total_B"] / 1e9, 1) for r in paper_rows(7.5e9, [64])]
    [120.0, 31.4, 16.6]
    """
    p, g, k = bytes_per_param
    return [per_replica(p * params, g * params, k * params, activations, int(n), int(s))
            for n in devices for s in stages]


def graph_bytes(g) -> dict:
    """One replica's unsharded bytes from a step's logical graph: parameters, gradients (as
    many bytes as the parameters), optimizer slots, and peak activations."""
    from graphdist.viz.summary import peak_bytes

    states = g.inputs[len(g.inputs) - len(g.variables):] if g.variables else ()
    total = {"parameter": 0, "slot": 0}
    for var, ref in zip(states, g.variables):
        if ref.role in total:
            total[ref.role] += var.ty.nbytes
    return {"parameters": total["parameter"], "gradients": total["parameter"],
            "slots": total["slot"], "activations": max(peak_bytes(g).values(), default=0)}


def builder_rows(builder, devices, stages=(0, 1, 2)) -> list[dict]:
    """Per-replica bytes of the builder's step (traced on 1 device) on each device count
    and stage. The builder's per-replica batch is taken to stay the same (weak scaling)."""
    f, args = builder(1)
    b = graph_bytes(f.get_graph(*args))
    if not b["slots"]:
        raise ValueError("simulate --memory: the builder's step has no optimizer slots in "
                         "its graph (does it call apply_gradients with an optimizer that "
                         "keeps slots, such as Adam or SGD with momentum?)")
    return [dict(per_replica(b["parameters"], b["gradients"], b["slots"], b["activations"],
                             int(n), int(s)), params=b["parameters"])
            for n in devices for s in stages]


def format_memory(rows: list[dict]) -> str:
    """The table `graphdist simulate --memory` prints (GB = 1e9 bytes, as the paper)."""
    def size(b: float) -> str:
        return f"{b / GB:.1f}" if b >= 0.05 * GB else f"{b / 2**20:.3f} MiB"

    header = (f"{'devices':>8} {'stage':>5} {'params GB':>12} {'grads GB':>12} "
              f"{'slots GB':>12} {'activ. GB':>12} {'total GB':>12}")
    lines = ["memory per replica (ZeRO arithmetic: stage 1 shards the optimizer slots, "
             "stage 2 the gradients too)", header]
    for r in rows:
        lines.append(f"{r['devices']:>8} {r['zero_stage']:>5} "
                     + " ".join(f"{size(r[k]):>12}" for k in (*ROWS, "total_B")))
    return "\n".join(lines)


__all__ = ["MIXED_PRECISION_ADAM", "builder_rows", "format_memory", "graph_bytes",
           "paper_rows", "per_replica"]
