"""graphdist: compiled graph capture for synchronous data-parallel training.

This module re-exports the public API and nothing else. Its reference, every name and what
it does, is docs/api.md in graphdist's source (linked from the README); the guide,
docs/guide.md, shows the pieces at work.
"""

from graphdist.device import threads as _threads  # noqa: F401  (sets OpenMP waiting first)
from graphdist import config, data, initializers, nn, optimizers, random  # noqa: F401
from graphdist import callbacks, losses, metrics  # noqa: F401
from graphdist.autodiff import GradientTape, value_and_grad
from graphdist.checkpoint import Checkpoint
from graphdist.distribute.context import (get_replica_context, get_strategy, has_strategy,
                                          in_cross_replica_context)
from graphdist.device.names import devices
from graphdist.distribute.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce,
                                                   HostAllReduce, NcclAllReduce,
                                                   ReductionToOneDevice, RingAllReduce,
                                                   choose_cross_device_ops)
from graphdist.distribute.multi_step import MultiStepContext
from graphdist.distribute.multi_worker import MultiWorkerMirroredStrategy
from graphdist.distribute.strategy import MirroredStrategy, OneDeviceStrategy, ReplicaContext
from graphdist.distribute.values import (Mirrored, PerReplica, ReduceOp, ValueContext,
                                         VariableAggregation, VariableSynchronization)
from graphdist.errors import (CheckpointError, GraphError, NumericsError, ShapeError,
                              TraceError, WorkerError)
from graphdist.ir import Graph
from graphdist.ops.array import (broadcast_to, cast, concat, expand_dims, one_hot, ones_like,
                                 pad, reshape, shape, split, squeeze, stop_gradient, transpose,
                                 zeros_like)
from graphdist.ops.math import (abs, add, argmax, clip_by_value, divide, equal, exp, greater,
                                greater_equal, less, less_equal, log, matmul, maximum, minimum,
                                multiply, negative, not_equal, power, reduce_max, reduce_mean,
                                reduce_min, reduce_sum, relu, sigmoid, sqrt, square, subtract,
                                tanh, where)
from graphdist.ops.construct import arange, stack
from graphdist.ops.division import floor_divide, mod
from graphdist.ops.control_flow import cond, fori_loop, scan, while_loop
from graphdist.ops.logic import (ceil, cumsum, floor, logical_and, logical_not, logical_or,
                                 round)
from graphdist.ops.einsum import einsum
from graphdist.ops.special import cos, sin
from graphdist.ops.clip import clip_by_global_norm
from graphdist.function import function
from graphdist.benchmark import benchmark
from graphdist.runtime.profile import profile_report
from graphdist.equivalence import check_equivalence
from graphdist.simulate import simulate
from graphdist.ops.sparse import IndexedSlices, gather
from graphdist.trace import Tensor, name_scope
from graphdist.variables import Variable

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "CheckpointError", "CrossDeviceOps", "GradientTape", "Graph", "GraphError",
    "HierarchicalCopyAllReduce", "HostAllReduce", "IndexedSlices", "Mirrored", "MirroredStrategy",
    "MultiStepContext", "MultiWorkerMirroredStrategy",
    "NcclAllReduce", "NumericsError",
    "OneDeviceStrategy", "PerReplica", "ReduceOp", "ReductionToOneDevice", "ReplicaContext",
    "RingAllReduce", "ShapeError", "Tensor", "TraceError", "ValueContext", "Variable",
    "VariableAggregation", "VariableSynchronization", "WorkerError", "abs", "add", "arange", "argmax",
    "benchmark", "broadcast_to", "callbacks", "cast", "check_equivalence", "choose_cross_device_ops", "clip_by_global_norm",
    "ceil", "clip_by_value", "concat", "cond", "config", "cos", "cumsum",
    "data", "devices", "divide", "einsum", "equal", "exp", "expand_dims", "floor_divide",
    "floor", "fori_loop", "function",
    "gather", "get_replica_context", "get_strategy", "greater", "greater_equal", "has_strategy",
    "in_cross_replica_context", "initializers", "less", "less_equal", "log", "logical_and",
    "logical_not", "logical_or", "losses", "matmul",
    "maximum", "metrics", "minimum", "mod", "multiply", "name_scope", "negative", "nn", "not_equal",
    "one_hot",
    "ones_like", "optimizers", "pad", "power", "profile_report", "random", "reduce_max", "reduce_mean",
    "reduce_min", "reduce_sum", "relu", "reshape", "round", "scan", "shape", "sigmoid", "simulate", "sin", "split", "sqrt", "square", "squeeze", "stack", "stop_gradient",
    "subtract", "tanh", "transpose", "value_and_grad", "where", "while_loop", "zeros_like",
]
