"""Micro-batches: even and uneven splits, structured batches, other dims, errors, merge."""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime.microbatch import batch_size, merge, sizes, split


@pytest.mark.parametrize("total,n", [(8, 4), (12, 3), (5, 5), (7, 1)])
def test_even_split(total: int, n: int) -> None:
    x = torch.arange(total * 2).reshape(total, 2)
    parts = split(x, n)
    assert [p.shape[0] for p in parts] == [total // n] * n == sizes(total, n)
    assert torch.equal(torch.cat(parts), x)


@pytest.mark.parametrize("total,n", [(10, 4), (7, 3), (5, 4), (9, 2), (13, 5)])
def test_uneven_split(total: int, n: int) -> None:
    x = torch.arange(total)
    got = [p.shape[0] for p in split(x, n)]
    assert got == sizes(total, n)
    assert sum(got) == total
    assert max(got) - min(got) == 1
    assert got == sorted(got, reverse=True)  # the first ones are the larger
    assert got.count(total // n + 1) == total % n


def test_sizes_examples() -> None:
    assert sizes(10, 4) == [3, 3, 2, 2]
    assert sizes(7, 3) == [3, 2, 2]
    assert sizes(4, 4) == [1, 1, 1, 1]


def test_split_tuple_repeats_plain_values() -> None:
    x, y = torch.randn(6, 3), torch.arange(6)
    parts = split((x, 0.5, y, "mode", None), 3)
    assert len(parts) == 3
    for i, (px, scale, py, mode, nothing) in enumerate(parts):
        assert torch.equal(px, x[2 * i: 2 * i + 2])
        assert torch.equal(py, y[2 * i: 2 * i + 2])
        assert (scale, mode, nothing) == (0.5, "mode", None)


def test_split_dict_keeps_keys_and_structure() -> None:
    ids, mask = torch.arange(10).reshape(5, 2), torch.ones(5, 2, dtype=torch.bool)
    parts = split({"ids": ids, "extra": {"mask": mask, "causal": True}, "list": [ids]}, 2)
    assert [p["ids"].shape[0] for p in parts] == [3, 2]
    assert [p["extra"]["mask"].shape[0] for p in parts] == [3, 2]
    assert all(p["extra"]["causal"] is True for p in parts)
    assert all(isinstance(p["list"], list) for p in parts)
    assert torch.equal(parts[1]["ids"], ids[3:])


def test_split_along_dim_1() -> None:
    x = torch.arange(30).reshape(3, 10)  # e.g. (seq, batch) layout
    parts = split(x, 4, dim=1)
    assert [p.shape for p in parts] == [torch.Size([3, 3])] * 2 + [torch.Size([3, 2])] * 2
    assert torch.equal(torch.cat(parts, dim=1), x)
    assert batch_size(x, 1) == 10


def test_zero_dim_tensors_are_repeated() -> None:
    x, temp = torch.randn(4, 2), torch.tensor(0.7)
    parts = split((x, temp), 2)
    assert all(p[1] is temp for p in parts)


def test_batch_smaller_than_n() -> None:
    with pytest.raises(ValueError) as e:
        split(torch.randn(3, 2), 4)
    assert str(e.value) == (
        "batch of size 3 (dim 0) cannot be split into 4 micro-batches; "
        "use a batch of at least 4 samples or fewer micro-batches"
    )


def test_tensors_disagree_on_batch_size() -> None:
    with pytest.raises(ValueError) as e:
        split((torch.randn(4, 2), torch.randn(5, 2)), 2)
    assert str(e.value) == (
        "cannot split the batch along dim 0: its tensors have sizes [4, 5] there (need exactly "
        "one size; pass split_dim= to choose another dimension)"
    )


@pytest.mark.parametrize("batch", [3, (1.0, "x"), {"a": None}, [torch.tensor(2.0)]])
def test_batch_without_splittable_tensors(batch: object) -> None:
    with pytest.raises(ValueError, match=r"its tensors have sizes \[\] there"):
        split(batch, 2)


def test_merge_inverts_split() -> None:
    batch = {"h": torch.randn(7, 4), "pair": (torch.arange(14).reshape(7, 2), "tag")}
    back = merge(split(batch, 3))
    assert set(back) == {"h", "pair"}
    assert torch.equal(back["h"], batch["h"])
    assert torch.equal(back["pair"][0], batch["pair"][0])
    assert back["pair"][1] == "tag"


def test_merge_inverts_split_along_dim_1() -> None:
    x = torch.randn(2, 9, 3)
    assert torch.equal(merge(split(x, 4, dim=1), dim=1), x)


def test_merge_stacks_per_micro_batch_scalars() -> None:
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    assert torch.equal(merge(losses), torch.tensor([1.0, 2.0]))
