"""Lazy layers: build or materialise only this rank's layers, deterministically per layer.

A model too big for one process is described, not built: as a list of :class:`LayerSpec`
(a class and its arguments) or as modules created on the ``meta`` device. The pipeline then
materialises only the layers of its own stages. Each layer is initialised under its own seed,
``seed * 1_000_003 + index``, so a rank's parameters equal those of the whole model built with
:func:`build_layers` (or :func:`materialize` on every layer) from the same seed, whatever the
number of ranks or stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "build_layers", "materialize"]


def layer_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


@dataclass(frozen=True)
class LayerSpec:
    """A layer described by its factory and arguments: ``LayerSpec(nn.Linear, 512, 512)``."""

    factory: Callable[..., nn.Module]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "factory", factory)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)

    def build(self, index: int, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """The layer at position ``index``, initialised under its per-layer seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, index))
            with torch.device(device):
                layer = self.factory(*self.args, **self.kwargs)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"LayerSpec factory {self.factory!r} returned a "
                            f"{type(layer).__name__}, not an nn.Module")
        return layer


def is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def materialize(layer: nn.Module, index: int, seed: int,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a ``meta`` layer real storage on ``device`` and initialise it under its seed.

    Every submodule with ``reset_parameters()`` is re-initialised, in module order.

    Raises:
        ValueError: when a parameter is left uninitialised (no ``reset_parameters`` covers it).
    """
    layer = layer.to_empty(device=device)
    covered: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        for module in layer.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
                covered.update(id(p) for p in module.parameters())
    missing = [n for n, p in layer.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(f"layer {index}: parameters {missing} were built on the meta device but "
                         "no reset_parameters() initialises them; give their module a "
                         "reset_parameters() or use LayerSpec")
    return layer


def build_layers(layers: Sequence[nn.Module | LayerSpec], seed: int,
                 device: torch.device | str = "cpu") -> list[nn.Module]:
    """The whole model as the pipeline would build it: the single-device reference."""
    return [resolve(layer, i, seed, device) for i, layer in enumerate(layers)]


def resolve(layer: nn.Module | LayerSpec, index: int, seed: int,
            device: torch.device | str) -> nn.Module:
    """A real module for ``layer``: built from a spec, materialised from meta, or as given."""
    if isinstance(layer, LayerSpec):
        return layer.build(index, seed, device)
    if is_meta(layer):
        return materialize(layer, index, seed, device)
    return layer
