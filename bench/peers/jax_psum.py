"""JAX for bench/allreduce.py: `pmap(psum)` of N x MiB float32 buffers over N XLA host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, set before jax is imported),
the buffers already on their devices; every device gets the sum, in a new buffer.

    python -m bench.peers.jax_psum [--mib 16] [--devices 4] [--repeat 30]
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    from bench.peers.common import report, time_steps

    assert jax.device_count() == args.devices, jax.devices()
    size = args.mib * 2**20 // 4
    rng = np.random.default_rng(0)     # the buffers bench/allreduce.py sums
    bufs = np.stack([rng.standard_normal(size).astype(np.float32)
                     for _ in range(args.devices)])
    x = jax.pmap(lambda v: v)(bufs)    # one row per device, placed once before timing
    step = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
    got = np.asarray(step(x))
    np.testing.assert_allclose(got, np.broadcast_to(bufs.sum(0), got.shape), rtol=1e-5,
                               atol=1e-5)
    result = time_steps(lambda: step(x), sync=lambda r: r.block_until_ready(), warmup=3,
                        repeat=args.repeat)
    report({"peer": f"JAX pmap(psum) over {args.devices} XLA host devices",
            "jax": jax.__version__, **result})


if __name__ == "__main__":
    main()
