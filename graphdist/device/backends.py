"""The backend registry: one `Backend` per device kind, found by kind or by device name.

A backend declares what its kind can do (device/host.py lists the capabilities); everything
above device/ asks those, so a new kind is its backend module plus one
`register_backend(kind, backend)` (and, if it brings kernels, their entries under its
`kernel_kind`). CuPy is imported only when a gpu:N device is used, so `import graphdist`
needs no CUDA. The base class and the host's helpers are in host.py.
"""

from __future__ import annotations

from graphdist import config
from graphdist.device.gpu import GpuKind
from graphdist.device.host import (  # noqa: F401
    HOST_KERNELS,
    Backend,
    CpuBackend,
    host_value,
    is_device_array,
)

CPU = CpuBackend()

_BACKENDS: dict[str, Backend] = {}


def register_backend(kind: str, backend: Backend) -> None:
    """Make devices "kind:N" known: named by gd.devices, parsed by names.canonical, run by
    `backend`. A kind is registered once (unregister_backend first to replace it)."""
    if not (isinstance(kind, str) and kind.isidentifier() and kind == kind.lower()):
        raise ValueError(f"register_backend: a device kind is a lower-case identifier, "
                         f"got {kind!r}")
    if not isinstance(backend, Backend) or backend.kind != kind:
        raise ValueError(f"register_backend({kind!r}, {backend!r}): the backend must be a "
                         f"Backend whose kind is {kind!r}")
    if kind in _BACKENDS:
        raise ValueError(f"register_backend: device kind {kind!r} is already registered "
                         f"({_BACKENDS[kind]!r})")
    _BACKENDS[kind] = backend
    config.declare_device_kind(kind)


def unregister_backend(kind: str) -> None:
    """Forget device kind `kind` (a test's backend, when the test ends)."""
    if kind not in _BACKENDS:
        raise ValueError(f"unregister_backend: no device kind {kind!r}; kinds: {kinds()}")
    del _BACKENDS[kind]
    config.forget_device_kind(kind)


def kinds() -> list[str]:
    """The registered device kinds, in registration order (cpu first)."""
    return list(_BACKENDS)


def backend_of_kind(kind: str) -> Backend:
    """The backend of device kind `kind` (its capabilities; no device is set up)."""
    backend = _BACKENDS.get(kind)
    if backend is None:
        raise ValueError(f"unknown device kind {kind!r}; kinds: {kinds()}")
    return backend


def backend_for(device: str) -> Backend:
    """The backend that runs `device` (a canonical "kind:N" name)."""
    return backend_of_kind(str(device).partition(":")[0]).for_device(device)


def kind_backends(devices) -> list[Backend]:
    """The backends of the kinds of `devices` (canonical names), one per kind: what the
    compiler asks about capabilities, without setting any device up."""
    found = dict.fromkeys(str(d).partition(":")[0] for d in devices)
    return [backend_of_kind(kind) for kind in found]


register_backend("cpu", CPU)
register_backend("gpu", GpuKind())


def on_host(device) -> bool:
    """Does `device` run the host's Numba kernels (asked of its kind: no device is set up)?
    The compile passes fuse only for those: the fused forms' fast paths are CPU kernels."""
    if device is None:
        return False
    try:
        return backend_of_kind(str(device).partition(":")[0]).kernel_kind == HOST_KERNELS
    except (KeyError, ValueError):
        return False
