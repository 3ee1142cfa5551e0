"""Executor: the one interpreter of per-rank action lists, in-memory or point-to-point hand-off.

For every action of its list, in order, a rank does exactly this::

    F(s, mb):  x <- batch mb (s = 0) | activation of (s-1 -> s, mb)     run layers of s
               last stage: loss(out, target mb) * weight mb            else: send to s+1
    B/I(s, mb): g <- ones (last stage) | gradient of (s+1 -> s, mb)    backward of s
               s > 0: send input gradients to s-1                      (I defers the W part)
    W(s, mb):  weight gradients deferred by I(s, mb)

An asynchronous window (``schedule.update``: PipeDream-2BW, PipeDream) runs like any step, except
that a B of ``mb < 0`` finishes the previous step's micro-batch ``m + mb`` (its messages carry
that step's number) and each F and B first puts its weight version into the stage
(:mod:`pipetrain.runtime.versions`).

A decoding schedule (``schedule.feedback``) closes the chain into a ring: the last stage's F
hands its outputs to ``data.loop.pick``, which picks the tokens, and sends them to stage 0,
whose F on the fed micro-batch takes its input from ``data.loop.feed`` (:class:`TokenFeedback`).

That is the chain of a layer list; a traced model's stages take and send one message per
route instead (:mod:`pipetrain.runtime.transport.routes`: F takes a message from each earlier stage
whose
values it uses and sends one to each later stage using its values; B/I likewise for gradients).
A hand-off to a stage on the same process is a dictionary entry; to another rank it is a
:class:`~pipetrain.runtime.transport.comm.P2P` message. Local mode runs every rank's list in one
process in an
order :func:`~pipetrain.schedules.dataflow.walk` proves runnable. Nothing here knows schedule
names: even the point after which a stage's weight gradients are final (for ``on_grads_ready``) is
read off the lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipetrain.errors import CommError, PipelineError, StageError
from pipetrain.runtime.failure.watchdog import Activity
from pipetrain.runtime.stage import Incoming, Stage
from pipetrain.runtime.tied import TiedParam
from pipetrain.runtime.torch_private import pytree
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.payload import flatten
from pipetrain.runtime.transport.routes import Routes, linear_routes
from pipetrain.runtime.transport.wire import ACT, GRAD, Key, Message
from pipetrain.runtime.versions import Versions
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []

GradsReady = Callable[[int], None]


class TokenFeedback(Protocol):
    """What a decoding run adds to forward-only steps (:mod:`pipetrain.generation`)."""

    def enter(self, stage: int, mb: int) -> None:
        """Called before ``stage`` runs micro-batch ``mb`` (swaps in its group's KV cache)."""

    def pick(self, mb: int, outputs: Any) -> torch.Tensor:
        """On the last stage: the tokens that the model's ``outputs`` for ``mb`` give."""

    def feed(self, mb: int, tokens: torch.Tensor) -> Any:
        """On stage 0: the input of ``mb`` from the tokens picked for the micro-batch it
        follows (:meth:`Schedule.fed_back`)."""


@dataclass
class StepData:
    """The inputs of one step: per-micro-batch inputs, targets and loss weights."""

    step: int
    inputs: Sequence[Any]
    targets: Sequence[Any]
    weights: Sequence[float]
    keep_outputs: bool = False
    train: bool = True
    on_grads_ready: GradsReady | None = None
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)  # start, end of each action run, in order
    done_sent: bool = False  # this rank sent its end-of-step message
    rng: Sequence[str] = ()  # stage 0: each micro-batch's starting random state (rng.py)
    loop: TokenFeedback | None = None  # a decoding run's token picking and feeding
    previous: int = -1  # an asynchronous window: the number of the step before
    version: int = 0  # an asynchronous window: the weight version of this step's forwards


