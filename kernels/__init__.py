"""Fused update kernels, installed as graphdist.kernels: numpy specs, Numba CPU twins, CUDA.

formulas (each optimizer update written once, and the hyper vectors' fields), sgd (SGD,
momentum, Nesterov), adam (Adam, AdamW), reduce (all-reduce sum/mean, scale/cast);
common holds the flat views, tensor lists and launch grids they share. Imports numpy and numba
only, never graphdist; callers import the submodules, so importing this package compiles nothing.
"""

import numpy as _np

# numba-cuda (0.2x, as shipped beside numpy 2.5) registers a CUDA overload of np.row_stack
# when it first compiles, and numpy 2.5 removed that alias of np.vstack: every CUDA kernel
# then fails with "module 'numpy' has no attribute 'row_stack'". Restore the alias.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
