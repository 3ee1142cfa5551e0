"""Partition: layer lists, even and explicit balance (every problem named at once), stage bounds."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.split.partition import check_balance, even_balance, named_layers, stage_bounds


def test_named_layers_keeps_sequential_child_names() -> None:
    embed, block, head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    model = nn.Sequential(OrderedDict([("embed", embed), ("block0", block), ("head", head)]))
    assert named_layers(model) == [("embed", embed), ("block0", block), ("head", head)]


def test_named_layers_of_plain_sequential() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)]
    assert named_layers(nn.Sequential(*layers)) == [("0", layers[0]), ("1", layers[1]),
                                                     ("2", layers[2])]


@pytest.mark.parametrize("wrap", [list, tuple, nn.ModuleList], ids=["list", "tuple", "ModuleList"])
def test_named_layers_of_a_list(wrap: type) -> None:
    layers = [nn.Linear(2, 2), nn.Tanh()]
    got = named_layers(wrap(layers))
    assert [name for name, _ in got] == ["0", "1"]
    assert all(a is b for (_, a), b in zip(got, layers))


def test_named_layers_rejects_a_non_module_in_the_list() -> None:
    with pytest.raises(TypeError) as e:
        named_layers([nn.Linear(2, 2), "relu"])  # type: ignore[list-item]
    assert str(e.value) == "layer 1 is a str, not an nn.Module or a LayerSpec"


@pytest.mark.parametrize("model", [nn.Linear(2, 2), {"a": nn.Linear(2, 2)}, None])
def test_named_layers_rejects_other_things(model: object) -> None:
    with pytest.raises(TypeError) as e:
        named_layers(model)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"Pipeline takes an nn.Sequential or a list of layers, got {type(model).__name__}; "
        "wrap your layers in nn.Sequential(...)"
    )


@pytest.mark.parametrize("n_layers,n_stages", [(n, s) for s in range(1, 7) for n in range(s, 20)])
def test_even_balance_is_even(n_layers: int, n_stages: int) -> None:
    balance = even_balance(n_layers, n_stages)
    assert len(balance) == n_stages
    assert sum(balance) == n_layers
    assert max(balance) - min(balance) <= 1
    assert min(balance) >= 1
    assert balance == sorted(balance)  # later stages take the extra layers
    assert check_balance(balance, n_layers, n_stages) == balance


def test_even_balance_examples() -> None:
    assert even_balance(8, 4) == [2, 2, 2, 2]
    assert even_balance(10, 4) == [2, 2, 3, 3]
    assert even_balance(3, 3) == [1, 1, 1]


def test_even_balance_with_fewer_layers_than_stages() -> None:
    with pytest.raises(PartitionError) as e:
        even_balance(3, 4)
    assert str(e.value) == (
        "3 layers cannot fill 4 stages (each stage needs at least one layer); use fewer ranks "
        "or stages per rank, or split the model into more layers"
    )


def test_check_balance_returns_a_list() -> None:
    assert check_balance((1, 2, 1), 4, 3) == [1, 2, 1]


def test_check_balance_names_every_problem_at_once() -> None:
    with pytest.raises(PartitionError) as e:
        check_balance([2, 0], 5, 3)
    assert str(e.value) == (
        "balance [2, 0] does not fit: it has 2 entries but the pipeline has 3 stages; "
        "its sum is 2 but the model has 5 layers; stages [1] would get no layers"
    )


@pytest.mark.parametrize("balance,n_stages,problem", [
    ([2, 1, 1], 2, "it has 3 entries but the pipeline has 2 stages"),
    ([2, 1], 2, "its sum is 3 but the model has 4 layers"),
    ([5, -1], 2, "stages [1] would get no layers"),
    ([0, 4, 0], 3, "stages [0, 2] would get no layers"),
])
def test_check_balance_single_problem(balance: list[int], n_stages: int, problem: str) -> None:
    with pytest.raises(PartitionError) as e:
        check_balance(balance, 4, n_stages)
    assert str(e.value) == f"balance {balance} does not fit: {problem}"


@pytest.mark.parametrize("balance", [4, [1.5, 2.5], [True, 3], "13", None])
def test_check_balance_rejects_non_lists_of_ints(balance: object) -> None:
    with pytest.raises(PartitionError) as e:
        check_balance(balance, 4, 2)
    assert str(e.value) == f"balance must be a list of layer counts per stage, got {balance!r}"


def test_partition_error_is_a_value_error() -> None:
    assert issubclass(PartitionError, ValueError)


def test_stage_bounds() -> None:
    assert stage_bounds([2, 1, 3]) == [(0, 2), (2, 3), (3, 6)]
    assert stage_bounds([5]) == [(0, 5)]
    assert stage_bounds([]) == []


def test_stage_bounds_cover_every_layer_once() -> None:
    balance = even_balance(11, 4)
    covered = [i for first, end in stage_bounds(balance) for i in range(first, end)]
    assert covered == list(range(11))
