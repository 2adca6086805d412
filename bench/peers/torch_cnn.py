"""PyTorch: the tutorial CNN step on one CPU device (Adam, eager). torch.optim.Adam adds
epsilon to the bias-corrected sqrt(v), the others (Keras, graphdist) before the correction:
its loss after one step is 3.10733 against their 3.09642 (with eps scaled to match Keras's
in step 1, 3.09642); the same work per step.

    python -m bench.peers.torch_cnn
"""

from __future__ import annotations


def main() -> None:
    from bench.peers.common import (LR, cnn_data, cnn_init, one_device_args, report,
                                    timed_with_losses)

    one_device_args("torch_cnn", "the 4-replica rows compare TF and JAX")
    import torch

    x, y = cnn_data()
    k1, b1, k2, b2, w3, b3, w4, b4 = cnn_init()
    # TF layouts to PyTorch's: NHWC -> NCHW, HWIO -> OIHW; the flatten order follows NHWC
    conv = lambda k: torch.tensor(k.transpose(3, 2, 0, 1).copy())  # noqa: E731
    params = [conv(k1), torch.tensor(b1), conv(k2), torch.tensor(b2), torch.tensor(w3),
              torch.tensor(b3), torch.tensor(w4), torch.tensor(b4)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=LR, eps=1e-7)
    xs = torch.tensor(x.transpose(0, 3, 1, 2).copy())
    ys = torch.tensor(y, dtype=torch.long)
    F = torch.nn.functional

    def step():
        k1, b1, k2, b2, w3, b3, w4, b4 = params
        h = F.max_pool2d(F.relu(F.conv2d(xs, k1, b1)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, k2, b2)), 2)
        h = h.permute(0, 2, 3, 1).reshape(h.shape[0], -1)       # NHWC flatten, as TF
        loss = F.cross_entropy(F.relu(h @ w3 + b3) @ w4 + b4, ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    report({"peer": "PyTorch eager", "devices": 1, "optimizer": "adam",
            **timed_with_losses(step)})


if __name__ == "__main__":
    main()
