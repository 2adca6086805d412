"""The kernel adapters, by family, each registering its entries beside it
(adapters/registry.py): optim (the optimizer updates), collectives (the host all-reduce,
the fused all-reduce + update, NCCL), nn (elementwise, pooling, convolution, transformer
blocks), sparse (row-sparse values) and accumulate (gradient accumulation's GEMM with
beta=1). An adapter turns the runtime's calling convention (runtime/adapters/registry.py's
KernelEntry) into a kernel's (graphdist.kernels: Numba, CPU
and CUDA), which it imports when first called, so importing these compiles nothing.
runtime/kernel_table.py imports every family: the registry is complete once it is loaded.
"""
