"""Device strings ("kind:N" for every registered kind: cpu, gpu, ...): parsing, validation
and what exists on this machine (each kind's backend says how many devices it has)."""

from __future__ import annotations

from graphdist.device.backends import backend_of_kind, kinds
from graphdist.device.gpu import physical_gpu_count, physical_gpu_of  # noqa: F401 - here too

def devices(kind: str | None = None) -> list[str]:
    """The devices graphdist can place work on: "cpu:0" (or cpu:0..n-1 after
    set_logical_device_count("cpu", n); any cpu:N is valid anyway), one "gpu:i" per
    logical GPU, and those of any other registered kind.

    >>> gd.devices("cpu")
    ['cpu:0']
    """
    if kind is not None and kind not in kinds():
        raise ValueError(f"devices: kind must be one of {', '.join(map(repr, kinds()))} or "
                         f"None, got {kind!r}")
    return [f"{k}:{i}" for k in ([kind] if kind else kinds())
            for i in range(backend_of_kind(k).device_count())]


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
    if kind not in kinds() or not index.isdigit():
        raise ValueError(f"unknown device {device!r}; devices here: {devices()} "
                         "(any 'cpu:N' is a valid logical CPU device)")
    if not backend_of_kind(kind).has_device(int(index)):
        raise ValueError(f"device {device!r} is not available; devices here: {devices()}")
    return f"{kind}:{int(index)}"


def is_gpu(device) -> bool:
    return str(device).startswith("gpu")


def default_devices() -> list[str]:
    """What a strategy given no devices runs on (TF's MirroredStrategy()): every device of
    the first accelerator kind that has any, else cpu:0."""
    for kind in kinds():
        if backend_of_kind(kind).accelerator and backend_of_kind(kind).device_count():
            return devices(kind)
    return ["cpu:0"]


def default_device() -> str:
    """Where work without a strategy goes: the first of default_devices()."""
    return default_devices()[0]
