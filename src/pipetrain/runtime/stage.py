"""Stage: one model part on one rank, running F, B, I and W for one micro-batch at a time.

A stage keeps, per micro-batch in flight, the leaf tensors it received (their gradients go back
to the previous stage), its outputs (the roots of its backward), and after I the deferred
weight work. Its layers run like ``nn.Sequential``: each layer gets the previous one's output.

With keyed routes (:mod:`pipetrain.runtime.transport.routes`, a traced model) a stage takes several
messages,
merges their dicts into one payload, sends each later stage that uses its values their sub-dict,
and its backward starts from the gradient messages of later stages (values it made, and values
it received that a later stage used too) and returns the gradients of its inputs grouped by
the stage each goes back to.

Layers marked for recomputation (GPipe's re-materialisation, :mod:`pipetrain.runtime.recompute`)
keep only their input in F; right before the backward (the runtime calls
:meth:`Stage.prepare_backward` before it waits for the gradient) they run again from it under
the same RNG state, and B, or I then W, use what that replay saved: one recomputation. When
the stage's last layer is recomputed, the stage keeps its outputs' autograd edges, not their
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain.runtime import rng
from pipetrain.runtime.backward import Gathering, Root, WeightWork, backward_full, backward_input
from pipetrain.runtime.microbatch import batch_size
from pipetrain.runtime.recompute import Replay, segments
from pipetrain.runtime.transport.payload import flatten, unflatten
from pipetrain.runtime.transport.routes import Ports

__all__: list[str] = []

LossFn = Callable[[Any, Any], torch.Tensor]
Incoming = tuple[Sequence[torch.Tensor], Any, Sequence[bool]]  # tensors, spec, requires_grad
Outgoing = tuple[list[torch.Tensor], Any]  # tensors, spec


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]  # leaves; the ones requiring grad get gradients sent back
    outputs: list[Root | None] = field(default_factory=list)  # None: needs no gradient
    weight: WeightWork | None = None
    replays: list[Replay] = field(default_factory=list)
    payload: Any = None  # keyed routes: the received values, to group input gradients by key


class Stage:
    """Layers ``first_layer .. first_layer+len(layers)-1`` of the model, as stage ``index``.

    ``recompute`` is one flag for every layer, or one per layer.
    """

    def __init__(self, index: int, layers: Sequence[nn.Module], *, is_last: bool,
                 loss_fn: LossFn | None, device: torch.device,
                 recompute: bool | Sequence[bool] = False, split_dim: int = 0,
                 ports: Ports | None = None, carry_rng: bool = False) -> None:
        self.index, self.is_last, self.loss_fn, self.device = index, is_last, loss_fn, device
        self.ports = ports  # keyed routes (a traced model); None: a chain of whole payloads
        self.carry_rng = carry_rng  # micro-batches' random streams travel with them (rng.py)
        self.split_dim = split_dim
        flags = ([recompute] * len(layers) if isinstance(recompute, bool)
                 else [bool(f) for f in recompute])
        if len(flags) != len(layers):
            raise ValueError(f"stage {index} has {len(layers)} layers but {len(flags)} "
                             "recompute flags; give one per layer")
        self.module = nn.Sequential(*layers)
        self.segments = segments(list(layers), flags)
        self.recompute = any(flags)
        self._edges_only = bool(flags) and flags[-1]  # outputs made by a recomputed layer
        self._flight: dict[int, _InFlight] = {}
        self.gathering: Gathering | None = None  # set by a resharding ``parallelize``
        self.compiled: Callable[[Any], Any] | None = None  # compiled layers (compiled.py)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def forward(self, mb: int, inputs: Sequence[Incoming], target: Any = None,
                weight: float = 1.0, track: bool = True, rng_start: str | None = None
                ) -> tuple[list[Outgoing], torch.Tensor | None, Any]:
        """F: run the layers on one micro-batch.

        ``inputs`` holds one ``(tensors, spec, requires_grad)`` per message of
        ``ports.act_in`` (a chain's single input otherwise). Returns ``(sends, loss, raw
        output)``: one ``(tensors, spec)`` per message of ``ports.act_out`` (a chain's single
        output), the weighted loss on the last stage, and the model output (for ``outputs=``).
        ``rng_start`` is stage 0's random state of the micro-batch (:mod:`pipetrain.runtime.rng`).
        """
        dev = self.device
        leaves: list[torch.Tensor] = []
        replays: list[Replay] = []
        payload: Any = {}
        with torch.set_grad_enabled(track):
            for tensors, spec, requires_grad in inputs:
                group = [_leaf(t, rg and track, dev) for t, rg in zip(tensors, requires_grad)]
                leaves += group
                if self.ports is None:
                    payload = unflatten(group, spec)
                else:
                    payload.update(unflatten(group, spec))
            payload, state = self._take_rng(payload, rng_start)
            if state is None:
                out = self._layers(payload, replays if track else None)
            else:
                ended: list[str] = []
                with rng.stream(dev, state, ended):
                    out = self._layers(payload, replays if track else None)
                state = ended[0]
            loss = None
            sends: list[Outgoing] = []
            if self.is_last and self.loss_fn is not None and target is not None:
                _check_rows(out, target, self.split_dim)
                loss = self.loss_fn(out, _to_device(target, dev)) * weight
                roots: list[torch.Tensor] = [loss]
            elif self.ports is None or self.is_last:
                sends.append(flatten(out if state is None or self.is_last
                                     else {rng.KEY: state, "x": out}))
                roots = sends[0][0]
            else:
                sends = [flatten({k: state if rng.is_key(k) else out[k] for k in keys or ()})
                         for _, keys in self.ports.act_out]
                roots = [t for _, keys in self.ports.grad_in for t in flatten(
                    {k: payload[k] if k in payload else out[k] for k in keys or ()})[0]]
        if track:
            self._flight[mb] = _InFlight(leaves, [self._root(t) for t in roots],
                                         replays=replays,
                                         payload=None if self.ports is None else payload)
        return sends, loss, out

    def _take_rng(self, payload: Any, start: str | None) -> tuple[Any, str | None]:
        """The payload without the micro-batch's carried random state, and that state (None
        where this stage runs on the process's own generator)."""
        if not self.carry_rng:
            return payload, None
        if self.index == 0:
            return payload, start
        if self.ports is None:  # a chain: every message wraps the payload with the state
            return payload["x"], payload[rng.KEY]
        keys = [k for k in payload if rng.is_key(k)]
        return payload, (payload.pop(keys[0]) if keys else None)

    def _layers(self, x: Any, replays: list[Replay] | None) -> Any:
        if self.compiled is not None:
            return self.compiled(x)
        if replays is None or not self.recompute:
            return self.module(x)
        for segment in self.segments:
            if segment.recompute:
                replays.append(Replay(segment, x, self.device))
                x = replays[-1].forward(x)
            else:
                x = segment.run(x)
        return x

    def _root(self, t: torch.Tensor) -> Root | None:
        if not t.requires_grad:
            return None
        if self._edges_only and t.grad_fn is not None and t.numel() != 1:
            return get_gradient_edge(t)
        return t

    def prepare_backward(self, mb: int) -> None:
        """Recompute the layers of ``mb`` whose activations F dropped (no-op otherwise)."""
        state = self._flight.get(mb)
        if state is not None:
            for replay in state.replays:
                replay.replay()

    def backward(self, mb: int, grads: Sequence[Sequence[torch.Tensor | None]],
                 split: bool) -> list[list[torch.Tensor | None]]:
        """B (``split=False``) or I (``split=True``): gradients w.r.t. this stage's inputs.

        ``grads`` holds the gradients of one message of ``ports.grad_in`` each (a chain's
        single output gradient otherwise; nothing on the last stage, whose scalar output is
        the loss); an output without a gradient did not influence the loss. Returns one list
        of input gradients per message of ``ports.grad_out`` (a chain's single one).
        """
        self.prepare_backward(mb)
        state = self._flight[mb]
        if self.is_last:
            out_grads: Sequence[torch.Tensor | None] = [None] * len(state.outputs)
            roots = state.outputs
        else:  # a None gradient never seeds a scalar output here: only the loss is seeded
            out_grads = grads[0] if len(grads) == 1 else [g for group in grads for g in group]
            if len(out_grads) != len(state.outputs):
                raise ValueError(f"stage {self.index} mb {mb}: {len(out_grads)} gradients "
                                 f"arrived for {len(state.outputs)} outputs")
            roots = [y if g is not None else None for y, g in zip(state.outputs, out_grads)]
        if split:
            got, state.weight = backward_input(roots, out_grads, state.inputs)
        else:
            _last_use(state.replays)
            got = backward_full(roots, out_grads, state.inputs)
        state.outputs = []
        result = [g if x.requires_grad else None for g, x in zip(got, state.inputs)]
        payload, state.payload = state.payload, None
        if not split:
            del self._flight[mb]
        if self.ports is None:
            return [result]
        grad_of = {id(x): g for x, g in zip(state.inputs, result)}
        return [[grad_of[id(t)] for t in flatten({k: payload[k] for k in keys or ()})[0]]
                for _, keys in self.ports.grad_out]

    def weight(self, mb: int) -> None:
        """W: the weight gradients deferred by I."""
        state = self._flight.pop(mb)
        if state.weight is not None:
            _last_use(state.replays)
            state.weight.run(self.gathering)

    def clear(self) -> None:
        self._flight.clear()


def _last_use(replays: list[Replay]) -> None:
    for replay in replays:
        replay.last_use = True


def _to_device(obj: Any, device: torch.device) -> Any:
    tensors, spec = flatten(obj)
    return unflatten([t.to(device) for t in tensors], spec)


def _leaf(t: torch.Tensor, requires_grad: bool, device: torch.device) -> torch.Tensor:
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _check_rows(out: Any, target: Any, dim: int) -> None:
    """Outputs and targets of one micro-batch must agree on its size (when both have one)."""
    if isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor):  # the usual case
        if out.dim() and target.dim() and -out.dim() <= dim < out.dim() \
                and -target.dim() <= dim < target.dim():
            rows, wanted = out.shape[dim], target.shape[dim]
        else:
            return  # no size to compare: leave it to the loss function
    else:
        try:
            rows, wanted = batch_size(out, dim), batch_size(target, dim)
        except (ValueError, IndexError):
            return  # no single batch size to compare: leave it to the loss function
    if rows != wanted:
        raise ValueError(f"the model output has {rows} rows along dim {dim} but the targets have "
                         f"{wanted}: pass targets with the same batch size as the inputs")
