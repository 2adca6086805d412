"""Device backends declare what their kind can do, and everything above graphdist/device/
asks them: a new kind is its Backend subclass plus one `register_backend` call. Shown here
with "xpu", a numpy kind in host memory that is not "cpu" (it reuses the "cpu" kernels),
registered by this file only: it trains the demo's MLP on xpu:0 and xpu:1 to the very
parameters two cpu devices give, and is unregistered afterwards."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from graphdist.device.backends import (Backend, backend_for, backend_of_kind, kinds,
                                       register_backend, unregister_backend)
from graphdist.device.host import HOST_KERNELS
from graphdist.device.names import canonical, default_devices
from graphdist.distribute.cross_device_ops import choose_cross_device_ops
from graphdist.examples import mlp_digits

ROOT = Path(__file__).resolve().parents[2]


class XpuBackend(Backend):
    """Two numpy devices in host memory; the host's Numba kernels serve them."""

    kind = "xpu"
    kernel_kind = HOST_KERNELS

    def __init__(self):
        super().__init__()
        self.ran_on: set[str] = set()       # the devices the runtime asked this backend for

    def physical_count(self) -> int:
        return 2

    def for_device(self, device: str) -> Backend:
        self.ran_on.add(device)
        return self


class AcceleratorXpu(XpuBackend):
    accelerator = True


@pytest.fixture
def xpu():
    backend = XpuBackend()
    register_backend("xpu", backend)
    try:
        yield backend
    finally:
        unregister_backend("xpu")


def test_each_kind_declares_its_capabilities_without_setting_a_device_up():
    cpu, gpu = backend_of_kind("cpu"), backend_of_kind("gpu")
    assert kinds()[:2] == ["cpu", "gpu"]
    assert cpu.xp is np and cpu.shares_host_memory and not cpu.ordered
    assert cpu.merges_replicas and cpu.threads and not cpu.accelerator
    assert (cpu.kernel_kind, cpu.default_lowering) == ("cpu", "host")
    assert not gpu.shares_host_memory and gpu.ordered and gpu.accelerator and gpu.nccl
    assert not gpu.merges_replicas and not gpu.threads
    assert (gpu.kernel_kind, gpu.default_lowering) == ("gpu", "nccl")
    assert backend_for("cpu:3") is cpu                 # host memory: one backend for all
    # what cross_device_ops=None means is what each kind declares
    assert type(choose_cross_device_ops(["gpu:0", "gpu:1"])).__name__ == "NcclAllReduce"
    assert type(choose_cross_device_ops(["cpu:0", "cpu:1"])).__name__ == "HostAllReduce"


def test_a_registered_kind_is_named_parsed_and_counted_then_forgotten(xpu):
    assert gd.devices("xpu") == ["xpu:0", "xpu:1"]
    assert gd.devices()[-2:] == ["xpu:0", "xpu:1"]
    assert canonical("/device:XPU:1") == "xpu:1"
    with pytest.raises(ValueError, match=r"'xpu:2' is not available.*xpu:1"):
        canonical("xpu:2")
    gd.config.set_logical_device_count("xpu", 3)       # a logical split, as for GPUs
    assert gd.devices("xpu") == ["xpu:0", "xpu:1", "xpu:2"]
    assert type(choose_cross_device_ops(["xpu:0", "xpu:1"])).__name__ == "HostAllReduce"
    assert default_devices() == ["cpu:0"]              # not an accelerator: not the default
    unregister_backend("xpu")
    try:
        assert "xpu:0" not in gd.devices()
        with pytest.raises(ValueError, match="unknown device 'xpu:0'"):
            canonical("xpu:0")
        with pytest.raises(ValueError, match="kind must be one of 'cpu', 'gpu'.*got 'xpu'"):
            gd.config.set_logical_device_count("xpu", 2)
        with pytest.raises(ValueError, match="unknown device kind 'xpu'"):
            backend_of_kind("xpu")
    finally:
        register_backend("xpu", xpu)                    # for the fixture to unregister
    assert gd.devices("xpu") == ["xpu:0", "xpu:1"]     # the logical split went with it


def test_registering_checks_the_kind():
    with pytest.raises(ValueError, match="'cpu' is already registered"):
        register_backend("cpu", backend_of_kind("cpu"))
    with pytest.raises(ValueError, match="whose kind is 'tpu'"):
        register_backend("tpu", XpuBackend())
    with pytest.raises(ValueError, match="lower-case identifier, got 'x:y'"):
        register_backend("x:y", XpuBackend())
    with pytest.raises(ValueError, match="no device kind 'tpu'"):
        unregister_backend("tpu")
    assert "tpu" not in kinds() and "x:y" not in kinds()


