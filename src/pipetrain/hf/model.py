"""HF model: a local ``save_pretrained`` directory as a model on ``meta``, cut at its decoder
layers, whose ranks each read only their own tensors from the safetensors files.

The model class comes from ``config.json`` through ``AutoModelForCausalLM`` and is built on the
``meta`` device in float32 (no storage). :func:`split_points` names the decoder layers (the
largest stack of one layer class) as the units the pipeline's balance groups into stages.
After the pipeline has materialised a rank's stages, :func:`load_weights` opens each
safetensors file with ``safe_open`` and copies only the tensors of that rank's parameters and
buffers into them, by name (a tied weight under any of its names): the rank never maps or reads
another rank's tensors. A directory without weights keeps the seeded initialisation by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.dtensors import copy_whole_
from pipetrain.split.autosplit import cut_points, units

__all__ = ["HFModel", "LoadReport", "has_weights", "load_weights", "open_model", "split_points"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def transformers() -> Any:
    """The ``transformers`` module, quiet, or an ImportError that says how to install it."""
    try:
        import transformers as tf
    except ImportError as e:  # pragma: no cover - the hf extra is a test dependency
        raise ImportError("--hf needs transformers and safetensors: pip install "
                          "'pipetrain[hf]' (with torch pinned)") from e
    tf.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    return tf


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
    """Model tensor name -> (the safetensors file holding it, its name there); empty: no
    weights."""
    aliases: dict[str, tuple[str, ...]]
    """Each parameter and buffer name -> every name of the same tensor (a tied weight's)."""
    fused: tuple[str, ...] = ()
    """Model tensors that transformers builds at load from several stored ones (a mixture of
    experts' fused expert weights), which are not read one by one."""

    @property
    def n_params(self) -> int:
        """Parameters, a tied weight counted once."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's position table covers (None: no limit stated)."""
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) else None

    def describe(self) -> dict[str, Any]:
        """The model's identity as JSON values (checkpoint metadata; equal across restarts)."""
        config = json.loads(self.config.to_json_string(use_diff=False))
        for volatile in ("transformers_version", "_name_or_path", "use_cache"):
            config.pop(volatile, None)
        return {"hf": {"architecture": type(self.model).__name__, "config": config}}


def open_model(root: str | Path) -> HFModel:
    """The model of directory ``root`` (``config.json``, optional safetensors weights).

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
                                "tokenizer files)")
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    config.use_cache = False
    try:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"--hf {str(path)!r}: {type(config).__name__} is not a causal language "
                         f"model transformers can build ({e})") from None
    model.train()
    renamings, fused = _conversions(model)
    return HFModel(path, config, model, _weight_files(path, renamings),
                   _names_by_tensor(model), fused)


def _conversions(model: nn.Module) -> tuple[list[tuple[str, str]], tuple[str, ...]]:
    """transformers' own checkpoint conversions for ``model``: the renamings of stored names
    (regex, replacement), and the model names of tensors it fuses from several stored ones."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        rules = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001  (an older or newer transformers: no renaming)
        return [], ()
    renamings: list[tuple[str, str]] = []
    fused: list[str] = []
    for rule in rules:
        sources = list(getattr(rule, "source_patterns", []) or [])
        targets = list(getattr(rule, "target_patterns", []) or [])
        if type(rule).__name__ == "WeightRenaming" and targets:
            renamings += [(src, targets[i] if len(targets) == len(sources) else targets[0])
                          for i, src in enumerate(sources)]
        elif targets:
            fused += targets
    return renamings, tuple(fused)


def _renamed(name: str, renamings: list[tuple[str, str]]) -> str:
    for pattern, replacement in renamings:
        name = re.sub(pattern, replacement, name)
    return name


def has_weights(root: str | Path) -> bool:
    """Whether directory ``root`` stores safetensors weights (the single file, or the index of
    shards) that :func:`open_model` reads; without them a run starts from ``--seed``."""
    return (Path(root) / INDEX).is_file() or (Path(root) / SINGLE).is_file()


