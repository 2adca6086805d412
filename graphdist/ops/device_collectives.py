"""The NCCL all-reduce node: one placed node that reduces every GPU replica's buffer and
leaves the result in every replica's output (the GPU counterpart of host_all_reduce). Made
by the "nccl" lowering of an all_reduce (passes/collectives/lowerings.py), never by user code.

It queues each device's part on that device's own stream and orders the streams itself, so
the lowering adds no events around it (`orders_own_streams`). Replicas that share a
physical GPU are summed there by one kernel; the partial sums of the physical GPUs are then
all-reduced with NCCL (runtime/gpu_collectives.py, listed in runtime/kernel_table.py).
"""

from __future__ import annotations

from graphdist.ops.collectives import reduce_types
from graphdist.ops.core import Op
from graphdist.ops.host_collectives import host_all_reduce_p

# inputs: one flat buffer per replica; outputs: one result per replica, each on its device.
# params: op ("sum" | "mean") and devices (the replicas' devices, whose streams it uses)
nccl_all_reduce_p = Op("nccl_all_reduce", collective=True, num_outputs=None,
                       differentiable=False, orders_own_streams=True)
nccl_all_reduce_p.def_shape(lambda *xs, op, devices: reduce_types("nccl_all_reduce", xs, op))
# the reference (and any host run): the sum in device order, as host_all_reduce's
nccl_all_reduce_p.def_impl(lambda xp, *xs, op, devices: host_all_reduce_p.impl(xp, *xs, op=op))
nccl_all_reduce_p.def_out(lambda xp, outs, *xs, op, devices:
                          host_all_reduce_p.out_impl(xp, outs, *xs, op=op), may_alias=True)
nccl_all_reduce_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                   2 * sum(t.nbytes for t in ins)))
