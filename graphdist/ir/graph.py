"""The IR: Var, Lit, Eqn and Graph, all immutable plain data (passes build new graphs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphdist.ir.types import ArrayType

# the name_scope of the nodes a collective is lowered into: views draw them between lanes
COLLECTIVES_SCOPE = "collectives"


@dataclass(frozen=True, slots=True, eq=False)
class Var:
    """An SSA value. Hashes by identity; `hint` is the name users gave it, if any."""

    ty: ArrayType
    hint: str | None = None
    device: str | None = None

    @property
    def shape(self):
        return self.ty.shape

    @property
    def dtype(self):
        return self.ty.dtype


@dataclass(frozen=True, slots=True)
class Lit:
    """An inline scalar constant."""

    value: object
    ty: ArrayType

    def __str__(self) -> str:
        value = self.value.item() if hasattr(self.value, "item") else self.value
        if not isinstance(value, float):
            return repr(value)
        text = f"{value:.6g}"
        return text if any(c in text for c in ".ein") else text + ".0"


@dataclass(frozen=True, slots=True, eq=False)
class Eqn:
    """One node: `outputs = op[params] inputs`, placed on `device` after replication.

    `scope` is the `gd.name_scope` path it was traced in; `source` the user's line.
    """

    op: object  # graphdist.ops.core.Op; kept untyped so ir/ does not import ops/
    inputs: tuple
    outputs: tuple
    params: tuple = ()
    device: str | None = None
    scope: str = ""
    source: str = ""

    @property
    def attrs(self) -> dict:
        return dict(self.params)

    def __str__(self) -> str:
        from graphdist.ir.printer import eqn_text

        return eqn_text(self)


@dataclass(frozen=True, slots=True)
class StateRef:
    """How a graph names a variable's state: an immutable reference, never the live
    variable. The compiled function maps it to the variable's storage (`key` is the
    variable's serial number); the rest is what passes and views need to know of it."""

    key: int
    name: str
    devices: tuple
    on_read: bool = False     # sync-on-read: components differ per replica
    # what the state is for, as g.summary()'s memory table groups it: "parameter" (a
    # trainable variable), "slot" (optimizer state per variable), "accumulator" (gradient
    # accumulation), "" (anything else: counters, hyper-parameters, statistics)
    role: str = ""

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Replication:
    """How a placed graph's inputs and outputs divide into replicas: every replica's
    `args_per_replica` arguments, then the states; every replica's `results_per_replica`
    results, then the final states. A merged graph (passes/merge.py) runs all replicas as
    one program: `components[i]` is which component of its variable state input i is, and
    `batched_results[k]` whether result k is stacked per replica."""

    replicas: int
    args_per_replica: int
    results_per_replica: int
    merged: bool = False
    components: tuple = ()
    batched_results: tuple = ()


@dataclass(frozen=True, slots=True, eq=False)
class Graph:
    """A flat, topologically ordered list of eqns in SSA form.

    `inputs` are the call's array arguments followed by one state Var per captured
    variable (`variables[i]`, a StateRef, pairs with `inputs[num_args + i]`); `outputs` are
    the results followed by each variable's final state, in the same variable order.
    """

    inputs: tuple
    eqns: tuple
    outputs: tuple
    variables: tuple = ()
    devices: tuple = ()
    replication: Replication | None = None   # set by replicate and merge
    liveness: object = None                  # set by schedule (ir.liveness.Liveness)

    @property
    def num_args(self) -> int:
        return len(self.inputs) - len(self.variables)

    @property
    def num_results(self) -> int:
        return len(self.outputs) - len(self.variables)

    @property
    def merged(self) -> bool:
        """Whether the replicas run merged into one batched program (opt-in)."""
        return self.replication is not None and self.replication.merged

    def mode_note(self) -> str:
        """One line saying how the replicas run when that is not what the views draw by
        default (one lane per device): empty unless merged."""
        if not self.merged:
            return ""
        return (f"{self.replication.replicas} replicas merged into one batched program on "
                f"{self.devices[0]} (opt-in: set_device_concurrency(\"merged\")); "
                "the default runs one copy per device")

    @property
    def nodes(self) -> tuple:
        return self.eqns

    def __len__(self) -> int:
        return len(self.eqns)

    def __iter__(self):
        return iter(self.eqns)

    def __str__(self) -> str:
        from graphdist.ir.printer import graph_text

        return graph_text(self)

    def __repr__(self) -> str:
        return f"<Graph: {len(self.eqns)} eqns, {len(self.inputs)} inputs, devices={self.devices}>"

    def replace(self, **changes) -> Graph:
        return replace(self, **changes)

    # Views of the graph; each lives in graphdist.viz and only reads the IR.
    def to_networkx(self):
        from graphdist.viz.nx import to_networkx

        return to_networkx(self)

    def to_dot(self) -> str:
        from graphdist.viz.dot import to_dot

        return to_dot(self)

    def to_html(self, path, profile: dict | None = None) -> str:
        from graphdist.viz.html import to_html

        return to_html(self, path, profile)

    def summary(self) -> str:
        from graphdist.viz.summary import summary

        return summary(self)
