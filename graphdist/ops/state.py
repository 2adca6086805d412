"""Variable state in the IR. A captured variable enters a graph as a state input; `read_var`
makes its current value available and `assign_var` yields the next state, so program order
per variable is data dependence and passes need no side channel."""

from __future__ import annotations

from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op


def _same(op_name: str, state: ArrayType, value: ArrayType, var) -> ArrayType:
    if value != state:
        raise (TypeError if value.shape == state.shape else ValueError)(
            f"{op_name}: variable '{getattr(var, 'name', var)}' is {state}, the new value is "
            f"{value}")
    return state


# aliases the state: no copy. Gradients stop at reads; tapes collect them per variable
read_p = Op("read_var", view=True, stateful=True, differentiable=False)
read_p.def_shape(lambda state, *, var: state)
read_p.def_impl(lambda xp, state, *, var: state)

# the new state is the value (alias_input=1); lowering copies it into storage
assign_p = Op("assign_var", stateful=True, differentiable=False, alias_input=1,
              overwrites_state=True)
assign_p.def_shape(lambda state, value, *, var: _same("assign", state, value, var))
assign_p.def_impl(lambda xp, state, value, *, var: value)
assign_p.def_cost(lambda ins, outs, **_: (0, 2 * outs[0].nbytes))
