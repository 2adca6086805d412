"""The intermediate representation: types, graphs, validity check and text form."""

from graphdist.ir.check import check
from graphdist.ir.evaluate import evaluate
from graphdist.ir.graph import COLLECTIVES_SCOPE, Eqn, Graph, Lit, Replication, StateRef, Var
from graphdist.ir.printer import eqn_text, graph_text
from graphdist.ir.types import DEFAULT_FLOAT, DTYPES, FLOATS, ArrayType, as_dtype, type_of

__all__ = ["COLLECTIVES_SCOPE", "ArrayType", "Eqn", "Graph", "Lit", "Replication", "StateRef", "Var", "check", "evaluate", "eqn_text", "graph_text",
           "as_dtype", "type_of", "DTYPES", "FLOATS", "DEFAULT_FLOAT"]
