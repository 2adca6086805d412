"""gd.optimizers: SGD (momentum, nesterov, coupled weight decay), Adam and AdamW.

apply_gradients emits one update eqn per variable (sgd_update, sgd_momentum_update,
adam_update) followed by assigns; in a replica context the gradients are first all-reduced
(unless all_reduce=False), then clipped (clipnorm / global_clipnorm). Under a strategy with
`zero_stage` 1 or 2 they are reduce-scattered instead, and each replica updates its shard
(graphdist/optimizers/zero.py).

Gradient accumulation (`gradient_accumulation_steps=k`, Keras 3's name): k-1 calls add the
local gradients to per-replica accumulators and communicate nothing; the k-th all-reduces
the accumulated sum once and applies it. graphdist has no conditional op that could skip a
collective inside one program (a `where` would run the all-reduce on every call), so the
choice is made on the host: the optimizer is a *program switch* (graphdist/program_switch.py)
whose state, "is the next call the k-th?", read from its `accumulation_step` counter before
each call, picks one of two compiled programs of the step: the micro-step program (local
adds, no collective) or the applying one (the all-reduce, the update, the accumulators
zeroed). Each is traced once; the profile shows the all-reduce only on applying calls.

Hyper-parameters are optimizer state, as in Keras: float64 scalar variables made in the
constructor and read inside the step into one `hyper` vector per update, so assigning
`opt.learning_rate = 0.05` between steps changes the next step without a retrace. A
learning-rate schedule (or any callable of the step) is evaluated inside the step instead.
"""

from __future__ import annotations

import inspect

import numpy as np

from graphdist import config, program_switch
from graphdist.distribute.context import get_replica_context, get_strategy
from graphdist.distribute.sparse import all_reduce_gradients
from graphdist.ir.types import is_float
from graphdist.ops import optim
from graphdist.ops.array import cast, fill_p
from graphdist.ops.clip import clip_by_global_norm
from graphdist.ops.core import Symbolic, bind, current_tracer
from graphdist.ops.math import add, divide, multiply, power, sqrt, subtract
from graphdist.ops.sparse import IndexedSlices, densify, sum_duplicates
from graphdist.optimizers.roles import with_role
from graphdist.optimizers.schedules import LearningRateSchedule
from graphdist.trace import name_scope
from graphdist.variables import Variable


# where a call falls in its accumulation window (Optimizer.switch_state): the first
# micro-step, a later one, the applying k-th call
FIRST, ADD, APPLY = "first", "add", "apply"


