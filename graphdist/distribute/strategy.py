"""Strategy (the machinery every strategy shares), the default strategy, OneDeviceStrategy,
MirroredStrategy and ReplicaContext.

Traced code is SPMD: `strategy.run` traces the replica function once, as replica 0 sees it;
a per-replica value inside the trace is a LocalValue (this replica's tensor), and every
cross-replica point (reduce, all_reduce, merge_call's regrouping, sync-on-read reads) is an
explicit collective that the replication pass lowers between devices.
"""

from __future__ import annotations

import weakref

import numpy as np

from graphdist import eager
from graphdist.distribute import context
from graphdist.device.names import canonical, default_device, default_devices
from graphdist.distribute.input import DistributedDataset
from graphdist.device.backends import host_value
from graphdist.distribute.values import (LocalValue, PerReplica, ReduceOp, ValueContext,
                                         VariableAggregation, _as_tensor_value, as_reduce_op,
                                         map_structure)
from graphdist.ir import Var
from graphdist.ir.types import is_float
from graphdist.ops.array import reshape_p, split_p
from graphdist.ops.collectives import all_gather_p, all_reduce_p, broadcast_p
from graphdist.ops.core import Symbolic, current_tracer
from graphdist.ops.state import read_p
from graphdist.pytree import flatten, unflatten


def _local(value, n: int = 1, first: int = 0):
    """A LocalValue or PerReplica argument -> what replica 0's code sees. In a trace with
    n > 1 replicas a PerReplica of n values (numpy constants, say) becomes a selection by
    replica id, so that every replica's clone of the code sees its own component (`first`:
    the global id of this process's first replica, under a multi-worker strategy)."""
    def local(v):
        if not isinstance(v, PerReplica):
            return v
        if isinstance(v, LocalValue):
            return v.local
        if n == 1 or len(v.values) == 1:
            return v.values[0]
        return _select_by_replica(v.values, n, first)

    return map_structure(local, value)


def _select_by_replica(values, n: int, first: int = 0):
    """Structured components (tuples, lists, dicts) are selected leaf by leaf."""
    if len(values) != n:
        raise ValueError(f"a PerReplica of {len(values)} values given to {n} replicas")
    flat = [flatten(v) for v in values]
    tree = flat[0][2]
    if tree is None:
        return _select_leaf(values, n)
    for k, (_, _, other) in enumerate(flat):
        if other != tree:
            raise ValueError(f"a PerReplica whose values differ in structure: replica 0 has "
                             f"{values[0]!r}, replica {k} has {values[k]!r}")
    return unflatten(tree, [_select_leaf([leaves[i] for leaves, _, _ in flat], n, path,
                                         first) for i, path in enumerate(flat[0][1])])


def _select_leaf(values, n: int, path: str = "", first: int = 0):
    if all(not isinstance(x, Symbolic) for x in values):
        if not all(isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__array__")
                   or hasattr(x, "__cuda_array_interface__") for x in values):
            if all(type(x) is type(values[0]) and x == values[0] for x in values):
                return values[0]            # a static value (None, a string) all replicas share
            raise ValueError(f"a PerReplica whose component{path} differs between replicas "
                             f"but is not an array ({[values[k] for k in range(n)]!r}); traced "
                             "code runs one program for every replica: make it a numpy array")
        arrays = [np.asarray(host_value(x)) for x in values]
        if all(a.dtype == arrays[0].dtype and np.array_equal(a, arrays[0]) for a in arrays):
            return values[0]
        if any(a.shape != arrays[0].shape for a in arrays):
            raise ValueError("a PerReplica of constants with different shapes "
                             f"{[a.shape for a in arrays]} cannot be used in traced code; "
                             "pass it to the gd.function as an argument instead")
    from graphdist.ops.collectives import replica_id
    from graphdist.ops.math import equal, where

    rid = replica_id()
    out = values[0]
    for k in range(1, n):
        out = where(equal(rid, np.int32(first + k)), values[k], out)
    return out


