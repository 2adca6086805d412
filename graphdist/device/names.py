"""Device strings ("cpu:N", "gpu:N"): parsing, validation and what exists on this machine."""

from __future__ import annotations

import functools

from graphdist import config


@functools.cache
def physical_gpu_count() -> int:
    try:
        import cupy  # noqa: PLC0415 - optional, imported only when asked about GPUs

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU"
        return 0


def physical_gpu_of(device: str) -> int:
    """The physical GPU a logical one runs on: round robin, gpu:i on i % physical count.

    >>> physical_gpu_of("gpu:5") == 5 % max(physical_gpu_count(), 1)
    True
    """
    return int(str(device).partition(":")[2]) % max(physical_gpu_count(), 1)


def gpu_count() -> int:
    physical = physical_gpu_count()
    return (config.logical_device_count("gpu") or physical) if physical else 0


def devices(kind: str | None = None) -> list[str]:
    """The devices graphdist can place work on: "cpu:0" (or cpu:0..n-1 after
    set_logical_device_count("cpu", n); any cpu:N is valid anyway) and one "gpu:i" per
    logical GPU.

    >>> gd.devices("cpu")
    ['cpu:0']
    """
    cpus = config.logical_device_count("cpu") or 1
    found = [f"cpu:{i}" for i in range(cpus)] + [f"gpu:{i}" for i in range(gpu_count())]
    if kind is None:
        return found
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"devices: kind must be 'cpu', 'gpu' or None, got {kind!r}")
    return [d for d in found if d.startswith(kind)]


def _parts(device) -> tuple[str, str]:
    text = str(device).strip().lower().removeprefix("/device:").removeprefix("/")
    kind, _, index = text.partition(":")
    return kind, index


def device_kind(device) -> str:
    """'CPU:0', '/device:gpu:1', 'cpu' -> 'cpu' or 'gpu' (whether or not it exists here)."""
    return _parts(device)[0]


def canonical(device) -> str:
    """'CPU:0', '/device:cpu:0', 'cpu' -> 'cpu:0'; raises ValueError for unknown devices."""
    kind, index = _parts(device)
    index = index or "0"
    if kind not in ("cpu", "gpu") or not index.isdigit():
        raise ValueError(f"unknown device {device!r}; devices here: {devices()} "
                         "(any 'cpu:N' is a valid logical CPU device)")
    if kind == "gpu" and int(index) >= gpu_count():
        raise ValueError(f"device {device!r} is not available; devices here: {devices()}")
    return f"{kind}:{int(index)}"


def is_gpu(device) -> bool:
    return str(device).startswith("gpu")


def default_device() -> str:
    return "gpu:0" if gpu_count() else "cpu:0"