class Executor:
    """Runs the actions of the ranks it hosts: one rank (distributed) or all of them (local).

    ``linked[s]`` are the stages whose backward also writes gradients of stage ``s``'s
    parameters (a weight tied between stages on this process); ``deferred`` stages get their
    ``on_grads_ready`` call at the end of the step (a weight tied across ranks is summed then).
    """

    def __init__(self, schedule: Schedule, stages: dict[int, Stage], ranks: Sequence[int],
                 transport: P2P | None, linked: dict[int, set[int]] | None = None,
                 deferred: Collection[int] = (), routes: Routes | None = None,
                 versions: Versions | None = None,
                 local: dict[Key, Message] | None = None) -> None:
        self.schedule, self.stages, self.ranks, self.transport = schedule, stages, ranks, transport
        self.versions = versions  # an asynchronous window's weight versions
        self.m = schedule.n_microbatches
        self.routes = linear_routes(schedule.n_stages) if routes is None else routes
        ports = self.routes.ports  # per stage, the other stage of each message, in order
        self._act_in = [tuple(s for s, _ in p.act_in) for p in ports]
        self._act_out = [tuple(s for s, _ in p.act_out) for p in ports]
        self._grad_in = [tuple(s for s, _ in p.grad_in) for p in ports]
        self._grad_out = [tuple(s for s, _ in p.grad_out) for p in ports]
        self._local: dict[Key, Message] = {} if local is None else local  # shared by a
        # window's phases: a step's messages to the next step wait here
        self.current: tuple[int, Action] | None = None
        if len(ranks) > 1:
            order = [(r, i) for r, i in walk(schedule).order if r in ranks]
        else:
            order = [(ranks[0], i) for i in range(len(schedule.actions[ranks[0]]))]
        self.order = [(r, schedule.actions[r][i]) for r, i in order]
        self.ready = grads_final_after(self.order, linked or {}, set(deferred))
        self.deferred = tuple(s for s in sorted(deferred) if s in stages)
        self.activity = Activity()
        """What this rank does now, for the watchdog (:mod:`pipetrain.runtime.failure.watchdog`)."""
        self._takes = [self._sources(a) for _, a in self.order]
        """Per position in ``order``: the stages whose messages its action takes."""
        self._waits_on = [(str(a), tuple(dict.fromkeys(
            schedule.rank_of(s) for s in srcs if schedule.rank_of(s) != r)))
            for (r, a), srcs in zip(self.order, self._takes)]

    def _rank(self, rank: int) -> str:
        return f"rank {rank}" if self.transport is None else self.transport.name(rank)

    def _where(self, rank: int, a: Action, step: int) -> str:
        mb = f"mb {a.mb}" if a.mb >= 0 else f"mb {a.mb + self.m} of the step before"
        return f"[{self._rank(rank)} | stage {a.stage} | {mb} | {a}] step {step}"

    def _sources(self, a: Action) -> tuple[int, ...]:
        """The stages whose messages ``a`` consumes."""
        if a.op is Op.W:
            return ()
        fed = self.schedule.fed_back(a)
        if fed is not None:
            return (fed.stage,)
        return self._act_in[a.stage] if a.op is Op.F else self._grad_in[a.stage]

    def executed(self, train: bool) -> list[tuple[int, Action]]:
        """The (rank, action) pairs a step runs, in the order their times are recorded."""
        return [(r, a) for r, a in self.order if train or a.op is Op.F]

    def run(self, data: StepData) -> None:
        """Execute every hosted rank's list for one step (raises StageError / CommError)."""
        train, times, ready, activity = data.train, data.times, self.ready, self.activity
        for index, (rank, action) in enumerate(self.order):
            op = action.op
            if not train and op is not Op.F:
                continue
            self.current = (rank, action)
            if self.versions is not None and train:
                self.versions.use(action.stage, max(0, data.version + (action.version or 0)),
                                  op is Op.F)
            if op is Op.B or op is Op.I:  # recompute (if any) before waiting for the gradient
                activity.computing()
                self._guarded(rank, action, data, self.stages[action.stage].prepare_backward)
            activity.waiting(*self._waits_on[index], data.step)
            received = self._receive(rank, action, data, self._takes[index])
            activity.computing()
            start = time.time()
            try:
                self._compute(rank, action, received, data)
            except PipelineError:
                raise
            except Exception as e:
                raise StageError(self._where(rank, action, data.step) + f" failed: {e!r}") from e
            times.append(start)
            times.append(time.time())
            if train and index in ready and data.on_grads_ready is not None:
                self.grads_ready(rank, action, ready[index], data)
        self.current = None
        activity.idle()

    def grads_ready(self, rank: int, action: Action | None, stages: Sequence[int],
                    data: StepData) -> None:
        """Call ``data.on_grads_ready`` for ``stages``; a hook that raises fails the step."""
        hook = data.on_grads_ready
        for s in stages:
            try:
                if hook is not None:
                    hook(s)
            except Exception as e:
                where = (self._where(rank, action, data.step) if action is not None
                         else f"[{self._rank(rank)} | stage {s}] step {data.step}")
                raise StageError(f"{where} on_grads_ready({s}) raised {e!r}") from e

    def _guarded(self, rank: int, action: Action, data: StepData, fn: Any) -> None:
        try:
            fn(action.mb % self.m)
        except Exception as e:
            where = self._where(rank, action, data.step)
            raise StageError(f"{where} recompute failed: {e!r}") from e

    def _receive(self, rank: int, a: Action, data: StepData, sources: tuple[int, ...]
                 ) -> list[Message]:
        """The messages ``a`` takes from ``sources`` (where a rank waits for its peers)."""
        kind = ACT if a.op is Op.F else GRAD
        step, mb = self._step_mb(data, a.mb)
        return [self._take(rank, Key(kind, step, mb, src, a.stage), a) for src in sources]

    def _step_mb(self, data: StepData, mb: int) -> tuple[int, int]:
        """The step and micro-batch a message of ``mb`` belongs to: below 0, the step
        before's ``m + mb`` (an asynchronous window)."""
        return (data.step, mb) if mb >= 0 else (data.previous, mb + self.m)

    def _compute(self, rank: int, a: Action, msgs: list[Message], data: StepData) -> None:
        stage = self.stages[a.stage]
        if a.op is Op.F:
            self._forward(rank, stage, a, msgs, data)
        elif a.op is Op.W:
            stage.weight(a.mb)
        else:
            step, mb = self._step_mb(data, a.mb)
            got = stage.backward(mb, [m.tensors for m in msgs], split=a.op is Op.I)
            for dst, grads in zip(self._grad_out[a.stage], got):
                self._put(rank, Message(Key(GRAD, step, mb, a.stage, dst), grads))
            if self.versions is not None:  # PipeDream: the stage's update after each B
                self.versions.finished(
                    a.stage, max(0, data.version + (a.version or 0)),
                    None if data.on_grads_ready is None else
                    lambda s: self.grads_ready(rank, a, (s,), data))

    def _forward(self, rank: int, stage: Stage, a: Action, msgs: list[Message],
                 data: StepData) -> None:
        inputs: list[Incoming]
        loop = data.loop
        if loop is not None:
            loop.enter(a.stage, a.mb)
        if a.stage == 0 and loop is not None and self.schedule.fed_back(a) is not None:
            tensors, spec = flatten(loop.feed(a.mb, _present(msgs[0].tensors[0], msgs[0].key)))
            inputs = [(tensors, spec, [False] * len(tensors))]
        elif a.stage == 0:
            tensors, spec = flatten(data.inputs[a.mb])
            inputs = [(tensors, spec, [False] * len(tensors))]
        else:
            inputs = [([_present(t, m.key) for t in m.tensors], m.spec, m.requires_grad)
                      for m in msgs]
        target = data.targets[a.mb] if stage.is_last else None
        start = data.rng[a.mb] if a.stage == 0 and data.rng else None
        sends, loss, raw = stage.forward(a.mb, inputs, target, data.weights[a.mb],
                                         track=data.train, rng_start=start)
        if stage.is_last:
            if data.keep_outputs:
                data.outputs[a.mb] = _detach(raw)
            if loss is not None:
                data.losses[a.mb] = loss.detach()
            if loop is not None:
                self._feed_back(rank, a, loop.pick(a.mb, raw), data.step)
            return
        for dst, (flat, spec) in zip(self._act_out[a.stage], sends):
            self._put(rank, Message(Key(ACT, data.step, a.mb, a.stage, dst), list(flat), spec,
                                    [t.requires_grad for t in flat]))

    def _feed_back(self, rank: int, a: Action, tokens: torch.Tensor, step: int) -> None:
        """Send the tokens of ``a`` (the last stage's F) to stage 0, for the mb they feed."""
        if self.schedule.feedback is None:
            return
        lag, start = self.schedule.feedback
        fed = a.mb + lag
        if start <= fed < self.schedule.n_microbatches:
            self._put(rank, Message(Key(ACT, step, fed, a.stage, 0), [tokens], None, [False]))

    def _put(self, rank: int, msg: Message) -> None:
        dst = msg.key.dst_stage
        if dst in self.stages:
            self._local[msg.key] = msg
        elif self.transport is None:
            raise CommError(f"rank {rank}: stage {dst} is not hosted here and no transport exists")
        else:
            self.transport.send(self.schedule.rank_of(dst), msg)

    def _take(self, rank: int, key: Key, a: Action) -> Message:
        if key.src_stage in self.stages:
            if key not in self._local:
                raise PipelineError(f"{self._where(rank, a, key.step)}: the {key.describe()} was "
                                    "not produced before it was needed (the schedule is not "
                                    "runnable)")
            return self._local.pop(key)
        if self.transport is None:
            raise CommError(f"{self._where(rank, a, key.step)}: no transport for the "
                            f"{key.describe()}")
        return self.transport.recv(key, lambda: self._where(rank, a, key.step))


