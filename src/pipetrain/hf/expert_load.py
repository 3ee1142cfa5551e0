"""Expert load: how many tokens each expert of each MoE layer was sent, per training step.

A router sends every token to its top ``k`` experts; an expert that gets many more than the
mean is the one every other waits for (and, in models with a capacity, the one that drops
tokens: none of transformers' MoEs that pipetrain trains has one, they are dropless). The
count is taken where the experts are called, from ``top_k_index``:

- under expert parallelism by the experts module itself (:mod:`pipetrain.hf.expert_parallel`
  hands it every call);
- otherwise by a tap put into the captured stage graph, on the experts' ``top_k_index``
  (:meth:`ExpertLoad.tap`), which passes the tensor through unchanged.

Only the forward of a training step counts (``when``, and :attr:`ExpertLoad.on`): a
recomputed layer's replay before its backward, and eval steps, do not. Counts are (token,
expert) pairs, so a layer's total is ``k`` times its tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn

__all__ = ["ExpertLoad", "summarize"]


class ExpertLoad:
    """Per layer (in ``paths`` order) and expert, the (token, expert) pairs of a step.

    Args:
        paths: the experts modules' paths, one per MoE layer, in the model's order.
        experts: experts per layer.
        when: counts only while it returns True (the executor is running an F).
    """

    def __init__(self, paths: list[str], experts: int,
                 when: Callable[[], bool] | None = None) -> None:
        self.rows = {p: i for i, p in enumerate(paths)}
        self.experts, self.when = experts, when
        self.on = False
        """Counting (the trainer turns it on for a training step's ``pipe.step``)."""
        self.counts = torch.zeros(len(paths), experts, dtype=torch.int64)

    def __call__(self, path: str, index: torch.Tensor) -> None:
        if not self.on or (self.when is not None and not self.when()):
            return
        if self.counts.device != index.device:
            self.counts = self.counts.to(index.device)
        ids = index.detach().reshape(-1)
        self.counts[self.rows[path]] += torch.bincount(ids, minlength=self.experts)[
            :self.experts]

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count while the body (a training step) runs."""
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def take(self) -> torch.Tensor:
        """The counts so far (layers x experts), and start again from zero."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def tap(self, layers: Iterable[nn.Module]) -> int:
        """Put a counting tap on ``top_k_index`` of every experts call in the graphs of
        ``layers``; how many."""
        from pipetrain.hf.expert_parallel import called, region, roles

        done = 0
        for layer in layers:
            for gm in [m for m in layer.modules() if isinstance(m, fx.GraphModule)]:
                for path in called(gm, list(self.rows)):
                    inside, inputs, output = region(gm.graph, path)
                    index = roles(inputs, output, path)[1]
                    name = f"_pipetrain_load_{self.rows[path]}"
                    gm.add_submodule(name, _Tap(path, self))
                    with gm.graph.inserting_after(index):
                        tapped = gm.graph.call_module(name, (index,))
                    tapped.meta = dict(index.meta)
                    for node in inside:
                        node.replace_input_with(index, tapped)
                    gm.recompile()
                    done += 1
        return done


class _Tap(nn.Module):
    """Tells ``load`` of ``top_k_index`` on its way to the experts."""

    def __init__(self, path: str, load: ExpertLoad) -> None:
        super().__init__()
        self.path, self.load = path, load

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        self.load(self.path, index)
        return index


def summarize(counts: torch.Tensor) -> dict[str, Any] | None:
    """A step's load over every layer that got tokens: the fewest, mean and most (token,
    expert) pairs of any expert, and the worst layer's ``max / mean`` (1: even). None when no
    layer got any."""
    used = counts[counts.sum(dim=1) > 0].double()
    if used.numel() == 0:
        return None
    means = used.mean(dim=1)
    ratios = used.max(dim=1).values / means
    worst = int(ratios.argmax())
    layer = int(torch.nonzero(counts.sum(dim=1) > 0)[worst])
    return {"tokens_min": int(used.min()), "tokens_mean": round(float(means.mean()), 2),
            "tokens_max": int(used.max()), "imbalance": round(float(ratios[worst]), 3),
            "worst_layer": layer}
