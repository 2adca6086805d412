"""gd.function: the signature cache around trace -> pipeline -> runtime."""

from __future__ import annotations

import gc
import inspect
import itertools
import threading
import time

import numpy as np

from graphdist import config, eager, program_switch
from graphdist.ir import ArrayType, Graph, as_dtype
from graphdist.distribute import recipes
from graphdist.distribute.values import PerReplica
from graphdist.ops.core import Symbolic, current_tracer, is_python_scalar
from graphdist.progress import slow_notice
from graphdist.pytree import flatten, unflatten
from graphdist.device.backends import is_device_array
from graphdist.errors import user_frame_text
from graphdist.trace import Tensor, Tracer, tracing

# How many signatures one gd.function keeps compiled. Each holds a traced graph, its
# compiled programs and their buffers, so a function called with ever-new shapes (a
# retrace storm) would otherwise grow without limit; the least recently used one goes, and
# traces again if it comes back. 64 is far above what a training loop needs (a few).
MAX_SIGNATURES = 64
# From this trace on, every retrace logs a warning saying what changed (TF warns at about
# the same count): a function that keeps retracing compiles on every call.
RETRACE_WARNING_FROM = 6

# Programs that touch variables run one at a time. One signature's program already did
# (Program.lock), but two signatures' programs updating the same variable in two threads
# lost updates (v.assign_add(1) from 8 threads x 500 calls kept 3,380 of 4,000 whenever
# some calls retraced). One lock for every stateful step also covers two functions sharing
# a variable; it costs one uncontended acquisition per call, and steps gain little from
# running side by side on a host whose BLAS serializes concurrent calls anyway.
_STATE_LOCK = threading.RLock()
_use_clock = itertools.count(1)     # Compiled.last_used: the LRU's order


def _leaf_spec(leaf, path, name=str):
    """The part of the signature a leaf contributes; arrays are dynamic, the rest static.
    `name(path)` gives the argument's name for errors (only then: a step with many array
    arguments pays for this on every call)."""
    if isinstance(leaf, Tensor):
        raise TypeError(f"argument {name(path)}: a gd.Tensor from another trace cannot be "
                        "passed to a gd.function called outside tracing")
    if is_device_array(leaf):                # a CuPy array: used where it lies
        return ("array", tuple(leaf.shape), as_dtype(leaf.dtype))
    if isinstance(leaf, np.ndarray) or (isinstance(leaf, np.generic)):
        try:
            dtype = as_dtype(leaf.dtype)
        except TypeError as e:
            raise TypeError(f"argument {name(path)}: {e}") from None
        return ("array", tuple(leaf.shape), dtype)
    if is_python_scalar(leaf) or leaf is None or isinstance(leaf, (str, bytes)):
        return ("static", type(leaf), leaf)
    if isinstance(leaf, Symbolic):           # a Variable passed as an argument: captured
        return ("variable", id(leaf))
    if hasattr(leaf, "__array__") or hasattr(leaf, "__cuda_array_interface__"):
        return _leaf_spec(np.asarray(leaf), path, name)
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(f"argument {name(path)}: {type(leaf).__name__} is neither an array "
                        "nor a hashable static value") from None
    return ("static", type(leaf), leaf)


def _spec_text(spec) -> str:
    if spec[0] == "array":
        return str(ArrayType(spec[1], spec[2]))
    if spec[0] == "variable":
        return "a variable"
    return repr(spec[2])


