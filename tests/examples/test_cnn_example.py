"""The CNN example (examples/cnn_digits.py, `graphdist demo --model cnn`): it learns the
digits, and 4 replicas train the same model as one device on the global batch."""

from __future__ import annotations

import numpy as np

from graphdist.cli import main
from graphdist.examples import cnn_digits


def test_the_cnn_reaches_97_percent_held_out_on_one_and_four_devices():
    one, four = cnn_digits.train(1, 300), cnn_digits.train(4, 300)
    assert one["accuracy"] >= 0.97 and four["accuracy"] >= 0.97
    # dropout off: the same training. The two programs add in different orders (one
    # device sums the bias gradients of 128 images in blocks, a replica of 32 in one), and
    # 300 steps of Adam amplify float32 rounding (a relu mask that flips near 0), so the
    # losses are compared while rounding is all that separates them (measured: under 3e-7
    # for 20 steps, 1e-5 by step 30, and 0.06 apart in a parameter after 300)
    np.testing.assert_allclose(one["losses"][:20], four["losses"][:20], rtol=1e-5)
    for v in four["model"].variables:                     # mirrored components stay equal
        if not v.on_read:
            assert all(np.array_equal(v.values[0], c) for c in v.values[1:])


def test_demo_trains_the_cnn_and_writes_its_replicated_graph(tmp_path, capsys):
    html = tmp_path / "cnn.html"
    assert main(["demo", "--model", "cnn", "--devices", "2", "--steps", "20",
                 "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "a CNN" in out and "held-out accuracy" in out
    diff = float(out.split("max |parameter difference| vs one device: ")[1].split()[0])
    assert diff < 1e-4
    assert "conv2d" in out and "conv2d_backprop_filter" in out and "cpu:1" in html.read_text()
