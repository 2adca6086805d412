"""Builder: makes placed eqns with typed, device-tagged outputs (used by replication and by
the cross-device ops that lower collectives)."""

from __future__ import annotations

from graphdist.ir import Eqn, Var


class Builder:
    def __init__(self, scope: str = ""):
        self.eqns: list[Eqn] = []
        self.scope = scope

    def add(self, op, ins, device: str, hint: str | None = None, **params) -> tuple:
        types = op.out_types(*(v.ty for v in ins), **params)
        outs = tuple(Var(ty, hint, device) for ty in types)
        self.eqns.append(Eqn(op, tuple(ins), outs, tuple(sorted(params.items())),
                             device=device, scope=self.scope))
        return outs

    def add1(self, op, ins, device: str, hint: str | None = None, **params) -> Var:
        (out,) = self.add(op, ins, device, hint, **params)
        return out
