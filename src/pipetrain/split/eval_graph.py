"""Eval graph: the evaluation graph of a model captured in training mode, sharing its tensors.

Capture takes a model's Python-level decisions once (:mod:`pipetrain.split.trace`): a model in
training mode records dropout that draws, and batch norms that normalise by the batch and
update their running statistics. ``eval_step`` must run what ``model.eval()`` runs, so when
the training graph depends on the mode, the model is captured a second time in eval mode and
cut at the same split points (:func:`eval_split`). After the pipeline has built this rank's
stages, :func:`share` points every tensor of the eval units at the training units' own (the
materialised parameters and buffers, by the model's names): one copy of the weights, two
graphs. Anything else that ``self.training`` decides (an MoE router's jitter) follows too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from pipetrain.errors import PartitionError
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.torch_private import BATCH_NORM_LEGIT, buffers_dict
from pipetrain.split.capture import capture, move_graph, on_model_device
from pipetrain.split.partition import stage_bounds
from pipetrain.split.prefix import Prefixed
from pipetrain.split.shared_capture import capture_shared
from pipetrain.split.trace import TracedSplit, split_model, with_prefix

__all__: list[str] = []

_TRAINING_NORMS = {"aten.batch_norm.default": 5, "aten.native_batch_norm.default": 5,
                   **dict.fromkeys(BATCH_NORM_LEGIT, 5)}
"""Batch-norm ops and the index of their ``training`` argument."""


def depends_on_mode(model: nn.Module, traced: TracedSplit) -> bool:
    """Whether ``model`` was captured in training mode into a graph that eval would change:
    one that draws random numbers, or normalises by the batch."""
    if not any(m.training for m in model.modules()):
        return False
    return any(traced.draws) or any(_normalises_by_batch(n) for stage in traced.stages
                                    for m in stage.modules() if isinstance(m, fx.GraphModule)
                                    for n in m.graph.nodes)


def _normalises_by_batch(node: fx.Node) -> bool:
    index = _TRAINING_NORMS.get(str(node.target))
    return node.op == "call_function" and index is not None and len(node.args) > index \
        and node.args[index] is True


@contextmanager
def eval_mode(models: nn.Module | Iterable[nn.Module]) -> Iterator[None]:
    """``models`` in eval mode inside, every module's own flag restored after."""
    roots = [models] if isinstance(models, nn.Module) else list(models)
    flags = [(m, m.training) for root in roots for m in root.modules()]
    for root in roots:
        root.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def eval_split(model: nn.Module, traced: TracedSplit, example_inputs: Any,
               share: Any = None, dynamic: bool = True) -> TracedSplit:
    """``model`` captured in eval mode and cut where ``traced`` was cut (``share``: the
    pipeline group, whose rank 0 exports for all: :mod:`pipetrain.split.shared_capture`;
    ``dynamic``:
    as :func:`~pipetrain.split.capture.capture`).

    Raises:
        PartitionError: when the eval graph cuts into another number of units.
    """
    prefix = traced.prefix  # an image-text model: captured from its language model on
    with eval_mode(model), torch.no_grad():
        example = example_inputs if prefix is None else on_model_device(model,
                                                                        prefix.captured_with)
        captured = capture(model, example, dynamic) if share is None else \
            capture_shared(model, example, share, dynamic)
        split = split_model(model, list(traced.points), example, captured=captured)
        if prefix is not None:
            split = with_prefix(split, prefix, model)
    if len(split.stages) != len(traced.stages):
        raise PartitionError(f"the model captured in eval mode cuts into {len(split.stages)} "
                             f"units at {list(traced.points)}, in training mode into "
                             f"{len(traced.stages)}")
    return split


def eval_stages(split: TracedSplit, balance: Sequence[int], trained: Mapping[int, Stage],
                layers: Mapping[int, Sequence[tuple[str, nn.Module]]], device: torch.device,
                loss_fn: Any, split_dim: int) -> dict[int, Stage]:
    """The stages of ``split`` (the eval capture) that this rank holds in ``trained``, each
    unit reading the tensors of its training twin in ``layers`` (:func:`share`)."""
    routes = split.routes(balance)
    stages: dict[int, Stage] = {}
    for s, (lo, hi) in enumerate(stage_bounds(balance)):
        if s not in trained:
            continue
        units = [share(split.stages[i], m).to(device)
                 for i, (_, m) in zip(range(lo, hi), layers[s])]
        for unit in units:
            move_graph(unit, device)
        stages[s] = Stage(s, units, is_last=trained[s].is_last, loss_fn=loss_fn, device=device,
                          split_dim=split_dim, ports=routes.ports[s] if routes.keyed else None)
    return stages


def share(unit: nn.Module, trained: nn.Module) -> nn.Module:
    """``unit`` (an eval unit) reading the tensors of ``trained`` (the same unit built for
    training) wherever it has them, by name; in place. An image-text model's first unit runs
    the trained unit's vision prefix, in eval mode.

    Raises:
        PartitionError: for a tensor the eval graph makes that is still on ``meta``.
    """
    if isinstance(unit, Prefixed) and isinstance(trained, Prefixed):
        return Prefixed(trained.prefix, share(unit.stage, trained.stage), unit.pack,
                        evaluating=True)
    if not isinstance(unit, fx.GraphModule):
        raise TypeError(f"an eval unit is a GraphModule of split_model, got {type(unit)}")
    for node in unit.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        own = _get(trained, target)
        if own is not None:
            _set(unit, target, own)
        elif isinstance(_get(unit, target), torch.Tensor) and _get(unit, target).is_meta:
            raise PartitionError(f"the eval graph reads {target!r}, which the training graph "
                                 "lacks and a model described on meta holds no values of")
    return unit


def _get(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _set(module: nn.Module, target: str, value: Any) -> None:
    *path, name = target.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    if isinstance(value, nn.Parameter) or not isinstance(owner, nn.Module) \
            or name not in buffers_dict(owner):
        setattr(owner, name, value)
    else:
        buffers_dict(owner)[name] = value
