"""From a Plan (graphdist/pipeline.py) to something callable: lower its placed graph to one
program per device, or one for all, and run it as the plan's mode says. With "threads"
several devices run concurrently, one worker thread each; a value crossing devices goes
through a Channel (an event and a slot)."""

from __future__ import annotations

import threading

from graphdist import config
from graphdist.errors import WorkerError
from graphdist.ir import Graph, Var
from graphdist.device import threads
from graphdist.device.backends import backend_for, kind_backends
from graphdist.runtime.lower import lower
from graphdist.runtime.schedule_check import checked

_ABORT = object()


class Aborted(WorkerError):
    """This device stopped because another one failed (never reaches the user)."""


class Channel:
    """One cross-device value per run: the producer posts it, consumers wait for it."""

    __slots__ = ("event", "value", "name")

    def __init__(self, name: str):
        self.event = threading.Event()
        self.value = None
        self.name = name

    def post(self, value) -> None:
        self.value = value
        self.event.set()

    def wait(self):
        if not self.event.wait(config.collective_timeout()):
            raise WorkerError(f"timed out after {config.collective_timeout()} s waiting for "
                              f"{self.name} (gd.config.set_collective_timeout to change)")
        if self.value is _ABORT:
            raise Aborted(f"stopped: another device failed before sending {self.name}")
        return self.value

    def reset(self) -> None:
        self.event.clear()
        self.value = None

    def abort(self) -> None:
        if not self.event.is_set():
            self.value = _ABORT
            self.event.set()


def _storage(state: Var, variable):
    return variable.values[variable.devices.index(state.device)] \
        if state.device in variable.devices else variable.values[0]


def returned_results(placed: Graph, shared_results) -> list[tuple]:
    """The result Vars each replica returns: all of replica 0's, and only the per-replica
    ones of the others (a mirrored result is the same everywhere: returned once)."""
    r, shared = placed.replication.results_per_replica, set(shared_results)
    return [tuple(v for k, v in enumerate(placed.outputs[d * r:(d + 1) * r])
                  if d == 0 or k not in shared) for d in range(len(placed.devices))]


def _guarded(program, devices):
    """The program itself, or for devices with streams one that gives the caller back its
    current device and stream (the program switches between the devices' streams)."""
    ordered = [b for b in kind_backends(devices) if b.ordered]
    if not ordered:
        return program
    restoring = ordered[0].restoring_caller

    def run(*arrays):
        with restoring():
            return program(*arrays)

    return run


def _use_every_core() -> None:
    """One program in the calling thread: BLAS and Numba get every core."""
    threads.set_blas_threads(None)
    threads.set_numba_threads(threads.cores())


class OneDeviceExecutable:
    def __init__(self, placed: Graph, program):
        self.graph = placed
        self.program = _guarded(program, placed.devices)
        self.programs = [program]
        self.devices = placed.devices
        self.source = program.source
        self.replicas = 1

    def __call__(self, arrays):
        """Returns [results]: one list per replica, as MultiDeviceExecutable does."""
        _use_every_core()
        return [self.program(*arrays)]


