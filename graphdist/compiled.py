"""gd.function: the signature cache around trace -> passes -> lower -> run."""

from __future__ import annotations

import inspect
import threading

import numpy as np

from graphdist import config
from graphdist.ir import ArrayType, Graph, as_dtype
from graphdist.ops.core import Symbolic, current_tracer, is_python_scalar
from graphdist.pytree import flatten, unflatten
from graphdist.trace import Tensor, Tracer, tracing


def _leaf_spec(leaf, path):
    """The part of the signature a leaf contributes; arrays are dynamic, the rest static."""
    if isinstance(leaf, Tensor):
        raise TypeError(f"argument {path}: a gd.Tensor from another trace cannot be passed to "
                        "a gd.function called outside tracing")
    if isinstance(leaf, np.ndarray) or (isinstance(leaf, np.generic)):
        try:
            dtype = as_dtype(leaf.dtype)
        except TypeError as e:
            raise TypeError(f"argument {path}: {e}") from None
        return ("array", tuple(leaf.shape), dtype)
    if is_python_scalar(leaf) or leaf is None or isinstance(leaf, (str, bytes)):
        return ("static", type(leaf), leaf)
    if isinstance(leaf, Symbolic):           # a Variable passed as an argument: captured
        return ("variable", id(leaf))
    if hasattr(leaf, "__array__") or hasattr(leaf, "__cuda_array_interface__"):
        return _leaf_spec(np.asarray(leaf), path)
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(f"argument {path}: {type(leaf).__name__} is neither an array nor a "
                        "hashable static value") from None
    return ("static", type(leaf), leaf)


def _spec_text(spec) -> str:
    if spec[0] == "array":
        return str(ArrayType(spec[1], spec[2]))
    if spec[0] == "variable":
        return "a variable"
    return repr(spec[2])


class Compiled:
    """One signature's trace: its logical graph, the placed graph and the program."""

    def __init__(self, graph: Graph, out_tree, out_statics: list, executable):
        self.graph = graph
        self.out_tree = out_tree
        self.out_statics = out_statics     # output leaves: None where dynamic, else the value
        self.executable = executable

    @property
    def replicated_graph(self) -> Graph:
        return self.executable.graph

    def __call__(self, arrays):
        results = iter(self.executable(arrays))
        leaves = [next(results) if s is None else s[0] for s in self.out_statics]
        leaves = [r[()] if isinstance(r, np.ndarray) and r.ndim == 0 else r for r in leaves]
        return unflatten(self.out_tree, leaves)


class Function:
    """A traced-and-compiled Python function (see graphdist.trace.function)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "function")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.trace_count = 0
        self._cache: dict = {}
        self._last = None
        self._lock = threading.RLock()
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
        leaves, key, dynamic = self._signature(args, kwargs)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(key, leaves, args, kwargs)
        return compiled([leaves[i] for i in dynamic])

    # ------------------------------------------------------------ signature
    def _signature(self, args, kwargs):
        leaves, paths, tree = flatten((args, kwargs))
        specs = tuple(_leaf_spec(leaf, self._path_name(p)) for leaf, p in zip(leaves, paths))
        dynamic = [i for i, s in enumerate(specs) if s[0] == "array"]
        leaves = [np.asarray(leaf) if specs[i][0] == "array" else leaf
                  for i, leaf in enumerate(leaves)]
        return leaves, (tree, specs, config.fused_kernels()), dynamic

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
        if not config._state["explain_retraces"] or self._last is None:
            return
        old_tree, old_specs, old_fused = self._last
        tree, specs, fused = key
        if old_tree != tree:
            what = "the structure of the arguments changed"
        elif old_fused != fused:
            what = f"fused kernels: {old_fused} -> {fused}"
        else:
            _, paths, _ = flatten(unflatten(tree, list(range(len(specs)))))
            changes = [f"{self._path_name(p)}: {_spec_text(a)} -> {_spec_text(b)}"
                       for p, a, b in zip(paths, old_specs, specs) if a != b]
            what = "; ".join(changes)
        config.logger.warning("gd.function %s retraced (trace %d): %s", self.__name__,
                              self.trace_count + 1, what)

    # ------------------------------------------------------------ tracing
    def _compile(self, key, leaves, args, kwargs) -> Compiled:
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            self._explain(key)
            graph, out_tree, out_statics = self._trace(key, leaves, args, kwargs)
            from graphdist.runtime.executable import compile_graph

            compiled = Compiled(graph, out_tree, out_statics, compile_graph(graph))
            self.trace_count += 1
            self._cache[key] = compiled
            self._last = key
            return compiled

    def _trace(self, key, leaves, args, kwargs):
        tree, specs, _ = key
        _, paths, _ = flatten((args, kwargs))
        tracer = Tracer()
        with tracing(tracer):
            traced = [tracer.new_arg(ArrayType(s[1], s[2]), self._path_name(p))
                      if s[0] == "array" else leaf for leaf, s, p in zip(leaves, specs, paths)]
            t_args, t_kwargs = unflatten(tree, traced)
            out = self.fn(*t_args, **t_kwargs)
            out_leaves, _, out_tree = flatten(out)
            results, statics = [], []
            for leaf in out_leaves:
                if isinstance(leaf, Symbolic):
                    results.append(tracer.lift(leaf))
                    statics.append(None)
                else:
                    statics.append((leaf,))
        from graphdist.passes import (eliminate_common_subexpressions, eliminate_dead_code,
                                      run_passes)

        graph = run_passes(tracer.graph(results), [eliminate_dead_code,
                                                   eliminate_common_subexpressions,
                                                   eliminate_dead_code])
        return graph, out_tree, statics

    # ------------------------------------------------------------ inspection
    def _entry(self, args, kwargs) -> Compiled:
        leaves, key, _ = self._signature(args, kwargs)
        return self._cache.get(key) or self._compile(key, leaves, args, kwargs)

    def _latest(self) -> Compiled:
        if self._last is None:
            raise ValueError(f"gd.function {self.__name__} has not been traced yet; call it "
                             "or use get_graph(*args)")
        return self._cache[self._last]

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

    def program_source(self, *args, **kwargs) -> str:
        """The generated Python program(s) of a signature (the latest when no args)."""
        entry = self._entry(args, kwargs) if args or kwargs else self._latest()
        return entry.executable.source
