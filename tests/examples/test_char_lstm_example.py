"""The character-level LSTM example (examples/char_lstm.py) on the bundled Shakespeare: its
loss falls, and 4 replicas train the same model as one device on the global batch."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.datasets import load_shakespeare
from graphdist.examples import char_lstm, gpt_chars

TINY = dict(steps=8, batch_size=8, context=16, units=32, embedding=8, evaluate=False)


def test_the_loss_falls_and_four_replicas_match_one_device():
    one, four = char_lstm.train(1, **TINY), char_lstm.train(4, **TINY)
    losses = one["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(np.log(one["data"].vocab_size), rel=0.05)  # uniform
    np.testing.assert_allclose(four["losses"], losses, rtol=1e-5)
    for a, b in zip(one["params"], four["params"]):
        np.testing.assert_allclose(b, a, atol=1e-5)
    for v in four["model"].variables:                     # mirrored components stay equal
        assert all(np.array_equal(v.values[0], c) for c in v.values[1:])


def test_the_step_runs_the_lstm_as_one_scan_node():
    from graphdist.ops.control_flow import scan_p

    result = char_lstm.train(1, **{**TINY, "steps": 1})
    batch = gpt_chars.windows(result["data"].train, np.arange(TINY["batch_size"]), 16)
    g = result["train_step"].get_graph(batch)
    assert [e.op for e in g.eqns].count(scan_p) == 2       # forward and backward


def test_bundled_text_and_its_splits():
    text = load_shakespeare()
    assert text.startswith("First Citizen:") and len(text) == 59804
    train, test = load_shakespeare("train"), load_shakespeare("test", test_fraction=0.1)
    assert train + test == text and len(test) == round(0.1 * len(text))
    assert len(load_shakespeare("test", test_fraction=0.5)) == len(text) // 2
    with pytest.raises(ValueError, match="split must be"):
        load_shakespeare("validation")
    with pytest.raises(ValueError, match="test_fraction"):
        load_shakespeare("train", test_fraction=1.5)
