"""Save back: a pipelined model's parameters as a ``save_pretrained`` directory, rank by rank.

Each pipeline rank of the first data-parallel replica writes the tensors it holds to its own
shard, ``model-0000k-of-0000n.safetensors`` (a tied weight once, by the lowest rank holding
it, under the model's first name for it, as ``save_pretrained`` does); no rank gathers the
model. Rank 0 then writes ``model.safetensors.index.json``, ``config.json`` and the tokenizer,
and renames the finished directory over the previous one, so ``OUT/hf`` is always complete::

    OUT/hf/config.json                         the source's config (float32)
    OUT/hf/model-00001-of-00002.safetensors    rank 0's tensors
    OUT/hf/model-00002-of-00002.safetensors    rank 1's tensors
    OUT/hf/model.safetensors.index.json        name -> shard
    OUT/hf/tokenizer.json ...                  the source's tokenizer

The tensors are stored in the layout transformers' own ``save_pretrained`` writes: each
rank reverts transformers' load-time conversions of its own tensors with transformers'
``revert_weight_conversion`` (:func:`stored_layout`), so a mixture of experts' fused
``model.layers.0.mlp.experts.gate_up_proj`` (E, 2I, H) is written back as the per-expert
tensors its checkpoints hold (Mixtral: ``model.layers.0.block_sparse_moe.experts.{0..E-1}.w1``
and ``.w3``; Qwen3-MoE, DeepSeek-V3: ``...experts.{0..E-1}.gate_proj`` and ``.up_proj``),
and a model transformers does not convert (Llama, GPT-2, gpt-oss) under its own names.
``AutoModelForCausalLM.from_pretrained(OUT/hf)`` then holds exactly pipetrain's parameters.
:func:`export_checkpoint` writes the same directory from a checkpoint, in one process, one
shard of at most ``shard_bytes`` in memory at a time.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["export_checkpoint", "save_pretrained", "stored_layout", "write_directory"]

INDEX = "model.safetensors.index.json"
EXTRA_FILES = ("generation_config.json",)


def shard_name(number: int, total: int) -> str:
    """The file of shard ``number`` (from 1) of ``total``, as Hugging Face names them."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def write_shard(directory: Path, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Write ``tensors`` (contiguous copies where needed) to ``directory/name``; their bytes."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / name),
              metadata={"format": "pt"})
    return {k: v.numel() * v.element_size() for k, v in tensors.items()}


