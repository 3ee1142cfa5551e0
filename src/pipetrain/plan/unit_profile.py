"""Unit profile: the model cut into units as ``pipetrain train`` cuts it, each timed and sized.

``pipetrain plan`` profiles every unit in its own process on one micro-batch of each size the
search tries (:func:`pipetrain.split.profile.profile_layers`): the GPT preset's blocks, or the
decoder layers of ``--hf DIR`` (captured with torch.export and cut where ``pipetrain train
--hf`` cuts); under tensor parallelism one rank's share of each, with the bytes it
all-reduces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.choice import GPTKind, HFKind, Kind, kind_of

__all__ = ["UNITS", "Units", "model_units", "profile_layouts", "profile_model"]

Layout = tuple[int, Any]
"""(pp, a :class:`~pipetrain.plan.shardcost.Sharding`)."""


@dataclasses.dataclass(frozen=True)
class Units:
    """The layers the balance groups into stages, as ``pipetrain train`` cuts the model (one
    tensor-parallel rank's share of each)."""

    layers: list[torch.nn.Module]
    feed: Callable[[torch.Tensor], Any]
    """Token ids -> the first layer's input."""
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    traffic: Callable[[torch.nn.Module, Any, torch.Tensor], tuple[tuple[int, ...], ...]]
    """(layer, its input, the token ids) -> the bytes it all-reduces over tp in F and in I."""
    experts: Callable[[torch.nn.Module, torch.Tensor], tuple[int, int]] = lambda u, ids: (0, 0)
    """(layer, the token ids) -> its experts' bytes and one all-to-all's (:mod:`.experts`)."""


def model_units(cfg: TrainConfig, pp: int, tp: int = 1) -> Units:
    """The units of ``cfg``'s model, by the kind of its source (:data:`UNITS`).

    Raises:
        ValueError: for a kind of source the planner cannot profile.
    """
    kind = kind_of(cfg)
    units = UNITS.get(type(kind))
    if units is None:
        raise ValueError(f"pipetrain plan cannot profile a {type(kind).__name__} source yet: "
                         "plan with --preset or --hf, or give --module")
    return units(cfg, pp, tp)


def gpt_units(cfg: TrainConfig, pp: int, tp: int) -> Units:
    """The GPT preset's blocks; under ``tp``, one rank's share of each, by the GPT plan
    (:func:`pipetrain.parallel.tensor_parallel.local_layer`)."""
    from pipetrain.models.gpt import gpt_layers, lm_loss
    from pipetrain.parallel.tensor_parallel import gpt_plan, local_layer, traffic
    from pipetrain.train.sources.source import GPTSource

    plan = gpt_plan(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        layers = [local_layer(layer, plan, tp) for layer in gpt_layers(GPTSource(cfg).model)]
    return Units(layers, lambda ids: ids, lm_loss,
                 lambda layer, x, ids: traffic(layer, plan, x) if tp > 1 else ((), ()))


def hf_units(cfg: TrainConfig, pp: int, tp: int) -> Units:
    """``--hf``'s units: its decoder layers (the embedding with the first, norm and head with
    the last) captured with torch.export, materialised from the seed (values do not change
    the times); under ``tp``, one rank's share by the model's own plan
    (:func:`pipetrain.hf.tp_plan.shrink`, before the capture, as ``train`` does)."""
    from pipetrain.hf.model import open_model, split_points
    from pipetrain.hf.tp_plan import shrink
    from pipetrain.plan.experts import expert_sizes
    from pipetrain.split.layers import packed, trace_stages
    from pipetrain.split.lazy import NamedInit
    from pipetrain.train.sources.hf_source import causal_lm_loss

    meta = open_model(Path(cfg.hf)).model
    splits = shrink(meta, tp) if tp > 1 else {}
    model: torch.nn.Module = NamedInit(meta, cfg.seed).materialize(meta)
    # 2 rows: export specializes a dimension of size 1, and the capture serves every size
    example = {"input_ids": torch.zeros(2, cfg.seq_len, dtype=torch.long)}
    # a balance mode: the units are grouped later, so they may outnumber the stages
    traced = trace_stages(model, split_points(model, pp, example), example, "time", pp)
    return Units(list(traced.stages), lambda ids: packed(traced, {"input_ids": ids}),
                 causal_lm_loss, lambda layer, x, ids: _split_traffic(layer, splits, ids),
                 expert_sizes(meta))


UNITS: dict[type[Kind], Callable[[TrainConfig, int, int], Units]] = {
    GPTKind: gpt_units, HFKind: hf_units}
"""How the planner cuts each kind of source into units (a new kind of source adds its own)."""


def _split_traffic(layer: torch.nn.Module, splits: dict[str, Any], ids: torch.Tensor
                   ) -> tuple[tuple[int, ...], ...]:
    """What a traced unit's split matrices all-reduce (:mod:`pipetrain.hf.tp_plan`):
    in F each row-wise one's output, in I each column-wise one's input gradient (fp32)."""
    f: list[int] = []
    i: list[int] = []
    for name, p in layer.named_parameters():
        style, whole = splits.get(name, ("", ()))
        if name.endswith("weight") and style:
            out_features, in_features = whole
            sizes = f if style == "rowwise" else i
            sizes.append(ids.numel() * (out_features if style == "rowwise" else in_features)
                         * p.element_size())
    return tuple(f), tuple(i)


def profile_layouts(cfg: TrainConfig, layouts: list[Layout]) -> dict[tuple[int, int], list[Any]]:
    """Per (pp, tp) of ``layouts``, the layers (a tensor-parallel rank's share of each)
    profiled on one micro-batch of every size the search tries there."""
    from pipetrain.plan.planner import microbatch_choices

    rows: dict[tuple[int, int], set[int]] = {}
    for pp, sharding in layouts:
        per_replica = cfg.batch_size // sharding.data
        rows.setdefault((pp, sharding.tp), set()).update(
            per_replica // m for m in microbatch_choices(per_replica, pp))
    return {(pp, tp): profile_model(cfg, model_units(cfg, pp, tp), tp, sorted(sizes))
            for (pp, tp), sizes in sorted(rows.items())}


def profile_model(cfg: TrainConfig, units: Units, tp: int, sizes: list[int]) -> list[Any]:
    """``units``' layers (one of ``tp`` ranks' share of each) profiled on one micro-batch of
    each of ``sizes`` rows."""
    from pipetrain.plan.planner import Profiled
    from pipetrain.split.profile import profile_layers

    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a CPU run computes
    try:
        for size in sizes:
            ids = torch.zeros(size, cfg.seq_len, dtype=torch.long)
            x = units.feed(ids)
            costs = profile_layers(units.layers, x, loss_fn=units.loss, sample_target=ids,
                                   repeats=2, reuse=True)
            inputs, comm = _walk(units, x, ids)
            out.append(Profiled(size, tuple(costs), inputs, comm, tp))
    finally:
        torch.set_num_threads(threads)
    return out


def _walk(units: Units, x: Any, ids: torch.Tensor) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """Per layer, the bytes of its input and its traffic (:class:`LayerComm`)."""
    from pipetrain.parallel.sharded import unit_bytes
    from pipetrain.plan.shardcost import LayerComm
    from pipetrain.runtime.transport.payload import flatten
    from pipetrain.train.memory import tensor_bytes

    sizes, comm = [], []
    with torch.no_grad():
        for layer in units.layers:
            sizes.append(tensor_bytes(flatten(x)[0]))
            f, i = units.traffic(layer, x, ids)
            comm.append(LayerComm(unit_bytes(layer), f, i, *units.experts(layer, ids)))
            x = layer(x)
    return tuple(sizes), tuple(comm)
