"""Routes: which values each stage sends straight to which later stage, and where gradients go.

A layer list is a chain: stage k sends its whole output to stage k+1 and gets one gradient back
from it. A traced model (:mod:`pipetrain.split.trace`) knows, for every value that crosses a stage
boundary, the stage that makes it and the stages that use it, so the value goes from its
producer directly to each stage that uses it, past the stages in between::

    v made in stage 0, used in stages 1 and 3
    forward    0 ──► 1,  0 ──► 3            (stage 2 never sees v)
    backward   3 ──► 1 ──► 0                (stage 1 adds its part to what stage 3 sent)

Gradients go back along the stages that use the value, latest first. Each adds its own
contributions to the sum the later ones sent, so a value's gradient is summed in the very order
autograd sums it on one device (floating-point addition is not associative: summing per stage
and then across stages would differ in the last bits), and its producer gets one gradient.

Every route goes from a lower stage to a higher one (gradients the other way), so the waits it
adds are implied by the chain the schedules are built for (F of stage k after F of k-1, B/I of
k after B/I of k+1): any schedule that :func:`~pipetrain.schedules.validate.validate` accepts runs
them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__: list[str] = []

Keys = tuple[str, ...] | None
"""The payload keys one message carries; None for a chain's whole payload."""
Link = tuple[int, Keys]
"""The other stage of a message, and what it carries."""


@dataclass(frozen=True)
class Ports:
    """One stage's messages, each list ordered by the other stage's index.

    F takes ``act_in`` and sends ``act_out``; B (or I) takes ``grad_in`` and sends ``grad_out``.
    """

    act_in: tuple[Link, ...]
    act_out: tuple[Link, ...]
    grad_in: tuple[Link, ...]
    grad_out: tuple[Link, ...]


@dataclass(frozen=True)
class Routes:
    """The :class:`Ports` of every stage; ``keyed`` when payloads are split by key."""

    ports: tuple[Ports, ...]
    keyed: bool

    @property
    def n_stages(self) -> int:
        return len(self.ports)

    def pairs(self) -> dict[tuple[str, int, int], Keys]:
        """Every message of one micro-batch: (``"act"`` | ``"grad"``, src, dst) -> its keys."""
        out: dict[tuple[str, int, int], Keys] = {}
        for s, p in enumerate(self.ports):
            out.update({("act", s, d): keys for d, keys in p.act_out})
            out.update({("grad", s, d): keys for d, keys in p.grad_out})
        return out


def linear_routes(n_stages: int) -> Routes:
    """Stage k sends its whole output to k+1 and its input gradient to k-1."""
    last = n_stages - 1
    return Routes(tuple(Ports(((s - 1, None),) if s > 0 else (),
                              ((s + 1, None),) if s < last else (),
                              ((s + 1, None),) if s < last else (),
                              ((s - 1, None),) if s > 0 else ())
                        for s in range(n_stages)), keyed=False)


def direct(made_in: Mapping[str, int], used_in: Mapping[str, Sequence[int]],
           stage_of: Sequence[int], n_stages: int, forward_only: Collection[str] = ()
           ) -> Routes:
    """Routes of values sent directly from their producer to every stage that uses them.

    Args:
        made_in: payload key -> the part (a traced unit) that makes the value.
        used_in: payload key -> the parts that use it.
        stage_of: part -> the stage holding it (non-decreasing).
        n_stages: the number of stages.
        forward_only: keys whose values have no gradient (a micro-batch's random state):
            no gradient message carries them.
    """
    acts: dict[tuple[int, int], list[str]] = {}
    grads: dict[tuple[int, int], list[str]] = {}
    for key, part in made_in.items():
        producer = stage_of[part]
        users = sorted({stage_of[u] for u in used_in.get(key, ())} - {producer})
        for before, user in zip([producer] + users, users):
            acts.setdefault((producer, user), []).append(key)
            if key not in forward_only:
                grads.setdefault((user, before), []).append(key)
    return Routes(tuple(Ports(_links(acts, s, to=True), _links(acts, s, to=False),
                              _links(grads, s, to=True), _links(grads, s, to=False))
                        for s in range(n_stages)), keyed=True)


def _links(pairs: dict[tuple[int, int], list[str]], stage: int, *, to: bool) -> tuple[Link, ...]:
    """The messages arriving at ``stage`` (``to``) or leaving it, by the other stage."""
    found = [(src if to else dst, tuple(keys)) for (src, dst), keys in pairs.items()
             if (dst if to else src) == stage]
    return tuple(sorted(found, key=lambda link: link[0]))