def stored_layout(model: nn.Module, state: Mapping[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s names) as transformers' ``save_pretrained`` stores it: the
    load-time conversions of ``model`` (a meta model) reverted by transformers'
    ``revert_weight_conversion`` (fused experts split back into one tensor per expert, stored
    names restored); unchanged with a transformers that has no conversions.

    ``state`` must hold whole every group of tensors transformers converts together (one
    fused tensor; the parts of one stored tensor): a rank's layers do, and so do the runs of
    :func:`conversion_units`.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers before 5
        return dict(state)
    return dict(revert_weight_conversion(model, dict(state)))


def conversion_units(model: nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` in runs that transformers' save converts together (model tensors made from
    one stored tensor go back into it together), each in its first name's place."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, apply_converters

        rules = get_model_conversion_mapping(model, add_legacy=False)
        reverse = [r for r in (c.reverse_transform() for c in rules[::-1])
                   if isinstance(r, WeightConverter)]
    except ImportError:  # pragma: no cover - transformers before 5
        return [[n] for n in names]
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(apply_converters(name, reverse)[0], []).append(name)
    return list(units.values())


def write_directory(partial: Path, final: Path, weight_map: dict[str, str], total: int,
                    config: Any, tokenizer: Any, source: Path | None) -> Path:
    """Finish ``partial`` (index, config, tokenizer, extra files) and move it to ``final``."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(partial)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    for extra in EXTRA_FILES:
        if source is not None and (source / extra).is_file():
            shutil.copyfile(source / extra, partial / extra)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def save_pretrained(final: Path, state: Mapping[str, torch.Tensor], config: Any,
                    tokenizer: Any, source: Path | None, *,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Write this rank's ``state`` into the directory ``final`` (collective over ``group``).

    Call on every rank of one pipeline (the first data-parallel replica): each writes its own
    shard into ``final.partial``, in the stored layout (:func:`stored_layout`); the group's
    rank 0 writes the rest and renames it ``final``. ``state`` maps the model's names to this
    rank's whole tensors (``pipe.state_dict()``, DTensors gathered).
    """
    from pipetrain.hf.model import meta_model

    model = meta_model(config, images=True)  # for transformers' conversions of its names
    distributed = dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    size = dist.get_world_size(group) if distributed else 1
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    names: list[Any] = [list(state)] * size
    if distributed:  # also: rank 0 has made the directory
        dist.all_gather_object(names, list(state), group=group)
    owner: dict[str, int] = {}
    for r, held in enumerate(names):
        for n in held:
            owner.setdefault(n, r)
    mine = stored_layout(model, {n: t for n, t in state.items() if owner[n] == rank})
    file = shard_name(rank + 1, size)
    written = write_shard(partial, file, mine) if mine else {}
    shards: list[Any] = [(file, written)] * size
    if distributed:  # also: every shard is written
        dist.all_gather_object(shards, (file, written), group=group)
    if rank == 0:
        weight_map = {n: f for f, sizes in shards for n in sizes}
        total = sum(b for _, sizes in shards for b in sizes.values())
        write_directory(partial, final, weight_map, total, config, tokenizer, source)
    return final


def export_checkpoint(checkpoint: Path, out: Path, *, shard_bytes: int = 2 << 30) -> Path:
    """Write the model of a committed ``pipetrain train --hf`` checkpoint as ``out``.

    The tensors are read in groups of at most ``shard_bytes`` (one shard each; tensors that
    transformers converts together stay in one), written in the stored layout
    (:func:`stored_layout`); the config comes from the checkpoint's metadata, the tokenizer
    from the run's ``--hf`` directory when it is still there.

    Raises:
        CheckpointError: when ``checkpoint`` is not a committed checkpoint of an ``--hf`` run.
    """
    from pipetrain.checkpoint import run as ckpt
    from pipetrain.checkpoint import store as store
    from pipetrain.errors import CheckpointError
    from pipetrain.hf.model import load_tokenizer, meta_model, transformers

    opened = store.open_checkpoint(Path(checkpoint))
    described = dict((opened.meta.get("model") or {}).get("hf", {}).get("config", {}))
    if "model_type" not in described:
        raise CheckpointError(f"{checkpoint} is a checkpoint of a built-in GPT run, not of a "
                              "pipetrain train --hf run; only those convert to Hugging Face")
    config = transformers().AutoConfig.for_model(described.pop("model_type"), **described)
    model = meta_model(config, images=True)
    entries = {k[len("model/"):]: v for k, v in opened.metadata.state_dict_metadata.items()
               if k.startswith("model/") and isinstance(v, TensorStorageMetadata)}
    groups = _shard_groups(entries, conversion_units(model, list(entries)), shard_bytes)
    final = Path(out)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map, total = {}, 0
    for number, group in enumerate(groups, start=1):
        tensors = {n: torch.empty(tuple(e.size), dtype=e.properties.dtype)
                   for n, e in group.items()}
        ckpt.load(opened.path, {f"model/{n}": t for n, t in tensors.items()}, strict=False,
                  verify=number == 1)
        file = shard_name(number, len(groups))
        sizes = write_shard(partial, file, stored_layout(model, tensors))
        weight_map.update({n: file for n in sizes})
        total += sum(sizes.values())
        del tensors
    source = Path(opened.meta.get("hf_source", ""))
    tokenizer = load_tokenizer(source) if opened.meta.get("hf_source") and source.is_dir() \
        else None
    return write_directory(partial, final, weight_map, total, config, tokenizer,
                           source if tokenizer is not None else None)


def _shard_groups(entries: dict[str, Any], units: list[list[str]], shard_bytes: int
                  ) -> list[dict[str, Any]]:
    """``entries`` (name -> its checkpoint metadata) in groups of at most ``shard_bytes``
    (a larger unit alone), each of ``units`` whole in one group."""
    groups: list[dict[str, Any]] = [{}]
    used = 0
    for unit in units:
        nbytes = sum(torch.Size(entries[n].size).numel() * entries[n].properties.dtype.itemsize
                     for n in unit)
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append({})
            used = 0
        groups[-1].update({n: entries[n] for n in unit})
        used += nbytes
    return groups
