"""RNG: the random state a micro-batch's forward carries from stage to stage, as on one device.

On one device, micro-batch i's forward runs every layer in turn on one generator: the dropout of
layer 5 draws right after the dropout of layer 4 of the same micro-batch. A pipeline runs stage
k of micro-batch i between other micro-batches' stages, so a shared generator would hand each
layer other numbers than one device does (wrong masks, wrong gradients, no error). Instead each
micro-batch has its own stream, and it travels with the activations::

    step start (stage 0's rank):  base <- one draw of the process's generator
    F(0, i):   generator := start(base, i);  run;  state_i <- generator     (then restored)
    F(k, i):   generator := state_i from the previous stage that draws;  run;  ...

So stage k's dropout draws exactly what it draws on one device when micro-batch i's forward
starts from ``start(base, i)`` (:func:`pipetrain.testing.reference_step` with ``rng=True``
does that), whatever the schedule, the number of stages or where the cuts are. The process's
own generator is put back after each forward; only the one draw of ``base`` advances it.

A state is the stage's device generator (the CPU's, or the CUDA device's) as text, so it is a
plain payload value and crosses any transport. Only models that draw pay for it: a captured
graph draws when it holds an op tagged ``nondeterministic_seeded`` whose dropout probability is
not zero (:func:`graph_draws`); a layer list when a layer holds a dropout module or a dropout
probability above 0 (:func:`module_draws`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from pipetrain.runtime.torch_private import DropoutNd, op_schema

__all__: list[str] = []

KEY = "rng@"
"""Payload keys of carried states (``rng@3``: the state after traced part 3), and the key of
a chain's wrapped payload."""


def key(part: int) -> str:
    return f"{KEY}{part}"


def is_key(name: str) -> bool:
    return name.startswith(KEY)


def draw_base() -> int:
    """One draw of the process's CPU generator: the seed of a step's micro-batch streams."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def start(base: int, mb: int, device: torch.device) -> str:
    """Micro-batch ``mb``'s state at the start of its forward: the generator of ``device``
    seeded with ``base + mb``."""
    g = torch.Generator(device) if device.type == "cuda" else torch.Generator()
    g.manual_seed(base + mb)
    return _text(g.get_state())


def get(device: torch.device) -> str:
    """The state of ``device``'s default generator, as text."""
    if device.type == "cuda":
        return _text(torch.cuda.get_rng_state(device))
    return _text(torch.get_rng_state())


def put(device: torch.device, state: str) -> None:
    """Set ``device``'s default generator to ``state`` (from :func:`get` or :func:`start`)."""
    raw = torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8)
    if device.type == "cuda":
        torch.cuda.set_rng_state(raw, device)
    else:
        torch.set_rng_state(raw)


@contextmanager
def stream(device: torch.device, state: str, out: list[str]) -> Iterator[None]:
    """Run the block on ``state``; append the state it ends with to ``out``; then put the
    process's own generator back."""
    own = get(device)
    put(device, state)
    try:
        yield
        out.append(get(device))
    finally:
        put(device, own)


def _text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


# -- who draws ----------------------------------------------------------------------------
_OFF = {"p": 0.0, "dropout_p": 0.0, "train": False}  # arguments that make a draw a no-op


def node_draws(node: fx.Node) -> bool:
    """Whether an op of a captured graph draws random numbers when it runs."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(
            target, "tags", ()):
        return False
    schema = op_schema(target)
    if schema is None:
        return True
    values: dict[str, Any] = {a.name: a.default_value if a.has_default_value() else None
                              for a in schema.arguments}
    values.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    values.update(node.kwargs)
    return not any(name in values and values[name] == off for name, off in _OFF.items())


def graph_draws(module: nn.Module) -> bool:
    """Whether a stage of a captured graph (its subgraphs included) draws random numbers."""
    graphs = [m.graph for m in module.modules() if isinstance(m, fx.GraphModule)]
    return any(node_draws(n) for g in graphs for n in g.nodes)


_RANDOM_MODULES = (DropoutNd, nn.RReLU)


def module_draws(module: nn.Module) -> bool:
    """Whether a layer may draw in training: it holds a dropout module with p > 0 or RReLU, or
    a module keeps a float named like ``dropout`` above 0 (the probability a ``forward`` that
    calls ``F.dropout`` itself passes: Hugging Face's ``attention_dropout``, GPT's ``dropout``).

    Other random calls in a layer's own ``forward`` are not seen here: pass ``rng=True``."""
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, _RANDOM_MODULES) and getattr(m, "p", 1.0) != 0.0:
            return True
        if any("dropout" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items()):
            return True
    return False
