"""Encoder: a route's later messages, written from its kept header, are the bytes encode writes."""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime.transport.encoder import Encoder, same_spec
from pipetrain.runtime.transport.payload import flatten
from pipetrain.runtime.transport.wire import ACT, DONE, GRAD, INLINE_BYTES, Key, Message, encode


def _msg(obj: object, step: int, mb: int, kind: int = ACT, stages: tuple[int, int] = (1, 2),
         flags: list[bool] | None = None) -> Message:
    tensors, spec = flatten(obj)
    return Message(Key(kind, step, mb, *stages), list(tensors), spec,
                   flags if flags is not None else [t.requires_grad for t in tensors])


def _same_as_encode(encoder: Encoder, msg: Message, op: int = 0,
                    capacity: int = INLINE_BYTES) -> None:
    got, want = encoder(msg, op, capacity)[:3], encode(msg, encoder.src_rank, op, capacity)
    assert got[2] == want[2]
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        assert got[1] is not None and torch.equal(got[1], want[1])


def test_a_routes_later_messages_are_written_from_its_kept_header_byte_for_byte() -> None:
    enc = Encoder(src_rank=1)
    g = torch.Generator().manual_seed(0)
    for mb in range(6):  # one tensor, the usual activation
        x = torch.randn(4, 3, generator=g, requires_grad=True)
        _same_as_encode(enc, _msg(x * 2, step=7, mb=mb))
    assert enc.reused == 5
    for mb in range(4):  # a dict with a plain value, a mask without gradient, odd sizes
        obj = {"h": torch.randn(3, 5, generator=g), "mask": torch.rand(3, 7, generator=g) > 0.5,
               "n": 3, "ids": (torch.arange(5, dtype=torch.int16), None)}
        _same_as_encode(enc, _msg(obj, step=8, mb=mb, stages=(2, 3)))
    assert enc.reused == 5 + 3
    for mb in range(3):  # gradients with an absent member, another op
        msg = Message(Key(GRAD, 9, mb, 2, 1), [torch.randn(2, 2, generator=g), None])
        _same_as_encode(enc, msg, op=2)
    assert enc.reused == 5 + 3 + 2


@pytest.mark.parametrize("change", ["shape", "dtype", "flag", "spec value", "spec type", "op",
                                    "stage", "capacity"])
def test_a_message_unlike_the_last_is_encoded_afresh(change: str) -> None:
    enc = Encoder(src_rank=0)
    base = {"x": torch.ones(2, 3), "n": 1}
    _same_as_encode(enc, _msg(base, 1, 0))
    obj: dict[str, object] = dict(base)
    op, stages, capacity = 0, (1, 2), INLINE_BYTES
    if change == "shape":
        obj["x"] = torch.ones(3, 2)
    elif change == "dtype":
        obj["x"] = torch.ones(2, 3, dtype=torch.float64)
    elif change == "spec value":
        obj["n"] = 2
    elif change == "spec type":
        obj["n"] = True  # == 1 in Python; "true" on the wire
    elif change == "op":
        op = 1
    elif change == "stage":
        stages = (1, 3)
    elif change == "capacity":
        obj["x"] = torch.ones(2000)  # 8000 bytes: travels as a second send
        capacity = 16
    flags = [True] if change == "flag" else None
    _same_as_encode(enc, _msg(obj, 1, 1, stages=stages, flags=flags), op, capacity)
    assert enc.reused == 0


def test_same_spec_means_the_same_json() -> None:
    assert same_spec({"t": 0}, {"t": 0})
    assert same_spec(["dict", {"a": {"t": 0}, "b": {"v": None}}],
                     ["dict", {"a": {"t": 0}, "b": {"v": None}}])
    assert not same_spec({"v": 1}, {"v": True})
    assert not same_spec({"v": 1}, {"v": 1.0})
    assert not same_spec({"v": 0.0}, {"v": -0.0})
    assert same_spec({"v": float("nan")}, {"v": float("nan")})
    assert not same_spec(["dict", {"a": {"t": 0}, "b": {"t": 1}}],
                         ["dict", {"b": {"t": 1}, "a": {"t": 0}}])  # key order travels
    assert not same_spec(["tuple", [{"t": 0}]], ["list", [{"t": 0}]])
    assert not same_spec(None, {"t": 0})


