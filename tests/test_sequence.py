"""Sequence shards (runtime/sequence.py) and their hook (parallel/context_parallel.py), on one
process: the mask of packed documents and windows, the key-value repeats, the tag's binding,
and the cut of a batch into slices."""

from __future__ import annotations

import gc

import pytest
import torch

from pipetrain.parallel.context_parallel import ContextParallel
from pipetrain.runtime import sequence
from pipetrain.runtime.sequence import Shards, document_mask, kv_repeats


def _brute(positions: list[int], window: int | None) -> torch.Tensor:
    n = len(positions)
    doc, out = [], torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(positions):
        doc.append(doc[-1] + (p != positions[i - 1] + 1) if i else 0)
    for q in range(n):
        for k in range(n):
            near = window is None or positions[q] - positions[k] < window
            out[q, k] = doc[q] == doc[k] and k <= q and near
    return out


@pytest.mark.parametrize("window", [None, 1, 3])
def test_the_mask_keeps_documents_apart_causal_and_windowed(window: int | None) -> None:
    positions = [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 0]
    got = document_mask(torch.tensor([positions, list(range(12))]), window)
    assert got.shape == (2, 1, 12, 12)
    assert torch.equal(got[0, 0], _brute(positions, window))
    assert torch.equal(got[1, 0], _brute(list(range(12)), window))


def test_key_value_heads_are_repeated_only_as_far_as_the_ranks_need() -> None:
    assert kv_repeats(8, 8, 4) == 1 and kv_repeats(8, 2, 2) == 1
    assert kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 1, 8) == 8
    with pytest.raises(ValueError, match="6 heads .* do not divide by cp=4"):
        kv_repeats(6, 3, 4)
    for heads, groups in ((12, 4), (12, 3), (16, 8)):  # every cp that divides the heads
        for cp in (c for c in range(1, heads + 1) if heads % c == 0):
            assert (groups % kv_repeats(heads, heads // groups, cp)) == 0


def test_a_tag_is_bound_once_and_released_by_close_or_drop() -> None:
    for _ in range(50):  # many objects in one process, as a test suite makes them
        with ContextParallel(None) as cp:
            assert sequence.bound(sequence.TAG) is cp.shards
            with pytest.raises(RuntimeError, match="bound to 'cp' already"):
                Shards(None)
        with pytest.raises(RuntimeError, match="no context-parallel group is bound"):
            sequence.bound(sequence.TAG)
    dropped = Shards(None)
    del dropped
    gc.collect()
    assert sequence.state() == ()


def test_take_cuts_each_sequence_and_leaves_the_rest() -> None:
    with ContextParallel(None) as cp:
        batch = ({"input_ids": torch.arange(12).view(2, 6), "weight": torch.ones(2)},
                 torch.arange(12).view(2, 6))
        inputs, labels = cp.take(batch, 6)
        assert torch.equal(inputs["input_ids"], batch[0]["input_ids"])
        assert inputs["weight"] is batch[0]["weight"]
        cp.shards.size, cp.shards.rank = 3, 2  # the third of three slices
        inputs, labels = cp.take(batch, 6)
        assert inputs["input_ids"].tolist() == [[4, 5], [10, 11]]
        assert labels.tolist() == [[4, 5], [10, 11]]
        with pytest.raises(ValueError, match="does not split into cp=3"):
            cp.take(batch, 7)


def test_the_exchanges_are_one_node_each_in_a_capture() -> None:
    """torch.export records the three operators (not their collectives) with the tag."""
    def attend(q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        whole = sequence.heads_to_seq(sequence.seq_to_heads(q, "cp"), "cp")
        return whole * sequence.gather_seq(positions, "cp").sum()

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return attend(q, positions)

    with Shards(None):
        program = torch.export.export(Attend(), (torch.ones(1, 2, 3, 4),
                                                 torch.arange(3)[None]))
    names = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert [n for n in names if "pipetrain" in n] == [
        "pipetrain.seq_to_heads.default", "pipetrain.heads_to_seq.default",
        "pipetrain.gather_seq.default"]
