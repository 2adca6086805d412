"""The text form of the IR: one eqn per line, `outs = op[params] ins` (see docs/ir.md)."""

from __future__ import annotations

import re

from graphdist.ir.graph import COLLECTIVES_SCOPE, Eqn, Graph, Lit, Var


def _letters(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


class Namer:
    """Gives each Var a short, stable, unique name: its hint when it has one, else a, b, c..."""

    def __init__(self, devices: tuple = ()):
        self.names: dict = {}
        self.taken: set = set()
        self.counter = 0
        # with several devices every name carries its replica: h@0, h@1
        self.replica = {d: i for i, d in enumerate(devices)} if len(devices) > 1 else {}

    def __call__(self, v) -> str:
        if isinstance(v, Lit):
            return str(v)
        name = self.names.get(v)
        if name is None:
            device = getattr(v, "device", None)
            name = self._fresh(v.hint, device)
            if device in self.replica:
                name += f"@{self.replica[device]}"
            self.names[v] = name
        return name

    def _fresh(self, hint: str | None, device=None) -> str:
        if hint:
            base = hint.replace("/", ".")
            name, k = base, 1
            while (name, device) in self.taken:
                name, k = f"{base}_{k}", k + 1
        else:
            name = _letters(self.counter)
            while (name, device) in self.taken:
                self.counter += 1
                name = _letters(self.counter)
            self.counter += 1
        self.taken.add((name, device))
        return name


def param_text(value) -> str:
    if isinstance(value, Graph):          # a body: printed indented under its eqn
        return f"{{{len(value.eqns)} eqns}}"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return "(" + ",".join(param_text(x) for x in value) + ")"
    if hasattr(value, "param_text"):
        return value.param_text()
    if isinstance(value, slice):
        parts = ["" if p is None else str(p) for p in (value.start, value.stop, value.step)]
        return ":".join(parts[:2] if value.step is None else parts)
    return str(value)


def _binder(namer: Namer, v: Var) -> str:
    return f"{namer(v)}:{v.ty}"


def named_bodies(eqn: Eqn) -> list:
    """(name, graph) of each sub-graph an eqn holds: `body`, `branches[0]`..."""
    out = []
    for key, value in eqn.params:
        if isinstance(value, Graph):
            out.append((key, value))
        elif isinstance(value, tuple) and value and all(isinstance(x, Graph) for x in value):
            out += [(f"{key}[{k}]", g) for k, g in enumerate(value)]
    return out


def body_lines(eqn: Eqn, namer: Namer, indent: str = "    ") -> list:
    """The sub-graphs of a control-flow eqn (cond, while, scan) as indented text: each
    `name(inputs) {`, its eqns (nested bodies further in), `return ...`, `}`."""
    lines = []
    for name, g in named_bodies(eqn):
        ins = ", ".join(_binder(namer, v) for v in g.inputs)
        lines.append(f"{indent}{name}({ins}) {{")
        for e in g.eqns:
            lines.append(f"{indent}  {eqn_text(e, namer)}")
            lines += body_lines(e, namer, indent + "    ")
        lines.append(f"{indent}  return {' '.join(namer(v) for v in g.outputs)}".rstrip())
        lines.append(f"{indent}}}")
    return lines


def eqn_text(eqn: Eqn, namer: Namer | None = None, device: bool = True) -> str:
    namer = namer or Namer()
    params = ",".join(f"{k}={param_text(v)}" for k, v in eqn.params)
    outs = " ".join(_binder(namer, v) for v in eqn.outputs)
    ins = " ".join(namer(v) for v in eqn.inputs)
    head = f"{eqn.op}[{params}]" if params else f"{eqn.op}"
    text = f"{outs} = {head} {ins}".rstrip()
    return text + (f"   # {eqn.device}" if eqn.device and device else "")


_REPLICA = re.compile(r"@(\d+)\b")


def _fold_binders(namer: Namer, vs, n: int) -> str:
    """'x@0:f32[4], x@1:f32[4]' -> 'x@0..1:f32[4]' when every replica has the same type."""
    seen: dict = {}
    for v in vs:
        name = namer(v)
        base = _REPLICA.sub("", name)
        seen.setdefault((base, str(v.ty)), []).append(name)
    parts = []
    for (base, ty), names in seen.items():
        if n > 1 and len(names) == n:
            parts.append(f"{base}@0..{n - 1}:{ty}")
        else:
            parts += [f"{name}:{ty}" for name in names]
    return ", ".join(parts)


def _device_column(texts, devices, limit: int = 72) -> list:
    """Lines with their device as a right-hand column: `text   # cpu:1`, aligned over the
    lines up to `limit` characters (longer ones just get it at their end)."""
    width = max((len(t) for t in texts if len(t) <= limit), default=0)
    return [f"  {t.ljust(width)}   # {d}" if d else "  " + t for t, d in zip(texts, devices)]


def _runs(eqns):
    """Consecutive eqns on one device, or consecutive collective eqns on any devices."""
    runs = []
    for eqn in eqns:
        collective = eqn.scope == COLLECTIVES_SCOPE or eqn.op.collective
        key = (None, True) if collective else (eqn.device, False)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(eqn)
        else:
            runs.append((key, [eqn]))
    return runs


def graph_text(g: Graph, max_eqns: int | None = 400, fold: bool = True) -> str:
    """The text form (docs/ir.md). With several devices, a replica whose eqns repeat
    replica 0's (names @0 -> @k) is folded into one comment line unless fold=False."""
    namer = Namer(g.devices)
    n = len(g.devices)
    multi = n > 1
    fold = fold and multi
    args = _fold_binders(namer, g.inputs[: g.num_args], n if fold else 0)
    state = _fold_binders(namer, g.inputs[g.num_args:], n if fold else 0)
    head = f"graph({args}" + (f"; vars {state}" if state else "") + ")"
    if g.devices:
        head += " on " + ",".join(g.devices)
    body: list[str] = [f"  # {g.mode_note()}"] if g.merged else []
    if not multi:
        scope = ""
        for eqn in g.eqns:
            if eqn.scope != scope:
                scope = eqn.scope
                body.append(f"  # {scope}" if scope else "  #")
            body.append("  " + eqn_text(eqn, namer))
            body += body_lines(eqn, namer)
    else:
        first_run: list[str] | None = None
        for (device, collective), run in _runs(g.eqns):
            if collective:
                body.append("  # collectives")
                body += _device_column([eqn_text(e, namer, device=False) for e in run],
                                       [e.device for e in run])
                first_run = None
                continue
            texts = [eqn_text(e, namer, device=False) for e in run]
            k = g.devices.index(device) if device in g.devices else -1
            if k == 0 or first_run is None:
                first_run = [_REPLICA.sub("@0", t) for t in texts] if k == 0 else None
            elif fold and [_REPLICA.sub("@0", t) for t in texts] == first_run:
                body.append(f"  # replica {device}: same {len(run)} eqns as {g.devices[0]}, "
                            f"@0 -> @{k}")
                continue
            body.append(f"  # {n} replicas merged on {device}" if g.merged
                        else f"  # replica {device}")
            scope = ""
            for e, t in zip(run, texts):
                if e.scope != scope:
                    scope = e.scope
                    body.append(f"  # {scope}" if scope else "  #")
                body.append("  " + t)
                body += body_lines(e, namer)
    if max_eqns is not None and len(body) > max_eqns:
        hidden = len(body) - max_eqns
        body = body[: max_eqns // 2] + [
            f"  ... {hidden} lines elided (print with gd.ir.graph_text(g, None)) ..."
        ] + body[len(body) - max_eqns // 2:]
    results = " ".join(namer(v) for v in g.outputs[: g.num_results])
    updates = [f"{var.name} := {namer(new)}"
               for var, old, new in zip(g.variables, g.inputs[g.num_args:],
                                        g.outputs[g.num_results:])
               if new is not old]
    if fold and updates and len(updates) % n == 0:
        per = len(updates) // n
        folded = [_REPLICA.sub("@0", u) for u in updates]
        if all(folded[i] == folded[i % per] for i in range(len(folded))):
            updates = [u.replace("@0", f"@0..{n - 1}") for u in updates[:per]]
    tail = f"  return {results}".rstrip() + ("; " + ", ".join(updates) if updates else "")
    return "\n".join([head + " {", *body, tail, "}"])
