"""Vision prefix: an image-text model's forward up to its language model, run eagerly in stage 0.

An image-text-to-text model (LLaVA, Qwen2-VL, Gemma 3, PaliGemma, ...) encodes its images,
projects them, writes them over the image placeholders of the embedded text, for Qwen2-VL
computes 3-D position ids from the image grids, and only then calls its ``language_model``.
The vision part's shapes depend on its inputs' values (Qwen2-VL splits its patches by
``image_grid_thw.tolist()``), which torch.export cannot capture, and how many image tokens a
row holds changes from batch to batch. So pipetrain captures such a model from its language
model on (:func:`vision_prefix` finds one):

* :class:`VisionPrefix` runs the model's own ``forward`` as Python up to the call of its
  ``language_model`` and records that call's arguments; what it returns are the arguments of
  the model's ``forward`` that stand for them (``inputs_embeds`` for the token ids and the
  images, ``position_ids``, Mllama's ``cross_attention_states``), with the user's other
  arguments (the 2-D ``attention_mask``, ``token_type_ids``, ``labels``) as given;
* the capture is taken of the model called with those, so the graph holds the language model,
  the head and the loss, cut between decoder layers as for a text model;
* stage 0 runs the prefix on each micro-batch before its graph (:class:`Prefixed`), and
  autograd through that eager run gives the vision tower, the projector and the embedding
  their gradients (their modules are stage 0's, under the model's names).

A batch of such a model is not split by rows alone: Qwen2-VL's ``pixel_values`` holds every
image's patches one after another. :meth:`VisionPrefix.split` gives each micro-batch its rows
and the images whose placeholders those rows hold (see its docstring).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.runtime import microbatch
from pipetrain.split.inputs import Packed
from pipetrain.split.lazy import is_meta
from pipetrain.split.prefix_images import is_visual, split_images, tokens_per_image
from pipetrain.split.prefix_meta import (
    Holder,
    attach,
    enclosing_parameters,
    holders,
    materialize_beside,
    to_meta,
)

__all__ = ["Prefixed", "VisionPrefix", "vision_prefix"]

_FROM_CALL = ("inputs_embeds", "position_ids", "cross_attention_states",
              "cross_attention_mask", "full_text_row_masked_out_mask")
"""Arguments of the language model's call that stand in for the images in the capture."""
_LANGUAGE = ("language_model", "text_model")
"""What image-text models call their language model (``text_model``: Idefics3, SmolVLM)."""
_TYPED = ("token_type_ids", "mm_token_type_ids")
"""Arguments with which a model's masks let image tokens attend both ways (Gemma 3,
PaliGemma): transformers builds those masks with ``torch.vmap``, which a captured graph cannot
run, and PaliGemma lets them so only on a call that shows its images (``pixel_values``, which
the capture is not given), so the capture takes the masks the prefix's run built
(``attention_mask``: a 4-D mask, or a dict of them, which these models' forward accepts)
instead of building them itself."""
_DEEPSTACK = ("deepstack_visual_embeds", "visual_pos_masks")
"""What Qwen3-VL's forward hands its language model beside the embedded ids (the vision
tower's features of its earlier layers, added to the first decoder layers' outputs at the
image tokens), which that forward does not take."""
_FEATURES = "BaseModelOutputWithDeepstackFeatures"
"""The output type a deepstack model's ``mm_encoder_outputs`` holds (in its modeling module)."""
_GROUPS = (("pixel_values", "image_grid_thw", "image_token_id", "image_token_index"),
           ("pixel_values_videos", "video_grid_thw", "video_token_id", "video_token_index"))
"""Per kind of visual input: its pixels, its grid, the config's placeholder token names."""


