"""Meta prefix: an image-text model described on ``meta``, made real beside its language model
while its vision prefix runs on the example (:mod:`pipetrain.split.prefix`).

The capture needs the prefix's outputs on the example: their shapes, and values such as
Qwen2-VL's position ids, which its image grids decide. The prefix needs real modules for that.
:func:`materialize_beside` gives the modules beside the language model (the vision tower, the
projector) and the token embedding the values :class:`~pipetrain.split.lazy.NamedInit` gives
them by name, so they equal what the stage that holds them gets. :func:`to_meta` puts them back
afterwards. A tied weight (a head tied to the embedding) stays one Parameter throughout.
"""

from __future__ import annotations

from torch import nn

from pipetrain.split.lazy import NamedInit

__all__ = ["Holder", "attach", "enclosing_parameters", "holders", "materialize_beside",
           "to_meta"]

Places = list[list[tuple[nn.Module, str]]]
"""Per Parameter that several modules hold: (module, attribute name) of each."""


class Holder(nn.Module):
    """A container of some of a model's modules at their paths that stands for none of the
    model's own (:meth:`~pipetrain.split.lazy.NamedInit.materialize` initialises a plain
    ``nn.Module`` container as the model's module at its path)."""


def attach(root: nn.Module, path: str, value: nn.Module | nn.Parameter,
           container: type[nn.Module] = nn.Module) -> None:
    """``value`` (a module or a parameter) under ``root`` at the dotted ``path``, through
    empty ``container`` s made where there is none."""
    *parents, leaf = path.split(".")
    at = root
    for part in parents:
        if part not in dict(at.named_children()):
            at.add_module(part, container())
        at = at.get_submodule(part)
    if isinstance(value, nn.Parameter):
        at.register_parameter(leaf, value)
    else:
        at.add_module(leaf, value)


def materialize_beside(model: nn.Module, path: str, seed: int,
                       shared: Places) -> dict[str, nn.Module]:
    """The modules beside ``path`` in its parent, and the input embedding, made real (each
    of ``shared`` one Parameter still); by path."""
    parent, _, name = path.rpartition(".")
    inner = model.get_submodule(parent) if parent else model
    made = {f"{parent}.{child}" if parent else child: module
            for child, module in inner.named_children() if child != name}
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(embed, nn.Module) and id(embed) in names:
        made[names[id(embed)]] = embed
    holder = Holder()
    for at, module in made.items():
        attach(holder, at, module, Holder)
    direct = enclosing_parameters(model, path)  # LLaVA-NeXT's image_newline
    for at, p in direct:
        attach(holder, at, p, Holder)
    NamedInit(model, seed).materialize(holder, "cpu")
    for at, _ in direct:  # the model's modules hold the real ones too (put back by to_meta)
        path_of_owner, _, name = at.rpartition(".")
        owner = model.get_submodule(path_of_owner)  # "" is the model itself
        setattr(owner, name, holder.get_parameter(at))
        made[at] = owner
    for places in shared:  # a head tied to the token embedding: the real one in both
        real = [getattr(m, n) for m, n in places if not getattr(m, n).is_meta]
        for m, n in places:
            if real:
                setattr(m, n, real[0])
    return made


def enclosing_parameters(model: nn.Module, path: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters held directly by the modules whose forward encloses the call of ``path``
    (LLaVA-NeXT's ``image_newline``, which its forward writes between image rows)."""
    parts = path.split(".")
    found = []
    for i in range(len(parts)):
        at = ".".join(parts[:i])
        module = model.get_submodule(at) if at else model
        found += [(f"{at}.{n}" if at else n, p) for n, p in module.named_parameters(recurse=False)]
    return found


def to_meta(modules: list[nn.Module], shared: Places) -> None:
    """``modules``' tensors back on ``meta`` (each of ``shared`` one Parameter still)."""
    places = {id(getattr(m, n)): ps for ps in shared for m, n in ps[:1]}
    for module in modules:
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                if not p.is_meta:
                    meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                    for m, n in places.get(id(p), [(sub, name)]):
                        setattr(m, n, meta)
            for name, b in list(sub.named_buffers(recurse=False)):
                setattr(sub, name, b.to("meta"))


def holders(model: nn.Module) -> Places:
    """Per Parameter held by several modules: (module, name) of each."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((module, name))
    return [ps for ps in places.values() if len(ps) > 1]