def grads_final_after(order: Sequence[tuple[int, Action]], linked: dict[int, set[int]],
                      deferred: set[int]) -> dict[int, tuple[int, ...]]:
    """Positions in ``order`` after which stages' weight gradients are final in a step.

    A stage's weight gradients are written by its W actions (its B actions where the schedule
    does not split the backward); the last of them, or of those of its ``linked`` stages, is
    the point. Stages in ``deferred`` are left out (their point is the end of the step).
    """
    last: dict[int, int] = {}
    for index, (_, a) in enumerate(order):
        if a.op is Op.W or a.op is Op.B:
            last[a.stage] = index
    out: dict[int, list[int]] = {}
    for stage in sorted(last):
        if stage not in deferred:
            point = max(last.get(t, -1) for t in linked.get(stage, set()) | {stage})
            out.setdefault(point, []).append(stage)
    return {index: tuple(stages) for index, stages in out.items()}


def grad_links(tied: Sequence[TiedParam], local: bool) -> tuple[dict[int, set[int]], set[int]]:
    """Stages sharing a weight: linked when one process holds them all, else deferred."""
    linked: dict[int, set[int]] = {}
    deferred: set[int] = set()
    for t in tied:
        if len(t.ranks) > 1 and not local:
            deferred.update(t.stages)
        for s in t.stages:
            linked.setdefault(s, set()).update(t.stages)
    return linked, deferred


