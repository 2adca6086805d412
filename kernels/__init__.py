"""Fused update kernels, installed as graphdist.kernels: numpy specs, Numba CPU twins, CUDA.

formulas (each optimizer update written once, and the hyper vectors' fields), sgd (SGD,
momentum, Nesterov), adam (Adam, AdamW), reduce (all-reduce sum/mean, scale/cast);
common holds the flat views, tensor lists and launch grids they share. Imports numpy and numba
only, never graphdist; callers import the submodules, so importing this package compiles nothing.
"""
