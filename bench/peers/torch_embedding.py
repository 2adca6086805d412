"""PyTorch: the embedding-heavy step (a 50,000 x 256 table, 16,384 lookups = 4 replicas'
4,096) with nn.Embedding(sparse=True) and SGD, one process.

    python -m bench.peers.torch_embedding
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--sparse", type=int, default=1)
    args = ap.parse_args()
    import torch

    from bench.peers.common import report, time_steps
    from bench.peers.embedding import LR, embedding_data

    table, ids, targets = embedding_data()
    emb = torch.nn.Embedding.from_pretrained(torch.tensor(table), freeze=False,
                                             sparse=bool(args.sparse))
    opt = torch.optim.SGD(emb.parameters(), lr=LR)
    ids_t, targets_t = torch.tensor(ids, dtype=torch.long), torch.tensor(targets)

    def step():
        loss = ((emb(ids_t) - targets_t) ** 2).sum(dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    result = time_steps(step, sync=lambda r: float(r))
    report({"peer": f"PyTorch nn.Embedding(sparse={bool(args.sparse)}) + SGD, 1 process",
            **result})


if __name__ == "__main__":
    main()
