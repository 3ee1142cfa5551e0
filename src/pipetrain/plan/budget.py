"""Budget: a memory budget in bytes per rank as the simulator's stage-activations (a Target).

``make_schedule("zb-auto", p, m, target=Target(memory_limit=N))`` keeps every rank at or under
``N`` stage-activations, the unit of :mod:`pipetrain.schedules.simulator`: what one F of one
stage on one micro-batch keeps alive until its backward. A budget is bytes. Per rank ``r``
(zb-auto: one stage per rank, stage ``r``), in the planner's memory model
(:mod:`pipetrain.plan.planner`)::

    predicted peak  = state[r] + max(alive[r] + work[r], temporaries[r])
    alive[r]       <= unit[r] x (stage-activations alive on r)
    unit[r]         = kept[r] + held[r] + replay[r]

``state`` is the parameters, gradients and AdamW moments, ``work`` one micro-batch's backward
working memory plus the largest weight's whole gradient, ``temporaries`` the optimizer step's.
One unit weighs what the stage's F keeps (its activations and input; the input alone when
recomputed), plus what its I keeps until W, plus what a recomputed backward rebuilds. Each of
those is alive only while its micro-batch holds its unit (at ``w_share = 1``, the planner's and
``Target``'s default, a unit is freed when W or B ends), so a rank under ``N`` units holds at most
``unit x N`` bytes of them. Hence

    N = min over r of floor((budget - state[r] - work[r]) / unit[r])

keeps every rank's predicted peak within the budget, whatever schedule zb-auto picks under it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipetrain.plan.planner import ONE, Profiled, Scale, _costs, stage_bytes
from pipetrain.plan.shardcost import state_bytes, step_temporaries
from pipetrain.schedules.generators import Target
from pipetrain.split.partition import check_balance, stage_bounds

__all__ = ["stage_activations", "memory_target"]


def stage_activations(budget_bytes: float, unit_bytes: Sequence[float],
                      fixed_bytes: Sequence[float]) -> float:
    """The most stage-activations every rank can hold within ``budget_bytes``.

    Args:
        budget_bytes: what each rank may hold.
        unit_bytes: per rank, the bytes of one unit: what one micro-batch's F on the rank's
            stage keeps until its backward ends (and whatever else lives only that long).
        fixed_bytes: per rank, the bytes it holds whatever the schedule does: parameters,
            gradients, optimizer state, and the working memory of one backward.

    Returns:
        ``min over r of floor((budget_bytes - fixed_bytes[r]) / unit_bytes[r])``, the
        ``memory_limit`` of :class:`~pipetrain.schedules.generators.Target`.

    Raises:
        ValueError: for lengths that differ, a negative size, or a budget under one unit on
            some rank (the message says how many bytes more it needs).

    Example:
        >>> stage_activations(100, [10, 20], [30, 20])  # rank 0: 7 units, rank 1: 4
        4.0
    """
    if len(unit_bytes) != len(fixed_bytes) or not unit_bytes:
        raise ValueError(f"give one unit size and one fixed size per rank, got "
                         f"{len(unit_bytes)} and {len(fixed_bytes)}")
    if any(not math.isfinite(x) or x < 0 for x in (budget_bytes, *unit_bytes, *fixed_bytes)):
        raise ValueError("budget_bytes, unit_bytes and fixed_bytes must be finite and >= 0")
    units = []
    for r, (unit, fixed) in enumerate(zip(unit_bytes, fixed_bytes, strict=True)):
        room = budget_bytes - fixed
        fit = math.inf if unit == 0 and room >= 0 else math.floor(room / unit) if unit else -1
        if fit < 1:
            raise ValueError(
                f"rank {r} needs {fixed + unit:,.0f} bytes for one stage-activation "
                f"({fixed:,.0f} fixed + {unit:,.0f} per unit) but the budget is "
                f"{budget_bytes:,.0f}: raise it by {fixed + unit - budget_bytes:,.0f} bytes, "
                "recompute, or spread the model over more ranks")
        units.append(fit)
    return float(min(units))


def memory_target(budget_bytes: float, profile: Profiled, balance: Sequence[int], *,
                  recompute: str = "never", scale: Scale | None = None) -> Target:
    """The :class:`~pipetrain.schedules.generators.Target` for zb-auto (one stage per rank,
    ``len(balance)`` ranks) whose schedule keeps every rank's predicted peak (the planner's,
    :func:`pipetrain.plan.planner.evaluate`) within ``budget_bytes``.

    ``memory_limit`` is :func:`stage_activations` of the profile's bytes: per stage, a unit is
    what its F keeps plus what its I keeps until W plus what a recomputed backward rebuilds;
    fixed is the parameter state (4 x the trainable bytes, + frozen) and one micro-batch's
    backward working memory plus the largest weight's gradient. The costs are the profile's
    seconds per stage (times ``scale``'s ratios) and ``comm`` the scale's hop delay, so the
    search also fits the schedule to the model's own times.

    Args:
        budget_bytes: bytes each rank may hold.
        profile: the model's layers on one micro-batch (:class:`~pipetrain.plan.planner.
            Profiled`; :func:`pipetrain.plan.plan_module` gives it as ``plan.profile``).
        balance: layers per stage, one stage per rank.
        recompute: ``"never"`` or ``"always"`` (a stage keeps only its input).
        scale: the calibration's ratios (default: the profile as measured).

    Raises:
        ValueError: for a balance that does not cover the profile's layers, an unknown
            ``recompute``, or a budget that holds not even the parameter state and the
            optimizer step, or not one stage-activation (:func:`stage_activations`).

    Example::

        target = memory_target(64 * 2**20, plan.profile, plan.balance)
        schedule = pt.schedules.make_schedule("zb-auto", len(plan.balance), plan.microbatches,
                                    target=target)
    """
    if recompute not in ("never", "always"):
        raise ValueError(f"recompute must be 'never' or 'always', got {recompute!r}")
    sizes = check_balance(list(balance), len(profile.layers), len(balance))
    bounds = stage_bounds(sizes)
    scale = scale or Scale()
    full, kept, replay, held = stage_bytes(profile, bounds, recompute)
    units, fixed = [], []
    for r, (a, e) in enumerate(bounds):
        mine = list(profile.layers[a:e])
        state = state_bytes(mine, profile.comms()[a:e], ONE)
        temporaries = step_temporaries(mine, ONE, scale.foreach)
        if state + temporaries > budget_bytes:
            raise ValueError(f"rank {r}'s parameter state and optimizer step need "
                             f"{state + temporaries:,.0f} bytes, over the budget of "
                             f"{budget_bytes:,.0f}: raise the budget or use more ranks")
        largest = max((c.largest_grad_bytes for c in mine), default=0)
        units.append(kept[r] + held[r] + replay[r])
        fixed.append(state + full[r] + largest)
    costs = _costs(profile, bounds, recompute, scale)
    return Target(stage_activations(budget_bytes, units, fixed), costs, scale.comm)
