"""Shared capture: one rank of a pipeline group exports the model, the others load its program.

Every rank of a pipeline needs the same graph, and torch.export takes seconds (a symbolic trace
of every op). So rank 0 of the group exports, and its program travels to the others through the
job's store, as
``torch.export.save`` writes it but without the model's tensors (meta tensors stand in for its
parameters and buffers: what travels is the graph, its signature and export's own constants).
Each other rank loads it and builds its capture on its own model's tensors::

    rank 0      export ──► save (no weights) ──► store[key] ──► its capture
    rank r > 0  ........ wait for store[key] ──► load ──► its capture, on its own tensors

Loading is not free: torch's loader builds every node's fake tensors again, so a load took
half of an export's CPU for GPT ``small`` (``benchmarks/capture.py``; 0.45 at fixed shapes,
where both are cheaper).
What sharing guarantees is that every rank splits the very same graph: a
rank whose model or example differs from rank 0's (their
:func:`~pipetrain.split.capture_reuse.key` differs), or whose loaded graph does not print as rank
0's, captures on its own instead, as does every rank when rank 0 could not save its program.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.runtime.torch_distributed import default_store
from pipetrain.runtime.torch_private import program_state, program_state_swapped
from pipetrain.split import capture_reuse
from pipetrain.split.capture import (
    RECALL,
    Captured,
    _bind,
    capture,
    export,
    from_program,
    on_model_device,
)

__all__: list[str] = []

START_S = 120.0
"""The longest a rank waits for rank 0 to start its export (it reaches the pipeline later)."""
WAIT_S = 1800.0
"""The longest a rank then waits for rank 0's program (an export of a very large model)."""
_OWN = b"-"  # rank 0's word for "capture on your own"
_count: dict[tuple[int, ...], int] = {}  # per group (its ranks): captures shared so far
_WIDER: list[dist.ProcessGroup] = []  # the innermost ``across`` group


