"""Receiver: the main thread's receives, posted ahead per peer, over a fake channel (no processes).

A fake channel hands each posted receive the next bytes a fake peer "sent"; a receive with
nothing left to fill it fails its wait as gloo's timeout does. What is checked: messages taken
in another order than sent, the timeout naming the message awaited, news raised at the next
wait, a message alike the last taking the short path and one that is not the full checks.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import pytest
import torch

from pipetrain.errors import CommError
from pipetrain.runtime.transport.receiver import _UNCLAIMED, Inbound, Inbox, Link, PeerClosed
from pipetrain.runtime.transport.wire import ACT, DONE, GRAD, INLINE_BYTES, Key, Message, encode


class _Work:
    def __init__(self, frame: torch.Tensor, wire: _Wire) -> None:
        self.frame, self.wire = frame, wire

    def wait(self, timeout: timedelta) -> bool:
        if not self.wire.sent:
            raise RuntimeError(self.wire.failure)
        data = self.wire.sent.popleft()
        if data.numel() > self.frame.numel():
            raise AssertionError("a send larger than its posted receive (gloo aborts on it)")
        self.frame[:data.numel()].copy_(data)
        return True


class _Wire:
    """One peer's sends to this rank, in order; and the receives posted for them."""

    def __init__(self) -> None:
        self.sent: deque[torch.Tensor] = deque()
        self.posted = 0
        self.failure = "[gloo] Timed out waiting 5ms for recv operation to complete"

    def send(self, msg: Message, capacity: int = INLINE_BYTES) -> None:
        first, payload, _ = encode(msg, 0, 0, capacity)
        assert payload is None
        self.sent.append(first)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self.posted += 1
        return _Work(tensors[0], self)


def _inbox(wire: _Wire, timeout: float = 0.05) -> Inbox:
    link = Link(1, "rank 1", wire, wire, {}, torch.device("cpu"), timeout,  # type: ignore[arg-type]
                1 << 20, 17, 18)
    return Inbox({0: Inbound(link, 0, 0)}, timeout)


def _act(step: int, mb: int, value: float = 1.0, n: int = 4) -> Message:
    return Message(Key(ACT, step, mb, 0, 1), [torch.full((n,), value + mb)], {"t": 0}, [True])


def _start(box: Inbox, step: int, mbs: list[int]) -> None:
    plan = {0: [(ACT, mb, 0, 1) for mb in mbs]}
    box.start(step, plan, {0: Key(DONE, step, 0, -1, -1)})


def test_messages_are_taken_in_any_order_and_each_receive_is_posted_ahead() -> None:
    wire = _Wire()
    box = _inbox(wire)
    _start(box, 0, [0, 1, 2])
    assert wire.posted == 1  # the first message's receive, posted at the start of the step
    for mb in (0, 1, 2):
        wire.send(_act(0, mb))
    third = box.take(Key(ACT, 0, 2, 0, 1), "rank 1 F2")  # takes 0 and 1 on the way
    assert third.tensors[0] is not None and third.tensors[0].tolist() == [3.0] * 4
    assert sorted(k.mb for k in box.arrived) == [0, 1]
    assert box.take(Key(ACT, 0, 0, 0, 1), "rank 1 F0").requires_grad == [True]
    assert wire.posted == 4  # one ahead of the last message taken: the end-of-step message


def test_a_message_alike_the_last_is_read_where_it_lay_and_one_unlike_is_checked() -> None:
    wire = _Wire()
    box = _inbox(wire)
    _start(box, 0, [0, 1, 2])
    wire.send(_act(0, 0))
    wire.send(_act(0, 1))
    wire.send(_act(0, 2, n=6))  # another shape: the short path must not read it as 4 floats
    box.take(Key(ACT, 0, 0, 0, 1), "F0")
    assert list(box.peers[0].known) == [(ACT, 0, 1)]
    got = [box.take(Key(ACT, 0, mb, 0, 1), f"F{mb}").tensors[0] for mb in (1, 2)]
    assert [t.tolist() if t is not None else None for t in got] == [[2.0] * 4, [3.0] * 6]


