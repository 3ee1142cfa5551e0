"""HF model: a local ``save_pretrained`` directory as a model on ``meta``, cut at its decoder
layers, whose ranks each read only their own tensors from the safetensors files.

The model class comes from ``config.json`` through ``AutoModelForCausalLM`` and is built on the
``meta`` device in float32 (no storage). :func:`split_points` names the decoder layers (the
largest stack of one layer class) as the units the pipeline's balance groups into stages.
After the pipeline has materialised a rank's stages, :func:`load_weights` opens each
safetensors file with ``safe_open`` and copies only the tensors of that rank's parameters and
buffers into them, by name (a tied weight under any of its names): the rank never maps or reads
another rank's tensors. A directory without weights keeps the seeded initialisation by name.

Stored names are read through transformers' own conversion rules (``conversion_mapping``):
renamed (``embed_out`` -> ``lm_head``), or, where transformers fuses several stored tensors
into one model tensor at load (a mixture of experts stores each expert apart), fused from the
rank's stored tensors by transformers' ``WeightConverter`` and its operations::

    stored: layers.0.mlp.experts.{0..E-1}.gate_proj.weight   (I, H) each ─┐ MergeModulelist
            layers.0.mlp.experts.{0..E-1}.up_proj.weight     (I, H) each ─┘ then Concatenate
    model:  layers.0.mlp.experts.gate_up_proj                (E, 2I, H)    on dim 1
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.hf.image_text import is_image_text, meta_image_text, transformers
from pipetrain.runtime.dtensors import copy_whole_
from pipetrain.split.autosplit import cut_points, units

__all__ = ["Fused", "HFModel", "LoadReport", "has_weights", "load_weights", "meta_model",
           "open_model", "split_points", "decoder_layers", "check_generation_stages",
           "transformers"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True, eq=False)
class Fused:
    """Stored tensors that transformers fuses at load into model tensors, and how."""

    key: str
    """The model name transformers converts them under (the first of :attr:`targets`)."""
    targets: tuple[str, ...]
    """The model tensors the conversion gives."""
    converter: Any
    """transformers' ``WeightConverter`` (a template: each read converts with a copy)."""
    sources: tuple[tuple[str, Path, str], ...]
    """(source pattern, file, stored name) of each stored tensor, in transformers' order."""


@dataclass(frozen=True, eq=False)
class HFModel:
    """A local Hugging Face checkpoint, described (its model lives on ``meta``)."""

    root: Path
    """The ``save_pretrained`` directory."""
    config: Any
    """Its ``PretrainedConfig`` (``use_cache`` off: a pipeline passes no KV cache)."""
    model: nn.Module
    """``AutoModelForCausalLM.from_config(config)`` on the ``meta`` device, float32."""
    weights: dict[str, tuple[Path, str]]
    """Model tensor name -> (the safetensors file holding it, its name there), for the tensors
    stored whole; empty: no weights."""
    aliases: dict[str, tuple[str, ...]]
    """Each parameter and buffer name -> every name of the same tensor (a tied weight's)."""
    fused: dict[str, Fused] = field(default_factory=dict)
    """Model tensor name -> the stored tensors transformers fuses into it at load (a mixture
    of experts' per-expert weights), for the tensors not stored whole."""
    image_text: bool = False
    """Built through ``AutoModelForImageTextToText`` (:mod:`pipetrain.hf.image_text`)."""

    @property
    def n_params(self) -> int:
        """Parameters, a tied weight counted once."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's position table covers (None: no limit stated)."""
        value = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        return int(value) if isinstance(value, int) else None

    def describe(self) -> dict[str, Any]:
        """The model's identity as JSON values (checkpoint metadata; equal across restarts)."""
        config = json.loads(self.config.to_json_string(use_diff=False))
        for volatile in ("transformers_version", "_name_or_path", "use_cache"):
            config.pop(volatile, None)
        return {"hf": {"architecture": type(self.model).__name__, "config": config}}