def _structure_text(tree, specs, limit: int = 120) -> str:
    """A pytree of leaf specs as text (consuming its leaves from the iterator `specs`)."""
    if tree is None:
        return _spec_text(next(specs))
    kind = tree[0]
    if kind is dict:
        text = "{" + ", ".join(f"{k!r}: {_structure_text(t, specs)}"
                               for k, t in zip(tree[1], tree[2])) + "}"
    else:
        inner = ", ".join(_structure_text(t, specs) for t in tree[1])
        text = (f"{kind.__name__}({inner})" if hasattr(kind, "tree_children")
                else f"[{inner}]" if issubclass(kind, list)
                else f"({inner}{',' if len(tree[1]) == 1 else ''})")
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Compiled:
    """One signature's trace: the logical graph (replica 0's), the pipeline's plan and its
    executable, plus how call arguments feed it and how its results come back."""

    def __init__(self, graph: Graph, out_tree, out_kinds: list, plan, variables: dict,
                 feeds: list, shared_results=()):
        self.graph = graph
        self.plan = plan
        self.variables = variables             # StateRef -> Variable: the storage
        self.shared_results = shared_results   # results returned by replica 0 only
        self.out_tree = out_tree
        # per output leaf: ("static", value) | ("mirrored",) | ("per_replica",)
        self.out_kinds = out_kinds
        self._executables: dict = {}   # gd.config.numerics_checked() -> its executable
        self.feeds = feeds           # per replica: indices of the call's leaves it takes
        self.profiled = None         # the instrumented executable, built on first profile
        # steps that touch variables run one at a time (_STATE_LOCK); so do the calls of a
        # stateless one with several programs, whose per-run channels two calls would share
        # (two threads' "threads"-mode all-reduces swapped values: 963 of 1,200 sums wrong)
        self.lock = _STATE_LOCK if variables else (
            threading.Lock() if len(self.executable.programs) > 1 else None)
        self.last_used = next(_use_clock)

    @property
    def executable(self):
        """The executable of the current gd.config.check_numerics setting (a checked
        program is compiled the first time a step runs with the checks on)."""
        checked = config.numerics_checked()
        if checked not in self._executables:
            from graphdist.runtime.executable import executable
            from graphdist.runtime.numerics import Guarded

            run = executable(self.plan, self.variables, shared_results=self.shared_results)
            self._executables[checked] = Guarded(run, self.variables.values()) if checked \
                else run
        return self._executables[checked]

    def rebuild(self, profile: bool):
        from graphdist.runtime.executable import executable

        return executable(self.plan, self.variables, profile, self.shared_results)

    @property
    def replicated_graph(self) -> Graph:
        return self.executable.graph

    def run(self, arrays, executable=None):
        """Run the executable (or `executable`, its profiled twin) on the fed arrays, under
        self.lock if it has one."""
        run = executable or self.executable
        try:
            if self.lock is None:
                return run(arrays)
            with self.lock:
                return run(arrays)
        except BaseException as e:
            if self.plan.on_failure is not None:
                self.plan.on_failure(e)
            raise

    def __call__(self, leaves, executable=None):
        per_device = self.run([leaves[i] for feed in self.feeds for i in feed], executable)
        out, k, shared_seen = [], 0, 0
        for kind in self.out_kinds:
            if kind[0] == "static":
                out.append(kind[1])
                continue
            if kind[0] == "per_replica":
                # replicas > 0 return only their per-replica results, in order
                j = k - shared_seen
                out.append(PerReplica((_scalar(per_device[0][k]),) + tuple(
                    _scalar(res[j]) for res in per_device[1:])))
            else:
                out.append(_scalar(per_device[0][k]))
                shared_seen += 1
            k += 1
        return unflatten(self.out_tree, out)


def _scalar(r):
    return r[()] if isinstance(r, np.ndarray) and r.ndim == 0 else r


def _replica_count(tree_value) -> int | None:
    counts = set()

    def visit(x):
        if isinstance(x, PerReplica):
            counts.add(len(x.values))
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)

    visit(tree_value)
    if len(counts) > 1:
        raise ValueError(f"PerReplica arguments disagree on the number of replicas: {counts}")
    return counts.pop() if counts else None


def _replica_shape_table(seen: list) -> list | None:
    """Per crossing of replicas, every replica's shape (from each replica's trace), or None
    when all replicas saw the same shapes or took different paths."""
    if all(s == seen[0] for s in seen) or any(len(s) != len(seen[0]) for s in seen):
        return None
    return [tuple(s[k] for s in seen) for k in range(len(seen[0]))]


