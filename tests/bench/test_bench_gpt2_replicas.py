"""bench/gpt2.py --replicas: what the 4-replica GPT-2-style step spends beyond the one-device
step, per group of ops. The groups must cover every node of both profiled steps once (a
collective drawn on every replica's lane counted once), so the table's sum is the profile's."""

from __future__ import annotations

from bench import gpt2


def test_the_replica_table_counts_every_node_once(capsys):
    out = gpt2.replicas_part(profiles=1, repeat=1)
    rows = {r[0]: r[1:] for r in out["groups"]}
    gemms = rows["GEMMs (matmul, matmul + bias + act)"]
    # one program per replica: each GEMM of the one-device step runs once per replica
    assert gemms[1] == 4 * gemms[0] > 0
    # one fused Adam on 1 device; on 4, the all-reduce fused with Adam per gradient bucket
    adam = rows["Adam (x4: fused with the all-reduce)"]
    assert adam[0] == 1 and adam[1] >= 1
    # the loss's all-reduce and its wait: twice on 4 replicas (counted once, not per lane)
    assert rows["loss all-reduce and its wait"][:2] == [0, 2]
    total = rows.pop("sum")
    for k in range(5):
        assert abs(total[k] - sum(r[k] for r in rows.values())) < 1e-9
    assert abs(total[4] - (total[3] - total[2])) < 1e-9
    assert set(out["wall_ms"]) == {gpt2.ONE, "graphdist Mirrored x4, one program",
                                   "graphdist Mirrored x4, a thread each (default)"}
    assert "x4 - x1" in capsys.readouterr().out