class MultiDeviceExecutable:
    """Runs a replicated graph: one program per group of devices, the groups at once, one
    worker thread each. A group is one device where there are cores enough for one thread
    per device; with more devices than cores, the devices are shared out among one thread
    per core (see `device_groups`)."""

    def __init__(self, placed: Graph, variables: dict, profile: bool = False,
                 shared_results=()):
        self.graph = placed
        self.variables = variables
        self.profile = profile
        self.returned = returned_results(placed, shared_results)
        self.devices = placed.devices
        self.replicas = len(self.devices)
        self.args_per_replica = placed.replication.args_per_replica
        self.results_per_replica = placed.replication.results_per_replica
        self.groups = device_groups(self.replicas, threads.cores())
        group_of = {self.devices[d]: k for k, group in enumerate(self.groups) for d in group}
        producer = {v: v.device for v in placed.inputs}
        for eqn in placed.eqns:
            producer.update((v, eqn.device) for v in eqn.outputs)
        crossing = {}

        def cross(v, reader: str) -> None:
            if isinstance(v, Var) and group_of[producer[v]] != group_of[reader] \
                    and v not in crossing:
                crossing[v] = Channel(f"{v.hint or 'a value'} from {producer[v]}")

        for eqn in placed.eqns:
            for v in eqn.inputs:
                cross(v, eqn.device)
        for d, device in enumerate(self.devices):        # results another device made
            for v in self._outputs_of(d):
                cross(v, device)
        self.channels = list(crossing.values())
        self.programs = [self._program(group, crossing, producer) for group in self.groups]
        self.source = "\n\n".join(
            f"# ---- {', '.join(self.devices[d] for d in group)}\n{p.source}"
            for group, p in zip(self.groups, self.programs))
        self.pool = threads.ForkSafePool(len(self.groups) - 1, "graphdist-device")
        self.threads = threads.share(len(self.groups))
        self.mirrored = _mirrored(variables[r] for r in placed.variables)

    def _program(self, group: tuple, crossing: dict, producer: dict):
        """The program of the devices `group` (indices): their nodes in the placed graph's
        order, which every group follows, so a group waits only for values made earlier in
        that order and no two groups wait for each other."""
        g = self.graph
        a = self.args_per_replica
        n_states = len(g.variables) // self.replicas
        devices = tuple(self.devices[d] for d in group)
        eqns = tuple(e for e in g.eqns if e.device in devices)
        outputs = [v for d in group for v in self._outputs_of(d)]
        reads = [v for e in eqns for v in e.inputs] + outputs
        imports = {v: crossing[v].wait for v in reads
                   if isinstance(v, Var) and v in crossing and producer[v] not in devices}
        args = [v for d in group for v in g.inputs[d * a:(d + 1) * a]]
        first_state = self.replicas * a
        states = [v for d in group for v in
                  g.inputs[first_state + d * n_states:first_state + (d + 1) * n_states]]
        # what another group reads: values these devices' eqns make, and their own
        # arguments and variable states (a collective on cpu:0 reading cpu:1's argument
        # waited for a value nobody sent, until the collective timeout)
        made_here = [v for e in eqns for v in e.outputs] + args + states
        exports = {v: crossing[v].post for v in made_here if v in crossing}
        variables = [v for d in group for v in g.variables[d * n_states:(d + 1) * n_states]]
        results = [v for d in group for v in self._results_of(d)]
        finals = [v for d in group for v in self._finals_of(d)]
        sub = Graph(inputs=tuple(args) + tuple(imports) + tuple(states), eqns=eqns,
                    outputs=tuple(results) + tuple(finals), variables=tuple(variables),
                    devices=devices)
        storage = {s: _storage(s, self.variables[v]) for s, v in zip(states, variables)}
        return lower(sub, backend_for(devices[0]), storage, imports=imports,
                     exports=exports, events=[] if self.profile else None,
                     replica_devices=self.devices)

    def _results_of(self, d: int) -> tuple:
        return self.returned[d]

    def _finals_of(self, d: int) -> tuple:
        n_states = len(self.graph.variables) // self.replicas
        start = self.replicas * self.results_per_replica + d * n_states
        return self.graph.outputs[start:start + n_states]

    def _outputs_of(self, d: int) -> tuple:
        return self._results_of(d) + self._finals_of(d)

    def _run_group(self, k: int, arrays):
        threads.set_numba_threads(self.threads)
        a = self.args_per_replica
        try:
            flat = self.programs[k](*[x for d in self.groups[k]
                                       for x in arrays[d * a:(d + 1) * a]])
        except BaseException:
            self._abort()        # wake every group waiting on a value this one will not send
            raise
        per, i = [], 0
        for d in self.groups[k]:
            n = len(self.returned[d])
            per.append(flat[i:i + n])
            i += n
        return per

    def __call__(self, arrays):
        """arrays: the argument arrays of every replica, replica after replica."""
        catch_up(self.mirrored)
        for ch in self.channels:
            ch.reset()
        threads.set_blas_threads(self.threads)
        futures = [self.pool.submit(self._run_group, k, arrays)
                   for k in range(1, len(self.groups))]
        results, errors = [None] * len(self.groups), [None] * len(self.groups)
        try:
            results[0] = self._run_group(0, arrays)
        except BaseException as e:  # noqa: BLE001 - every failure must stop the others
            errors[0] = e
            self._abort()
        for k, f in enumerate(futures, start=1):
            try:
                results[k] = f.result()
            except BaseException as e:  # noqa: BLE001
                errors[k] = e
                self._abort()
        real = [e for e in errors if e is not None and not isinstance(e, Aborted)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        return [per for group in results for per in group]

    def _abort(self) -> None:
        for ch in self.channels:
            ch.abort()


def device_groups(devices: int, cores: int) -> list[tuple]:
    """The devices (indices) each worker thread runs: one each where there are cores enough,
    else `cores` groups of consecutive devices. More worker threads than cores share them
    by the OS's time slices and hand the interpreter lock around more often; with one per
    core each runs its devices' programs interleaved as one."""
    k = max(1, min(devices, cores))
    bounds = [devices * i // k for i in range(k + 1)]
    return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _mirrored(variables) -> list:
    """The distinct multi-component mirrored variables among `variables`."""
    seen = {}
    for v in variables:
        if len(v.devices) > 1 and not v.on_read:
            seen.setdefault(id(v), v)
    return list(seen.values())


def catch_up(variables) -> None:
    """Before a per-device program reads components 1..N-1: bring up to date the ones a
    merged step left behind."""
    for v in variables:
        if v._lagging:
            v.catch_up()


class MergedExecutable:
    """Runs a merged graph (passes/merge.py): every replica at once, as one program over
    stacked values, in the calling thread with all cores for BLAS. It takes and returns
    what the replicated executables do; of each mirrored variable it updates component 0
    and marks the others lagging (Variable.catch_up).

    When a step fails, the per-device executable (`per_device()`, built then) runs it
    again: a stacked op cannot say which replica's data failed, the per-device program's
    error names the device and the node. Variables are untouched by the failed attempt."""

    def __init__(self, merged: Graph, variables: dict, profile: bool = False,
                 shared_results=(), per_device=None):
        self.graph = merged
        self.per_device = per_device
        self.diagnosis = None
        self.devices = merged.devices
        self.replicas = len(self.devices)
        states = merged.inputs[merged.num_args:]
        storage = {s: variables[ref].values[k] for s, ref, k in
                   zip(states, merged.variables, merged.replication.components)}
        program = lower(merged, backend_for(self.devices[0]), storage,
                        events=[] if profile else None)
        self.program = program
        self.programs = [program]
        self.source = program.source
        finals = merged.outputs[merged.num_results:]
        self.written = _mirrored(variables[v] for v, s, f in zip(merged.variables, states,
                                                                 finals)
                                 if f is not s)
        batched, shared = merged.replication.batched_results, set(shared_results)
        self.layout = [[(k, batched[k]) for k in range(len(batched)) if d == 0 or k not in shared]
                       for d in range(self.replicas)]

    def __call__(self, arrays):
        _use_every_core()
        for v in self.written:
            v._lagging = True
        try:
            flat = self.program(*arrays)
        except Exception:
            if self.per_device is None:
                raise
            return self.run_per_device(arrays)
        return [[flat[k][d] if batched else flat[k] for k, batched in per]
                for d, per in enumerate(self.layout)]


    def run_per_device(self, arrays):
        if self.diagnosis is None:
            self.diagnosis = self.per_device()
        results = self.diagnosis(arrays)    # raises the failing replica's own error
        config.logger.warning("a merged step failed where its per-device form ran; the "
                              "per-device results were used")
        return results


class SequentialExecutable:
    """Runs a replicated graph over logical CPU devices as ONE generated program, device
    segments in the replication order, in the calling thread. It wins where the nodes are
    small (their Python costs what their work does, and device threads would contend for
    the interpreter lock: "auto" picks it there, pipeline.py `small_node_step`), and it
    can fuse each bucket's all-reduce with every replica's update into one node. Cross-
    device values are plain references; every device keeps its own buffers. GPU devices
    always run this way: each queues its work on its own stream, ordered by events
    (runtime/streams.py)."""

    def __init__(self, placed: Graph, variables: dict, profile: bool = False,
                 shared_results=()):
        self.graph = placed
        self.devices = placed.devices
        self.replicas = len(self.devices)
        self.returned = returned_results(placed, shared_results)
        results = tuple(v for per in self.returned for v in per)
        finals = placed.outputs[self.replicas * placed.replication.results_per_replica:]
        whole = Graph(inputs=placed.inputs, eqns=placed.eqns, outputs=results + finals,
                      variables=placed.variables, devices=placed.devices)
        storage = {s: _storage(s, variables[v]) for s, v in
                   zip(placed.inputs[placed.num_args:], placed.variables)}
        program = lower(whole, backend_for(self.devices[0]), storage,
                        events=[] if profile else None)
        self.program = _guarded(program, self.devices)
        self.programs = [program]
        self.source = program.source
        self.mirrored = _mirrored(variables[r] for r in placed.variables)

    def __call__(self, arrays):
        catch_up(self.mirrored)
        _use_every_core()
        flat = self.program(*arrays)
        out, k = [], 0
        for per in self.returned:
            out.append(flat[k:k + len(per)])
            k += len(per)
        return out


def executable(plan, variables: dict, profile: bool = False, shared_results=()):
    """The callable that runs `plan` (graphdist.pipeline.Plan). `variables` maps the
    graph's StateRefs to the Variables whose storage the program updates in place.
    `shared_results`: indices of results every replica returns alike (mirrored), returned
    by replica 0 only."""
    g = plan.graph
    if plan.mode == "one_device":
        storage = {s: variables[ref].values[0]
                   for s, ref in zip(g.inputs[g.num_args:], g.variables)}
        return OneDeviceExecutable(g, lower(g, backend_for(g.devices[0]), storage,
                                            events=[] if profile else None))
    if plan.mode == "merged":
        return MergedExecutable(g, variables, profile, shared_results, lambda: executable(
            plan.per_device(), variables, profile, shared_results))
    # collectives across workers: agreed with the other workers before each call runs them
    if plan.mode == "threads":
        return checked(MultiDeviceExecutable(g, variables, profile, shared_results), g)
    return checked(SequentialExecutable(g, variables, profile, shared_results), g)
