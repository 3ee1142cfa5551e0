"""Peak memory meter: distinct storages, the measured step, and a known allocation's peak."""

from __future__ import annotations

import torch

from pipetrain.train.memory import MemoryMeter, _peak, tensor_bytes

MIB = 2**20


def test_tensor_bytes_counts_each_storage_once() -> None:
    a = torch.zeros(256, 256)  # 256 KiB
    b = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes([a, a.view(-1), a[1:], b, torch.zeros(3, device="meta")]) == 256 * 1024 + 80


def _step(size_mib: int) -> None:
    x = torch.ones(size_mib * MIB // 4)
    y = x * 2  # two buffers alive at once, then both freed
    del x, y


def test_cpu_measures_the_second_step_on_top_of_what_is_held() -> None:
    held = [torch.zeros(MIB // 4)]  # 1 MiB
    calls: list[int] = []

    def listed() -> list[torch.Tensor]:
        calls.append(1)
        return held

    meter = MemoryMeter(torch.device("cpu"), steps=3)
    with meter.step(listed):
        _step(64)  # the first step is not measured
    assert meter.peak_bytes is None
    with meter.step(listed):
        _step(8)
    peak = meter.peak_bytes
    assert peak is not None and 17 * MIB <= peak < 18 * MIB
    with meter.step(listed):
        _step(32)  # later steps repeat the measured one's allocations: not measured
    assert meter.peak_bytes == peak
    assert len(calls) == 1  # what the rank holds is listed for the measured step only


def test_a_one_step_run_measures_its_only_step() -> None:
    meter = MemoryMeter(torch.device("cpu"), steps=1)
    with meter.step(list):
        _step(4)
    assert meter.peak_bytes is not None and 8 * MIB <= meter.peak_bytes < 9 * MIB


def test_an_address_handed_out_again_was_freed_unseen() -> None:
    # (time, size, address): a free is a negative size
    events = [(0, 100, 1), (1, 50, 2), (2, -50, 2), (3, 30, 1), (4, 10, 3)]
    assert _peak(events) == 150  # address 1's 100 bytes were freed before its 30 came
    assert _peak([(0, 100, 1), (1, -40, 9), (2, 20, 2)]) == 100  # 9: made before the block
    assert _peak([(0, 100, 1), (1, 100, 2), (2, -100, 1), (3, -100, 2)]) == 200
