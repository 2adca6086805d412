"""A generated program: its source compiled into a callable (split into chunks when long),
and exceptions raised inside it re-raised with the node that failed and its source line."""

from __future__ import annotations

import itertools
import re
import threading
import traceback

import numpy as np

from graphdist.errors import NumericsError
from graphdist.ir import Graph, eqn_text

_program_ids = itertools.count()


class Program:
    """A compiled one-device graph: call it with the argument arrays, get the results."""

    def __init__(self, graph: Graph, fn, source: str, line_eqns: dict, device: str):
        # line_eqns: (filename, lineno) of generated code -> the eqn it runs
        self.graph = graph
        self.fn = fn
        self.source = source
        self.line_eqns = line_eqns
        self.device = device
        self.lock = threading.Lock()

    def __call__(self, *arrays):
        # numpy's floating-point warnings are off inside programs: the Numba kernels (and
        # the CUDA ones) never warn, so the numpy forms of the same ops must not either, or
        # a step would warn on its first calls and not later. An overflow that loss scaling
        # skips is expected; a NaN that matters is found by checking values, not warnings.
        with self.lock, np.errstate(all="ignore"):
            try:
                return self.fn(*arrays)
            except NumericsError:
                raise                  # it names its node, device and line already
            except Exception as e:
                raise _annotated(e, self) from e.__cause__


def _annotated(e: Exception, program: Program) -> Exception:
    eqn = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        eqn = program.line_eqns.get((frame.f_code.co_filename, lineno), eqn)
    if eqn is None:
        return e
    where = f"while executing  {eqn_text(eqn, device=False)}  on {eqn.device or program.device}"
    if eqn.source:
        where += f"\n  traced at  {eqn.source}"
    try:
        new = type(e)(f"{e}\n  {where}")
        new.__traceback__ = e.__traceback__
        return new
    except Exception:
        if hasattr(e, "add_note"):
            e.add_note(where)
        return e


def compile_program(lines, line_eqn, env, arg_names, graph, events=None) -> Program:
    """Compile the lines; long programs become a chain of functions of CHUNK_LINES lines
    each, because CPython compiles one huge function in superlinear time."""
    program_id = next(_program_ids)
    lines, eqns = lines or ["    pass"], line_eqn or [None]
    if len(lines) <= CHUNK_LINES:
        chunks = [(arg_names, lines, eqns, None)]
    else:
        chunks = _split(arg_names, lines, eqns)
    sources, line_eqns, calls = [], {}, []
    for k, (params, body, body_eqns, returns) in enumerate(chunks):
        name = "program" if returns is None and k == 0 else f"chunk{k}"
        filename = f"<graphdist program {program_id}{'' if name == 'program' else ' ' + name}>"
        tail = [f"    return ({', '.join(returns)}{',' if len(returns) == 1 else ''})"] \
            if returns is not None else []
        source = f"def {name}({', '.join(params)}):\n" + "\n".join(body + tail)
        exec(compile(source, filename, "exec"), env)
        sources.append(source)
        line_eqns.update({(filename, i + 2): e for i, e in enumerate(body_eqns) if e})
        if returns is not None:
            target = f"{', '.join(returns)}{',' if len(returns) == 1 else ''} = " \
                if returns else ""
            calls.append(f"    {target}{name}({', '.join(params)})")
        else:
            calls.append(f"    return {name}({', '.join(params)})")
    if len(chunks) > 1:
        source = f"def program({', '.join(arg_names)}):\n" + "\n".join(calls)
        exec(compile(source, f"<graphdist program {program_id}>", "exec"), env)
        sources.insert(0, source)
    fn = env["program"]
    program = Program(graph, fn, "\n\n".join(sources), line_eqns,
                      graph.devices[0] if graph.devices else "cpu:0")
    program.events = events
    return program


CHUNK_LINES = 1000
_LOCAL = re.compile(r"\b(?:[av]\d+|_t0)\b")   # _t0: a profiled eqn's start time


def _split(arg_names, lines, eqns) -> list:
    """Cut the body into chunks; each takes the locals it (or a later chunk) reads that were
    made before it and returns those made up to it that later chunks read."""
    pieces = [(lines[i:i + CHUNK_LINES], eqns[i:i + CHUNK_LINES])
              for i in range(0, len(lines), CHUNK_LINES)]
    reads_after = [set() for _ in pieces]            # locals read in chunk k or later
    later: set = set()
    for k in range(len(pieces) - 1, -1, -1):
        later |= {n for line in pieces[k][0] for n in _LOCAL.findall(line)}
        reads_after[k] = set(later)
    chunks, made = [], list(arg_names)
    for k, (body, body_eqns) in enumerate(pieces):
        params = [n for n in made if n in reads_after[k]]
        written = [m for line in body for m in _LOCAL.findall(line.split(" = ")[0])
                   if " = " in line]
        # each name once (the profiler's _t0 is written before every node)
        made = list(dict.fromkeys(params + written))
        last = k == len(pieces) - 1
        returns = None if last else [n for n in made if k + 1 < len(pieces)
                                     and n in reads_after[k + 1]]
        chunks.append((params, body, body_eqns, returns))
        if not last:
            made = returns
    # the last chunk ends with the program's own return statement
    params, body, body_eqns, _ = chunks[-1]
    chunks[-1] = (params, body, body_eqns, None)
    return chunks
