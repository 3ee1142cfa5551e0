"""Wire codec and mailbox: encode/decode round trips, capacities, header checks, deadline waits."""

from __future__ import annotations

import pytest
import torch

from pipetrain.errors import CommError
from pipetrain.runtime.transport.payload import DTYPES, flatten
from pipetrain.runtime.transport.wire import (
    ABORT,
    ACT,
    DONE,
    FRAME_BYTES,
    GRAD,
    HEADER_BYTES,
    HEADER_LEN,
    INLINE_BYTES,
    MAX_DIMS,
    MAX_TENSORS,
    WINDOW,
    Capacity,
    Key,
    Message,
    decode,
    encode,
    expected_bytes,
    inline_payload,
    new_frame,
    read_header,
)

CPU = torch.device("cpu")
_FIXED, _PER_TENSOR = 16, 12  # header layout: fixed fields, then per-tensor slots


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _header(frame: torch.Tensor) -> list[int]:
    return read_header(frame)


def _round_trip(msg: Message, src_rank: int = 3, op: int = 2,
                capacity: int = INLINE_BYTES) -> tuple[list[int], Message]:
    first, separate, size = encode(msg, src_rank, op, capacity)
    header = _header(first)
    assert first.dtype == torch.uint8 and first.dim() == 1
    assert first.numel() == HEADER_BYTES + (size if separate is None else 0)
    assert len(header) == HEADER_LEN
    payload = inline_payload(header, first)
    assert (payload is None) == (separate is not None) == (header[12] == 0)
    payload = separate if payload is None else payload
    assert payload is not None and payload.dtype == torch.uint8 and payload.dim() == 1
    assert header[9] == size == payload.numel() == expected_bytes(header)
    assert header[6] == src_rank and header[10] == op
    received = new_frame(capacity)  # what a receiver posts; the send may fill only part of it
    assert received.numel() == HEADER_BYTES + capacity
    received[:first.numel()].copy_(first)
    inside = inline_payload(read_header(received), received)
    return header, decode(header, payload.clone() if inside is None else inside)