class _Reached(Exception):  # noqa: N818  (control flow, never seen by a user)
    """Raised in the language model's pre-hook to stop the forward there."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("language model reached")
        self.kwargs = kwargs


def vision_prefix(model: nn.Module, example: dict[str, Any], seed: int = 0
                  ) -> VisionPrefix | None:
    """The prefix of an image-text model (one whose ``forward`` takes ``pixel_values``, that
    holds a ``language_model`` or ``text_model`` and whose config names an image placeholder
    token), else None.

    On ``meta``, the modules beside the language model (the vision tower, the projector) and
    the token embedding are made real for the prefix to run on ``example``, and put back on
    ``meta`` after (:mod:`pipetrain.split.prefix_meta`, under ``seed``).

    Raises:
        PartitionError: for a model on ``meta`` with an example on ``meta``.
    """
    params = inspect.signature(model.forward).parameters
    lm = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in _LANGUAGE]
    config = getattr(model, "config", None)
    placeholder = any(getattr(config, t, None) is not None for group in _GROUPS for t in group[2:])
    if "pixel_values" not in params or not lm or not placeholder or not isinstance(example, dict):
        return None  # (two towers side by side, as CLIP's, have no image placeholder)
    path = min(lm, key=len)
    if not is_meta(model):
        prefix = VisionPrefix(model, path, example)
        prefix.captured_with = prefix.example(example)
        return prefix
    if any(torch.is_tensor(v) and v.is_meta for v in example.values()):
        raise PartitionError(
            f"{type(model).__name__} is an image-text model on the meta device: its vision "
            "prefix runs on example_inputs, which must be real tensors")
    shared = holders(model)  # a tied weight is one Parameter in several modules
    made = materialize_beside(model, path, seed, shared)
    prefix = VisionPrefix(model, path, example)
    prefix.captured_with = prefix.example(example)
    to_meta(list(made.values()), shared)  # the stage holding them makes them real again
    for name, p in enclosing_parameters(model, path):  # the model's own (new) meta ones
        attach(prefix, name, p, Holder)
    return prefix


class VisionPrefix(nn.Module):
    """``model.forward`` up to ``model.<path>(...)``, eager (see the module).

    Holds as submodules, under the model's own paths, the modules that part of the forward
    runs (the vision tower, the projector, the token embedding), so that stage 0 holds their
    parameters; the model itself is kept outside the module tree."""

    def __init__(self, model: nn.Module, path: str, example: dict[str, Any]) -> None:
        super().__init__()
        self.path = path
        object.__setattr__(self, "_model", model)  # not a submodule: stage 0 holds a part
        self._signature = inspect.signature(model.forward)
        self.given = tuple(example)
        """The arguments the example gave, in order."""
        self.captured_with: dict[str, Any] = {}
        """What the model is captured with: the prefix's outputs on the example."""
        self.ran, call = _modules_run(model, path, example)
        params = self._signature.parameters
        self.dropped = sorted(k for k, v in call.items()
                              if k not in params and _holds_tensor(v))
        """Tensors the language model's call takes that the model's forward does not: the
        capture goes without them, and computes the same only if the model makes them again
        from what it is given (Mllama's row mask, from its ``cross_attention_mask``)."""
        self.encoded = set(self.dropped) == set(_DEEPSTACK) and "mm_encoder_outputs" in params
        """Qwen3-VL: the graph takes the token ids and the vision tower's outputs as the
        forward's ``mm_encoder_outputs`` (:func:`encoder_outputs`), and makes the deepstack
        features its language model takes itself."""
        if self.encoded:
            self.dropped = []
        for name in self.ran:
            attach(self, name, model.get_submodule(name), Holder)
        for name, p in enclosing_parameters(model, path):  # LLaVA-NeXT's image_newline
            attach(self, name, p, Holder)

    @property
    def whole(self) -> nn.Module:
        """The model (kept outside the module tree)."""
        model: nn.Module = self.__dict__["_model"]
        return model

    def payload(self, inputs: Any) -> Packed:
        """Stage 0's payload for a step's ``inputs``: keyword arguments (a dict), positional
        ones (a tuple) or the first argument, bound to the model's ``forward``.

        Raises:
            ValueError: when they do not fit ``forward``.
        """
        if isinstance(inputs, Packed):
            return inputs
        try:
            bound = (self._signature.bind(**inputs) if isinstance(inputs, dict) else
                     self._signature.bind(*inputs) if isinstance(inputs, tuple) else
                     self._signature.bind(inputs))
        except TypeError as e:
            raise ValueError(f"the inputs do not fit {type(self.whole).__name__}.forward: {e}; "
                             f"the model was captured with {list(self.given)}") from None
        return Packed(bound.arguments)

    def example(self, example: dict[str, Any]) -> dict[str, Any]:
        """What the capture is taken with for ``example``: the prefix's outputs, detached."""
        with torch.no_grad():
            out = self(self.payload(example))
        return {k: v.detach() if torch.is_tensor(v) else v for k, v in out.items()}

    def forward(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The arguments for the captured model in place of ``payload``'s images and ids."""
        call = self.reach(payload)
        if self.encoded:
            kept = {k: v for k, v in payload.items() if not is_visual(k)}
            kept["position_ids"] = call["position_ids"]
            if kept["position_ids"] is None:  # no image: the positions count along each axis
                ids = payload["input_ids"]
                axes = self.captured_with["position_ids"].shape[0] if self.captured_with else 3
                kept["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(
                    axes, *ids.shape)
            kept["mm_encoder_outputs"] = encoder_outputs(self.whole, payload, call)
            return kept
        embedded = torch.is_tensor(call.get("inputs_embeds"))  # else the ids (Mllama)
        kept = {k: v for k, v in payload.items()
                if not is_visual(k) and not (embedded and k == "input_ids")}
        params = self._signature.parameters
        for name in _FROM_CALL:
            if name in params and name not in kept and torch.is_tensor(call.get(name)):
                kept[name] = call[name]
        mask = call.get("attention_mask")
        built = isinstance(mask, dict) or torch.is_tensor(mask) and mask.dim() == 4
        if built and any(k in payload for k in _TYPED):
            kept["attention_mask"] = mask  # the model's own masks, images seen both ways
        if "use_cache" in params and "use_cache" not in kept:
            kept["use_cache"] = False  # a pipeline passes no KV cache between steps
        return kept

    def reach(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments the model's forward passes its language model for
        ``payload``."""
        call = _run_to(self.whole, self.path, dict(payload))
        if not any(torch.is_tensor(call.get(k)) for k in ("inputs_embeds", "input_ids")):
            raise PartitionError(
                f"{type(self.whole).__name__} calls {self.path} with neither inputs_embeds nor "
                "input_ids; pipetrain captures an image-text model from its text on")
        return call

    def split(self, payload: dict[str, Any], m: int, dim: int = 0) -> list[dict[str, Any]]:
        """``payload`` in ``m`` micro-batches of rows, each with the images its rows show.

        Rows are split as :func:`~pipetrain.runtime.microbatch.split` splits them. The visual
        tensors (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...) go by rows when
        each has one entry per row and nothing describes single images (no grid, no
        ``image_sizes``), and every row shows as many placeholders or its images have an axis
        of their own (Idefics3, Mllama). Else, as many images as rows, each row showing
        placeholders, is one image a row, of any size. Else images belong to rows in the order
        of their placeholder tokens, an image filling as many placeholders as its grid says
        (Qwen2-VL's ``t * h * w / merge**2``; its patches are ``t * h * w`` rows of
        ``pixel_values``) or, without a grid, an equal share of the batch's placeholders.

        Raises:
            ValueError: when the placeholders do not match the images.
        """
        if dim != 0 or "input_ids" not in payload:
            return microbatch.split(payload, m, dim)
        ids = payload["input_ids"]
        rows = microbatch.sizes(ids.shape[0], m)
        if rows and min(rows) < 1:
            return microbatch.split(payload, m, dim)  # its error names the sizes
        plain = {k: v for k, v in payload.items() if not is_visual(k)}
        parts = microbatch.split(Packed(plain), m, dim) if plain else [{} for _ in rows]
        for pixels, grid, *tokens in _GROUPS:
            if pixels in payload:
                per_row = self._images_per_row(payload, pixels, grid, tokens)
                split_images(payload, pixels, grid, per_row, rows, parts,
                              self._shown(payload, tokens, rows))
        # in the order of forward's arguments, as the capture bound them
        return [Packed({k: part[k] for k in payload if k in part}) for part in parts]

    def _placeholder(self, tokens: list[str]) -> Any:
        """The placeholder token id the config names under one of ``tokens``, else None."""
        config = getattr(self.whole, "config", None)
        return next((getattr(config, t) for t in tokens if getattr(config, t, None)
                     is not None), None)

    def _shown(self, payload: dict[str, Any], tokens: list[str], rows: list[int]
               ) -> list[bool]:
        """Per micro-batch, whether its rows show a placeholder of ``tokens``' kind, or
        cross-attend to their images whatever their tokens (Mllama: every micro-batch takes
        its image slots)."""
        token = self._placeholder(tokens)
        if token is None or "cross_attention_mask" in payload:
            return [True] * len(rows)
        counts = (payload["input_ids"] == token).sum(dim=1)
        bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
        return [bool(counts[a:b].any()) for a, b in zip(bounds, bounds[1:])]

    def _images_per_row(self, payload: dict[str, Any], pixels: str, grid: str,
                        tokens: list[str]) -> list[int] | None:
        """How many images each row shows (None: the visual tensors go by rows)."""
        token = self._placeholder(tokens)
        ids = payload["input_ids"]
        if token is None:
            return None
        counts = [int(c) for c in (ids == token).sum(dim=1)]
        n_rows, images = ids.shape[0], payload[pixels]
        by_rows = all(torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n_rows
                      for k, v in payload.items() if is_visual(k) and k.startswith(pixels[:5]))
        per_image = grid in payload or "image_sizes" in payload  # a row per image
        if by_rows and not per_image and (len(set(counts)) == 1 or images.dim() >= 5):
            return None  # a row's images on an axis of their own (Idefics3, Mllama)
        if grid not in payload and images.shape[0] == n_rows and min(counts) > 0:
            return [1] * n_rows  # as many images as rows, each showing one: of any size
        need = tokens_per_image(self.whole, payload, pixels, grid, sum(counts))
        per_row, i = [], 0
        for r, count in enumerate(counts):
            n = 0
            while count > 0 and i < len(need):
                count -= need[i]
                i, n = i + 1, n + 1
            if count != 0:
                raise ValueError(
                    f"row {r} of input_ids holds placeholders that do not fit the images of "
                    f"{pixels} in order ({[int(c) for c in need]} tokens each); give each row "
                    "the placeholders its images fill (the model's processor writes them)")
            per_row.append(n)
        if i != len(need):
            raise ValueError(f"{len(need)} images in {pixels} but the rows' placeholders "
                             f"fill only {i}; give as many images as placeholders")
        return per_row


def encoder_outputs(model: nn.Module, payload: dict[str, Any], call: dict[str, Any]
                    ) -> dict[str, Any]:
    """A deepstack model's ``mm_encoder_outputs`` for the images its language model's ``call``
    shows: the image rows of ``inputs_embeds`` as the pooled features, and the call's
    deepstack features, each one tensor (an empty one where no row shows an image), so that
    every micro-batch gives the graph the same structure.

    Raises:
        PartitionError: for videos (their rows are not told apart from the images' yet).
    """
    import sys

    if "pixel_values_videos" in payload:
        raise PartitionError(f"{type(model).__name__} with videos: its deepstack features of "
                             "images and videos are not told apart yet; give images only")
    embeds = call["inputs_embeds"]
    mask = call.get("visual_pos_masks")
    deep = call.get("deepstack_visual_embeds")
    if mask is None or deep is None:
        config: Any = getattr(model, "config", None)
        layers = len(config.vision_config.deepstack_visual_indexes)
        mask = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        deep = [embeds.new_zeros(0, embeds.shape[-1]) for _ in range(layers)]
    output = next(getattr(sys.modules[type(m).__module__], _FEATURES) for m in model.modules()
                  if hasattr(sys.modules[type(m).__module__], _FEATURES))  # the model's own
    return {"image": output(pooler_output=(embeds[mask],),
                            deepstack_features=[(d,) for d in deep])}


def _run_to(model: nn.Module, path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run ``model(**kwargs)`` until it calls the module at ``path``; that call's keyword
    arguments."""
    def stop(_: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if args:
            raise PartitionError(f"{type(model).__name__} calls {path} with positional "
                                 "arguments; pipetrain reads that call's keywords")
        raise _Reached(dict(kw))

    handle = model.get_submodule(path).register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(**kwargs)
    except _Reached as reached:
        return reached.kwargs
    finally:
        handle.remove()
    raise PartitionError(f"{type(model).__name__}.forward never called {path}")


def _holds_tensor(value: Any) -> bool:
    return torch.is_tensor(value) or (isinstance(value, (list, tuple)) and
                                      any(torch.is_tensor(v) for v in value))


def _modules_run(model: nn.Module, path: str, example: dict[str, Any]
                 ) -> tuple[list[str], dict[str, Any]]:
    """The outermost modules the forward runs before it calls ``path`` (the model and the
    modules whose forward encloses that call left out), and that call's keywords."""
    ran: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    parts = path.split(".")
    enclosing = {".".join(parts[:i]) for i in range(len(parts) + 1)}  # "" ... path

    def seen(module: nn.Module, *_: Any) -> None:
        name = names.get(id(module))
        if name is not None and name not in enclosing and name not in ran:
            ran.append(name)

    handles = [m.register_forward_pre_hook(seen) for m in model.modules()]
    try:
        with torch.no_grad():
            call = _run_to(model, path, dict(example))
    finally:
        for h in handles:
            h.remove()
    return [n for n in ran if not any(n.startswith(o + ".") for o in ran if o != n)], call


class Prefixed(nn.Module):
    """Stage 0 of an image-text model: the prefix, then the captured graph's first stage
    (``pack``: the capture's, binding the prefix's outputs as at capture); ``evaluating``:
    the eval graph's, which runs the prefix's modules in eval mode."""

    def __init__(self, prefix: VisionPrefix, stage: nn.Module, pack: Any,
                 evaluating: bool = False) -> None:
        super().__init__()
        self.prefix, self.stage = prefix, stage
        self.pack, self.evaluating = pack, evaluating

    def forward(self, payload: dict[str, Any]) -> Any:
        if not self.evaluating:
            return self.stage(self.pack(**self.prefix(payload)))
        flags = [(m, m.training) for m in self.prefix.modules()]
        self.prefix.eval()
        try:
            return self.stage(self.pack(**self.prefix(payload)))
        finally:
            for m, flag in flags:
                m.training = flag
