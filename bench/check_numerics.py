"""What gd.config.check_numerics(True) costs: the MLP, CNN and GPT training steps of
bench/models.py on one CPU device and the MLP on 2 mirrored logical devices, each timed
with the checks off and on, interleaved in one run (the same compiled step: it holds one
program per setting).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.check_numerics
"""

from __future__ import annotations

import argparse

import graphdist as gd
from bench.common import interleaved, table

from bench.models import make_cnn_step, make_gpt_step, make_step
from bench.peers.common import cnn_data, data
from bench.peers.gpt_common import gpt_data


def _with_checks(step, batch, checked: bool):
    def run():
        gd.config.check_numerics(checked)
        try:
            return step(batch)
        finally:
            gd.config.check_numerics(False)
    return run


def main(repeat: int = 10) -> dict:
    one = gd.OneDeviceStrategy("cpu:0")
    two = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    steps = {"MLP 784-1024-1024-10, batch 512": (make_step(one)[0], data()),
             "MLP on 2 mirrored devices": (make_step(two)[0], next(iter(
                 two.experimental_distribute_dataset([data()])))),
             "CNN, batch 256": (make_cnn_step(one)[0], cnn_data()),
             "GPT 2x128, batch 32x64": (make_gpt_step(one)[0], gpt_data())}
    contenders = {}
    for name, (step, batch) in steps.items():
        contenders[f"{name}: off"] = _with_checks(step, batch, False)
        contenders[f"{name}: on"] = _with_checks(step, batch, True)
    t = interleaved(contenders, repeat=repeat)
    rows = []
    for name in steps:
        off, on = t[f"{name}: off"]["median_s"], t[f"{name}: on"]["median_s"]
        rows.append([name, f"{off * 1e3:.2f}", f"{on * 1e3:.2f}", f"{on / off:.2f}x"])
    table("gd.config.check_numerics: median step time (ms), interleaved",
                ["step", "off", "on", "on / off"], rows)
    return t


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    main(parser.parse_args().repeat)
