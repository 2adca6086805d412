"""GPU benchmarks, side by side in one run on gpu:0 (needs CuPy and a CUDA GPU):

1. Fused Adam over 100M float32 parameters in 50 tensors through the public API
   (apply_gradients inside a compiled step) against a device-to-device copy of the same
   bytes (the bandwidth limit; target: at least 0.85x of it at 7 x 4 B per parameter vs
   2 x 4 B per copied element), torch.optim.Adam(fused=True) on the same GPU, the unfused
   step, and the bare kernel on separate tensors vs one flat buffer (which layout to use).
2. The MLP 784-1024-1024-10 (batch 512, Adam) on one GPU and on 4 logical GPUs
   (set_logical_device_count("gpu", 4)) against the same model in PyTorch.

Every timed call ends with a device synchronize, so the times are the GPU's.

    python -m bench.gpu [--quick] [--no-save]
"""

from __future__ import annotations

import argparse

import numpy as np

import graphdist as gd
from bench.adam_fused import B1, B2, EPS, LR, N_TENSORS, sizes
from bench.common import interleaved, save, table
from bench.models import make_step
from bench.peers.common import BATCH, SIZES, data, init

ADAM_PARAMS = 100 * 2**20


def _synced(fn):
    import cupy

    def run():
        fn()
        cupy.cuda.runtime.deviceSynchronize()
    return run


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def adam(total: int, repeat: int) -> tuple[dict, str]:
    import cupy

    rng = np.random.default_rng(0)
    shapes = sizes(total)
    host_params = [rng.standard_normal(n).astype(np.float32) for n in shapes]
    with gd.OneDeviceStrategy("gpu:0").scope():
        variables = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(host_params)]
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)
    with cupy.cuda.Device(0):
        grads = [cupy.asarray(rng.standard_normal(n).astype(np.float32) * 1e-2) for n in shapes]
        src, dst = cupy.ones(total, np.float32), cupy.empty(total, np.float32)
    step = gd.function(lambda gs: opt.apply_gradients(zip(gs, variables)))
    fused = sum(e.op.name == "adam_multi_update" for e in step.get_graph(grads).eqns)
    contenders = {"graphdist fused Adam": _synced(lambda: step(grads)),
                  "graphdist unfused (CuPy ops)": _synced(lambda: _unfused(step, grads)),
                  "cupy copy (D2D)": _synced(lambda: cupy.copyto(dst, src)),
                  **_kernel_layouts(cupy, rng, shapes)}
    torch = _torch()
    if torch is not None:
        tp = [torch.nn.Parameter(torch.from_numpy(p).cuda()) for p in host_params]
        for p in tp:
            p.grad = torch.randn_like(p) * 1e-2
        topt = torch.optim.Adam(tp, lr=LR, betas=(B1, B2), eps=EPS, fused=True)
        contenders["torch Adam(fused=True)"] = lambda: (topt.step(), torch.cuda.synchronize())
    t = interleaved(contenders, repeat=repeat, warmup=3)
    copy_gbs = 8 * total / t["cupy copy (D2D)"]["min_s"] / 1e9
    results, rows = {"fused_nodes": fused}, []
    for name, r in t.items():
        per_param = 8 if "copy" in name else 28
        gbs = per_param * total / r["min_s"] / 1e9
        results[name] = {**r, "GB_per_s": gbs, "vs_copy": gbs / copy_gbs}
        rows.append([name, r["median_s"] * 1e3, r["min_s"] * 1e3, gbs, gbs / copy_gbs])
    text = table(f"Adam over {total / 2**20:.0f}M float32 params in {N_TENSORS} tensors on "
                 f"gpu:0 (GB/s by min of {repeat}; target >= 0.85x copy)",
                 ["contender", "median ms", "min ms", "GB/s", "vs copy"], rows)
    return results, text


def _unfused(step, grads):
    gd.config.set_fused_kernels(False)      # its own compiled variant of the step
    try:
        step(grads)
    finally:
        gd.config.set_fused_kernels(True)


