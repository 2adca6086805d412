"""Where a GPU step's time goes: host dispatch against the GPU, and the host's profile.

For each case (fused Adam over 100M parameters, the benchmark MLP on one GPU, on 4 logical
GPUs with overlap on and off) it prints the step synced (what bench.gpu times), the host's
time to issue it unsynced (the GPU still busy behind it), the stream synchronizations per
step, and cProfile's top functions by own time. Run on a GPU machine by tools/gpu_check.sh:

    python tools/gpu_profile.py [--steps 20] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))   # for bench/; graphdist as installed

import numpy as np  # noqa: E402

import graphdist as gd  # noqa: E402


def adam_case():
    import cupy

    from bench.adam_fused import B1, B2, EPS, LR, sizes

    rng = np.random.default_rng(0)
    shapes = sizes(100 * 2**20)
    with gd.OneDeviceStrategy("gpu:0").scope():
        variables = [gd.Variable(rng.standard_normal(n).astype(np.float32), name=f"p{i}")
                     for i, n in enumerate(shapes)]
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)
    with cupy.cuda.Device(0):
        grads = [cupy.asarray(rng.standard_normal(n).astype(np.float32) * 1e-2) for n in shapes]
    step = gd.function(lambda gs: opt.apply_gradients(zip(gs, variables)))
    return lambda: step(grads)


def mlp_case(replicas: int, overlap: bool):
    from bench.models import make_step
    from bench.peers.common import data

    x, y = data()
    gd.config.set_overlap(overlap)
    if replicas == 1:
        strategy, batch = gd.OneDeviceStrategy("gpu:0"), (x, y)
    else:
        strategy = gd.MirroredStrategy([f"gpu:{i}" for i in range(replicas)])
        strategy.bucket_bytes = 2**20
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    step, _ = make_step(strategy, "adam")
    step(batch)                              # compiled with this overlap setting
    gd.config.set_overlap(True)
    return lambda: step(batch)


def measure(name: str, run, steps: int, top: int) -> None:
    import cupy

    sync = cupy.cuda.runtime.deviceSynchronize
    for _ in range(3):
        run()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        run()
        sync()
    synced = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        run()
    issued = (time.perf_counter() - t) / steps
    sync()
    drained = (time.perf_counter() - t) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run()
    sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    syncs = sum(v[1] for k, v in stats.stats.items() if "synchronize" in k[2]) / steps
    gets = sum(v[1] for k, v in stats.stats.items() if k[2] in ("get", "<method 'get' of "
               "'cupy._core.core._ndarray_base' objects>")) / steps
    print(f"\n=== {name}: synced {synced * 1e3:.2f} ms/step, host issues a step in "
          f"{issued * 1e3:.2f} ms (all drained {drained * 1e3:.2f}), synchronize calls "
          f"{syncs:.1f}/step, get calls {gets:.1f}/step")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("graphdist|kernels", top)
    print(out.getvalue())


def launch_costs(n: int = 2000) -> None:
    """The host's cost of one device_view and one numba launch against a CuPy kernel's."""
    import cupy

    from graphdist.kernels.common import device_view
    from graphdist.kernels.reduce import all_reduce_gpu

    xs = [cupy.ones(1 << 16, cupy.float32) for _ in range(4)]
    outs = [cupy.empty_like(x) for x in xs]
    cases = {"device_view (CuPy -> numba)": lambda: device_view(xs[0]),
             "all_reduce_gpu, 4 in, 4 out": lambda: all_reduce_gpu(xs, outs=outs),
             "cupy x + y": lambda: cupy.add(xs[0], xs[1], out=outs[0])}
    for name, fn in cases.items():
        print(f"{name}: {_per_call(fn, n) * 1e6:.1f} us per call")


def _per_call(fn, n: int) -> float:
    """Seconds per call of `fn` over n calls after one, the device synchronized around."""
    import cupy

    fn()
    cupy.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t) / n


def chunk_sizes(repeat: int = 20) -> None:
    """The multi-tensor Adam kernel over bench.gpu's 100M parameters in 50 tensors, at
    several elements per block (common.GPU_CHUNK), against the flat kernel."""
    import cupy

    from bench.adam_fused import sizes
    from graphdist.kernels import common
    from graphdist.kernels.adam import adam_gpu, adam_multi_gpu

    rng = np.random.default_rng(0)
    shapes = sizes(100 * 2**20)
    hyper = cupy.asarray(np.array([1e-3, 0.9, 0.999, 1e-7]))
    ts = [[cupy.asarray(rng.standard_normal(n).astype(np.float32)) for n in shapes]
          for _ in range(4)]
    flat = [cupy.concatenate(t) for t in ts]

    def timed(fn):
        return _per_call(fn, repeat) * 1e3

    print(f"flat adam_gpu: {timed(lambda: adam_gpu(*flat, hyper=hyper)):.3f} ms")
    kept = common.GPU_CHUNK
    for chunk in (1 << 10, 1 << 12, 1 << 13, 1 << 15):
        common.GPU_CHUNK = chunk
        common._tables.clear()
        print(f"adam_multi_gpu, {chunk} elements per block: "
              f"{timed(lambda: adam_multi_gpu(*ts, hyper=hyper)):.3f} ms")
    common.GPU_CHUNK = kept
    common._tables.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    if not gd.devices("gpu"):
        print("gpu_profile: no GPU here")
        return
    launch_costs()
    chunk_sizes()
    measure("fused Adam, 100M params in 50 tensors", adam_case(), args.steps, args.top)
    measure("MLP, 1 GPU", mlp_case(1, True), args.steps, args.top)
    gd.config.set_logical_device_count("gpu", 4)
    measure("MLP, 4 logical GPUs, overlap on", mlp_case(4, True), args.steps, args.top)
    measure("MLP, 4 logical GPUs, overlap off", mlp_case(4, False), args.steps, args.top)


if __name__ == "__main__":
    main()