def _assert_same_tensors(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g is not None
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


SHAPES = [(), (5,), (2, 3, 4, 5), (0,), (3, 0, 2)]
DTYPE_CASES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPE_CASES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_one_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    key = Key(ACT, step=4, mb=7, src_stage=1, dst_stage=2)
    header, got = _round_trip(Message(key, [t]))
    assert got.key == key
    assert got.spec is None
    assert got.requires_grad == [False]
    _assert_same_tensors(got.tensors, [t])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_wire_dtype(dtype: torch.dtype) -> None:
    t = _tensor(dtype, (3, 5))  # odd byte counts for 1-byte dtypes exercise the padding
    _, got = _round_trip(Message(Key(GRAD, 0, 0, 1, 0), [t, t[:1]]))
    _assert_same_tensors(got.tensors, [t, t[:1]])


def test_round_trip_many_tensors_none_entries_flags_and_spec() -> None:
    payload = {"h": torch.randn(2, 3), "ids": torch.arange(5), "scale": 0.5, "name": "x",
               "mask": torch.ones(2, dtype=torch.bool), "aux": (torch.randn(4).bfloat16(), None)}
    tensors, spec = flatten(payload)
    sent: list[torch.Tensor | None] = [tensors[0], None, tensors[1], tensors[2], None, tensors[3]]
    flags = [True, False, False, False, False, True]
    msg = Message(Key(ACT, 1, 2, 0, 1), sent, spec, flags)
    header, got = _round_trip(msg)
    assert got.spec == spec
    assert got.requires_grad == flags
    _assert_same_tensors(got.tensors, sent)
    assert [header[_FIXED + i * _PER_TENSOR] for i in range(len(sent))] == [1, 0, 1, 1, 0, 1]


def test_absent_gradients_cost_no_payload() -> None:
    first, separate, size = encode(Message(Key(GRAD, 0, 0, 1, 0), [None, None]), 0)
    header = _header(first)
    assert separate is None and header[9] == size == 0 and header[7] == 2
    assert first.numel() == HEADER_BYTES
    _, got = _round_trip(Message(Key(GRAD, 0, 0, 1, 0), [None, None]))
    assert got.tensors == [None, None] and got.requires_grad == [False, False]


def test_non_contiguous_tensor_round_trips() -> None:
    t = torch.randn(4, 6)[:, ::2].t()
    _, got = _round_trip(Message(Key(ACT, 0, 0, 0, 1), [t]))
    _assert_same_tensors(got.tensors, [t])


def test_no_tensors_only_spec() -> None:
    _, got = _round_trip(Message(Key(ACT, 0, 0, 0, 1), [], {"v": 3}))
    assert got.tensors == [] and got.spec == {"v": 3}


def test_payload_is_16_byte_aligned() -> None:
    ts: list[torch.Tensor | None] = [torch.ones(3, dtype=torch.uint8), torch.randn(3)]
    header = _header(encode(Message(Key(ACT, 0, 0, 0, 1), ts, {"v": "abc"}), 0, 0, 0)[0])
    assert header[9] % 16 == 0 and header[9] == 16 + 16 + 16
    assert header[8] == len(b'{"v":"abc"}')


def test_a_payload_within_the_capacity_travels_behind_the_header_a_larger_one_after_it() -> None:
    fits = torch.zeros(INLINE_BYTES // 4, dtype=torch.float32)  # exactly fills the capacity
    first, separate, _ = encode(Message(Key(ACT, 0, 0, 0, 1), [fits]), 0)
    assert separate is None and _header(first)[12] == 1 and first.numel() == FRAME_BYTES
    too_big = torch.zeros(INLINE_BYTES // 4 + 1, dtype=torch.float32)
    first, separate, _ = encode(Message(Key(ACT, 0, 0, 0, 1), [too_big]), 0)
    assert separate is not None and _header(first)[12] == 0 and first.numel() == HEADER_BYTES
    assert separate.numel() == _header(first)[9] == INLINE_BYTES + 16
    first, separate, _ = encode(Message(Key(ACT, 0, 0, 0, 1), [too_big]), 0, 0, INLINE_BYTES + 16)
    assert separate is None and first.numel() == FRAME_BYTES + 16  # a larger capacity: one send
    for t in (fits, too_big, torch.randn(40, 50)):
        for capacity in (INLINE_BYTES, 4 * 40 * 50, 1 << 16):
            msg = Message(Key(ACT, 0, 0, 0, 1), [t], {"t": 0}, [True])
            _, got = _round_trip(msg, capacity=capacity)
            _assert_same_tensors(got.tensors, [t])
            assert got.spec == {"t": 0} and got.requires_grad == [True]


def test_padding_sent_behind_the_header_is_zero() -> None:
    ts: list[torch.Tensor | None] = [torch.full((3,), 7, dtype=torch.uint8), torch.ones(5)]
    first, _, size = encode(Message(Key(ACT, 0, 0, 0, 1), ts, {"v": "abc"}), 0)
    body = first[HEADER_BYTES:].tolist()
    assert size == len(body) == 16 + 16 + 32
    assert body[11:16] == [0] * 5 and body[19:32] == [0] * 13 and body[52:] == [0] * 12


def test_a_receive_never_reads_past_what_was_agreed() -> None:
    first, _, _ = encode(Message(Key(ACT, 0, 0, 0, 1), [torch.ones(64)]), 0)
    header = _header(first)
    got = inline_payload(header, new_frame(256))
    assert got is not None and got.numel() == 256
    with pytest.raises(CommError, match="claims 256 payload bytes in the same message, but only "
                                        "128 were agreed"):
        inline_payload(header, new_frame(128))


def test_capacity_covers_the_largest_of_the_recent_cpu_payloads() -> None:
    c = Capacity()
    assert c.bytes == INLINE_BYTES  # every receive holds at least a small message
    c.record(100, on_device=False)
    assert c.bytes == INLINE_BYTES
    c.record(50_000, on_device=False)
    c.record(10_000_000, on_device=True)  # a GPU payload never travels behind the header
    assert c.bytes == 50_000
    for _ in range(WINDOW - 2):
        c.record(20_000, on_device=False)
    assert c.bytes == 50_000  # still within the window
    c.record(20_000, on_device=False)
    assert c.bytes == 20_000  # the 50,000-byte message left it


def test_too_many_tensors() -> None:
    key = Key(ACT, 0, 5, 0, 1)
    msg = Message(key, [torch.zeros(1)] * (MAX_TENSORS + 1))
    with pytest.raises(CommError) as e:
        encode(msg, 0)
    assert str(e.value) == (
        f"a activation of mb 5 from stage 0 to stage 1 (step 0) holds {MAX_TENSORS + 1} tensors; "
        f"at most {MAX_TENSORS} fit one message (pack them into fewer tensors)"
    )
    _round_trip(Message(key, [torch.zeros(1)] * MAX_TENSORS))  # the limit itself fits


def test_too_many_dims() -> None:
    with pytest.raises(CommError, match=f"9-d tensor; at most {MAX_DIMS} dims"):
        encode(Message(Key(ACT, 0, 0, 0, 1), [torch.zeros([1] * 9)]), 0)


def _header_of(*tensors: torch.Tensor) -> list[int]:
    return _header(encode(Message(Key(ACT, 0, 0, 0, 1), list(tensors), {"v": 1}), 0)[0])


def test_expected_bytes_matches_payload_size() -> None:
    header = _header_of(torch.randn(3, 5), torch.zeros(7, dtype=torch.uint8))
    assert expected_bytes(header) == 16 + 64 + 16 == header[9]


@pytest.mark.parametrize("field,value", [
    ("dtype", len(DTYPES)), ("dtype", -1),
    ("ndim", MAX_DIMS + 1), ("ndim", -1),
    ("dim", -3),
    ("n_tensors", MAX_TENSORS + 1), ("n_tensors", -1), ("n_tensors", 10**6),
    ("spec_bytes", -5),
])
def test_expected_bytes_rejects_a_corrupted_header(field: str, value: int) -> None:
    header = _header_of(torch.randn(3, 5))
    index = {"dtype": _FIXED + 1, "ndim": _FIXED + 3, "dim": _FIXED + 5,
             "n_tensors": 7, "spec_bytes": 8}[field]
    header[index] = value
    assert expected_bytes(header) == -1


def test_key_describe() -> None:
    assert Key(ACT, 3, 5, 1, 2).describe() == "activation of mb 5 from stage 1 to stage 2 (step 3)"
    assert Key(GRAD, 0, 1, 2, 1).describe() == "gradient of mb 1 from stage 2 to stage 1 (step 0)"
    assert Key(DONE, 9, 2, 0, 0).describe() == "end-of-step message of rank 2 (step 9)"
    assert Key(ABORT, 2, 4, 3, -1).describe() == "abort of mb 4 from stage 3 to stage -1 (step 2)"
    assert Key(42, 0, 0, 0, 1).describe() == "kind 42 of mb 0 from stage 0 to stage 1 (step 0)"