def test_a_message_from_another_step_is_refused_on_the_short_path_too() -> None:
    wire = _Wire()
    box = _inbox(wire)
    _start(box, 4, [0, 1])
    wire.send(_act(4, 0))
    wire.send(_act(5, 1))  # alike but for its step
    box.take(Key(ACT, 4, 0, 0, 1), "F0")
    with pytest.raises(CommError, match="received the activation of mb 1 from stage 0 to stage "
                                         r"1 \(step 5\) instead"):
        box.take(Key(ACT, 4, 1, 0, 1), "F1")


def test_a_timeout_names_the_action_and_the_message_awaited() -> None:
    wire = _Wire()
    box = _inbox(wire)
    _start(box, 3, [0])
    before = len(_UNCLAIMED)
    with pytest.raises(CommError) as e:
        box.take(Key(ACT, 3, 0, 0, 1), "[rank 1 | stage 1 | mb 0 | 1F0] step 3")
    assert str(e.value).startswith(
        "[rank 1 | stage 1 | mb 0 | 1F0] step 3: timed out waiting for the activation of mb 0 "
        "from stage 0 to stage 1 (step 3) from rank 0 [")
    assert len(_UNCLAIMED) == before + 1  # the receive stays posted for good: gloo may fill it


def test_a_closed_connection_is_a_peer_closed_naming_the_peer() -> None:
    wire = _Wire()
    wire.failure = "[gloo] Connection closed by peer"
    box = _inbox(wire)
    _start(box, 0, [0])
    with pytest.raises(PeerClosed, match="the peer closed the connection") as e:
        box.take(Key(ACT, 0, 0, 0, 1), "F0")
    assert e.value.peer == 0


def test_news_is_raised_at_the_next_wait_but_a_kept_message_is_still_taken() -> None:
    wire = _Wire()
    box = _inbox(wire)
    _start(box, 0, [0, 1])
    wire.send(_act(0, 0))
    wire.send(_act(0, 1))
    box.take(Key(ACT, 0, 1, 0, 1), "F1")  # keeps mb 0
    news = CommError("rank 3 failed")
    box.fail(news)
    box.fail(CommError("later news"))  # the first one wins
    assert box.take(Key(ACT, 0, 0, 0, 1), "F0").key.mb == 0
    with pytest.raises(CommError) as e:
        box.take(Key(DONE, 0, 0, -1, -1), "end of step")
    assert e.value is news


def test_a_message_no_peer_sends_is_refused_at_once() -> None:
    box = _inbox(_Wire())
    _start(box, 0, [0])
    with pytest.raises(CommError, match="no peer sends the gradient of mb 0"):
        box.take(Key(GRAD, 0, 0, 2, 1), "B0")


def test_each_route_keeps_its_own_form_so_alternating_kinds_stay_on_the_short_path() -> None:
    wire = _Wire()
    box = _inbox(wire)
    plan = {0: [(ACT, 0, 2, 3), (GRAD, 0, 1, 0), (ACT, 1, 2, 3), (GRAD, 1, 1, 0)]}  # a V
    box.start(0, plan, {0: Key(DONE, 0, 0, -1, -1)})
    for mb in (0, 1):
        wire.send(Message(Key(ACT, 0, mb, 2, 3), [torch.full((2, 3), float(mb))], {"t": 0},
                          [True]))
        wire.send(Message(Key(GRAD, 0, mb, 1, 0), [torch.full((5,), -float(mb))], {"t": 0},
                          [False]))
    got = [box.take(Key(kind, 0, mb, src, dst), "V").tensors[0]
           for mb in (0, 1) for kind, src, dst in ((ACT, 2, 3), (GRAD, 1, 0))]
    assert sorted(box.peers[0].known) == [(ACT, 2, 3), (GRAD, 1, 0)]
    assert [tuple(t.shape) for t in got if t is not None] == [(2, 3), (5,), (2, 3), (5,)]
    assert [float(t.flatten()[0]) for t in got if t is not None] == [0.0, -0.0, 1.0, -1.0]


