"""Process groups made by every rank alike: no hang when pipelines of a job differ in members."""

from __future__ import annotations

import pytest  # (the tier's marker)
import torch
import torch.distributed as dist

import pipetrain as pt
from pipetrain.runtime.transport.groups import symmetric_groups

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


def _pairs(ctx: pt.RankContext, layout: list[list[int]]) -> list[str]:
    members = next(m for m in layout if ctx.rank in m)
    frames, pairs, _ = symmetric_groups(members, torch.device("cpu"))
    me = members.index(ctx.rank)
    seen = []
    for (a, b), pg in sorted(pairs.items()):  # a sends to b on the group of direction (a, b)
        t = torch.tensor([float(members[a])])
        if a == me:
            dist.send(t, dst=members[b], group=pg)
        else:
            dist.recv(t, src=members[a], group=pg)
            seen.append(f"{members[a]}->{ctx.rank}:{int(t.item())}")
    total = torch.tensor([1.0])
    dist.all_reduce(total, group=frames)
    return seen + [f"size {int(total.item())}"]


def test_pair_groups_of_unequal_pipelines_do_not_hang() -> None:
    # 3 ranks in one pipeline and 1 alone: rank 3 makes no pair of its own, yet every rank
    # makes the same groups in the same order
    got = pt.launch(_pairs, 4, [[0, 1, 2], [3]], timeout=60)
    assert got[0] == ["1->0:1", "2->0:2", "size 3"]
    assert got[1] == ["0->1:0", "2->1:2", "size 3"]
    assert got[2] == ["0->2:0", "1->2:1", "size 3"]
    assert got[3] == ["size 1"]
