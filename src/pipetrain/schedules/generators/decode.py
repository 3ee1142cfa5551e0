"""Decode: the schedule of generation, groups of sequences taking turns through the stages.

A batch of sequences is split into ``groups`` micro-batch groups; each group needs one
forward through every stage per step: a prefill step (a slice of its prompt) or a decode step
(the token the last stage picked one step before, fed back to stage 0). Micro-batch
``mb = step * groups + g`` is group g's step. While group g runs stage s, group g+1 runs stage
s-1, so with ``groups >= p`` every rank is busy in the steady state::

    p = 3, groups = 3        rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 ...   (0F3 takes 2F0's token)
                             rank 1:     1F0 1F1 1F2 1F3 1F4 ...
                             rank 2:         2F0 2F1 2F2 2F3 ...

The schedule is forward-only and its ``feedback`` says which micro-batches take a fed-back
token: ``(groups, fed_from)``, every mb from ``fed_from`` on takes the output of mb - groups.
Prefill micro-batches and a window's first decode step (whose tokens ended the previous
window) take their inputs from the caller instead. :func:`steady_bubble` is the bubble of
the steady state, which the simulator reproduces.
"""

from __future__ import annotations

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule

__all__ = ["decode_schedule", "steady_bubble"]


def decode_schedule(n_ranks: int, groups: int, steps: int, fed_from: int | None = None
                    ) -> Schedule:
    """``steps`` forward steps of ``groups`` groups through ``n_ranks`` stages, one per rank.

    Args:
        n_ranks: ranks (p), each holding one stage.
        groups: micro-batch groups of sequences taking turns (the feedback's lag).
        steps: steps per group (prefill slices, then decode steps).
        fed_from: the first step whose input is the previous step's token (default 1: only
            step 0 takes the caller's input).

    Raises:
        ValueError: for counts below 1, or ``fed_from`` outside 1 .. steps.
    """
    fed_from = 1 if fed_from is None else fed_from
    if n_ranks < 1 or groups < 1 or steps < 1:
        raise ValueError(f"decode needs ranks, groups and steps >= 1, got {n_ranks}, {groups}, "
                         f"{steps}")
    if not 1 <= fed_from <= steps:
        raise ValueError(f"fed_from must be in 1..{steps} (the first fed-back step), got "
                         f"{fed_from}")
    m = groups * steps
    actions = [[Action(r, Op.F, mb) for mb in range(m)] for r in range(n_ranks)]
    return Schedule.from_lists("decode", m, range(n_ranks), actions,
                               feedback=(groups, groups * fed_from))


def steady_bubble(n_ranks: int, groups: int, comm: float = 0.0) -> float:
    """The idle share of every rank in the steady state, with stage forwards of 1 unit.

    A group's step goes round the ring of p stages and back, p units plus the p messages of
    ``comm`` each; a rank serves ``groups`` groups per round: busy ``groups`` units of
    ``max(groups, p * (1 + comm))``.
    """
    period = max(float(groups), n_ranks * (1.0 + comm))
    return 1.0 - groups / period
