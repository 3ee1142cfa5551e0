"""Runtime: the one interpreter of per-rank action lists, with in-memory or point-to-point hand-off.

For every action of its list, in order, a rank does exactly this::

    F(s, mb):  x <- batch mb (s = 0) | activation of (s-1 -> s, mb)     run layers of s
               last stage: loss(out, target mb) * weight mb            else: send to s+1
    B/I(s, mb): g <- ones (last stage) | gradient of (s+1 -> s, mb)    backward of s
               s > 0: send input gradients to s-1                      (I defers the W part)
    W(s, mb):  weight gradients deferred by I(s, mb)

A hand-off to a stage on the same process is a dictionary entry; to another rank it is a
:class:`~pipetrain.comm.P2P` message. Local mode runs every rank's list in one process in an
order :func:`~pipetrain.dataflow.walk` proves runnable. Nothing here knows schedule names.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipetrain.action import Action, Op
from pipetrain.comm import ACT, DONE, GRAD, P2P, Key, Message
from pipetrain.dataflow import walk
from pipetrain.errors import CommError, PipelineError, StageError
from pipetrain.payload import flatten, unflatten
from pipetrain.schedule import Schedule
from pipetrain.stage import Stage
from pipetrain.timeline import Span

__all__: list[str] = []


@dataclass
class StepData:
    """The inputs of one step: per-micro-batch inputs, targets and loss weights."""

    step: int
    inputs: Sequence[Any]
    targets: Sequence[Any]
    weights: Sequence[float]
    keep_outputs: bool = False
    train: bool = True
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)


class Executor:
    """Runs the actions of the ranks it hosts: one rank (distributed) or all of them (local)."""

    def __init__(self, schedule: Schedule, stages: dict[int, Stage], ranks: Sequence[int],
                 transport: P2P | None) -> None:
        self.schedule, self.stages, self.ranks, self.transport = schedule, stages, ranks, transport
        self._local: dict[Key, Message] = {}
        self.current: tuple[int, Action] | None = None
        if len(ranks) > 1:
            w = walk(schedule)
            self.order = [(r, i) for r, i in w.order if r in ranks]
        else:
            self.order = [(ranks[0], i) for i in range(len(schedule.actions[ranks[0]]))]

    def run(self, data: StepData) -> None:
        """Execute every hosted rank's list for one step (raises StageError / CommError)."""
        for rank, index in self.order:
            action = self.schedule.actions[rank][index]
            if not data.train and action.op is not Op.F:
                continue
            self.current = (rank, action)
            if action.op in (Op.B, Op.I):  # recompute (if any) before waiting for the gradient
                self._guarded(rank, action, data, self.stages[action.stage].prepare_backward)
            received = self._receive(rank, action, data)
            start = time.time()
            try:
                self._compute(rank, action, received, data)
            except PipelineError:
                raise
            except Exception as e:
                raise StageError(_where(rank, action, data.step) + f" failed: {e!r}") from e
            data.spans.append(Span(rank, action, start, time.time()))
        self.current = None

    def _guarded(self, rank: int, action: Action, data: StepData, fn: Any) -> None:
        try:
            fn(action.mb)
        except Exception as e:
            raise StageError(_where(rank, action, data.step) + f" recompute failed: {e!r}") from e

    def _receive(self, rank: int, a: Action, data: StepData) -> Message | None:
        """The message ``a`` consumes, if any (this is where a rank waits for its peers)."""
        last = a.stage == self.schedule.n_stages - 1
        if a.op is Op.F and a.stage > 0:
            return self._take(rank, Key(ACT, data.step, a.mb, a.stage - 1, a.stage), a)
        if a.op in (Op.B, Op.I) and not last:
            return self._take(rank, Key(GRAD, data.step, a.mb, a.stage + 1, a.stage), a)
        return None

    def _compute(self, rank: int, a: Action, msg: Message | None, data: StepData) -> None:
        stage = self.stages[a.stage]
        if a.op is Op.F:
            self._forward(rank, stage, a, msg, data)
        elif a.op is Op.W:
            stage.weight(a.mb)
        else:
            got = stage.backward(a.mb, None if msg is None else msg.tensors, split=a.op is Op.I)
            if a.stage > 0:
                self._put(rank, Message(Key(GRAD, data.step, a.mb, a.stage, a.stage - 1), got))

    def _forward(self, rank: int, stage: Stage, a: Action, msg: Message | None,
                 data: StepData) -> None:
        if msg is None:
            tensors, spec = flatten(data.inputs[a.mb])
            flags = [False] * len(tensors)
        else:
            tensors = [_present(t, msg.key) for t in msg.tensors]
            spec, flags = msg.spec, msg.requires_grad
        target = data.targets[a.mb] if stage.is_last else None
        flat, out_spec, raw = stage.forward(a.mb, tensors, spec, flags, target,
                                            data.weights[a.mb], track=data.train)
        if stage.is_last:
            if data.keep_outputs:
                data.outputs[a.mb] = _detach(raw)
            if target is not None:
                data.losses[a.mb] = flat[0].detach()
            return
        self._put(rank, Message(Key(ACT, data.step, a.mb, a.stage, a.stage + 1), list(flat),
                                out_spec, [t.requires_grad for t in flat]))

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
                raise PipelineError(f"{_where(rank, a, key.step)}: the {key.describe()} was not "
                                    "produced before it was needed (the schedule is not runnable)")
            return self._local.pop(key)
        if self.transport is None:
            raise CommError(f"{_where(rank, a, key.step)}: no transport for the {key.describe()}")
        return self.transport.recv(key, _where(rank, a, key.step))


def _where(rank: int, a: Action, step: int) -> str:
    return f"[rank {rank} | stage {a.stage} | mb {a.mb} | {a}] step {step}"


def _present(t: torch.Tensor | None, key: Key) -> torch.Tensor:
    if t is None:
        raise CommError(f"the {key.describe()} is missing a tensor")
    return t


def _detach(obj: Any) -> Any:
    tensors, spec = flatten(obj)
    return unflatten([t.detach() for t in tensors], spec)


def done_key(step: int, sender: int) -> Key:
    """The end-of-step message ``sender`` sends every other rank (its mb field names it)."""
    return Key(DONE, step, sender, -1, -1)


def expected_messages(schedule: Schedule, rank: int, step: int, train: bool = True
                      ) -> dict[int, list[Key]]:
    """For each peer, the messages it sends ``rank`` in one step, in the order it sends them.

    Every peer ends its step with an end-of-step message to every other rank.
    """
    out: dict[int, list[Key]] = {}
    last = schedule.n_stages - 1
    for peer, acts in enumerate(schedule.actions):
        if peer == rank:
            continue
        keys = []
        for a in acts:
            if a.op is Op.F and a.stage < last and schedule.rank_of(a.stage + 1) == rank:
                keys.append(Key(ACT, step, a.mb, a.stage, a.stage + 1))
            elif (train and a.op in (Op.B, Op.I) and a.stage > 0
                  and schedule.rank_of(a.stage - 1) == rank):
                keys.append(Key(GRAD, step, a.mb, a.stage, a.stage - 1))
        keys.append(done_key(step, peer))
        out[peer] = keys
    return out