def _kernel_layouts(cupy, rng, shapes) -> dict:
    """The two layouts docs/architecture.md weighs, on the bare kernels: the parameters as
    separate tensors (one launch per 16, what graphdist runs) and as one flat buffer (one
    launch for all)."""
    from graphdist.kernels.adam import adam_gpu, adam_multi_gpu

    with cupy.cuda.Device(0):
        hyper = cupy.asarray(np.array([LR, B1, B2, EPS]))   # as a compiled step has it
        ps, gs = ([cupy.asarray(rng.standard_normal(n).astype(np.float32) * scale)
                   for n in shapes] for scale in (1.0, 1e-2))
        tensors = [ps, [cupy.zeros(n, np.float32) for n in shapes],
                   [cupy.zeros(n, np.float32) for n in shapes], gs]    # p, m, v, g
        flat = [cupy.concatenate(ts) for ts in tensors]
    return {"kernel: separate tensors": _synced(lambda: adam_multi_gpu(
                tensors[0], tensors[1], tensors[2], tensors[3], hyper=hyper)),
            "kernel: one flat buffer": _synced(lambda: adam_gpu(
                flat[0], flat[1], flat[2], flat[3], hyper=hyper))}


def torch_mlp(x, y):
    torch = _torch()
    if torch is None:
        return None
    ws = [torch.nn.Parameter(torch.from_numpy(w).cuda()) for w in init()]
    opt = torch.optim.Adam(ws, lr=LR, betas=(B1, B2), eps=EPS, fused=True)
    tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(y).long().cuda()

    def step():
        h = tx
        for i in range(0, len(ws), 2):
            h = h @ ws[i] + ws[i + 1]
            if i + 2 < len(ws):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h, ty)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()            # the loss reaches the host, as graphdist's does
    return step


def mlp(repeat: int) -> tuple[dict, str]:
    x, y = data()
    one = gd.OneDeviceStrategy("gpu:0")
    gd.config.set_logical_device_count("gpu", 4)
    four = gd.MirroredStrategy([f"gpu:{i}" for i in range(4)])
    batch4 = next(iter(four.experimental_distribute_dataset([(x, y)])))
    s1, w1 = make_step(one, "adam")
    s4, w4 = make_step(four, "adam")
    for _ in range(3):
        s1((x, y))
        s4(batch4)
    diff = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(w1, w4))
    contenders = {"graphdist 1 GPU": _synced(lambda: s1((x, y))),
                  "graphdist Mirrored x4 logical GPUs": _synced(lambda: s4(batch4))}
    peer = torch_mlp(x, y)
    if peer is not None:
        contenders["torch (same model, fused Adam)"] = peer
    t = interleaved(contenders, repeat=repeat, warmup=3)
    base = t["graphdist 1 GPU"]["min_s"]
    results = {name: {**r, "vs_graphdist_1": r["min_s"] / base} for name, r in t.items()}
    results["max_param_diff_after_3_steps"] = diff
    rows = [[name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["vs_graphdist_1"]]
            for name, r in results.items() if isinstance(r, dict)]
    text = table(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, Adam, on gpu:0 "
                 f"(min of {repeat})", ["contender", "median ms", "min ms", "vs 1 GPU"], rows)
    return results, text


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="a check that it runs: 1000 parameters, no MLP, 2 repeats")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if not gd.devices("gpu"):
        print("bench.gpu: no GPU here (needs CuPy and a CUDA device); nothing measured")
        return {}
    repeat = 2 if args.quick else 20
    adam_results, adam_text = adam(1000 if args.quick else ADAM_PARAMS, repeat)
    mlp_results, mlp_text = (({}, "") if args.quick else mlp(repeat))
    results = {"adam": adam_results, "mlp": mlp_results, "table": adam_text + "\n\n" + mlp_text}
    if not args.no_save:
        save("gpu", results)
    return results


if __name__ == "__main__":
    main()