def test_an_end_of_step_message_round_trips_through_the_encoder() -> None:
    enc = Encoder(src_rank=2)
    for step in range(3):
        msg = Message(Key(DONE, step, 2, -1, -1),
                      [torch.arange(6, dtype=torch.float64) + step, torch.tensor(0.5)])
        _same_as_encode(enc, msg)
    assert enc.reused == 2


def test_every_buffer_gloo_holds_is_torchs_own_memory_not_numpys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sends (written afresh or from a kept header, with the payload behind or apart) and
    posted receives are memory torch allocated, not tensors over numpy arrays: gloo's threads
    may drop one at the process's exit, and a tensor over a numpy array then needs the GIL of
    an interpreter shutting down, which aborts the process."""
    from pipetrain.runtime.transport.wire import new_buffer

    over_numpy: list[torch.Tensor] = []  # kept alive: their memory cannot be handed out again
    wrap = torch.from_numpy

    def recorded(array: object) -> torch.Tensor:
        over_numpy.append(wrap(array))
        return over_numpy[-1]

    monkeypatch.setattr(torch, "from_numpy", recorded)
    enc = Encoder(src_rank=0)
    x = torch.randn(4, 3)
    sends = [encode(_msg(x, 0, 0), 0), encode(_msg(x, 0, 0), 0, capacity=16),
             enc(_msg(x, 0, 0), 0, INLINE_BYTES), enc(_msg(x, 0, 1), 0, INLINE_BYTES)]
    assert enc.reused == 1 and sends[1][1] is not None  # the payload apart, once
    held = [send[0] for send in sends] + [sends[1][1], new_buffer()[0]]
    numpys = {t.untyped_storage().data_ptr() for t in over_numpy}
    assert not [t for t in held if t.untyped_storage().data_ptr() in numpys]


def test_a_send_buffer_given_back_is_written_again_as_encode_writes_it() -> None:
    """Once its send completed, a route's buffer is handed back (``Encoder.done``) and the
    route's next message is written into the same memory, its bytes still encode's; a buffer
    not handed back is never written again."""
    enc = Encoder(src_rank=3)
    g = torch.Generator().manual_seed(1)
    obj = lambda: {"h": torch.randn(3, 5, generator=g), "n": 2,  # noqa: E731
                   "m": torch.rand(7, generator=g) > 0.5}
    _same_as_encode(enc, _msg(obj(), 0, 0))  # the first, encoded afresh: kept as the form
    held = enc(_msg(obj(), 0, 1), 0, INLINE_BYTES)  # never handed back (its send failed)
    assert held.home is not None
    snapshot = held.first.clone()
    sent = enc(_msg(obj(), 0, 2), 0, INLINE_BYTES)
    assert sent.home is not None and sent.first.data_ptr() != held.first.data_ptr()
    Encoder.done(sent.first, sent.home)
    for mb in range(3, 6):
        msg = _msg(obj(), 1, mb)
        again = enc(msg, 0, INLINE_BYTES)
        assert again.first.data_ptr() == sent.first.data_ptr()  # the same memory
        assert torch.equal(again.first, encode(msg, 3, 0, INLINE_BYTES)[0])
        assert again.home is not None
        Encoder.done(again.first, again.home)
    assert torch.equal(held.first, snapshot)  # untouched


def test_a_large_or_fresh_send_has_no_home() -> None:
    enc = Encoder(src_rank=0)
    assert enc(_msg(torch.ones(3), 0, 0), 0, INLINE_BYTES).home is None  # afresh
    assert enc(_msg(torch.ones(3), 0, 1), 0, INLINE_BYTES).home is not None
    big = torch.ones(300_000)  # 1.2 MB: its copy dwarfs an allocation
    enc(_msg(big, 0, 0, kind=GRAD), 0, 1 << 21)
    assert enc(_msg(big, 0, 1, kind=GRAD), 0, 1 << 21).home is None
