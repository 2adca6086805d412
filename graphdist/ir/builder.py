"""Builder: makes placed eqns with typed, device-tagged outputs (used by replication and by
the cross-device ops that lower collectives)."""

from __future__ import annotations

from graphdist.ir import Eqn, Var


class Builder:
    def __init__(self, scope: str = ""):
        self.eqns: list[Eqn] = []
        self.scope = scope

    def add(self, op, ins, on: str, hint: str | None = None, **params) -> tuple:
        """Append `op[params] ins` running on device `on`; returns its output Vars."""
        types = op.out_types(*(v.ty for v in ins), **params)
        outs = tuple(Var(ty, hint, on) for ty in types)
        self.eqns.append(Eqn(op, tuple(ins), outs, tuple(sorted(params.items())),
                             device=on, scope=self.scope))
        return outs

    def add1(self, op, ins, on: str, hint: str | None = None, **params) -> Var:
        (out,) = self.add(op, ins, on, hint, **params)
        return out
