"""The GPT example (examples/gpt_chars.py, `graphdist demo --model gpt`): it learns more than
a bigram model, and 4 replicas train the same model as one device on the global batch."""

from __future__ import annotations

import numpy as np

from graphdist.cli import main
from graphdist.examples import gpt_chars

TINY = dict(steps=4, evaluate=False, width=32, layers=1, heads=2, context=16, batch_size=8)


def test_four_replicas_train_the_gpt_like_one_device_on_the_global_batch():
    one, four = gpt_chars.train(1, **TINY), gpt_chars.train(4, **TINY)
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-4)
    for a, b in zip(one["params"], four["params"]):
        np.testing.assert_allclose(b, a, atol=2e-3)
    for v in four["model"].variables:                     # mirrored components stay equal
        assert all(np.array_equal(v.values[0], c) for c in v.values[1:])


def test_a_small_gpt_beats_the_bigram_baseline_on_held_out_text():
    result = gpt_chars.train(1, steps=300, width=64, layers=1, heads=2, context=32,
                             batch_size=16, learning_rate=1e-2)
    assert result["held_out_loss"] < result["bigram_loss"] - 0.05, result


def test_sampling_continues_the_prompt_with_known_characters():
    result = gpt_chars.train(1, **TINY)
    text = gpt_chars.sample(result["model"], result["data"], "def ", length=20)
    assert text.startswith("def ") and len(text) == 24
    assert set(text) <= set(result["data"].chars)


def test_demo_trains_the_gpt(capsys):
    assert main(["demo", "--model", "gpt", "--devices", "2", "--steps", "3", "--html", ""]) == 0
    out = capsys.readouterr().out
    assert "character-level GPT" in out and "bigram baseline" in out and "sampled:" in out
    diff = float(out.split("max |parameter difference| vs one device: ")[1].split()[0])
    assert diff < 1e-3
    assert "einsum" in out and "layer_norm" in out
