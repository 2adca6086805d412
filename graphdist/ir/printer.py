"""The text form of the IR: one eqn per line, `outs = op[params] ins` (see docs/ir.md)."""

from __future__ import annotations

from graphdist.ir.graph import Eqn, Graph, Lit, Var


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


def eqn_text(eqn: Eqn, namer: Namer | None = None) -> str:
    namer = namer or Namer()
    params = ",".join(f"{k}={param_text(v)}" for k, v in eqn.params)
    outs = " ".join(_binder(namer, v) for v in eqn.outputs)
    ins = " ".join(namer(v) for v in eqn.inputs)
    head = f"{eqn.op}[{params}]" if params else f"{eqn.op}"
    text = f"{outs} = {head} {ins}".rstrip()
    return text + (f"   # {eqn.device}" if eqn.device else "")


def graph_text(g: Graph, max_eqns: int | None = 400) -> str:
    namer = Namer(g.devices)
    args = ", ".join(_binder(namer, v) for v in g.inputs[: g.num_args])
    state = ", ".join(_binder(namer, v) for v in g.inputs[g.num_args:])
    head = f"graph({args}" + (f"; vars {state}" if state else "") + ")"
    if g.devices:
        head += " on " + ",".join(g.devices)
    lines = [head + " {"]
    eqns = g.eqns
    hidden = 0
    if max_eqns is not None and len(eqns) > max_eqns:
        hidden = len(eqns) - max_eqns
        eqns = eqns[: max_eqns // 2] + eqns[len(eqns) - max_eqns // 2:]
    scope = ""
    for i, eqn in enumerate(eqns):
        if hidden and i == max_eqns // 2:
            lines.append(f"  ... {hidden} eqns elided (print with gd.ir.graph_text(g, None)) ...")
        if eqn.scope != scope:
            scope = eqn.scope
            lines.append(f"  # {scope}" if scope else "  #")
        lines.append("  " + eqn_text(eqn, namer))
    results = " ".join(namer(v) for v in g.outputs[: g.num_results])
    updates = [f"{var.name} := {namer(new)}"
               for var, old, new in zip(g.variables, g.inputs[g.num_args:], g.outputs[g.num_results:])
               if new is not old]
    lines.append(f"  return {results}".rstrip() + ("; " + ", ".join(updates) if updates else ""))
    lines.append("}")
    return "\n".join(lines)