def message_plans(schedule: Schedule, rank: int, train: bool = True,
                  routes: Routes | None = None) -> dict[int, list[tuple[int, int, int, int]]]:
    """For each peer, the messages it sends ``rank`` in one step, in the order it sends them.

    Each entry is ``(kind, mb, src_stage, dst_stage)``; ``routes`` (default: a chain) says
    which stages an action sends to, in the order :class:`Executor` sends. The end-of-step
    messages (:func:`pipetrain.runtime.step_end.ending_keys`) are not listed: the end of the
    step receives them directly.
    """
    ports = (linear_routes(schedule.n_stages) if routes is None else routes).ports
    mine = [[d for d, _ in p.act_out if schedule.rank_of(d) == rank] for p in ports]
    back = [[d for d, _ in p.grad_out if schedule.rank_of(d) == rank] for p in ports]
    out: dict[int, list[tuple[int, int, int, int]]] = {}
    last, lag, start = schedule.n_stages - 1, *(schedule.feedback or (0, 0))
    fed = schedule.feedback is not None and schedule.rank_of(0) == rank
    for peer, acts in enumerate(schedule.actions):
        if peer == rank:
            continue
        plan = []
        for a in acts:
            if a.op is Op.F:
                plan += [(ACT, a.mb, a.stage, d) for d in mine[a.stage]]
                if fed and a.stage == last and start <= a.mb + lag < schedule.n_microbatches:
                    plan.append((ACT, a.mb + lag, last, 0))
            elif train and a.op is not Op.W:
                plan += [(GRAD, a.mb, a.stage, d) for d in back[a.stage]]
        out[peer] = plan
    return out


def _present(t: torch.Tensor | None, key: Key) -> torch.Tensor:
    if t is None:
        raise CommError(f"the {key.describe()} is missing a tensor")
    return t


def _detach(obj: Any) -> Any:
    """``obj`` with its tensors detached, in its own structure (a ``ModelOutput`` stays one)."""
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, obj)