def _mean_dtype(dtype) -> np.dtype:
    """The dtype of reduce(MEAN), as TF's (its cross-device ops divide the sum by the
    replica count with `/`, a true division): floats keep theirs; integers of 8 and 16 bits
    give float32, wider ones float64, as TF's truediv table; bools cannot be averaged."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return dtype
    if dtype.kind in "iu":
        return np.dtype(np.float32 if dtype.itemsize <= 2 else np.float64)
    raise TypeError(f"reduce(MEAN) of {dtype} values: only numbers can be averaged; cast "
                    "them first (gd.cast), or reduce with SUM")


def _is_integer(x) -> bool:
    """An integer tensor, array or Python int (bools are not numbers to average)."""
    if isinstance(x, bool):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, int)
    return np.dtype(dtype).kind in "iu"


def _integer_mean(v, n: int):
    """ReplicaContext.all_reduce(MEAN) of integers, as TF's: the sum over the n replicas
    divided with a true division (float64, or float32 for 8- and 16-bit integers)."""
    from graphdist.ops.array import cast
    from graphdist.ops.collectives import all_reduce
    from graphdist.ops.math import divide

    dtype = _mean_dtype(getattr(v, "dtype", np.int64))
    return divide(cast(all_reduce(v, "sum"), dtype.name), dtype.type(n))


def _is_array(x) -> bool:
    """A concrete array (numpy, or a device array), not a traced tensor or a structure."""
    return not isinstance(x, Symbolic) and (isinstance(x, (np.ndarray, np.generic))
                                            or hasattr(x, "__cuda_array_interface__"))


def _require_cross_replica_context(method: str, instead: str) -> None:
    """strategy.run / reduce work on all replicas at once: inside a replica function (inside
    strategy.run) they are an error, as in TF; merge_fn is cross-replica context again."""
    if not context.has_strategy() or context.in_cross_replica_context():
        return
    from graphdist.errors import user_frame_text

    where = user_frame_text()
    raise RuntimeError(f"strategy.{method}() was called inside a replica function (in "
                       f"strategy.run); it is only allowed in cross-replica context: outside "
                       f"strategy.run, or in the merge_fn of ReplicaContext.merge_call. In a "
                       f"replica function, {instead}" + (f"\n  at  {where}" if where else ""))


def _on_devices(value, devices):
    """Record on every PerReplica of `value` which devices its values belong to."""
    def tag(v):
        if isinstance(v, PerReplica) and not isinstance(v, LocalValue) and v.devices is None \
                and devices is not None and len(v.values) == len(devices):
            v.devices = tuple(devices)
        return v

    return map_structure(tag, value)


# a bucketed all-reduce's results are split and reshaped views of one all-reduced buffer:
# as mirrored as the buffer (other ops on a mirrored value give a per-replica result, as
# TF's regrouping does for every tensor a replica computes)
_REARRANGING = (reshape_p, split_p)


def _is_mirrored_tensor(t) -> bool:
    """True for values every replica holds identically (collective results, mirrored reads,
    rearrangements of them)."""
    var = getattr(t, "var", None)
    tracer = current_tracer()
    if var is None or tracer is None:
        return True
    return _mirrored_var(tracer, var, depth=0)


def _mirrored_var(tracer, var, depth: int) -> bool:
    for eqn in reversed(tracer.eqns):
        if var in eqn.outputs:
            if eqn.op in (all_reduce_p, broadcast_p, all_gather_p):
                return True
            if eqn.op is read_p:
                return not dict(eqn.params)["var"].on_read
            if eqn.op in _REARRANGING and depth < 4:
                return all(_mirrored_var(tracer, v, depth + 1) for v in eqn.inputs
                           if isinstance(v, Var))      # literals are the same everywhere
            return False
    return False


def _read_if_no_aggregate(v):
    """A variable returned by a replica function is read after run, in cross-replica context
    (a sync-on-read one: its aggregate). One with aggregation NONE has no aggregate: each
    replica returns its own component instead, as TF does for every variable."""
    if getattr(v, "on_read", False) and getattr(v, "aggregation", None) is \
            VariableAggregation.NONE and hasattr(v, "traced_read"):
        return v.read_value()
    return v


class ReplicaContext:
    """What a replica function sees of the strategy running it."""

    def __init__(self, strategy, replica_id: int = 0):
        self.strategy = strategy
        self._replica_id = replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self):
        """This replica's index; a symbolic int32 scalar in traced code with several replicas."""
        if current_tracer() is not None and self.num_replicas_in_sync > 1:
            from graphdist.ops.collectives import replica_id

            return replica_id()
        return self._replica_id

    def all_reduce(self, op, value):
        """Reduce `value` (a tensor or a nested structure of them) across replicas."""
        from graphdist.ops.collectives import all_reduce

        from graphdist.distribute.sparse import all_reduce_gradients
        from graphdist.ops.sparse import IndexedSlices

        op = as_reduce_op(op)
        n = self.num_replicas_in_sync
        if n == 1:
            return value
        def integer_mean(v) -> bool:      # summed, then divided as strategy.reduce does
            return op is ReduceOp.MEAN and _is_integer(v)

        def bucketed(v) -> bool:
            return isinstance(v, (Symbolic, IndexedSlices)) and not integer_mean(v)

        # the traced tensors of a structure travel together, packed into buckets as
        # gradients are (TF's batch all-reduce); sparse ones as rows; constants alone
        leaves = []
        map_structure(lambda v: leaves.append(v) if bucketed(v) else None, value)
        bucket_bytes = getattr(self.strategy, "bucket_bytes", 25 * 2**20)
        reduced = iter(all_reduce_gradients(leaves, op.value, bucket_bytes, n) if leaves
                       else ())
        return map_structure(lambda v: _integer_mean(v, n) if integer_mean(v)
                             else next(reduced) if bucketed(v)
                             else all_reduce(v, op.value), value)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Call merge_fn(strategy, *args) once in cross-replica context, with per-replica
        arguments regrouped as PerReplica; each replica gets back its part of the result."""
        kwargs = kwargs or {}
        spmd = current_tracer() is not None and self.num_replicas_in_sync > 1
        if spmd:
            # per-replica tensors are regrouped; variables and mirrored values pass as they are
            regroup = (lambda v: LocalValue((v,)) if isinstance(v, Symbolic)
                       and not _is_mirrored_tensor(v) else v)
            args = map_structure(regroup, args)
            kwargs = map_structure(regroup, kwargs)
        with context.entered(self.strategy, None):
            result = merge_fn(self.strategy, *args, **kwargs)
        strategy = self.strategy
        return _local(result, strategy._local_replicas, strategy._first_replica) if spmd \
            else result


class Strategy:
    """The distribution API common to every strategy; one replica per device in `devices`."""

    def __init__(self, devices, cross_device_ops=None, bucket_bytes: int = 25 * 2**20,
                 zero_stage: int = 0):
        devices = [devices] if isinstance(devices, str) else list(devices)
        if not devices:
            raise ValueError(f"{type(self).__name__}: the device list is empty")
        self._devices = tuple(canonical(d) for d in devices)
        if len(set(self._devices)) != len(self._devices):
            raise ValueError(f"{type(self).__name__}: duplicate devices in {devices}")
        kinds = sorted({d.partition(":")[0] for d in self._devices})
        if len(kinds) > 1:
            raise ValueError(f"{type(self).__name__}: devices {list(self._devices)} mix the "
                             f"device kinds {', '.join(kinds)}; replicas on several kinds are "
                             "not supported: use devices of one kind (all cpu:N, say)")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"{type(self).__name__}: zero_stage must be 0, 1 or 2, got "
                             f"{zero_stage!r}")
        # ZeRO: 1 shards the optimizer slots over the replicas (gradients reduce-scattered,
        # parameters all-gathered), 2 also the reduced gradients (optimizers/zero.py)
        self.zero_stage = int(zero_stage)
        from graphdist.distribute.cross_device_ops import CrossDeviceOps, choose_cross_device_ops

        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"{type(self).__name__}: cross_device_ops must be a "
                            f"gd.CrossDeviceOps (e.g. gd.RingAllReduce()), got "
                            f"{cross_device_ops!r}")
        self.cross_device_ops = cross_device_ops or choose_cross_device_ops(self._devices)
        # explicit cross-device ops are honoured as written; left to us, a step over
        # logical CPU devices may merge its replicas instead (passes/merge.py)
        self.cross_device_ops_chosen = cross_device_ops is None
        self.bucket_bytes = int(bucket_bytes)
        self._run_functions: dict = {}
        self._run_steps_functions: dict = {}
        self._reduce_functions: dict = {}
        self.default_replica_context = ReplicaContext(self, 0)
        self._variables = weakref.WeakValueDictionary()   # id -> variable made under scope

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    # this process's replicas: all of them but under a multi-worker strategy
    _local_replicas = property(lambda self: len(self._devices))
    _first_replica = 0

    def _initial_value(self, value, variable=None):
        """A new variable's initial value (a multi-worker strategy takes the chief's)."""
        return value

    def _track(self, variable) -> None:
        """Remember a variable made under this strategy (weakly) for check_mirrored."""
        self._variables[id(variable)] = variable

    # ------------------------------------------------------------ checks
    def check_mirrored(self) -> None:
        """Check that every mirrored variable made under this strategy's scope is
        bit-identical on every replica (of every worker under a multi-worker strategy);
        raise naming the first that is not and its replicas (ValueError; gd.WorkerError
        on every worker when several workers take part). Returns None when all agree.
        Sync-on-read variables are skipped: their replicas differ by design."""
        for variable in self._mirrored_variables():
            parts = [variable._host(k) for k in range(len(variable.values))]
            for k, part in enumerate(parts[1:], 1):
                if part.tobytes() != parts[0].tobytes():
                    raise ValueError(
                        f"check_mirrored: mirrored variable {variable.name!r} differs between "
                        f"replica {self._first_replica} ({variable.devices[0]}) and replica "
                        f"{self._first_replica + k} ({variable.devices[k]})")

    def _mirrored_variables(self) -> list:
        """The live mirrored variables made under this strategy, in the order they were made."""
        return [v for v in list(self._variables.values()) if not v.on_read]

    def _sum_across_workers(self, value):
        """The sum of every worker's `value` (one worker: itself)."""
        return value

    def _from_chief(self, value):
        return value

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    def scope(self):
        """Variables created inside are placed by this strategy (cross-replica context)."""
        return context.entered(self, None)

    # ------------------------------------------------------------ running
    def run(self, fn, args=(), kwargs=None):
        """Run `fn` once per replica. Inside gd.function it joins that trace; on its own it is
        traced and compiled once per input signature. Returns a PerReplica, or a plain value
        where every replica returns the same mirrored value.

        A gd.PerReplica argument gives each replica its own component. A plain argument (a
        numpy array, a tensor) reaches every replica whole: a global batch passed plainly is
        processed N times, once by each replica. Split it first, with
        experimental_distribute_dataset (or a gd.PerReplica of shards), so each replica
        gets its part.

        >>> shards = next(iter(strategy.experimental_distribute_dataset(batches)))  # doctest: +SKIP
        >>> strategy.run(step_fn, args=(shards,))                                # doctest: +SKIP
        """
        _require_cross_replica_context("run", "call fn directly: it already runs once per "
                                       "replica")
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        kwargs = kwargs or {}
        tracer = current_tracer()
        if tracer is not None:
            if self.num_replicas_in_sync > 1:
                tracer.strategy = self
            with context.entered(self, ReplicaContext(self, 0)):
                n, first = self._local_replicas, self._first_replica
                out = fn(*_local(args, n, first), **_local(kwargs, n, first))
            if self.num_replicas_in_sync == 1:
                return out
            with context.entered(self, ReplicaContext(self, 0)):
                out = map_structure(_read_if_no_aggregate, out)
            return map_structure(lambda v: LocalValue((v,)) if isinstance(v, Symbolic)
                                 and not _is_mirrored_tensor(v) else v, out)
        compiled = eager.compiled(self._run_functions, fn, self._run_in_trace(fn))
        return _on_devices(compiled(*args, **kwargs), self._devices)

    def _run_in_trace(self, fn):
        """run(fn) as a function of fn's arguments, named as fn, for gd.function to trace
        (inside that trace, run takes the traced path above)."""
        def replica_fn(*a, **k):           # a, k: what errors call the arguments, as before
            return self.run(fn, a, k)

        replica_fn.__name__ = getattr(fn, "__name__", "replica_fn")
        return replica_fn

    def experimental_run_steps(self, fn, iterator, steps, initial_loop_values=None,
                               profile=False):
        """Run `steps` training steps from one call (TF's run_steps_on_dataset): `fn(ctx,
        *batch)` for each batch of `iterator` (a tuple batch is unpacked), in cross-replica
        context; `ctx` is a gd.MultiStepContext, returned at the end with the last step's
        outputs and `steps_run` (fewer when the iterator ends first). One step is traced
        and compiled once; the steps run its program back to back. `profile=True` times
        every node of every step (ctx.profile: a Chrome trace, a "step k" slice per step).

        >>> ctx = strategy.experimental_run_steps(fn, iter(dist_dataset), steps=50)
        """
        from graphdist.distribute.multi_step import run_steps, step_body

        _require_cross_replica_context("experimental_run_steps", "call it outside "
                                       "strategy.run and outside gd.function")
        if current_tracer() is not None:
            raise RuntimeError("experimental_run_steps runs its own compiled loop: call it "
                               "from Python, not inside a gd.function")
        carries = bool(initial_loop_values)       # loop-carried values: an extra argument
        compiled = eager.compiled(self._run_steps_functions, (fn, carries),
                                  step_body(self, fn, carries))
        return run_steps(self, compiled, iterator, steps, initial_loop_values, profile)

    def reduce(self, op, value, axis=None):
        """Reduce a per-replica value across replicas (and along `axis` of every component:
        MEAN with axis=0 is the mean over every example of the global batch)."""
        _require_cross_replica_context("reduce", "use gd.get_replica_context().all_reduce(op, "
                                       "value), or merge_call(merge_fn) to reduce in merge_fn")
        context.require_current(self, "strategy.reduce")
        op = as_reduce_op(op)
        if isinstance(value, (list, tuple, dict)):   # a structure (as run returns): each leaf
            return map_structure(lambda v: self.reduce(op, v, axis), value)
        tracer = current_tracer()
        constants = self._constant_parts(value)
        if tracer is not None and constants is None:
            if self.num_replicas_in_sync > 1:
                tracer.strategy = self
            return self._reduce_traced(op, value, axis)
        if tracer is None and self.num_replicas_in_sync > self._local_replicas:
            return self._eager_reduce(op, value, axis)           # other workers hold parts
        return self._reduce_parts(op, constants or self._eager_parts("reduce", value), axis)

    def _reduce_parts(self, op, parts: list, axis):
        """reduce() of the replicas' values as numpy arrays."""
        mean_dtype = _mean_dtype(parts[0].dtype) if op is ReduceOp.MEAN else None
        if axis is None:
            if any(p.shape != parts[0].shape for p in parts):
                raise ValueError("reduce(axis=None): the replicas' values have different shapes "
                                 f"{[p.shape for p in parts]}; pass axis=0 to reduce along "
                                 "the batch as well")
            total = np.sum(parts, axis=0, dtype=parts[0].dtype)
            count = len(parts)
        else:
            if not -parts[0].ndim <= axis < parts[0].ndim:
                raise ValueError(f"reduce: axis {axis} is out of range for the replicas' values "
                                 f"of shape {parts[0].shape}")
            total = sum(np.sum(p, axis=axis, dtype=p.dtype) for p in parts)
            count = sum(p.shape[axis] for p in parts)
        if mean_dtype is None:
            return total
        return np.asarray(total, mean_dtype) / mean_dtype.type(count)

    def _constant_parts(self, value) -> list | None:
        """The components of a PerReplica of this process's every replica whose components
        are all arrays (not traced tensors), else None: reduced or gathered in traced code
        (captured by the function, say) they give a constant, whatever their shapes."""
        if not isinstance(value, PerReplica) or isinstance(value, LocalValue) \
                or len(value.values) != self.num_replicas_in_sync \
                or self.num_replicas_in_sync > self._local_replicas \
                or not all(_is_array(v) for v in value.values):
            return None
        return self._eager_parts("strategy", value)

    def _eager_parts(self, what: str, value) -> list:
        """The replicas' components of `value` as numpy arrays (a plain value: n copies)."""
        n = self.num_replicas_in_sync
        if not isinstance(value, PerReplica):   # a value on every replica, typed as in a trace
            return [np.asarray(host_value(_as_tensor_value(value)))] * n
        if len(value.values) != n:
            raise ValueError(f"{what}: a PerReplica of {len(value.values)} values, but the "
                             f"strategy runs {n} replicas")
        return [np.asarray(host_value(v)) for v in value.values]

    def _reduce_traced(self, op, value, axis):
        from graphdist.ops.array import cast, shape
        from graphdist.ops.collectives import all_reduce
        from graphdist.ops.math import divide, reduce_sum

        n = self.num_replicas_in_sync
        local = _local(value, self._local_replicas, self._first_replica)
        dtype = (np.dtype(local.dtype) if hasattr(local, "dtype")     # Python numbers: as
                 else np.asarray(_as_tensor_value(local)).dtype)      # TF types them
        mean_dtype = _mean_dtype(dtype) if op is ReduceOp.MEAN else None
        if axis is None:
            if mean_dtype is None or mean_dtype == dtype:
                return local if n == 1 else all_reduce(local, op.value)
            total, count = (all_reduce(local, "sum") if n > 1 else local), np.float64(n)
        else:
            total = reduce_sum(local, axis=axis)
            if n > 1:
                total = all_reduce(total, "sum")
            if mean_dtype is None:
                return total
            count = cast(shape(local)[axis], "int64")
            if n > 1:
                count = all_reduce(count, "sum")
        # integers: their sum divided as TF's true division (float64, or float32 for 8- and
        # 16-bit integers); floats: in their own dtype
        return divide(cast(total, mean_dtype), cast(count, mean_dtype))

    def gather(self, value, axis=0):
        """Concatenate the replicas' components along `axis` (each leaf of a structure)."""
        context.require_current(self, "strategy.gather")
        if isinstance(value, (list, tuple, dict)):
            return map_structure(lambda v: self.gather(v, axis), value)
        tracer = current_tracer()
        constants = self._constant_parts(value)
        if tracer is None or constants is not None:
            return np.concatenate(constants or self._eager_parts("gather", value), axis=axis)
        n = self.num_replicas_in_sync
        local = _local(value, self._local_replicas, self._first_replica)
        if n == 1:
            return local
        from graphdist.ops.array import concat

        tracer.strategy = self
        return concat(list(LocalValue((local,)).values), axis=axis)

    # ------------------------------------------------------------ input
    def experimental_distribute_dataset(self, iterable, prefetch: int = 0,
                                        per_replica_batch: bool = False):
        """Split each global batch along axis 0 into one shard per replica (PerReplica).
        `prefetch=k` prepares the next k steps' batches on a background thread and places
        their shards on the devices; `per_replica_batch=True` takes each incoming batch as
        one replica's and groups num_replicas_in_sync of them into a step (replica 0 gets
        the first; an incomplete last group is dropped). See input.DistributedDataset."""
        return DistributedDataset(iterable, self.num_replicas_in_sync, self._devices,
                                  prefetch, per_replica_batch, self._first_replica)

    def experimental_distribute_values_from_function(self, fn):
        """fn(gd.ValueContext(replica id, replicas)) for each of this process's replicas."""
        values = [fn(ValueContext(self._first_replica + i, self.num_replicas_in_sync))
                  for i in range(self._local_replicas)]
        return values[0] if len(values) == 1 else PerReplica(values, self._devices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._devices)})"


class OneDeviceStrategy(Strategy):
    """All variables and computation on one device.

    >>> gd.OneDeviceStrategy("cpu:0").num_replicas_in_sync
    1
    """

    def __init__(self, device):
        super().__init__([device])


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over several devices of one machine: one replica per
    device, variables mirrored, gradients all-reduced.

    >>> strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> strategy.num_replicas_in_sync
    2
    """

    def __init__(self, devices=None, cross_device_ops=None, bucket_bytes: int = 25 * 2**20,
                 zero_stage: int = 0):
        if devices is None:
            devices = default_devices()
        super().__init__(devices, cross_device_ops, bucket_bytes, zero_stage)


class _DefaultStrategy(OneDeviceStrategy):
    """The strategy outside every scope: one device, and one replica context that its
    scope keeps (TF: inside the default strategy's scope get_replica_context() is still
    the default replica context, and has_strategy() is False)."""

    def scope(self):
        return context.entered(self, self.default_replica_context)


_default = []


def default_strategy() -> Strategy:
    if not _default:
        _default.append(_DefaultStrategy(default_device()))
    return _default[0]


context.register_default(default_strategy)     # outside every scope, context answers with it
