"""Weight versions: the parameters each forward and backward runs on under PipeDream-2BW.

The model's parameters (``P``, what the user's optimizer steps) stay where they are; a
version is a set of leaf tensors sharing the storage ``P`` had when its step began. Before an
F or B, the executor swaps the leaves of the action's version into the stage's modules, so the
forward records them and the backward accumulates its gradients on them, each version's apart::

    step t:   F(t, j) on version t         B(t-1, j) on version t-1 (finishing step t-1)
    end of t: version t-1 is done: its storage takes a copy of version t and becomes P's,
              its gradients become P.grad; the user's optimizer.step() then turns P into
              version t+1 = version t - lr * grad(version t-1)
    step t+1: version t+1's leaves share P's storage; version t's stay for step t's tail

So two versions live at once (the paper's two buffered weights), one weight copy per step is
made, and any ``torch.optim`` optimizer, its state keyed by ``P`` as always, applies the rule
W(t+1) = W(t) - lr * grad f(W(t-1)) (Narayanan et al., PipeDream-2BW, ICML 2021).

PipeDream's weight stashing (SOSP 2019) updates a stage after every backward instead: the
version a forward uses is a copy of ``P`` made at its first use, kept (stashed) while a
micro-batch forwarded on it is in flight; after each B, ``P.grad`` takes that micro-batch's
gradient on its version, the stage's own optimizer steps ``P``, and the next forward copies
the result. A stage holds the versions of its micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipetrain.runtime.stage import Stage
from pipetrain.runtime.torch_private import parameters_dict

__all__: list[str] = []

Slot = tuple[dict[str, nn.Parameter | None], str, nn.Parameter]  # where a parameter is held


class Versions:
    """The weight versions of the stages one process holds (local mode: all of them)."""

    def __init__(self, stages: dict[int, Stage],
                 optimizers: dict[int, torch.optim.Optimizer] | None = None) -> None:
        self.slots: dict[int, list[Slot]] = {s: list(_slots(st.module))
                                             for s, st in stages.items()}
        self.leaves: dict[int, dict[int, torch.Tensor]] = {}
        """Per version, per ``id(P)``: the leaf its actions run on."""
        self.optimizers = optimizers
        """PipeDream (weight stashing): each stage's optimizer, stepped after each of its B;
        None: PipeDream-2BW, the user steps after each step."""
        self.users: dict[tuple[int, int], int] = {}  # (stage, version): micro-batches on it
        self.installed: dict[int, int] = {}  # stage -> the version now in its modules
        self.gave_grads = False
        """Whether the last step ended with gradients (of the step before it) in ``.grad``:
        not after a first step, which fills the pipeline."""

    def use(self, stage: int, version: int, forward: bool = False) -> None:
        """Put ``version``'s leaves into ``stage``'s modules (made from P when first used);
        ``forward``: a micro-batch starts on it."""
        if forward:
            self.users[stage, version] = self.users.get((stage, version), 0) + 1
        if self.installed.get(stage) == version:
            return
        leaves = self.leaves.get(version)
        if leaves is None:
            leaves = self.leaves[version] = {}
        for held, name, p in self.slots[stage]:
            leaf = leaves.get(id(p))
            if leaf is None:
                # .data, not detach(): the leaf shares P's storage (a copy of it when P is
                # stepped while it lives) but not its version counter, so the optimizer's
                # in-place step on P is not taken for a change of what its backward saved
                leaf = leaves[id(p)] = nn.Parameter(
                    p.data if self.optimizers is None else p.data.clone(), requires_grad=True)
            held[name] = leaf  # type: ignore[assignment]
        self.installed[stage] = version

    def finished(self, stage: int, version: int,
                 ready: Callable[[int], None] | None = None) -> None:
        """A micro-batch of ``stage`` on ``version`` ended its B. PipeDream: step the stage's
        optimizer with its gradient (``ready(stage)`` first: ``on_grads_ready``, where data
        parallelism averages it), and drop the version once none is left on it."""
        left = self.users.pop((stage, version), 1) - 1
        if left:
            self.users[stage, version] = left
        if self.optimizers is None:
            return
        leaves = self.leaves[version]
        for held, name, p in self.slots[stage]:  # P back in the modules, with the gradient
            leaf = leaves[id(p)]
            p.grad, leaf.grad = leaf.grad, None
            held[name] = p
        self.installed.pop(stage, None)
        if ready is not None:
            ready(stage)
        optimizer = self.optimizers[stage]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not left:
            for _, _, p in self.slots[stage]:
                del leaves[id(p)]
            if not leaves:
                del self.leaves[version]

    def end_step(self, version: int, keep: bool = False) -> None:
        """After step ``version``: P holds version ``version``'s values in storage of its own
        and, as ``.grad``, the gradients of version ``version - 1``, now complete; the
        modules hold P again. (PipeDream: P is the newest version already.)"""
        if self.optimizers is not None:
            self.gave_grads = False
            self.restore()
            return
        done = self.leaves.pop(version - 1, {})
        self.gave_grads = bool(done)
        current = self.leaves.get(version, {})
        for p in self._params():
            leaf, old = current.get(id(p)), done.get(id(p))
            if leaf is not None and not keep:  # P's storage is the version's: give P its own
                # (``keep``: a refill, whose version was restored apart from P)
                spare = old.data if old is not None else torch.empty_like(p)
                with torch.no_grad():
                    spare.copy_(leaf)
                p.data = spare
            p.grad = None if old is None else old.grad
        self.restore()

    def restore(self) -> None:
        """Put P back into every module (what the user and checkpoints see)."""
        for slots in self.slots.values():
            for held, name, p in slots:
                held[name] = p
        self.installed.clear()

    def _params(self) -> Iterable[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for slots in self.slots.values():
            for _, _, p in slots:
                seen.setdefault(id(p), p)
        return seen.values()


def _slots(module: nn.Module) -> Iterable[Slot]:
    """Every trainable parameter's holder, name and value (a tied one once per holder)."""
    for sub in module.modules():
        held = parameters_dict(sub)
        for name, p in held.items():
            if p is not None and p.requires_grad:
                yield held, name, p