@contextlib.contextmanager
def across(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Share the captures made inside with all of ``group``, not the pipeline group alone:
    for pipelines that every rank of ``group`` builds at once, of the same model (the replicas
    of ``pipetrain train``, each its own pipeline group: one export for the job). None:
    no change."""
    if group is None:
        yield
        return
    _WIDER.append(group)
    try:
        yield
    finally:
        _WIDER.pop()


def capture_shared(model: nn.Module, example: Any, group: dist.ProcessGroup,
                   dynamic: bool = True) -> Captured:
    """:func:`~pipetrain.split.capture.capture` of ``model`` on ``example`` (``dynamic`` as
    there), exported once in ``group`` (every rank of it calls this, in the same order as its
    other collectives).

    Raises:
        PartitionError: as ``capture`` does (on every rank: the others export on their own
            when rank 0 could not).
        PipelineError: when rank 0 does not start its export within :data:`START_S`, or its
            program does not come within :data:`WAIT_S`.
    """
    group = _WIDER[-1] if _WIDER else group
    if dist.get_world_size(group) < 2:
        return capture(model, example, dynamic)
    example = on_model_device(model, example)
    signature = inspect.signature(model.forward)
    bound = _bind(signature, example)
    k = capture_reuse.key(model, example, dynamic)
    digest = hashlib.sha256(repr(k).encode()).hexdigest()
    members = tuple(dist.get_process_group_ranks(group))  # (a key of this group's own: another
    n = _count[members] = _count.get(members, -1) + 1  # group with this rank 0 counts apart)
    name = f"pipetrain/capture/{'-'.join(map(str, members))}/{n}"
    store = default_store()
    kept = RECALL.get(k, model)
    if dist.get_rank(group) == 0:
        return _export_and_share(model, signature, bound, kept, k, digest, store, name,
                                 dynamic)
    _fetch(store, f"{name}/start", START_S, "start exporting the model")
    payload = _fetch(store, name, WAIT_S, "share its capture of the model")
    if store.add(f"{name}/read", 1) == dist.get_world_size(group) - 1:
        for key in (name, f"{name}/start", f"{name}/read"):  # the last reader
            store.delete_key(key)
    if kept is not None:
        return kept  # type: ignore[no-any-return]
    try:
        captured, why = (None, "") if payload == _OWN else _load(payload, model, signature,
                                                                 bound, digest, dynamic)
    except Exception as e:  # noqa: BLE001  (a program this process cannot load)
        captured, why = None, f"rank 0's program does not load here: {e!r}"
    if why:
        warnings.warn(f"[rank {dist.get_rank()}] captures on its own: {why}", stacklevel=2)
    if captured is None:  # (without a word where its model or example is not rank 0's)
        return capture(model, example, dynamic)
    RECALL.put(k, captured, model)
    return captured


def _export_and_share(model: nn.Module, signature: inspect.Signature,
                      bound: inspect.BoundArguments, kept: Any, k: Any, digest: str,
                      store: Any, name: str, dynamic: bool) -> Captured:
    store.set(f"{name}/start", b"")
    if kept is not None:  # captured here before; the others may not have: they export
        store.set(name, _OWN)
        return kept  # type: ignore[no-any-return]
    try:
        program, seconds = export(model, bound, dynamic)
    except BaseException:
        store.set(name, _OWN)  # they fail alike on their own
        raise
    captured = from_program(program, model, signature, bound, seconds, dynamic=dynamic)
    try:
        payload = _payload(program, model, captured, digest)
    except Exception as e:  # noqa: BLE001  (what the program holds may not save)
        warnings.warn(f"[rank {dist.get_rank()}] could not share its capture, every rank "
                      f"captures on its own: {e!r}", stacklevel=3)
        payload = _OWN
    store.set(name, payload)
    RECALL.put(k, captured, model)
    return captured


def _payload(program: torch.export.ExportedProgram, model: nn.Module, captured: Captured,
             digest: str) -> bytes:
    """``program`` saved with meta tensors for ``model``'s, behind a JSON head: the recall
    key's digest, the graph's, and which ``get_attr`` targets read which model tensor."""
    owned = capture_reuse.names_by_id(model)
    named = {t: owned[id(v)] for t, v in captured.attrs.items()
             if isinstance(v, torch.Tensor) and id(v) in owned}
    state, constants = program_state(program)
    with program_state_swapped(
            program, {n: _meta(t) for n, t in state.items()},
            {n: _meta(t) if isinstance(t, torch.Tensor) and id(t) in owned else t
             for n, t in constants.items()}):
        out = io.BytesIO()
        torch.export.save(program, out)
    head = json.dumps({"key": digest, "graph": _graph_digest(captured), "named": named})
    return len(head).to_bytes(8, "little") + head.encode() + out.getvalue()


def _load(payload: bytes, model: nn.Module, signature: inspect.Signature,
          bound: inspect.BoundArguments, digest: str, dynamic: bool = True
          ) -> tuple[Captured | None, str]:
    """This rank's capture from rank 0's payload; or None, and why it does not serve (empty
    where this rank's model or example is not rank 0's)."""
    size = int.from_bytes(payload[:8], "little")
    head = json.loads(payload[8:8 + size])
    if head["key"] != digest:
        return None, ""
    program = torch.export.load(io.BytesIO(payload[8 + size:]))
    # this rank's own tensors, not the stand-ins
    captured = from_program(program, model, signature, bound, 0.0, head["named"], dynamic)
    if not all(t.is_meta for t in (*model.parameters(), *model.buffers())):
        stand_ins = [t for t, v in captured.attrs.items()
                     if isinstance(v, torch.Tensor) and v.is_meta]
        if stand_ins:
            return None, f"{stand_ins[:3]} have no tensor of this rank's model"
    if _graph_digest(captured) != head["graph"]:
        return None, "the loaded graph differs from rank 0's"
    return captured, ""


def _fetch(store: Any, name: str, limit: float, what: str) -> bytes:
    """The value under ``name``, once rank 0 set it, waiting at most ``limit`` seconds. (No
    news can end the wait: the pipeline being built has none yet; a launcher ends a job whose
    process died.)"""
    start, pause = time.monotonic(), 0.001
    while not store.check([name]):
        if time.monotonic() - start > limit:
            raise PipelineError(f"[rank {dist.get_rank()}] rank 0 of the pipeline group did "
                                f"not {what} within {limit:.0f} s: did it build the same "
                                "Pipeline? (every rank of the group builds it, in the same "
                                "order)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    value: bytes = store.get(name)
    return value


def _meta(t: Any) -> Any:
    if isinstance(t, nn.Parameter):
        return nn.Parameter(t.detach().to("meta"), requires_grad=t.requires_grad)
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _graph_digest(captured: Captured) -> str:
    return hashlib.sha256(str(captured.graph).encode()).hexdigest()
