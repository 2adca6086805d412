"""The fused reduce-scatter + sharded update + all-gather (ops/zero_collectives.py): its
Numba kernel, its numpy twin and the op's impl give the same bits, and those of the three
steps apart (a reduce-scatter summed in replica order, the multi-tensor update of each
replica's chunk, the chunks concatenated into every replica's parameter). The node in a
step: tests/distribute/test_zero.py."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.kernels import formulas
from graphdist.ops import OPS
from graphdist.runtime import kernel_table

NAME = "host_reduce_scatter_update_all_gather"
UPDATES = {
    "sgd": ("sgd_multi_update", 0, formulas.SGDHyper(0.1, 0.01).encode(), {}),
    "momentum": ("sgd_momentum_multi_update", 1,
                 formulas.MomentumHyper(0.1, 0.9, 0.01).encode(), {"nesterov": True}),
    "adam": ("adam_multi_update", 2, formulas.AdamHyper(3e-3, 0.9, 0.999, 1e-7, 0.0).encode(),
             {}),
    "adamw": ("adam_multi_update", 2,
              formulas.AdamHyper(3e-3, 0.9, 0.999, 1e-7, 3e-4).encode(), {}),
}


def _case(kind: str, reduce: str, replicas=3, shapes=((5, 7), (2,), (200003,))):
    """Inputs and params of one node: members of 35, 2 and 200,003 elements on 3 replicas
    (chunks of 12, 1 and 66,668: all padded; the last spans two of the kernels' 64K
    chunks)."""
    update, slots, hyper, extra = UPDATES[kind]
    rng = np.random.default_rng(7)
    lengths = tuple(-(-int(np.prod(s)) // replicas) for s in shapes)
    offsets = tuple(int(x) for x in np.cumsum((0,) + lengths[:-1]))
    width = sum(lengths)
    buckets = [rng.standard_normal(replicas * width).astype(np.float32)
               for _ in range(replicas)]
    whole = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ins = list(buckets)
    for k in range(replicas):
        for j, s in enumerate(shapes):
            ins.append(whole[j].copy())            # every replica holds the same values
            ins += [np.abs(rng.standard_normal(lengths[j])).astype(np.float32)
                    for _ in range(slots)]
        ins.append(np.array(hyper, np.float64))
    params = dict(extra, update=update, reduce=reduce, replicas=replicas, width=width,
                  offsets=offsets, lengths=lengths, n=len(shapes),
                  variables=tuple(f"v{j}" for j in range(len(shapes))),
                  members=("host_reduce_scatter", update, "host_all_gather"))
    return ins, params, slots


def _apart(ins, params, slots):
    """The three steps apart, on numpy: the sum of the buckets in replica order, each
    replica's update of its padded chunk (the multi-tensor op's impl), the chunks back."""
    op = OPS[params["update"]]
    r, width, n = params["replicas"], params["width"], params["n"]
    total = ins[0].copy()
    for b in ins[1:r]:
        total += b
    if params["reduce"] == "mean":
        total /= np.float32(r)
    per = n * (1 + slots) + 1
    outs = [[None] * n for _ in range(r)]
    chunks = [[None] * r for _ in range(n)]
    for k in range(r):
        mine = ins[r + k * per:r + (k + 1) * per]
        for j in range(n):
            p, *ss = mine[j * (1 + slots):(j + 1) * (1 + slots)]
            length, offset = params["lengths"][j], params["offsets"][j]
            flat = np.zeros(r * length, np.float32)
            flat[:p.size] = p.reshape(-1)
            g = total[k * width + offset:k * width + offset + length]
            extra = {"nesterov": params["nesterov"]} if "nesterov" in params else {}
            new = op.impl(np, flat[k * length:(k + 1) * length].copy(), *ss, g, mine[-1],
                          n=1, **extra)
            chunks[j][k] = new[0]
            outs[k][j] = list(new[1:])
    for k in range(r):
        for j in range(n):
            p = ins[r + k * per + j * (1 + slots)]
            outs[k][j].insert(0, np.concatenate(chunks[j])[:p.size].reshape(p.shape))
    return [x for row in outs for member in row for x in member]


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("kind", list(UPDATES))
def test_kernel_twin_and_impl_give_the_bits_of_the_steps_apart(kind, reduce):
    ins, params, slots = _case(kind, reduce)
    op = OPS[NAME]
    inplace = op.inplace(tuple(params.items()))
    want = _apart([x.copy() for x in ins], params, slots)
    entry = kernel_table.entry("cpu", NAME)
    for form in (entry.kernel, entry.numpy):
        args = [x.copy() for x in ins]
        form(*args, **params)
        got = [args[j] for j in inplace.values()]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    made = op.impl(np, *ins, **params)
    assert [t.shape for t in made] == [t.shape for t in want]
    for a, b in zip(made, want):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.array_equal(want[0], ins[params["replicas"]])        # it updated


def test_the_shape_rule_refuses_a_member_larger_than_its_shards():
    ins, params, _ = _case("sgd", "sum", shapes=((5, 7),))
    from graphdist.ir import ArrayType

    types = [ArrayType(x.shape, x.dtype) for x in ins]
    with pytest.raises(ValueError, match=r"member 0 \(v0\) has 35 elements, more than 3 "
                                         r"shards of 11"):
        OPS[NAME].out_types(*types, **dict(params, lengths=(11,)))