def _view(tree_value, r: int):
    """What replica r's code sees: each PerReplica becomes a LocalValue of its r-th value."""
    from graphdist.distribute.values import LocalValue, map_structure

    return map_structure(lambda v: LocalValue((v.values[r],)) if isinstance(v, PerReplica)
                         else v, tree_value)


class Function:
    """A traced-and-compiled Python function (see `function` below)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "function")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.trace_count = 0
        self.warns_on_retraces = True   # False for graphdist's own per-shape helpers
        self._cache: dict = {}       # signature -> Compiled, at most MAX_SIGNATURES of them
        self._last = None            # the signature of the latest trace
        self._last_compiled = None
        self._lock = threading.RLock()
        # gd.Variables may be made on the first trace only (as in tf.function); True once a
        # trace has run to its end
        self._first_trace_done = False
        # host state its traces consulted (gradient accumulation's phase): its states are
        # part of the signature key, one program per state (graphdist/program_switch.py)
        self._switches: list = []
        try:
            self._params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self._params = []

    def __repr__(self) -> str:
        return f"<gd.function {self.__name__}: {self.trace_count} traces>"

    def __get__(self, obj, objtype=None):   # methods: bind like a plain function would
        if obj is None:
            return self
        import functools

        return functools.partial(self.__call__, obj)

    def __call__(self, *args, **kwargs):
        if current_tracer() is not None:      # called from traced code: inline
            return self.fn(*args, **kwargs)
        leaves, key = self._signature(args, kwargs)
        compiled = self._lookup(key)
        if compiled is None:     # trace, compile and the first run (Numba kernels load)
            with slow_notice(f"compiling gd.function {self.__name__} for a new signature "
                             "(tracing, compile passes, the first step, and the Numba kernels "
                             "it must wait for; the others load in the background)"):
                compiled = self._compile(key, leaves, args, kwargs)
                return compiled(leaves)
        return compiled(leaves)

    # ------------------------------------------------------------ signature
    def _signature(self, args, kwargs):
        leaves, paths, tree = flatten((args, kwargs))
        specs = tuple(_leaf_spec(leaf, p, self._path_name) for leaf, p in zip(leaves, paths))
        leaves = [leaf if type(leaf) is np.ndarray or specs[i][0] != "array"
                  or is_device_array(leaf) else np.asarray(leaf) for i, leaf in enumerate(leaves)]
        # settings that change what a trace emits are part of its key
        return leaves, (tree, specs, config.fused_kernels(), config.precision(),
                        program_switch.states(self._switches))

    def _path_name(self, path: str) -> str:
        # "[0][1][2]" -> "batch[2]" using the function's parameter names
        if path.startswith("[0]["):
            rest = path[4:]
            index, _, tail = rest.partition("]")
            if index.isdigit() and int(index) < len(self._params):
                return self._params[int(index)] + tail
            return f"args[{index}]{tail}"
        if path.startswith("[1]["):
            key, _, tail = path[4:].partition("]")
            return key.strip("'\"") + tail
        return path

    def _explain(self, key) -> None:
        """Log what changed since the previous trace: on every retrace with
        gd.config.explain_retraces(True), and from trace RETRACE_WARNING_FROM on always."""
        if self._last is None:
            return
        trace = self.trace_count + 1
        often = trace >= RETRACE_WARNING_FROM and self.warns_on_retraces
        if not (often or config._state["explain_retraces"]):
            return
        hint = ("; it traces and compiles again for every new signature: keep shapes, "
                "dtypes and Python arguments the same from call to call (pad the last "
                "batch, say)" if often else "")
        config.logger.warning("gd.function %s retraced (trace %d): %s%s", self.__name__,
                              trace, self._changes(self._last, key), hint)

    def _changes(self, old, new) -> str:
        """What differs between two signatures, old -> new."""
        old_tree, old_specs, old_fused, old_precision, old_switched = old
        tree, specs, fused, precision, switched = new
        if old_tree != tree:
            before, after = self._argument_texts(old_tree, old_specs), \
                self._argument_texts(tree, specs)
            return "; ".join(f"{name}: {before.get(name, 'not passed')} -> "
                             f"{after.get(name, 'not passed')}"
                             for name in dict.fromkeys([*before, *after])
                             if before.get(name) != after.get(name))
        if old_fused != fused:
            return f"fused kernels: {old_fused} -> {fused}"
        if old_precision != precision:
            return f"precision: {old_precision} -> {precision}"
        if old_switched != switched:
            return f"program switch states (gradient accumulation): {old_switched} -> {switched}"
        _, paths, _ = flatten(unflatten(tree, list(range(len(specs)))))
        return "; ".join(f"{self._path_name(p)}: {_spec_text(a)} -> {_spec_text(b)}"
                         for p, a, b in zip(paths, old_specs, specs) if a != b)

    def _argument_texts(self, tree, specs) -> dict:
        """Parameter name -> what was passed for it: its structure with each leaf's spec,
        'PerReplica(f32[4,2], f32[4,2])', say (a structure change, explained)."""
        leaves = iter(specs)
        _, (args_tree, kwargs_tree) = tree
        texts = {self._path_name(f"[0][{i}]"): _structure_text(t, leaves)
                 for i, t in enumerate(args_tree[1])}
        texts.update((str(k), _structure_text(t, leaves))
                     for k, t in zip(kwargs_tree[1], kwargs_tree[2]))
        return texts

    def _lookup(self, key) -> Compiled | None:
        """The cached trace of a signature, marked as just used (for the LRU)."""
        compiled = self._cache.get(key)
        if compiled is not None:
            compiled.last_used = next(_use_clock)
        return compiled

    def _remember(self, key, compiled: Compiled) -> None:
        """Cache a new trace, dropping the least recently used one when MAX_SIGNATURES are
        kept (under self._lock). Its variables live on: a signature that comes back traces
        again and reuses them, as the function's variables are made on its first trace."""
        while len(self._cache) >= max(1, MAX_SIGNATURES):
            oldest = min(self._cache, key=lambda k: self._cache[k].last_used)
            del self._cache[oldest]
        self._cache[key] = compiled

    # ------------------------------------------------------------ tracing
    def _compile(self, key, leaves, args, kwargs) -> Compiled:
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            self._explain(key)
            # tracing makes many small objects and no cycles worth collecting: pausing the
            # cyclic GC keeps compile time linear (50k nodes: 3.4 s -> 2.9 s)
            enabled = gc.isenabled()
            gc.disable()
            first = not self._first_trace_done
            try:
                with program_switch.recording() as seen:
                    compiled = self._build(key, leaves)
            except BaseException:
                if first:          # nothing compiled yet: the next call is a first trace
                    self._first_trace_done = False
                raise
            finally:
                if enabled:
                    gc.enable()
            self.trace_count += 1
            new = [s for s in seen if all(s is not t for t in self._switches)]
            if new:                     # the trace consulted them: key it by their states
                self._switches += new
                key = key[:-1] + (program_switch.states(self._switches),)
            self._remember(key, compiled)
            self._last, self._last_compiled = key, compiled
            return compiled

    def _build(self, key, leaves) -> Compiled:
        """Trace replica 0's view; if it ran a strategy with several replicas, trace the
        other shard shapes too; hand the logical graphs to the pipeline."""
        from graphdist import pipeline
        from graphdist.distribute.context import get_strategy

        tree, specs = key[:2]
        index_tree = unflatten(tree, list(range(len(leaves))))
        n_args = _replica_count(index_tree)
        if n_args:
            self._check_per_replica_static(index_tree, n_args, specs)
        view = _view(index_tree, 0) if n_args else index_tree
        stages: list = []
        variables: dict = {}
        graph, out_tree, out_kinds, strategy, seen = self._trace(view, leaves, specs, variables,
                                                                 stages)
        if strategy is None:   # no strategy.run, but mirrored variables: their strategy
            found = {v._strategy for v in variables.values() if len(v.devices) > 1}
            strategy = found.pop() if len(found) == 1 else None
        # this process's replicas (all of them but under a multi-worker strategy)
        n = strategy._local_replicas if strategy is not None else 1
        across = strategy is not None and strategy.num_replicas_in_sync > n
        if n_args and n_args != n:
            raise ValueError(f"gd.function {self.__name__}: PerReplica arguments have {n_args} "
                             f"values but the strategy runs {n} replicas"
                             + (" in this process" if across else ""))
        if n == 1 and not across:
            device = pipeline.device_of(graph, get_strategy().devices[0])
            plan = pipeline.one_device(graph, device, stages)
            return Compiled(graph, out_tree, out_kinds, plan, variables,
                            [self._feed(view, specs)])
        views = [_view(index_tree, r) for r in range(n)] if n_args else [index_tree] * n
        shape_keys = [tuple(specs[i] for i in self._feed(v, specs)) for v in views]
        known, rounds = None, 0
        while True:
            by_shapes = {shape_keys[0]: (graph, seen)}
            for r, v in enumerate(views):      # an uneven shard: trace its shapes too
                if shape_keys[r] not in by_shapes:
                    traced = self._trace(v, leaves, specs, variables, known=known)
                    by_shapes[shape_keys[r]] = (traced[0], traced[4])
            table = _replica_shape_table([by_shapes[k][1] for k in shape_keys])
            rounds += 1
            if table is None or table == known or rounds > 8:
                break
            # per-replica values of uneven shards crossed replicas (strategy.gather, say):
            # trace again, now that every replica's shapes are known
            known, stages = table, []
            graph, out_tree, out_kinds, _, seen = self._trace(view, leaves, specs, variables,
                                                              stages, known)
        graphs = [by_shapes[k][0] for k in shape_keys]
        recipes.check_replicated_step(self, graphs)   # a loss recipe that N replicas break?
        shared = [k for k, kind in enumerate(r for r in out_kinds if r[0] != "static")
                  if kind[0] == "mirrored"]
        feeds = [self._feed(v, specs) for v in views]
        same_array = [i for i, leaf in enumerate(feeds[0]) if all(f[i] == leaf for f in feeds)]
        plan = pipeline.replicated(graphs, strategy, same_array, stages)
        return Compiled(graph, out_tree, out_kinds, plan, variables, feeds, shared)

    def _check_per_replica_static(self, index_tree, n: int, specs) -> None:
        """Every replica runs replica 0's trace: the leaves of PerReplica components that the
        trace bakes in (anything not an array) must be the same on every replica."""
        first, paths, tree = flatten(_view(index_tree, 0))
        for r in range(1, n):
            leaves, _, other = flatten(_view(index_tree, r))
            if other != tree:
                raise ValueError(f"gd.function {self.__name__}: a PerReplica argument's values "
                                 f"differ in structure between replica 0 and replica {r}")
            for i, j, p in zip(first, leaves, paths):
                if specs[i][0] != "array" and specs[i] != specs[j]:
                    raise ValueError(
                        f"gd.function {self.__name__}: argument "
                        f"{self._path_name(p.replace('.values[0]', ''))} of a PerReplica is "
                        f"{_spec_text(specs[i])} on replica 0 but {_spec_text(specs[j])} on "
                        f"replica {r}; only arrays and numbers may differ between replicas "
                        "(one program is traced for all of them)")

    @staticmethod
    def _feed(view, specs) -> list:
        indices, _, _ = flatten(view)
        return [i for i in indices if specs[i][0] == "array"]

    def _trace(self, view, leaves, specs, variables: dict, stages: list | None = None,
               known: list | None = None):
        """Trace `fn` on `view`; the Variables it captured are added to `variables`. `known`:
        every replica's shapes of the per-replica values that cross replicas, in order."""
        from graphdist.distribute.values import LocalValue

        indices, paths, view_tree = flatten(view)
        tracer = Tracer()
        tracer.replica_shapes_known = known
        if self._first_trace_done:
            tracer.refuse_variables = self._retrace_text(known is not None or stages is None)
        start = time.perf_counter()
        with tracing(tracer):
            traced = [tracer.new_arg(ArrayType(specs[i][1], specs[i][2]),
                                     self._path_name(p.replace(".values[0]", "")))
                      if specs[i][0] == "array" else leaves[i] for i, p in zip(indices, paths)]
            t_args, t_kwargs = unflatten(view_tree, traced)
            try:
                out = self.fn(*t_args, **t_kwargs)
            except (ValueError, TypeError) as e:    # raised before any eqn: add the line
                where = "" if "while tracing" in str(e) else user_frame_text(e.__traceback__)
                if not where:
                    raise
                raise type(e)(f"{e}\n  while tracing  {where}") from None
            self._first_trace_done = True
            out_leaves, _, out_tree = flatten(out, leaf_types=(LocalValue,))
            results, kinds = [], []
            for leaf in out_leaves:
                if isinstance(leaf, LocalValue):
                    results.append(tracer.lift(leaf.local))
                    kinds.append(("per_replica",))
                elif isinstance(leaf, Symbolic):
                    results.append(tracer.lift(leaf))
                    kinds.append(("mirrored",))
                else:
                    kinds.append(("static", leaf))
        from graphdist import pipeline

        variables.update(tracer.captured())
        graph = pipeline.logical(tracer.graph(results), stages, time.perf_counter() - start)
        return graph, out_tree, kinds, tracer.strategy, tracer.replica_shapes_seen

    def _retrace_text(self, for_shards: bool) -> str:
        """Why a trace may not create variables (Tracer.refuse_variables)."""
        if for_shards:
            why = "traces again for another replica's shard shapes"
        else:
            why = f"retraces for a new signature (trace {self.trace_count + 1})"
        return (f"gd.function {self.__name__} {why}, and this trace creates it again. A "
                "gd.function creates variables on its first trace only, as tf.function "
                "('singleton variables created on the first call'): a fresh variable on each "
                "retrace would silently drop the state. Create it outside the function, or "
                "once (if self.v is None: self.v = gd.Variable(...))")

    # ------------------------------------------------------------ inspection
    def _entry(self, args, kwargs) -> Compiled:
        leaves, key = self._signature(args, kwargs)
        return self._lookup(key) or self._compile(key, leaves, args, kwargs)

    def _latest(self) -> Compiled:
        if self._last_compiled is None:
            raise ValueError(f"gd.function {self.__name__} has not been traced yet; call it "
                             "or use get_graph(*args)")
        return self._last_compiled

    @property
    def graph(self) -> Graph:
        """The logical (one-replica) graph of the most recent signature."""
        return self._latest().graph

    @property
    def replicated_graph(self) -> Graph:
        """The placed graph that actually runs, for the most recent signature."""
        return self._latest().replicated_graph

    def get_graph(self, *args, **kwargs) -> Graph:
        return self._entry(args, kwargs).graph

    def get_replicated_graph(self, *args, **kwargs) -> Graph:
        return self._entry(args, kwargs).replicated_graph

    @property
    def stages(self) -> dict:
        """The graph after every stage of the compile pipeline (graphdist/pipeline.py), in
        order, for the most recent signature: {"trace": ..., "dce": ..., "replicate": ...,
        "lower_collectives": ..., "schedule": ...}; the last is the replicated graph."""
        return {s.name: s.graph for s in self._latest().plan.stages}

    def get_stages(self, *args, **kwargs) -> dict:
        """`stages` for the signature of these arguments (traced and compiled if new)."""
        return {s.name: s.graph for s in self._entry(args, kwargs).plan.stages}

    def profile(self, *args, path=None, **kwargs) -> dict:
        """Run one step with a timer around every node; returns (and writes to `path`) the
        Chrome trace event object: one lane per device, one event per node. It first waits
        for the kernels still loading in the background, so no node is charged for them."""
        from graphdist.runtime.profile import chrome_trace, write_trace

        leaves, key = self._signature(args, kwargs)
        compiled = self._lookup(key) or self._compile(key, leaves, args, kwargs)
        if compiled.profiled is None:
            compiled.profiled = compiled.rebuild(True)
        executable = compiled.profiled
        for program in executable.programs:
            program.events.clear()
        _kernels_loaded()
        compiled.run([leaves[i] for feed in compiled.feeds for i in feed], executable)
        trace = chrome_trace(executable, self.__name__)
        if path is not None:
            write_trace(trace, path)
        return trace

    def call_many(self, args_of, steps: int, profile: bool = False):
        """Call this function up to `steps` times, `args_of(previous result)` giving each
        call's arguments (StopIteration ends the calls early). Returns (last result, calls
        made, Chrome trace or None). After the first call of a signature every call feeds
        its program directly: the arguments are checked by their arrays' shapes and dtypes
        instead of having their signature derived again. With `profile`, every node of
        every call is timed and each call is a "step k" slice on every device's lane."""
        result, done, bounds = None, 0, []
        tree = specs = compiled = switched = None
        for _ in range(steps):
            try:
                args = args_of(result)
            except StopIteration:
                break
            leaves, _, t = flatten((args, {}))
            if compiled is None or t != tree or not _same_arrays(leaves, specs) or (
                    self._switches and program_switch.states(self._switches) != switched):
                leaves, key = self._signature(args, {})
                if profile and compiled is not None and (key[0], key[1]) != (tree, specs):
                    raise ValueError(f"gd.function {self.__name__}: a profiled run of many "
                                     "calls needs one signature; the arguments changed")
                compiled = self._lookup(key)
                if compiled is None:
                    with slow_notice(f"compiling gd.function {self.__name__} for a new "
                                     "signature"):
                        compiled = self._compile(key, leaves, args, {})
                tree, specs = key[0], key[1]
                switched = program_switch.states(self._switches)
            if not profile:
                result = compiled(leaves)
            else:
                if compiled.profiled is None:
                    compiled.profiled = compiled.rebuild(True)
                if not bounds:
                    _kernels_loaded()
                start = time.perf_counter()
                result = compiled(leaves, compiled.profiled)
                bounds.append((start, time.perf_counter()))
            done += 1
        trace = None
        if profile and compiled is not None:
            from graphdist.runtime.profile import chrome_trace

            trace = chrome_trace(compiled.profiled, self.__name__, steps=bounds)
            for program in compiled.profiled.programs:
                program.events.clear()
        return result, done, trace

    def program_source(self, *args, **kwargs) -> str:
        """The generated Python program(s) of a signature (the latest when no args). While
        its kernels still load in the background, a first line says that their calls run
        their numpy forms for now (runtime/warmup.py): the source shows what runs next."""
        entry = self._entry(args, kwargs) if args or kwargs else self._latest()
        if any(getattr(p, "warming", False) for p in entry.executable.programs):
            return ("# the Numba kernels below are still loading: until they have, their calls "
                    "run their numpy forms (the same bits)\n" + entry.executable.source)
        return entry.executable.source


def _kernels_loaded() -> None:
    """Before a profiled run: wait for the kernels still loading in the background
    (runtime/warmup.py), as gd.benchmark does before it times. A profile right after a
    first call otherwise charged their loading (325 ms) to the node whose kernel was still
    loading, in a 7 ms step."""
    from graphdist.runtime import warmup

    warmup.wait()


def _same_arrays(leaves, specs) -> bool:
    """Do these leaves fit the signature `specs` (numpy arrays of the same shapes and dtypes,
    the same static values)?"""
    if len(leaves) != len(specs):
        return False
    for leaf, spec in zip(leaves, specs):
        if spec[0] == "array":
            if not (type(leaf) is np.ndarray and leaf.shape == spec[1] and leaf.dtype == spec[2]):
                return False
        elif _leaf_spec(leaf, "") != spec:
            return False
    return True


def function(fn=None):
    """Trace `fn` once per input signature into a graph, compile it, and run the compiled
    program on later calls.

    >>> @gd.function
    ... def f(x): return gd.tanh(x) * 2
    >>> f(np.ones(3, np.float32)).shape
    (3,)
    """
    if fn is None:
        return function
    return Function(fn)


# the lower layers (value_and_grad, the strategies) compile eager calls through graphdist.eager
eager.register(function)
