"""PyTorch DistributedDataParallel (gloo): the MLP step on N processes (PyTorch's data
parallelism on CPU), each on its share of the global batch (DDP averages the gradients)
with the host's cores shared out, or PyTorch in one process with every thread
(`--procs 1`). Started with torch.multiprocessing.spawn, the rendezvous on a free TCP port
of 127.0.0.1; rank 0 reports, its first step as `first_call_s`.

    python -m bench.peers.torch_ddp_mlp [--procs 2] [--threads 1] [--pin] [--optimizer adam]
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import sys
import time


def _model(torch):
    from bench.peers.common import SIZES, init

    layers = []
    params = init()
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        linear = torch.nn.Linear(a, b)
        with torch.no_grad():           # Linear keeps (out, in) weights: the transpose
            linear.weight.copy_(torch.tensor(params[2 * i].T.copy()))
            linear.bias.copy_(torch.tensor(params[2 * i + 1]))
        layers += [linear] + ([torch.nn.ReLU()] if i + 2 < len(SIZES) else [])
    return torch.nn.Sequential(*layers)


def _worker(rank: int, args, port: int, queue) -> None:
    import torch

    from bench.peers.common import BATCH, LR, data

    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(args.threads)
    model = _model(torch)
    if args.procs > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.procs)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = (torch.optim.Adam(model.parameters(), lr=LR, eps=1e-7) if args.optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    x, y = data()
    share = BATCH // args.procs                 # this process's rows of the global batch
    xs = torch.tensor(x[rank * share:(rank + 1) * share])
    ys = torch.tensor(y[rank * share:(rank + 1) * share], dtype=torch.long)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xs), ys)
        loss.backward()                          # DDP all-reduces the gradients here
        opt.step()
        return loss

    t0 = time.perf_counter()
    for k in range(3):                           # the same first 3 steps as the others
        losses.append(float(step().detach()))
        if k == 0:
            first = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    samples = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        float(step().detach())
        samples.append(time.perf_counter() - t0)
    if args.procs > 1:
        # the mean loss over the workers is the global batch's (what the others return)
        t = torch.tensor(losses)
        torch.distributed.all_reduce(t)
        losses = (t / args.procs).tolist()
        every = [None] * args.procs              # per step, the slower process's time
        torch.distributed.all_gather_object(every, samples)
        samples = [max(s) for s in zip(*every)]
    if rank == 0:
        queue.put({"median_s": statistics.median(samples), "min_s": min(samples),
                   "first_call_s": first,
                   "repeat": args.repeat, "samples_s": samples, "losses": losses,
                   "threads": torch.get_num_threads(),
                   "affinity": sorted(os.sched_getaffinity(0))})
    if args.procs > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=None, help="default: --devices")
    ap.add_argument("--threads", type=int, default=None,
                    help="per process (default: the cores shared out, at least 1)")
    ap.add_argument("--pin", action="store_true", help="each process on one core of its own")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--devices", type=int, default=2,
                    help="processes when --procs is not given (run_peer passes it)")
    args = ap.parse_args()
    args.procs = args.procs or args.devices
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.procs)
    import torch.multiprocessing as mp

    from bench.peers.common import report

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    if args.procs == 1:
        _worker(0, args, 0, queue)
    else:
        try:
            mp.spawn(_worker, args=(args, _free_port(), queue), nprocs=args.procs, join=True)
        except mp.ProcessExitedException as e:
            # gloo now and then aborts a process as it exits ("terminate called without an
            # active exception"), after rank 0 has put its result: use it if it is there
            if queue.empty():
                raise
            print(f"torch_ddp_mlp: after the timing: {e}", file=sys.stderr)
    r = queue.get()
    name = (f"PyTorch DDP gloo {args.procs} procs x {args.threads} thread"
            if args.procs > 1 else f"PyTorch 1 process x {args.threads} threads")
    report({"peer": name + (", pinned" if args.pin else ""), "procs": args.procs,
            "optimizer": args.optimizer, **r})


if __name__ == "__main__":
    main()
