"""Two processes over gloo: messages behind their header in one send, capacities, forged headers.

One group of 2 processes runs every case in turn; each case builds a fresh transport on both
ranks (its own tags), rank 0 sends, rank 1 receives. A forged message is what a peer running
other code, or corrupted memory, could send: rank 1 must refuse it with a CommError, never
read past its receive, and never die of a send larger than what it posted (gloo aborts the
process on that).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pipetrain as pt
from pipetrain.errors import CommError
from pipetrain.runtime.step_end import done_key
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.wire import (
    ACT,
    HEADER_BYTES,
    INLINE_BYTES,
    Key,
    Message,
    encode,
    read_header,
)

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

CPU = torch.device("cpu")
LIMIT = 1 << 20  # max_message_bytes of the receiving transport
SIZES = [100, 4000, 4000, 8000, 100]  # floats: inline, larger than the least capacity, ...


def _transport(rank: int) -> P2P:
    return P2P(None, rank, 2, CPU, timeout=60, max_message_bytes=LIMIT)  # a loaded machine


def _tensor(step: int, i: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (step + 1) + i


def _key(step: int, i: int) -> Key:
    return Key(ACT, step, i, 0, 1)


def _sends_per_message(p2p: P2P, step: int) -> list[int]:
    counts = []
    for i, n in enumerate(SIZES):
        before = p2p.posted
        p2p.send(1, Message(_key(step, i), [_tensor(step, i, n)]))
        counts.append(p2p.posted - before)
    p2p.send(1, Message(done_key(step, 0), [torch.zeros(3)]))
    p2p.settle("rank 0")
    return counts


def _same(msg: Message, want: torch.Tensor) -> bool:
    got = msg.tensors[0]
    return got is not None and torch.equal(got, want)


def _receive_step(p2p: P2P, step: int) -> str:
    p2p.start_step(step, {0: [(ACT, i, 0, 1) for i in range(len(SIZES))]}, {0: done_key(step, 0)})
    wrong = [i for i, n in enumerate(SIZES)
             if not _same(p2p.recv(_key(step, i), "rank 1"), _tensor(step, i, n))]
    p2p.receive_last({0: done_key(step, 0)}, "rank 1")
    return f"wrong: {wrong}"


def _growth(rank: int) -> list[str]:
    p2p = _transport(rank)
    try:
        if rank == 0:
            return [str(_sends_per_message(p2p, step)) for step in range(2)]
        return [_receive_step(p2p, step) for step in range(2)]
    finally:
        p2p.close()


def _forged(rank: int, forge: Callable[[torch.Tensor], torch.Tensor], valid: bool) -> str:
    """Rank 0 sends one 4000-float message with the right key, then a forged one (and the
    end-of-step message when the forgery is ``valid``)."""
    p2p = _transport(rank)
    try:
        if rank == 0:
            p2p.send(1, Message(_key(0, 0), [_tensor(0, 0, 4000)]))  # grows the capacity
            first, _, _ = encode(Message(_key(0, 1), [_tensor(0, 1, 4000)]), 0, 0, 1 << 16)
            sent = forge(first)
            p2p._link.to(1).send([sent], 1, p2p._tag).wait()  # raw, as a peer
            if valid:
                p2p.send(1, Message(done_key(0, 0), [torch.zeros(3)]))
            p2p.settle("rank 0")
            return f"sent {sent.numel()}"
        p2p.start_step(0, {0: [(ACT, 0, 0, 1), (ACT, 1, 0, 1)]}, {0: done_key(0, 0)})
        p2p.recv(_key(0, 0), "rank 1")
        try:
            got = p2p.recv(_key(0, 1), "rank 1")
        except CommError as e:
            return f"CommError: {e}"
        p2p.receive_last({0: done_key(0, 0)}, "rank 1")
        return f"accepted: {_same(got, _tensor(0, 1, 4000))}"
    finally:
        p2p.close()


def _set(first: torch.Tensor, index: int, value: int) -> torch.Tensor:
    out = first.clone()
    header = read_header(out)
    header[index] = value
    out[:HEADER_BYTES].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8))
    return out


FORGERIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "combined-ok": lambda f: f,
    "other-mb": lambda f: _set(f, 3, 7),
    "other-step": lambda f: _set(f, 2, 5),
    "magic": lambda f: _set(f, 0, 1234),
    "huge-size": lambda f: _set(f, 9, 1 << 40),
    "huge-shape": lambda f: _set(_set(f, 16 + 4, 1 << 30), 9, 4 << 30),
    "more-than-agreed": lambda f: _set(_set(f, 16 + 4, 6000), 9, 24000)[:HEADER_BYTES],
    "short": lambda f: f[:8],  # the magic number alone
}


def _directions(rank: int) -> bool:
    """Whether this rank's messages to its peer and the peer's to it use separate groups
    (separate connections: one of our threads at each end of each)."""
    p2p = _transport(rank)
    try:
        link = p2p._link
        return link.to(1 - rank) is not link.from_(1 - rank)
    finally:
        p2p.close()


def _run(ctx: pt.RankContext) -> dict[str, object]:
    out: dict[str, object] = {"growth": _growth(ctx.rank), "split": _directions(ctx.rank)}
    for name, forge in FORGERIES.items():
        out[name] = _forged(ctx.rank, forge, valid=name == "combined-ok")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return pt.launch(_run, 2, timeout=240)  # type: ignore[no-any-return]


def test_a_payload_goes_behind_its_header_once_the_capacity_holds_it(
        results: list[dict[str, object]]) -> None:
    # 400 bytes fit the least capacity; 16,000 do not (two sends) and raise it; the next
    # 16,000 take one send; 32,000 need two again; afterwards everything takes one send
    assert results[0]["growth"] == ["[1, 2, 1, 2, 1]", "[1, 1, 1, 1, 1]"]
    assert results[1]["growth"] == ["wrong: []", "wrong: []"]
    assert 4 * 100 <= INLINE_BYTES < 4 * 4000


def test_each_direction_of_a_pair_has_its_own_group(results: list[dict[str, object]]) -> None:
    assert [r["split"] for r in results] == [True, True]


WHERE = ("CommError: rank 1 receiving the activation of mb 1 from stage 0 to stage 1 "
         "(step 0) from rank 0: ")
REFUSED = {
    "other-mb": "received the activation of mb 7 from stage 0 to stage 1 (step 0) instead; the "
                "ranks disagree on the schedule or on the step (did a rank skip a step?)",
    "other-step": "received the activation of mb 1 from stage 0 to stage 1 (step 5) instead; the "
                  "ranks disagree on the schedule or on the step (did a rank skip a step?)",
    "magic": "received a message without pipetrain's magic number",
    "short": "the header sends 0 payload bytes separately although the agreed 16000 hold them; "
             "refusing it",
    "huge-size": f"the header claims {1 << 40} payload bytes but describes 16000 (limit "
                 f"{LIMIT}); refusing it",
    "huge-shape": f"the header claims {4 << 30} payload bytes but describes {4 << 30} (limit "
                  f"{LIMIT}); refusing it",
    "more-than-agreed": "the header claims 24000 payload bytes in the same message, but only "
                        "16000 were agreed; refusing it",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_forged_header_is_refused_before_its_payload_is_used(
        results: list[dict[str, object]], case: str) -> None:
    assert results[1][case] == WHERE + REFUSED[case]


def test_the_forgeries_never_exceed_the_posted_receive(results: list[dict[str, object]]) -> None:
    assert results[1]["combined-ok"] == "accepted: True"
    assert results[0]["combined-ok"] == f"sent {HEADER_BYTES + 16000}"
    assert results[0]["more-than-agreed"] == f"sent {HEADER_BYTES}"
