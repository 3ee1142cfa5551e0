"""Parallelize: the user's wrapping of each stage's layers, and names that follow the weights.

``Pipeline(..., parallelize=fn)`` calls ``fn(stage, layers)`` once for each stage the process
holds, after the split. Wrappers such as FSDP2 register new Parameter objects in the layers,
so the pipeline's names (the model's own, found by Parameter identity) are carried over by
place: the k-th parameter of a layer keeps the k-th name. A weight tied across ranks is read
from its module each time its gradient is summed, since FSDP2 swaps the sharded parameter for
the gathered one while a step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.runtime.backward import Gathering
from pipetrain.runtime.tied import TiedParam

__all__ = ["Composed", "Gathering", "StageLayers", "join", "parallelize_stages",
           "held_parameter"]

StageLayers = dict[int, list[tuple[str, nn.Module]]]
"""Per stage this process holds: its layers, with their names in the model."""


class Composed:
    """Several ``parallelize`` hooks applied in order (tensor parallel, then FSDP2: the way
    torchtitan composes them); it gathers through the first of them that gathers."""

    def __init__(self, *hooks: Callable[[int, list[nn.Module]], None]) -> None:
        self.hooks = hooks
        gathering = [cast(Gathering, h) for h in hooks if isinstance(h, Gathering)]
        self._gathering: Gathering | None = gathering[0] if gathering else None

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        for hook in self.hooks:
            hook(stage, layers)

    def gathered(self, param: nn.Parameter) -> nn.Parameter:
        return param if self._gathering is None else self._gathering.gathered(param)

    def gather(self, weights: Sequence[torch.Tensor]) -> None:
        if self._gathering is not None:
            self._gathering.gather(weights)

    def release(self) -> None:
        if self._gathering is not None:
            self._gathering.release()


def join(layer_name: str, param_name: str) -> str:
    """A parameter's name under its layer's."""
    return f"{layer_name}.{param_name}" if layer_name else param_name


def parallelize_stages(fn: Callable[[int, list[nn.Module]], None], stages: StageLayers,
                       tied: Sequence[TiedParam], names: dict[int, str]
                       ) -> dict[str, list[tuple[nn.Module, str]]]:
    """``fn`` on each stage's layers; ``names`` (``id`` -> name) learns the new parameters.
    Returns the tied weights ``fn`` untied, several stages of this process sharing each
    (FSDP2 shards each stage's copy apart): name -> every (module, attribute) holding a copy,
    the first stage's first (:class:`pipetrain.runtime.tied.LocalCopies` keeps them one weight).

    Raises:
        PipelineError: when ``fn`` adds or removes a layer's parameters.
    """
    holders = _places(stages, names)
    shared = {t.name: holders[t.name] for t in tied if sum(s in stages for s in t.stages) > 1}
    before = {s: [[names.get(id(p), join(name, pname)) for pname, p in layer.named_parameters()]
                  for name, layer in chunk] for s, chunk in stages.items()}
    for s in sorted(stages):
        fn(s, [m for _, m in stages[s]])
        for (name, layer), old in zip(stages[s], before[s], strict=True):
            now = list(layer.named_parameters())
            if len(now) != len(old):
                raise PipelineError(
                    f"parallelize changed the parameters of stage {s}'s layer {name!r} "
                    f"({len(old)} before, {len(now)} after); it may wrap or shard them, "
                    "not add or remove any")
            names.update((id(p), n) for (_, p), n in zip(now, old, strict=True))
    return {name: places for name, places in shared.items()  # a V's embedding and head
            if len({id(getattr(module, attr)) for module, attr in places}) > 1}


def _places(stages: StageLayers, names: dict[int, str]) -> dict[str, list[tuple[nn.Module, str]]]:
    """Name -> every (module, attribute) of this process's stages that holds that weight."""
    found: dict[str, list[tuple[nn.Module, str]]] = {}
    for s in sorted(stages):
        for layer_name, layer in stages[s]:
            for path, module in layer.named_modules():
                for attr, p in module.named_parameters(recurse=False):
                    name = names.get(id(p), join(join(layer_name, path), attr))
                    found.setdefault(name, []).append((module, attr))
    return found


def held_parameter(stages: StageLayers, names: dict[int, str],
                   gathering: Gathering | None = None) -> Callable[[str], nn.Parameter]:
    """Name -> the parameter its module holds at the moment of the call (``gathering``: the
    one a step's gradients accumulate in)."""
    where = {name: found[0] for name, found in _places(stages, names).items()}

    def held(name: str) -> nn.Parameter:
        module, attr = where[name]
        p: nn.Parameter = getattr(module, attr)
        return p if gathering is None else gathering.gathered(p)
    return held
