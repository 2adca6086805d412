"""Device backends: the array module (numpy or CuPy) and kernel table of a device kind.

CuPy is imported only when a gpu:N device is used, so `import graphdist` needs no CUDA.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Backend:
    kind: str          # "cpu" or "gpu": the key into Op.kernels
    xp: object         # numpy or cupy

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def kernel(self, op):
        path = op.kernels.get(self.kind)
        return resolve(path) if path else None


@functools.cache
def resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


CPU = Backend("cpu", np)


def backend_for(device: str) -> Backend:
    if device.startswith("cpu"):
        return CPU
    from graphdist.runtime.gpu import gpu_backend  # lazily: imports cupy

    return gpu_backend(device)