def meta_model(config: Any, *, images: bool = False) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on ``meta``, float32, in train mode
    (``images``: an image-text-to-text config through ``AutoModelForImageTextToText``).

    Raises:
        ValueError: when ``config`` is not of a causal LM transformers can build.
    """
    if images and is_image_text(config):
        return meta_image_text(config)
    tf = transformers()
    try:
        with torch.device("meta"):
            model: nn.Module = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError:  # its message lists every causal LM config transformers has
        image_text = hasattr(config, "vision_config")
        kind = ("an encoder-decoder" if getattr(config, "is_encoder_decoder", False)
                else "an image-text model" if image_text
                else "not a causal language model transformers can build")
        other = ("pipetrain train --chat, verify and generate --image take an image-text "
                 "model, and so does pt.Pipeline(model, schedule, m, loss_fn, "
                 "split_points='auto', example_inputs=dict(processor(...))) "
                 "(docs/multimodal.md)" if image_text else
                 "split any other model with pt.Pipeline and check it with pt.verify(model, "
                 "inputs) (docs/models.md, docs/verify.md)")
        raise ValueError(f"{type(config).__name__} is {kind} (AutoModelForCausalLM does not "
                         "take it); this command takes causal language models only: "
                         f"{other}") from None
    return model.train()


def open_model(root: str | Path, *, images: bool = False) -> HFModel:
    """The model of directory ``root`` (``config.json``, optional safetensors weights).

    ``images``: an image-text-to-text config (:func:`pipetrain.hf.image_text.is_image_text`)
    is built through ``AutoModelForImageTextToText``; without it, such a config is refused.

    Raises:
        FileNotFoundError: when ``root`` or its ``config.json`` is missing.
        ValueError: when the config is not a causal LM transformers knows, or the weights are
            only in pickle files (``pytorch_model.bin``), which are not read.
    """
    tf = transformers()
    path = Path(root)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--hf {str(path)!r}: no config.json there; give a directory "
                                "written by save_pretrained (config.json, *.safetensors, "
                                "tokenizer files) or a Hub id, ORG/NAME[@REVISION]")
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    config.use_cache = False
    image_text = images and is_image_text(config)
    try:
        model = meta_model(config, images=images)
    except ValueError as e:
        raise ValueError(f"--hf {str(path)!r}: {e}") from None
    weights, fused = _index(_stored_files(path), _renamer(model))
    return HFModel(path, config, model, weights, _names_by_tensor(model), fused, image_text)


Renamer = Callable[[str], tuple[str, str | None, Any]]
"""stored name -> (model name, the fusing converter's source pattern or None, it or None)"""


def _renamer(model: nn.Module) -> Renamer:
    """transformers' own renaming of stored names for ``model`` (``from_pretrained``'s: its
    ``WeightRenaming`` rules, then at most one ``WeightConverter``; a name the model has
    already is kept); names unchanged with a transformers that has no such rules."""
    try:
        import transformers.core_model_loading as loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # pragma: no cover - transformers before 5
        return lambda name: (name, None, None)
    rules = get_model_conversion_mapping(model)
    renamings = [r for r in rules if isinstance(r, loading.WeightRenaming)]
    converters = [r for r in rules if isinstance(r, loading.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known, prefix = model.state_dict(), getattr(model, "base_model_prefix", None)

    def rename(name: str) -> tuple[str, str | None, Any]:
        target, pattern = loading.rename_source_key(name, renamings, converters, prefix, known)
        if target not in known and name in known:  # as from_pretrained: not to be renamed
            target, pattern = loading.rename_source_key(name, [], [], prefix, known)
        return target, pattern, by_pattern.get(pattern) if pattern is not None else None

    return rename


def _index(stored: dict[str, Path], rename: Renamer
           ) -> tuple[dict[str, tuple[Path, str]], dict[str, Fused]]:
    """The stored tensors by model name: those stored whole (file, stored name), and those
    transformers fuses from several stored ones (:class:`Fused`, under each of its targets)."""
    weights: dict[str, tuple[Path, str]] = {}
    groups: dict[str, tuple[Any, list[tuple[str, Path, str]]]] = {}
    for name in sorted(stored, key=_natural):  # as transformers: expert 2 before expert 10
        target, pattern, converter = rename(name)
        if converter is None or pattern is None:
            weights[target] = (stored[name], name)
        else:
            groups.setdefault(target, (converter, []))[1].append((pattern, stored[name], name))
    fused: dict[str, Fused] = {}
    for key, (converter, sources) in groups.items():
        first = converter.target_patterns[0]
        targets = tuple(key.replace(first, t) for t in converter.target_patterns)
        group = Fused(key, targets, converter, tuple(sources))
        fused.update(dict.fromkeys(targets, group))
    return weights, fused


def _natural(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]


def has_weights(root: str | Path) -> bool:
    """Whether directory ``root`` stores safetensors weights (the single file, or the index of
    shards) that :func:`open_model` reads; without them a run starts from ``--seed``."""
    return (Path(root) / INDEX).is_file() or (Path(root) / SINGLE).is_file()


def _stored_files(root: Path) -> dict[str, Path]:
    """Stored tensor name -> its file, from the index of a sharded checkpoint or the single
    file; empty: no weights. A ValueError when the weights are only in pickle files."""
    if (root / INDEX).is_file():
        index = json.loads((root / INDEX).read_text())
        return {name: root / file for name, file in index["weight_map"].items()}
    if (root / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(root / SINGLE), "pt") as f:
            return {name: root / SINGLE for name in f.keys()}  # a safetensors handle, not a dict
    pickled = sorted(p.name for p in root.glob("*.bin"))
    if pickled:
        raise ValueError(f"{root} holds weights only as pickle files ({', '.join(pickled)}), "
                         "which pipetrain does not unpickle; convert them once with "
                         "model.save_pretrained(dir, safe_serialization=True)")
    return {}


def load_tokenizer(root: str | Path) -> Any:
    """The tokenizer saved in ``root`` (``AutoTokenizer``, local files only).

    Raises:
        FileNotFoundError: when ``root`` has no tokenizer files, saying how to add them.
    """
    tf = transformers()
    try:
        return tf.AutoTokenizer.from_pretrained(Path(root), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise FileNotFoundError(
            f"--hf {str(root)!r}: no tokenizer could be loaded from it ({e}); save the "
            "model's tokenizer there too (tokenizer.save_pretrained(dir))") from None


def split_points(model: nn.Module, n_stages: int, example: dict[str, Any] | None = None
                 ) -> list[str]:
    """The units to group into ``n_stages`` stages: the decoder layers, or every unit.

    Each name starts a unit. The decoder layers (the largest stack of one layer class, such as
    ``model.layers.0`` .. ``model.layers.31``) are the units when there are at least
    ``n_stages`` of them: the embedding goes with the first, the final norm and head with the
    last. A model with fewer layers than stages is cut at every unit instead, in the order
    ``forward`` runs them on ``example`` (:func:`pipetrain.split.autosplit.cut_points`: a rotary
    table registered after the final norm runs before the first layer); without ``example``,
    in registration order (:func:`pipetrain.split.autosplit.units`).

    Raises:
        ValueError: when the model has fewer units than stages.
    """
    found = units(model)
    layers = decoder_layers(model, found)
    if len(layers) >= n_stages:
        return layers[1:]
    if len(found) >= n_stages:
        return found[1:] if example is None else cut_points(model, example)
    raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers and "
                     f"{len(found)} units in all, fewer than the {n_stages} stages of this "
                     "layout; use fewer ranks or stages per rank (--stages-per-rank 1)")


def decoder_layers(model: nn.Module, found: list[str] | None = None) -> list[str]:
    """The names of the model's decoder layers: its largest stack of numbered units, such as
    ``model.layers.0`` .. ``model.layers.31`` (``found``: its units, when known already); in
    an image-text model, the largest under its language model (a vision tower may be
    deeper)."""
    stacks: dict[str, list[str]] = {}
    for name in units(model) if found is None else found:
        parent, _, index = name.rpartition(".")
        if index.isdigit():
            stacks.setdefault(parent, []).append(name)
    text = {k: v for k, v in stacks.items()
            if {"language_model", "text_model"} & set(k.split("."))}
    return max((text or stacks).values(), key=len, default=[])


def check_generation_stages(model: nn.Module, n_stages: int, how: str = "--nproc {}"
                            ) -> None:
    """Refuse, before any capture, more generation stages than the model has decoder layers
    (``how``: the setting that asks for N stages, as a format: ``"--nproc {}"``,
    ``"{} ranks"``).

    Generation cuts between decoder layers only: its stages carry the KV cache's positions and
    mask, which a cut inside the embedding, the rotary table or the head would have to pass
    between shapes that torch.export cannot tie together (training, without a cache, can cut
    at every unit: :func:`split_points`).

    Raises:
        ValueError: naming the model, its layers, the stages asked for and what to use.
    """
    n_layers = len(decoder_layers(model))
    if n_stages > n_layers:
        raise ValueError(f"{type(model).__name__} has {n_layers} decoder layers, fewer than the "
                         f"{n_stages} stages asked for ({how.format(n_stages)}: one stage a "
                         f"rank); generation cuts between decoder layers only: use "
                         f"{how.format(max(n_layers, 1))} or fewer")


@dataclass(frozen=True)
class LoadReport:
    """What one rank read from the safetensors files."""

    tensors: int
    """Stored tensors read (a fused tensor counts each stored one it is made of)."""
    bytes: int
    """Bytes of the tensors read, as stored."""
    files: int
    """Files opened."""


def load_weights(hf: HFModel, state: Mapping[str, torch.Tensor]) -> LoadReport:
    """Copy the stored value of every tensor of ``state`` (a rank's own) into it, in place.

    ``state`` maps the model's names (``pipe.state_dict()``) to this rank's materialised
    tensors; each is looked up in the files under its own name or, for a tied weight, any
    other name of the same Parameter, and cast to the tensor's dtype; one that transformers
    fuses at load (:attr:`HFModel.fused`) is fused from its stored tensors by transformers'
    ``WeightConverter``. A DTensor (FSDP2, expert-parallel) takes its slice of the whole.

    Raises:
        ValueError: naming the tensors the files lack, or a stored (or fused) shape that
            differs from the model's, with the file and the stored names.
    """
    if not hf.weights and not hf.fused:
        return LoadReport(0, 0, 0)
    by_file, fused, missing = _plan(hf, state)
    if missing:
        raise ValueError(f"{hf.root}: the weights lack {_few(missing)}; is this directory "
                         "from another model than its config.json?")
    read = n_bytes = 0
    files = set(by_file)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            for run in _groups(names, state):  # the file is mapped one run at a time
                n, b = _read_whole(file, run, state)
                read, n_bytes = read + n, n_bytes + b
        for group, wanted in fused.values():  # one fused tensor's stored ones at a time
            n, b = _read_fused(hf, group, wanted, state)
            read, n_bytes = read + n, n_bytes + b
            files.update(file for _, file, _ in group.sources)
    return LoadReport(read, n_bytes, len(files))


def _plan(hf: HFModel, state: Mapping[str, torch.Tensor]
          ) -> tuple[dict[Path, list[tuple[str, str]]], dict[str, tuple[Fused, dict[str, str]]],
                     list[str]]:
    """What ``state`` reads: (state name, stored name) by file for the tensors stored whole;
    by fused group, the group and its model names -> state names; the names not stored."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    fused: dict[str, tuple[Fused, dict[str, str]]] = {}
    missing = []
    for name in state:
        candidates = (name, *(a for a in hf.aliases.get(name, ()) if a != name))
        found = next((a for a in candidates if a in hf.weights or a in hf.fused), None)
        if found is None:
            missing.append(name)
        elif found in hf.weights:
            file, stored = hf.weights[found]
            by_file.setdefault(file, []).append((name, stored))
        else:
            group = hf.fused[found]
            fused.setdefault(group.key, (group, {}))[1][found] = name
    return by_file, fused, missing


def _read_whole(file: Path, names: list[tuple[str, str]], state: Mapping[str, torch.Tensor]
                ) -> tuple[int, int]:
    """Copy each (state name, stored name) of ``names`` from ``file``; tensors and bytes read."""
    from safetensors import safe_open

    n_bytes = 0
    with safe_open(str(file), "pt", device="cpu") as f:
        for name, stored in names:
            value = f.get_tensor(stored)
            _copy(state[name], value, name, f"{file}: {stored}")
            n_bytes += value.numel() * value.element_size()
    return len(names), n_bytes


def _read_fused(hf: HFModel, group: Fused, wanted: dict[str, str],
                state: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """Read the stored tensors of ``group``, fuse them with a copy of transformers' converter,
    and copy the results ``wanted`` (model name -> state name) in; stored tensors and bytes
    read."""
    from safetensors import safe_open

    values: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(file for _, file, _ in group.sources):
        with safe_open(str(file), "pt", device="cpu") as f:
            values.update({s: f.get_tensor(s) for _, fl, s in group.sources if fl == file})
    n_read, n_bytes = len(values), sum(v.numel() * v.element_size() for v in values.values())
    where = (f"{group.sources[0][1]}: {n_read} stored tensors "
             f"({_few([s for _, _, s in group.sources], 3)})")
    converter = copy.deepcopy(group.converter)
    for pattern, _, stored in group.sources:  # in order; the converter frees each as it goes
        converter.add_tensor(group.key, stored, pattern, values.pop(stored))
    try:
        out = converter.convert(group.key, model=hf.model, config=hf.config)
    except Exception as e:  # any op's failure, named with the tensors
        ops = ", ".join(type(op).__name__ for op in converter.operations)
        raise ValueError(f"{where}: transformers' {ops} could not fuse them into the model's "
                         f"{group.key} ({type(e).__name__}: {e})") from e
    converted = {k: v[0] if isinstance(v, list) else v for k, v in out.items()}
    for model_name, name in wanted.items():
        if model_name not in converted:
            raise ValueError(f"{where} fuse into {_few(sorted(converted))}, not the model's "
                             f"{model_name}")
        _copy(state[name], converted[model_name], name, f"{where} (fused)")
    return n_read, n_bytes


def _copy(target: torch.Tensor, value: torch.Tensor, name: str, where: str) -> None:
    """``value`` (the whole tensor) into ``target``, or a ValueError naming both shapes."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, the model's {name} "
                         f"{tuple(target.shape)}")
    copy_whole_(target, value)  # a FSDP2 shard or an expert-parallel slice takes its slice


MAPPED_BYTES = 256 << 20
"""The file pages a rank keeps mapped while it reads: safetensors maps the file, and the
pages it has read count in the process's resident memory until the file is closed."""


def _groups(names: list[tuple[str, str]], state: Mapping[str, torch.Tensor]
            ) -> list[list[tuple[str, str]]]:
    """``names`` in runs of at most :data:`MAPPED_BYTES` (a larger tensor alone)."""
    runs: list[list[tuple[str, str]]] = [[]]
    size = 0
    for item in names:
        t = state[item[0]]
        nbytes = t.numel() * t.element_size()
        if runs[-1] and size + nbytes > MAPPED_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return runs


def _names_by_tensor(model: nn.Module) -> dict[str, tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(n)
    return {n: tuple(g) for g in groups.values() for n in g}


def share_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a rank's tensors (its share of the model)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def _few(items: list[str], n: int = 6) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more

