"""Partition: cut a model's layer list into contiguous stages, never dropping or repeating one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.runtime.torch_private import modules_dict
from pipetrain.split.lazy import LayerSpec

__all__: list[str] = []


def named_layers(model: nn.Module | Sequence[nn.Module | LayerSpec]
                 ) -> list[tuple[str, nn.Module | LayerSpec]]:
    """The layers of an ``nn.Sequential`` (under its child names) or of a list (``"0"``, ``"1"``..).

    Raises:
        TypeError: for a model that is neither.
    """
    if isinstance(model, nn.Sequential):
        # not named_children(): it hides a module used twice (a tied layer), which would
        # silently drop a layer from the pipeline
        return [(name, m) for name, m in modules_dict(model).items() if m is not None]
    if isinstance(model, (list, tuple, nn.ModuleList)):
        layers = list(model)
        for i, layer in enumerate(layers):
            if not isinstance(layer, (nn.Module, LayerSpec)):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module or "
                                "a LayerSpec")
        return [(str(i), layer) for i, layer in enumerate(layers)]
    raise TypeError(
        f"Pipeline takes an nn.Sequential or a list of layers, got {type(model).__name__}; "
        "wrap your layers in nn.Sequential(...)"
    )


def even_balance(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as possible (later stages get the extra layers)."""
    if n_layers < n_stages:
        raise PartitionError(
            f"{n_layers} layers cannot fill {n_stages} stages (each stage needs at least one "
            "layer); use fewer ranks or stages per rank, or split the model into more layers"
        )
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s >= n_stages - extra else 0) for s in range(n_stages)]


def check_balance(balance: Any, n_layers: int, n_stages: int) -> list[int]:
    """Validate an explicit ``balance`` (layers per stage) and return it as a list.

    Raises:
        PartitionError: naming every problem (length, sum, non-positive entries) at once.
    """
    if not isinstance(balance, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise PartitionError(f"balance must be a list of layer counts per stage, got {balance!r}")
    problems = []
    if len(balance) != n_stages:
        problems.append(f"it has {len(balance)} entries but the pipeline has {n_stages} stages")
    if sum(balance) != n_layers:
        problems.append(f"its sum is {sum(balance)} but the model has {n_layers} layers")
    bad = [i for i, b in enumerate(balance) if b < 1]
    if bad:
        problems.append(f"stages {bad} would get no layers")
    if problems:
        raise PartitionError(f"balance {list(balance)} does not fit: " + "; ".join(problems))
    return list(balance)


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` layer index range of each stage."""
    bounds, first = [], 0
    for n in balance:
        bounds.append((first, first + n))
        first += n
    return bounds
