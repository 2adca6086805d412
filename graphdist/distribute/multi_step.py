"""Many steps per call: strategy.experimental_run_steps and the MultiStepContext its `fn`
gets (TF's run_steps_on_dataset, from the days of its contrib DistributionStrategy).

TF puts the loop in the graph (a while_loop) so that one session call runs many steps. Here
one step of `fn` is traced and compiled once (a gd.function), and the loop runs that
program step after step from one Python call (`Function.call_many`): per step only the
batch's arrays are fed, checked by shape rather than re-derived, so what a step costs is
what its program costs. The step's graph and profile are those of that function
(`ctx.step_function`), the profile with one "step k" slice per step on every lane.
"""

from __future__ import annotations

import inspect

from graphdist.distribute.context import get_replica_context
from graphdist.distribute.values import LocalValue, as_reduce_op
from graphdist.ops.core import Symbolic


class MultiStepContext:
    """What `fn` is handed at every step of experimental_run_steps, and what the call
    returns: the last step's outputs, how many steps ran, the step's compiled function.

    >>> def fn(ctx, x, y):
    ...     loss = strategy.run(step, args=(x, y))
    ...     ctx.set_last_step_output("loss", loss, gd.ReduceOp.MEAN)
    >>> ctx = strategy.experimental_run_steps(fn, iterator, steps=50)
    >>> ctx.last_step_outputs["loss"], ctx.steps_run              # doctest: +SKIP
    """

    def __init__(self, strategy, initial=None):
        self._strategy = strategy
        self._last_step_outputs = dict(initial or {})
        self._reduce_ops: dict = {}
        self.steps_run = 0
        self.step_function = None      # the gd.function of one step: graphs, profile
        self.profile = None            # the Chrome trace of a profiled run

    @property
    def last_step_outputs(self) -> dict:
        """name -> the last step's value: reduced across replicas where a reduce op was
        given, else a gd.PerReplica of every replica's value. Inside `fn`, the previous
        step's values (the initial_loop_values at the first step)."""
        return self._last_step_outputs

    def set_last_step_output(self, name: str, output, reduce_op=None) -> None:
        """Record `output` under `name`; the last step's is returned. Called in `fn` (cross-
        replica context: `output` is what strategy.run returned) or inside the replica
        function; with `reduce_op`, reduced as strategy.reduce(reduce_op, output, axis=None)
        (in a replica: its all-reduce)."""
        op = None if reduce_op is None else as_reduce_op(reduce_op)
        replica = get_replica_context()
        n = self._strategy.num_replicas_in_sync
        if replica is not None and n > 1:           # inside the replica function
            value = output if op is None else replica.all_reduce(op, output)
            if op is None and isinstance(value, Symbolic):
                value = LocalValue((value,))
        else:
            value = output if op is None else self._strategy.reduce(op, output, axis=None)
        self._last_step_outputs[name] = value
        self._reduce_ops[name] = op

    def __repr__(self) -> str:
        return (f"MultiStepContext(steps_run={self.steps_run}, "
                f"last_step_outputs={sorted(self._last_step_outputs)})")


def step_body(strategy, fn, carries: bool):
    """One step as a function of the batch -> the step's outputs: `fn` called in the
    strategy's cross-replica context with a fresh context object. With loop-carried values
    (`carries`), their dict comes first: step(carried, *batch). Without, step(*batch): the
    step function (ctx.step_function) takes a batch as a plain train step does."""
    def step(*args):
        carried, batch = (args[0], args[1:]) if carries else ({}, args)
        ctx = MultiStepContext(strategy, carried)
        with strategy.scope():
            fn(ctx, *batch)
        return ctx.last_step_outputs

    step.__name__ = f"run_steps[{getattr(fn, '__name__', 'fn')}]"
    try:      # the graph names the batch's arguments as fn does: fn(ctx, x, y) -> x, y
        params = list(inspect.signature(fn).parameters.values())[1:]
        if all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            carried = [inspect.Parameter("carried", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            step.__signature__ = inspect.Signature(carried * carries + params)
    except (TypeError, ValueError):
        pass
    return step


def run_steps(strategy, function, iterator, steps: int, initial_loop_values=None,
              profile: bool = False) -> MultiStepContext:
    """Run `function` (the gd.function of step_body, carrying values exactly when
    initial_loop_values has some) for up to `steps` batches of `iterator`; the values
    named in initial_loop_values are carried from step to step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"experimental_run_steps: steps must be an int >= 1, got {steps!r}")
    if not hasattr(iterator, "__next__"):
        raise TypeError(f"experimental_run_steps: expected an iterator (iter() of a "
                        f"distributed dataset), got {type(iterator).__name__}")
    if not isinstance(initial_loop_values or {}, dict):
        raise TypeError("experimental_run_steps: initial_loop_values must be a dict of "
                        f"name -> value, got {type(initial_loop_values).__name__}")
    carried = dict(initial_loop_values or {})

    def args_of(previous):
        nonlocal carried
        if previous is not None and carried:
            carried = {k: previous.get(k, v) for k, v in carried.items()}
        batch = next(iterator)            # StopIteration: the input ended, no more steps
        batch = batch if isinstance(batch, tuple) else (batch,)
        return ((carried,) + batch) if carried else batch

    result, done, trace = function.call_many(args_of, steps, profile)
    ctx = MultiStepContext(strategy, result if result is not None else carried)
    ctx.steps_run, ctx.step_function, ctx.profile = done, function, trace
    return ctx


__all__ = ["MultiStepContext", "run_steps", "step_body"]
