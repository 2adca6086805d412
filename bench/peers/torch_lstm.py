"""PyTorch: the LSTM training step (torch.nn.LSTM, its fused CPU kernel; SGD) on one CPU
device, eager, from the same weights (Keras's kernel transposed: PyTorch's gate order i, f,
g, o is Keras's i, f, c, o; its second bias at zero).

    python -m bench.peers.torch_lstm
"""

from __future__ import annotations


def main() -> None:
    from bench.peers.common import (LSTM_LR, LSTM_WIDTH, lstm_data, lstm_init, one_device_args,
                                    report, timed_with_losses)

    one_device_args("torch_lstm")
    import torch

    x, y = lstm_data()
    kernel, recurrent, bias = lstm_init()
    lstm = torch.nn.LSTM(LSTM_WIDTH, LSTM_WIDTH, batch_first=True)
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.tensor(kernel.T))
        lstm.weight_hh_l0.copy_(torch.tensor(recurrent.T))
        lstm.bias_ih_l0.copy_(torch.tensor(bias))
        lstm.bias_hh_l0.zero_()
    lstm.bias_hh_l0.requires_grad_(False)      # one bias trained, as the others have
    opt = torch.optim.SGD([p for p in lstm.parameters() if p.requires_grad], lr=LSTM_LR)
    xs, ys = torch.tensor(x), torch.tensor(y)

    def step():
        out, _ = lstm(xs)
        loss = ((out[:, -1] - ys) ** 2).sum() / xs.shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    report({"peer": "PyTorch eager (nn.LSTM)", "devices": 1, "optimizer": "sgd",
            **timed_with_losses(step)})


if __name__ == "__main__":
    main()