def test_an_accelerator_kind_is_what_mirrored_strategy_takes_by_default():
    register_backend("xpu", AcceleratorXpu())
    try:
        assert gd.MirroredStrategy().devices == ("xpu:0", "xpu:1")
    finally:
        unregister_backend("xpu")
    assert gd.MirroredStrategy().devices == (tuple(gd.devices("gpu")) or ("cpu:0",))


def test_host_all_reduce_asks_for_host_memory_and_nccl_for_nccl_devices(xpu):
    from graphdist.passes.collectives.blocks import require_capability

    require_capability("HostAllReduce", ("xpu:0", "cpu:1"), "shares_host_memory",
                       "devices in host memory", "")
    with pytest.raises(ValueError, match=r"NcclAllReduce: expected only devices NCCL runs "
                                         r"between, got \['xpu:0', 'gpu:1'\] \(xpu:0 not\)"):
        require_capability("NcclAllReduce", ("xpu:0", "gpu:1"), "nccl",
                           "devices NCCL runs between", "")


def _train_mlp(kind: str) -> dict:
    return mlp_digits.train(devices=2, steps=20, batch_size=64, seed=1, kind=kind,
                            steps_per_call=10, workers=False)


def test_the_mlp_trains_on_two_xpu_devices_to_the_bits_of_two_cpu_devices(xpu):
    on_xpu = _train_mlp("xpu")
    on_cpu = _train_mlp("cpu")
    assert on_xpu["strategy"].devices == ("xpu:0", "xpu:1")
    assert on_cpu["strategy"].devices == ("cpu:0", "cpu:1")
    assert xpu.ran_on == {"xpu:0", "xpu:1"}            # its devices went through its backend
    assert on_xpu["losses"][-1] < on_xpu["losses"][0]  # it trains
    # the kernel kind it names ("cpu") gives it the host's kernels: the very same program
    # (a backend naming its own kernel kind, with no entries, gets the ops' numpy forms)
    # (each device's program headed by its device's name: a thread per device)
    assert on_xpu["train_step"].program_source().replace("xpu:", "cpu:") == \
        on_cpu["train_step"].program_source()
    assert on_xpu["losses"] == on_cpu["losses"]
    for a, b in zip(on_xpu["params"], on_cpu["params"]):
        np.testing.assert_array_equal(a, b)             # the same numpy and Numba code ran


# ------------------------------------------------------ no device kind named above device/
# Where "gpu" may still be spelled outside graphdist/device/, and why: (file, source line).
ALLOWED_GPU_MENTIONS = {
    ("graphdist/cli.py", 'kind = "gpu" if args.gpu else "cpu"'):
        "user input: `graphdist demo --gpu` names the device kind the user asked for",
}

_GPU_NAME = re.compile(r"gpu(:\d+)?")


def gpu_mentions(source: str) -> list[tuple[int, str]]:
    """(line, what) for each "gpu" / "gpu:N" string constant and each `is_gpu` name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _GPU_NAME.fullmatch(node.value):
            found.append((node.lineno, repr(node.value)))
        name = getattr(node, "id", None) or getattr(node, "attr", None) or \
            getattr(node, "name", None)
        if isinstance(name, str) and name.split(".")[-1] == "is_gpu":
            found.append((getattr(node, "lineno", 0), "is_gpu"))
    return found


def test_the_scan_finds_what_it_looks_for():
    source = ('from graphdist.device.names import is_gpu\n'
              'if kind == "gpu" or d.startswith("gpu:1") or names.is_gpu(d):\n'
              '    """gpu devices"""\n')
    assert sorted(gpu_mentions(source)) == [(1, "is_gpu"), (2, "'gpu'"), (2, "'gpu:1'"),
                                            (2, "is_gpu")]


def test_no_module_above_device_names_the_gpu_kind():
    unexpected, used = [], set()
    for path in sorted((ROOT / "graphdist").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("graphdist/device/"):
            continue
        lines = path.read_text().splitlines()
        for lineno, what in gpu_mentions(path.read_text()):
            key = (rel, lines[lineno - 1].split("#")[0].strip())
            if key in ALLOWED_GPU_MENTIONS:
                used.add(key)
            else:
                unexpected.append(f"{rel}:{lineno}: {what} in {key[1]!r}")
    assert not unexpected, "ask the backend's capabilities instead:\n" + "\n".join(unexpected)
    assert used == set(ALLOWED_GPU_MENTIONS), f"stale allow-list entries: " \
                                              f"{set(ALLOWED_GPU_MENTIONS) - used}"
