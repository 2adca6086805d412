"""PyTorch's ZeroRedundancyOptimizer (torch.distributed.optim, PR #46750), the peer of
graphdist's zero_stage=1: the MLP step (784-1024-1024-10, Adam, global batch 512) on N gloo
processes (default 2), each on its share of the batch, one thread each and pinned, as
bench/zero_rank.py runs graphdist's 2 MPI workers. Two models in the same processes, timed
interleaved (a barrier before every sample; per sample the slower process's time):

- "stage 0": DistributedDataParallel + torch.optim.Adam (every process keeps all of Adam's
  state);
- "ZeRO": DistributedDataParallel + ZeroRedundancyOptimizer(optimizer_class=Adam): each
  process keeps the state of its share of the parameters (whole tensors, assigned greedily
  by size), updates them and broadcasts them to the others.

Started with torch.multiprocessing.spawn, the rendezvous on a free TCP port of 127.0.0.1;
rank 0 prints one `RESULT {json}` line with each optimizer's first 3 losses.

    .venv-bench/bin/python -m bench.peers.torch_zero [--procs 2] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.peers.torch_ddp_mlp import _free_port, _model


def _optimizer(torch, model, zero: bool):
    from bench.peers.common import LR

    if not zero:
        return torch.optim.Adam(model.parameters(), lr=LR, eps=1e-7)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                   lr=LR, eps=1e-7)


def _worker(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from bench.peers.common import BATCH, data

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.procs)
    x, y = data()
    share = BATCH // args.procs
    xs = torch.tensor(x[rank * share:(rank + 1) * share])
    ys = torch.tensor(y[rank * share:(rank + 1) * share], dtype=torch.long)
    steps, losses, state = {}, {}, {}
    for name, zero in (("stage 0", False), ("ZeRO", True)):
        model = torch.nn.parallel.DistributedDataParallel(_model(torch))
        opt = _optimizer(torch, model, zero)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xs), ys)
            loss.backward()                      # DDP all-reduces the gradients here
            opt.step()                           # ZeRO: its shard, then the broadcasts
            return loss

        steps[name] = step
        local = [float(step().detach()) for _ in range(3)]
        t = torch.tensor(local)
        dist.all_reduce(t)
        losses[name] = (t / args.procs).tolist()
        inner = getattr(opt, "optim", opt)       # ZeRO keeps its shard's optimizer there
        state[name] = sum(s.numel() * s.element_size() for group in inner.state.values()
                          for s in group.values() if torch.is_tensor(s))
    for step in steps.values():
        for _ in range(args.warmup):
            dist.barrier()
            step()
    samples = {name: [] for name in steps}
    for _ in range(args.repeat):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            float(step().detach())
            samples[name].append(time.perf_counter() - t0)
    slowest = {}
    for name, mine in samples.items():
        every = [None] * args.procs
        dist.all_gather_object(every, mine)
        slowest[name] = [max(s) for s in zip(*every)]
    states = [None] * args.procs
    dist.all_gather_object(states, state)
    if rank == 0:
        queue.put({name: {"median_s": statistics.median(v), "min_s": min(v), "samples_s": v,
                          "losses": losses[name],
                          "optimizer_state_B": [s[name] for s in states]}
                   for name, v in slowest.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    from bench.peers.common import report

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.spawn(_worker, args=(args, _free_port(), queue), nprocs=args.procs, join=True)
    except mp.ProcessExitedException as e:
        if queue.empty():                  # gloo may abort a process as it exits
            raise
        print(f"torch_zero: after the timing: {e}", file=sys.stderr)
    report({"peer": f"PyTorch {torch.__version__} DDP gloo {args.procs} procs x 1 thread, "
                    "pinned", "procs": args.procs, "repeat": args.repeat,
            "results": queue.get()})


if __name__ == "__main__":
    main()