class _Hyper:
    """A hyper-parameter: reading gives its float64 Variable (for the learning rate, the
    schedule if one was given); assigning a number writes that variable, after checking it,
    so the next step uses the new value without a retrace."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        if self.name == "learning_rate" and opt._schedule is not None:
            return opt._schedule
        return opt._hyper[self.name]

    def __set__(self, opt, value):
        opt._set_hyper(self.name, value)


class Optimizer:
    """Shared machinery: slots, iteration count, gradient reduction and eager application."""

    # the slots this optimizer keeps per variable: a checkpoint of one that kept others is
    # another optimizer's state (SGD with momentum into SGD without)
    slot_names: tuple = ()

    def __init__(self, name: str, gradient_reduction: str = "mean", clipnorm=None,
                 global_clipnorm=None, gradient_accumulation_steps=None):
        if gradient_reduction not in ("mean", "sum"):
            raise ValueError(f"{name}: gradient_reduction must be 'mean' or 'sum', got "
                             f"{gradient_reduction!r}")
        if clipnorm is not None and global_clipnorm is not None:
            raise ValueError(f"{name}: pass clipnorm or global_clipnorm, not both")
        self.name = name
        self.gradient_reduction = gradient_reduction
        self.clipnorm = _positive(f"{name}: clipnorm", clipnorm)
        self.global_clipnorm = _positive(f"{name}: global_clipnorm", global_clipnorm)
        self.iterations = Variable(np.int64(0), name=f"{name}/iterations", trainable=False)
        self._hyper: dict = {}          # name -> float64 scalar Variable, read in each step
        self._schedule = None           # a learning-rate schedule or callable of the step
        self._slots: dict = {}
        self._eager_steps: dict = {}
        self._warned_no_gradient: set = set()     # ids of variables warned of a None grad
        self._accumulators: dict = {}   # variable -> its per-replica gradient accumulator
        self._applied_to: dict = {}     # the variables updated so far (an ordered set)
        self._accumulation_step = None  # micro-steps taken in the current window (k > 1)
        self._accumulation_steps = 1
        self.gradient_accumulation_steps = gradient_accumulation_steps

    # ------------------------------------------------------------ accumulation
    @property
    def gradient_accumulation_steps(self) -> int:
        """k: apply_gradients applies on every k-th call, accumulating locally on the others
        (1: every call applies)."""
        return self._accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps) -> None:
        steps = 1 if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"{self.name}: gradient_accumulation_steps must be an int >= 1 "
                             f"or None, got {steps!r}")
        if steps > 1 and self._accumulation_step is None:
            self._accumulation_step = Variable(np.int64(0), trainable=False,
                                               name=f"{self.name}/accumulation_step",
                                               _devices=self.iterations.devices,
                                               _strategy=self.iterations._strategy)
        self._accumulation_steps = int(steps)
        if steps > 1 and current_tracer() is None:
            # a step traced already traces again; it may make no variables then
            for var in self._applied_to:
                self._accumulator(var)

    @property
    def accumulation_step(self):
        """How many micro-batches the current window has accumulated (a Variable; None
        without accumulation)."""
        return self._accumulation_step

    def switch_state(self) -> tuple:
        """The program switch's state, read on the host before each call of a compiled step:
        (k, where the next apply_gradients falls in its window: FIRST, ADD or APPLY). k is
        part of it, so that a step traced before `gradient_accumulation_steps` changed is
        traced again. Three programs for k > 2 (two for k = 2: its window is FIRST, APPLY):
        the first micro-step writes the accumulators (no add, and no zeroing pass after the
        applying call), the others add to them, the k-th applies."""
        k = self._accumulation_steps
        if k == 1:
            return k, APPLY
        taken = int(self._accumulation_step._host(0))
        return k, APPLY if taken >= k - 1 else FIRST if taken == 0 else ADD

    def _applying(self) -> bool:
        return self.switch_state()[1] == APPLY

    def _accumulator(self, var: Variable) -> Variable:
        """`var`'s gradient accumulator: one component per replica, each its own (sync on
        read, aggregation NONE), so that adding to it communicates nothing."""
        if var not in self._accumulators:
            from graphdist.distribute.values import VariableAggregation, VariableSynchronization

            self._accumulators[var] = with_role("accumulator", Variable(
                np.zeros(var.shape, var.dtype), trainable=False,
                name=f"{var.name}/{self.name}/accumulator",
                synchronization=VariableSynchronization.ON_READ,
                aggregation=VariableAggregation.NONE, _devices=var.devices,
                _strategy=var._strategy))
        return self._accumulators[var]

    def accumulation_checkpoint(self) -> dict:
        """What a checkpoint keeps of the current window: {"step": the micro-step counter,
        variable: its accumulator read whole} (empty without accumulation)."""
        if self._accumulation_step is None:
            return {}
        return {"step": self._accumulation_step,
                **{var: AccumulatorState(acc, self.gradient_reduction, self._accumulation_step)
                   for var, acc in self._accumulators.items()}}

    def _accumulate(self, pairs):
        """Gradient accumulation's traced half: on a micro-step add each gradient to its
        accumulator (the window's first writes it instead) and return None (no collective);
        on the k-th call add the last one the same way and return the window's gradients
        (for a mean reduction the mean of the k micro-batch gradients, for a sum their sum:
        as one step on the k micro-batches together). The accumulators then keep that sum
        until the next window's first micro-step overwrites them (no zeroing pass; a
        checkpoint between windows saves them as zeros). Every `acc := acc + x^T @ dy` runs
        as one GEMM into the accumulator (passes/accumulate.py). Sparse gradients are added
        densely into the accumulator (the window's rows are not known in advance); the
        applying call all-reduces them dense. Slots are made here, on the first trace,
        since the applying program is traced later and a gd.function makes variables on its
        first trace only."""
        for _, v in pairs:
            self._make_slots(v)
        counter = self._accumulation_step
        phase = self.switch_state()[1]
        totals = []
        for g, v in pairs:
            acc = self._accumulator(v)
            totals.append(densify(g) if phase == FIRST else add(acc.read_value(), densify(g)))
            acc.assign(totals[-1])
        if phase != APPLY:
            counter.assign_synced(add(counter.read_value(), np.int64(1)))
            return None
        out = []
        for total, (_, v) in zip(totals, pairs):
            if self.gradient_reduction == "mean":
                total = divide(total, np.asarray(self._accumulation_steps, v.dtype))
            out.append((total, v))
        counter.assign_synced(np.int64(0))
        return out

    # ------------------------------------------------------------ hyper-parameters
    def _build_hyper(self, **values) -> None:
        """Make the hyper-parameter variables; in the constructor, so that under a strategy
        scope they are mirrored like `iterations`."""
        for name, value in values.items():
            if name == "learning_rate" and _is_schedule(value):
                self._schedule = value
            elif isinstance(value, Variable):
                self._hyper[name] = self._own_variable(name, value)
            else:
                self._hyper[name] = Variable(np.float64(self._checked(name, value)),
                                             name=f"{self.name}/{name}", trainable=False)

    def _own_variable(self, name: str, var: Variable) -> Variable:
        # a user's scalar float Variable serves as the hyper-parameter itself (shared state)
        if var.shape != () or not is_float(var.dtype):
            raise TypeError(f"{self.name}: {name} as a Variable must be a float scalar, got "
                            f"shape {var.shape} {var.dtype}")
        if var.devices != self.iterations.devices:
            raise ValueError(f"{self.name}: {name} variable lives on {list(var.devices)}, the "
                             f"optimizer on {list(self.iterations.devices)}; create both under "
                             "the same strategy scope")
        self._checked(name, var.numpy())
        return var

    def _checked(self, name: str, value) -> float:
        try:
            value = float(np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError):
            raise TypeError(f"{self.name}: {name} must be a number, got "
                            f"{type(value).__name__}") from None
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{self.name}: {name} must be a finite non-negative number, got "
                             f"{value}")
        if name in ("beta_1", "beta_2") and not value < 1:
            raise ValueError(f"{self.name}: {name} must be < 1, got {value}")
        return value

    def _set_hyper(self, name: str, value) -> None:
        if name == "learning_rate" and (self._schedule is not None or _is_schedule(value)):
            raise TypeError(
                f"{self.name}: the learning rate was given as a "
                f"{'schedule' if self._schedule is not None else 'number'} when the optimizer "
                "was made and stays one (a compiled step keeps what it traced); make a new "
                "optimizer to switch between a number and a schedule, or assign numbers")
        var = self._hyper[name]
        if current_tracer() is not None and isinstance(value, Symbolic):
            var.assign(cast(value, var.dtype))        # in traced code: unchecked, as assign
            return
        var.assign(np.asarray(self._checked(name, value), var.dtype))

    def _read_hyper(self, name: str):
        """The hyper-parameter for this update as a float64 scalar tensor: the learning rate
        of a schedule at the iteration count before the update (Keras's convention), else
        the variable's value."""
        if name == "learning_rate" and self._schedule is not None:
            return _float64_scalar(_call_schedule(self._schedule, self.iterations.read_value()),
                                   "the learning rate schedule's value")
        return _float64_scalar(self._hyper[name].read_value(), name)

    def slot(self, var: Variable, name: str) -> Variable:
        """The optimizer's `name` slot for `var` (a zero-initialized mirrored variable; under
        a strategy with zero_stage > 0 a zero.ShardedSlot, each replica keeping its flat
        1/N shard)."""
        key = (var, name)
        if key not in self._slots and getattr(var._strategy, "zero_stage", 0) \
                and var._strategy.num_replicas_in_sync > 1:
            from graphdist.optimizers import zero

            self._slots[key] = zero.ShardedSlot(var, f"{var.name}/{self.name}/{name}")
        if key not in self._slots:
            self._slots[key] = with_role("slot", Variable(
                np.zeros(var.shape, var.dtype), trainable=False,
                name=f"{var.name}/{self.name}/{name}", _devices=var.devices,
                _strategy=var._strategy))
        return self._slots[key]

    def slots(self) -> dict:
        """{"<variable name>/<slot name>": slot}. Variables that share a name (every unnamed
        one is "Variable", as in TF) are told apart as name_1, name_2, ... in the order
        their first slot was made, so that no slot hides another."""
        labels: dict = {}            # id(variable) -> its unique label
        taken: set = set()
        for var, _ in self._slots:
            if id(var) not in labels:
                label, k = var.name, 0
                while label in taken:
                    k += 1
                    label = f"{var.name}_{k}"
                labels[id(var)] = label
                taken.add(label)
        return {f"{labels[id(var)]}/{name}": v for (var, name), v in self._slots.items()}

    def apply_gradients(self, grads_and_vars, all_reduce: bool = True,
                        skip_loss_scale_check: bool = False):
        """Apply one update; returns the new iteration count. In a replica, the gradients are
        all-reduced first (by `gradient_reduction`); with `all_reduce=False` they are taken
        as already reduced (equal on every replica), as TF's
        experimental_aggregate_gradients=False. clipnorm/global_clipnorm clip after.

        `None` gradients are skipped, with a warning naming their variables (once per
        variable). An empty list applies nothing and returns the count unchanged (None in
        a step on other devices than the optimizer's: Keras returns a no-op). Under
        gd.config.set_precision("mixed_float16") the step raises unless the optimizer is
        wrapped in gd.optimizers.LossScaleOptimizer: float16 gradients overflow, and an
        unscaled update writes inf/NaN into the float32 weights;
        `skip_loss_scale_check=True` says the caller handles that itself.

        >>> opt.apply_gradients(zip(grads, variables), all_reduce=False)   # doctest: +SKIP
        """
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self._unchanged_iterations()
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            names = ", ".join(repr(getattr(v, "name", v)) for _, v in grads_and_vars)
            raise ValueError(f"{self.name}.apply_gradients: no gradients provided for any "
                             f"variable ({names}): does the loss depend on them?")
        for g, v in pairs:
            if not isinstance(v, Variable):
                raise TypeError(f"{self.name}.apply_gradients: expected gd.Variable, got "
                                f"{type(v).__name__}")
            if tuple(np.shape(g)) != v.shape:    # np.shape: numbers and lists too
                raise ValueError(f"{self.name}.apply_gradients: gradient {tuple(np.shape(g))} "
                                 f"does not match variable '{v.name}' {v.shape}")
            if np.dtype(getattr(g, "dtype", v.dtype)) != v.dtype:   # lists take v's dtype
                raise TypeError(f"{self.name}.apply_gradients: gradient is {g.dtype}, variable "
                                f"'{v.name}' is {v.dtype}; use gd.cast")
        if not skip_loss_scale_check:
            require_loss_scaling(self)
        warn_missing_gradients(self, grads_and_vars)
        if current_tracer() is None:
            return self._apply_eagerly(pairs, all_reduce)
        program_switch.record(self)       # the program depends on k and the window position
        self._applied_to.update(dict.fromkeys(v for _, v in pairs))
        if self._accumulation_steps > 1:
            with accumulation_scope(self):         # the graph says which program it is
                pairs = self._accumulate(pairs)
                if pairs is None:                  # a micro-step: nothing applied
                    return self.iterations.read_value()
                return self._update(self._reduce(pairs, all_reduce))
        return self._update(self._reduce(pairs, all_reduce))

    def _reduce(self, pairs, all_reduce: bool = True):
        """The gradients every replica agrees on: all-reduced [(gradient, variable)], or,
        under a strategy with zero_stage > 0, this replica's reduce-scattered shards
        (a zero.ShardedGradients). Unreduced when `all_reduce` is False or on one replica."""
        ctx = get_replica_context()
        sharded = [v for _, v in pairs if getattr(v._strategy, "zero_stage", 0)
                   and v._strategy.num_replicas_in_sync > 1]
        if sharded and (ctx is None or ctx.num_replicas_in_sync == 1):
            raise ValueError(
                f"{self.name}.apply_gradients: variable '{sharded[0].name}' belongs to a "
                f"strategy with zero_stage={sharded[0]._strategy.zero_stage}, whose replicas "
                "each update their shard of the optimizer state: call apply_gradients inside "
                "strategy.run (not in cross-replica context, nor eagerly with numpy "
                "gradients)")
        if sharded:
            from graphdist.optimizers import zero

            bucket_bytes = getattr(ctx.strategy, "bucket_bytes", 25 * 2**20)
            return zero.reduce_scatter_gradients(self, pairs, ctx, bucket_bytes, all_reduce)
        if not (all_reduce and ctx is not None and ctx.num_replicas_in_sync > 1):
            return pairs
        bucket_bytes = getattr(ctx.strategy, "bucket_bytes", 25 * 2**20)
        reduced = all_reduce_gradients([g for g, _ in pairs], self.gradient_reduction,
                                       bucket_bytes, ctx.num_replicas_in_sync)
        return list(zip(reduced, (v for _, v in pairs)))

    def _update(self, reduced):
        """Clip and apply reduced gradients (what `_reduce` returned); count the step."""
        step = self.iterations.read_value() + np.int64(1)
        if isinstance(reduced, list):
            pairs = [(g if self._sparse_update(g) else densify(g), v)
                     for g, v in self._clip(reduced)]
            self._apply(pairs, step)
        else:                                      # sharded: zero_stage 1 or 2
            reduced.apply(step)
        self.iterations.assign_synced(step)
        return step

    def _unchanged_iterations(self):
        """What apply_gradients([]) returns: the iteration count where this code can read
        it, else None (a step of a strategy the optimizer was not made under)."""
        if current_tracer() is None:
            return self.iterations.numpy()[()]         # a numpy scalar, as a step returns
        if tuple(get_strategy().devices) != tuple(self.iterations.devices):
            return None
        return self.iterations.read_value()

    def _apply_eagerly(self, pairs, all_reduce: bool = True):
        return apply_eagerly(self, pairs, all_reduce)

    def _clip(self, pairs) -> list:
        """Keras's clipnorm (each gradient to norm <= clipnorm) and global_clipnorm (all of
        them scaled together to a global norm <= global_clipnorm): g * c / max(norm, c),
        through gd.clip_by_global_norm (norms in float32 at least, float64 if any is)."""
        if self.clipnorm is not None:
            grads = [clip_by_global_norm([g], self.clipnorm)[0][0] for g, _ in pairs]
        elif self.global_clipnorm is not None:
            grads = clip_by_global_norm([g for g, _ in pairs], self.global_clipnorm)[0]
        else:
            return pairs
        return [(g, v) for g, (_, v) in zip(grads, pairs)]

    def _apply(self, pairs, step) -> None:
        hyper = self._hyper_vector(step)
        for g, v in pairs:
            if isinstance(g, IndexedSlices):
                self._apply_sparse(g, v, hyper)
                continue
            slots = [self.slot(v, name) for name in self.slot_names]
            new_v, *new_slots = self._updated(v, slots, g, hyper)
            v.assign_synced(new_v)
            for slot, new in zip(slots, new_slots):
                slot.assign_synced(new)

    def _hyper_vector(self, step):
        """The step's hyper-parameters as one float64 vector (ops/optim.py encodes it)."""
        raise NotImplementedError

    def _updated(self, value, slots, g, hyper) -> tuple:
        """(new value, new slot values...) of one fused update kernel: on whole variables,
        or on a replica's flat shards of them (zero_stage > 0)."""
        raise NotImplementedError

    def _apply_sparse(self, g, v, hyper) -> None:
        raise NotImplementedError

    def _make_slots(self, var: Variable) -> None:
        for name in self.slot_names:
            self.slot(var, name)

    def _sparse_update(self, g) -> bool:
        """Does `_apply` take this row-sparse gradient as it is? Others get it densified:
        an update with slots (momentum, Adam's moments) decays every row, as the dense
        update does, so it reads and writes the whole table anyway."""
        return False

    def variables(self) -> list:
        """iterations, the hyper-parameter variables, then the slots (a sharded slot's
        per-replica shard variable), then the accumulation state."""
        slots = [getattr(s, "shard", s) for s in self._slots.values()]
        accumulation = [self._accumulation_step] if self._accumulation_step is not None else []
        return [self.iterations, *self._hyper.values(), *slots, *accumulation,
                *self._accumulators.values()]


class AccumulatorState:
    """A gradient accumulator as a checkpoint reads and writes it: whole, not per replica.
    Saved as what the applying all-reduce would make of it (the replicas' mean for a mean
    reduction, their sum for a sum), and restored so that it makes the same again on any
    replica count: every replica the mean, or the first replica the sum (the others an
    additive identity). Between windows (the micro-step counter at 0) it is saved as zeros:
    the accumulator still holds the last window's sum, which the next window's first
    micro-step overwrites unread."""

    def __init__(self, accumulator: Variable, reduction: str, counter: Variable):
        self.accumulator, self.reduction, self.counter = accumulator, reduction, counter

    name = property(lambda self: self.accumulator.name)
    shape = property(lambda self: self.accumulator.shape)
    dtype = property(lambda self: self.accumulator.dtype)
    synchronization = property(lambda self: self.accumulator.synchronization)
    aggregation = property(lambda self: self.accumulator.aggregation)
    values = property(lambda self: self.accumulator.values)
    _strategy = property(lambda self: self.accumulator._strategy)

    def numpy(self) -> np.ndarray:
        acc = self.accumulator
        if int(self.counter._host(0)) == 0:
            return np.zeros(acc.shape, acc.dtype)
        total, _ = acc._replicas()
        parts = [acc._host(k) for k in range(len(acc.values))]
        local = np.sum(parts, axis=0, dtype=acc.dtype)
        whole = acc._strategy._sum_across_workers(local) if total > len(parts) else local
        if self.reduction == "mean":
            return np.asarray(whole / acc.dtype.type(total), acc.dtype)
        return np.asarray(whole, acc.dtype)

    def components_for(self, value: np.ndarray) -> list:
        from graphdist.distribute.sync import sum_shares

        acc = self.accumulator
        total, first = acc._replicas()
        value = np.asarray(value, acc.dtype)
        if self.reduction == "mean" or total == 1:
            return [value] * len(acc.values)
        return sum_shares(value, total)[first:first + len(acc.values)]

    def assign_components(self, arrays) -> None:
        self.accumulator.assign_components(arrays)


def accumulation_scope(opt):
    """The name scope of an accumulating step's optimizer nodes: the printed graph, the
    viewer and the profile show which of the two programs this is, and the all-reduce
    under the condition that runs it."""
    k = opt.gradient_accumulation_steps
    if opt._applying():
        return name_scope(f"gradient_accumulation/apply (call {k} of every {k})")
    return name_scope(f"gradient_accumulation/accumulate (calls 1-{k - 1} of every {k}: "
                      "no collective)")


def require_loss_scaling(opt) -> None:
    """Under the mixed_float16 policy an update needs a LossScaleOptimizer around it (Keras
    wraps the optimizer itself only in Model.compile): float16 gradients overflow to inf,
    and a plain update writes inf/NaN into the float32 master weights, silently. Called
    where the update is traced, so the error names the user's line."""
    if config.precision() != "mixed_float16":
        return
    from graphdist.errors import user_frame_text

    where = user_frame_text()
    raise ValueError(
        f"{opt.name}.apply_gradients under gd.config.set_precision(\"mixed_float16\"): "
        "float16 gradients overflow, and an update without loss scaling would write inf/NaN "
        "into the float32 weights on the first overflow. Wrap the optimizer: "
        f"gd.optimizers.LossScaleOptimizer({type(opt).__name__}(...)), and scale the loss "
        "with opt.get_scaled_loss / opt.get_unscaled_gradients (see docs/guide.md, mixed "
        "precision); if your loop handles overflow itself, pass "
        "apply_gradients(..., skip_loss_scale_check=True)" + (f"\n  at  {where}" if where
                                                               else ""))


def warn_missing_gradients(opt, grads_and_vars) -> None:
    """Keras's warning for skipped None gradients, once per variable and optimizer: a
    variable the loss does not reach is silently never trained otherwise."""
    missing = [v for g, v in grads_and_vars
               if g is None and id(v) not in opt._warned_no_gradient]
    if not missing:
        return
    opt._warned_no_gradient.update(id(v) for v in missing)
    config.logger.warning(
        "%s.apply_gradients: gradients do not exist for variables %s when minimizing the "
        "loss; they are skipped (not updated). Does the loss depend on them?", opt.name,
        [getattr(v, "name", v) for v in missing])


def apply_eagerly(opt, pairs, all_reduce: bool = True):
    """`opt.apply_gradients` called with numpy gradients: a small update step compiled once
    per set of variables (kept in `opt._eager_steps`), run on them."""
    variables = tuple(v for _, v in pairs)
    fn = opt._eager_steps.get((variables, all_reduce))
    if fn is None:
        from graphdist.function import function

        # the caller checked the loss scaling already (or was told to skip it)
        fn = function(lambda grads: opt.apply_gradients(zip(grads, variables), all_reduce,
                                                        skip_loss_scale_check=True))
        opt._eager_steps[(variables, all_reduce)] = fn
    return fn([np.asarray(g, dtype=v.dtype) for g, v in pairs])


def _is_schedule(value) -> bool:
    return isinstance(value, LearningRateSchedule) or (
        callable(value) and not isinstance(value, (Variable, Symbolic)))


def _call_schedule(fn, step):
    """fn(step); a callable that takes no argument (Keras's legacy form) is called bare."""
    if not isinstance(fn, LearningRateSchedule):
        try:
            inspect.signature(fn).bind(step)
        except TypeError:
            return fn()
        except ValueError:          # no signature to inspect (a builtin): pass the step
            pass
    return fn(step)


def _float64_scalar(x, what: str):
    if isinstance(x, Variable):
        x = x.read_value()
    if isinstance(x, Symbolic):
        if tuple(x.shape) != ():
            raise ValueError(f"optimizer: {what} must be a scalar, got shape {tuple(x.shape)}")
        return cast(x, "float64")
    # a constant (a callable returning a number): made on the step's device, where the
    # hyper vector is assembled
    return bind(fill_p, shape=(), dtype=np.dtype("float64"), value=float(x))


def _positive(name: str, value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not (value > 0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive number or None, got {value}")
    return value


class SGD(Optimizer):
    """p -= lr * (g + weight_decay*p), with optional (Nesterov) momentum, as torch.optim.SGD.
    learning_rate, momentum and weight_decay may be assigned between steps; whether there is
    momentum at all (a slot per variable) is fixed by the constructor.

    >>> opt = gd.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    >>> opt.learning_rate = 0.05              # the next step uses it, no retrace
    """

    learning_rate = _Hyper()
    momentum = _Hyper()
    weight_decay = _Hyper()

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, weight_decay=0.0,
                 gradient_reduction="mean", clipnorm=None, global_clipnorm=None, name="SGD",
                 gradient_accumulation_steps=None):
        super().__init__(name, gradient_reduction, clipnorm, global_clipnorm,
                         gradient_accumulation_steps)
        self.nesterov = bool(nesterov)
        given = momentum.numpy() if isinstance(momentum, Variable) else momentum
        self._uses_momentum = self._checked("momentum", given) > 0
        if self.nesterov and not self._uses_momentum:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        self._build_hyper(learning_rate=learning_rate, momentum=momentum,
                          weight_decay=weight_decay)

    def _checked(self, name: str, value) -> float:
        value = super()._checked(name, value)
        if name == "momentum" and value > 0 and not getattr(self, "_uses_momentum", True):
            raise ValueError(f"{self.name}: made with momentum=0, so it has no momentum "
                             f"buffers; momentum={value} needs an optimizer made with "
                             "momentum > 0")
        return value

    @property
    def slot_names(self) -> tuple:
        return ("momentum",) if self._uses_momentum else ()

    def _sparse_update(self, g) -> bool:
        return isinstance(g, IndexedSlices) and not self._uses_momentum   # a scatter update

    def _hyper_vector(self, step):
        lr, weight_decay = self._read_hyper("learning_rate"), self._read_hyper("weight_decay")
        if self._uses_momentum:
            fields = optim.MomentumHyper(lr=lr, momentum=self._read_hyper("momentum"),
                                         weight_decay=weight_decay)
        else:
            fields = optim.SGDHyper(lr=lr, weight_decay=weight_decay)
        return bind(optim.hyper_p, *fields.encode())

    def _updated(self, value, slots, g, hyper) -> tuple:
        if self._uses_momentum:
            return tuple(bind(optim.momentum_p, value, slots[0], g, hyper,
                              nesterov=self.nesterov))
        return (bind(optim.sgd_p, value, g, hyper),)

    def _apply_sparse(self, g, v, hyper) -> None:
        g = sum_duplicates(g)     # each row once: the dense update's sums, in order
        v.assign_synced(bind(optim.sparse_sgd_p, v, g.indices, g.values, hyper))


def _no_weight_decay(opt, value):
    raise AttributeError(f"{opt.name}: Adam has no weight decay; use gd.optimizers.AdamW")


class Adam(Optimizer):
    """Adam with TF's epsilon placement: p -= lr_t * m / (sqrt(v) + eps),
    lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t). learning_rate, beta_1, beta_2 and epsilon may
    be assigned between steps.

    >>> opt = gd.optimizers.Adam(learning_rate=1e-3)
    """

    learning_rate = _Hyper()
    beta_1 = _Hyper()
    beta_2 = _Hyper()
    epsilon = _Hyper()
    weight_decay = property(lambda self: 0.0, _no_weight_decay)
    slot_names = ("m", "v")

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 gradient_reduction="mean", clipnorm=None, global_clipnorm=None, name="Adam",
                 gradient_accumulation_steps=None):
        super().__init__(name, gradient_reduction, clipnorm, global_clipnorm,
                         gradient_accumulation_steps)
        self._build_hyper(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                          epsilon=epsilon)

    def _hyper_vector(self, step):
        t = cast(step, "float64")
        lr, beta_1, beta_2, epsilon = (self._read_hyper(name) for name in
                                       ("learning_rate", "beta_1", "beta_2", "epsilon"))
        lr_t = divide(multiply(lr, sqrt(subtract(1.0, power(beta_2, t)))),
                      subtract(1.0, power(beta_1, t)))
        decay = None                          # Adam; AdamW: the decay rate lr * weight_decay
        if "weight_decay" in self._hyper:
            decay = multiply(lr, self._read_hyper("weight_decay"))
        fields = optim.AdamHyper(lr_t=lr_t, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                                 weight_decay_lr=decay)
        return bind(optim.hyper_p, *fields.encode())

    def _updated(self, value, slots, g, hyper) -> tuple:
        return tuple(bind(optim.adam_p, value, slots[0], slots[1], g, hyper))


class AdamW(Adam):
    """Adam with decoupled weight decay: p -= lr * weight_decay * p, then the Adam step;
    weight_decay may be assigned between steps too."""

    weight_decay = _Hyper()

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 weight_decay=0.004, gradient_reduction="mean", clipnorm=None,
                 global_clipnorm=None, name="AdamW", gradient_accumulation_steps=None):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, gradient_reduction, clipnorm,
                         global_clipnorm, name, gradient_accumulation_steps)
        self._build_hyper(weight_decay=weight_decay)


__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