def test_a_structured_message_alike_takes_the_short_path_and_one_unlike_does_not() -> None:
    from pipetrain.runtime.transport.payload import flatten, unflatten

    wire = _Wire()
    box = _inbox(wire)
    _start(box, 0, [0, 1, 2])
    for mb, names in ((0, ["a", "b"]), (1, ["a", "b"]), (2, ["c", "d"])):  # 2: other spec bytes
        tensors, spec = flatten({"x": torch.full((3,), float(mb)), "names": names})
        wire.send(Message(Key(ACT, 0, mb, 0, 1), list(tensors), spec, [False]))
    got = []
    for mb in (0, 1, 2):
        msg = box.take(Key(ACT, 0, mb, 0, 1), f"F{mb}")
        got.append(unflatten([t for t in msg.tensors if t is not None], msg.spec))
    assert [g["names"] for g in got] == [["a", "b"], ["a", "b"], ["c", "d"]]
    assert [g["x"].tolist() for g in got] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_a_frame_is_received_into_again_only_once_no_tensor_of_its_message_is_left() -> None:
    """Frames go back to a spare pool after their message is taken; a later receive takes one
    only if nothing holds a tensor of the message it held: not the tensor, a view of it, nor
    autograd's saved copy."""
    wire = _Wire()
    box = _inbox(wire)
    mbs = list(range(8))
    _start(box, 0, mbs)
    for mb in mbs:
        wire.send(_act(0, mb))

    def frame_of_next() -> int:  # the memory the next message is received into
        posted = box.peers[0].posted
        assert posted is not None
        return int(posted[0].untyped_storage().data_ptr())

    into = [frame_of_next()]
    got = []
    for mb in mbs[:-1]:
        got.append(box.take(Key(ACT, 0, mb, 0, 1), f"F{mb}").tensors[0])
        into.append(frame_of_next())
        if mb == 0:
            view = got[0][1:3]  # type: ignore[index]  # mb 0: held through a view
        if mb == 1:
            w = torch.ones(4, requires_grad=True)  # mb 1: held by autograd (mul saves it)
            graph = (got[1].detach().requires_grad_() * w).sum()  # type: ignore[union-attr]
        got[-1] = None  # no tensor kept but those
    # frames, in order: mb 0's and 1's held, 2's free when mb 4's receive is posted (after
    # mb 3 is taken), and so on
    assert into[4] == into[2] and into[5] == into[3]
    assert into[0] not in into[1:] and into[1] not in into[2:]
    graph.backward()
    assert w.grad is not None and w.grad.tolist() == [2.0] * 4  # mb 1's values, untouched
    assert view.tolist() == [1.0, 1.0]  # mb 0's values, untouched
    assert len(box.peers[0].spare) <= 4  # the oldest frames leave the pool


def test_a_reused_frame_of_a_shorter_send_reads_no_stale_header() -> None:
    """A frame received into again has its header zeroed: a send too short to hold a header
    (here the right magic and key, nothing after) is refused, not read with the header and
    payload of the message the frame held before (which would pass the short path's checks)."""
    import struct

    from pipetrain.runtime.transport.wire import MAGIC

    wire = _Wire()
    box = _inbox(wire)
    _start(box, 0, [0, 1, 2])
    wire.send(_act(0, 0))
    box.take(Key(ACT, 0, 0, 0, 1), "F0")  # its frame is free at once
    wire.send(_act(0, 1))  # received into the frame posted before: mb 0's goes to the spares
    box.take(Key(ACT, 0, 1, 0, 1), "F1")  # ... and mb 2's receive is posted into it
    lead = struct.pack("<6q", MAGIC, ACT, 0, 2, 0, 1)  # 48 bytes: the magic and mb 2's key
    wire.sent.append(torch.frombuffer(bytearray(lead), dtype=torch.uint8))
    with pytest.raises(CommError, match="refusing it"):
        box.take(Key(ACT, 0, 2, 0, 1), "F2")
