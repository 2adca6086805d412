"""What optimizer state is for, as the graphs name it (g.summary()'s memory table groups
state inputs by StateRef.role: parameters, optimizer slots, gradient accumulators)."""

from __future__ import annotations

import dataclasses


def with_role(role: str, var):
    """`var`, its graph reference marked with `role` ("slot", "accumulator"); set when the
    variable is made, before any graph names it."""
    var._ref = dataclasses.replace(var._ref, role=role)
    return var


__all__ = ["with_role"]