def _weight_files(root: Path, renamings: list[tuple[str, str]]) -> dict[str, tuple[Path, str]]:
    """Model tensor name -> (file, stored name), from the index of a sharded checkpoint or the
    single file; stored names are renamed as transformers renames them at load."""
    stored: dict[str, Path] = {}
    if (root / INDEX).is_file():
        index = json.loads((root / INDEX).read_text())
        stored = {name: root / file for name, file in index["weight_map"].items()}
    elif (root / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(root / SINGLE), "pt") as f:
            stored = {name: root / SINGLE for name in f.keys()}  # noqa: SIM118 (not a dict)
    if stored:
        return {_renamed(n, renamings): (file, n) for n, file in stored.items()}
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
    stacks: dict[str, list[str]] = {}
    for name in found:
        parent, _, index = name.rpartition(".")
        if index.isdigit():
            stacks.setdefault(parent, []).append(name)
    layers = max(stacks.values(), key=len, default=[])
    if len(layers) >= n_stages:
        return layers[1:]
    if len(found) >= n_stages:
        return found[1:] if example is None else cut_points(model, example)
    raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers and "
                     f"{len(found)} units in all, fewer than the {n_stages} stages of this "
                     "layout; use fewer ranks or stages per rank (--stages-per-rank 1)")


@dataclass(frozen=True)
class LoadReport:
    """What one rank read from the safetensors files."""

    tensors: int
    bytes: int
    """Bytes of the tensors read, as stored."""
    files: int
    """Files opened."""


def load_weights(hf: HFModel, state: Mapping[str, torch.Tensor]) -> LoadReport:
    """Copy the stored value of every tensor of ``state`` (a rank's own) into it, in place.

    ``state`` maps the model's names (``pipe.state_dict()``) to this rank's materialised
    tensors; each is looked up in the files under its own name or, for a tied weight, any
    other name of the same Parameter, and cast to the tensor's dtype.

    Raises:
        ValueError: naming the tensors the files lack, or a stored shape that differs.
    """
    if not hf.weights:
        return LoadReport(0, 0, 0)
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    missing = []
    for name in state:
        candidates = (name, *(a for a in hf.aliases.get(name, ()) if a != name))
        found = next((a for a in candidates if a in hf.weights), None)
        if found is None:
            missing.append(name)
        else:
            file, stored = hf.weights[found]
            by_file.setdefault(file, []).append((name, stored))
    fused = [n for n in missing if any(n.endswith(f.lstrip(".")) for f in hf.fused)]
    if fused:
        raise ValueError(f"{hf.root}: transformers builds {_few(fused)} at load from several "
                         f"stored tensors (a {type(hf.model).__name__} checkpoint keeps its "
                         "experts apart); pipetrain reads stored tensors one by one and does "
                         "not fuse them. Start from no weights (config and tokenizer only), or "
                         "use an architecture without fused weights")
    if missing:
        raise ValueError(f"{hf.root}: the weights lack {_few(missing)}; is this directory "
                         "from another model than its config.json?")
    read = n_bytes = 0
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            for group in _groups(names, state):  # the file is mapped one group at a time
                with safe_open(str(file), "pt", device="cpu") as f:
                    for name, stored in group:
                        value = f.get_tensor(stored)
                        target = state[name]
                        if tuple(value.shape) != tuple(target.shape):
                            raise ValueError(f"{file}: {stored} has shape "
                                             f"{tuple(value.shape)}, the model's {name} "
                                             f"{tuple(target.shape)}")
                        copy_whole_(target, value)  # a FSDP2 shard takes its slice
                        read, n_bytes = read + 1, n_bytes + value.numel() * value.element_size()
    return LoadReport(read, n_bytes, len(by_file))


MAPPED_BYTES = 256 << 20
"""The file pages a rank keeps mapped while it reads: safetensors maps the file, and the
pages it has read count in the process's resident memory until the file is closed."""


def _groups(names: list[tuple[str, str]], state: Mapping[str, torch.Tensor]
            ) -> list[list[tuple[str, str]]]:
    """``names`` in runs of at most :data:`MAPPED_BYTES` (a larger tensor alone)."""
    groups: list[list[tuple[str, str]]] = [[]]
    size = 0
    for item in names:
        t = state[item[0]]
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > MAPPED_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


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

