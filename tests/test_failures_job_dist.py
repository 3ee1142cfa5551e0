"""Failures across a whole job: data-parallel replicas learn of a failure in another replica's
pipeline (ordinary modules, and a Hugging Face Llama fed bad token ids), and a plain ``env://``
job (rank 0 hosts the store) keeps the news readable."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipetrain as pt
from pipetrain.runtime.launch import free_port
from pipetrain.train.mesh import GradReducer, build_mesh
from test_failures_scale_dist import Fault

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

TIMEOUT = 30.0  # far above the time news takes: a rank that only timed out fails the test
HANG_TIMEOUT = 6.0
HANG_S = HANG_TIMEOUT + 10.0  # past a peer's timeout, its 2.5 s probe, and 7.5 s of slack


def _pipeline(group: dist.ProcessGroup | None, schedule: str, n_stages: int, how: str,
              holder: list[int]) -> tuple[pt.Pipeline, list[Fault]]:
    """Linear + Fault per stage; ``holder[pipeline rank]`` is the global rank arming them."""
    torch.manual_seed(0)
    Fault.hang_s = HANG_S
    faults = [Fault(-1) for _ in range(n_stages)]
    layers = [m for fault in faults for m in (nn.Linear(4, 4), fault)]
    pipe = pt.Pipeline(nn.Sequential(*layers), schedule, 8, nn.MSELoss(), group=group,
                       balance=[2] * n_stages, timeout=HANG_TIMEOUT if how == "hang" else TIMEOUT)
    for s, fault in enumerate(faults):
        fault.rank = holder[pipe.schedule.rank_of(s)]
    return pipe, faults


def _dp_case(how: str, culprit: int) -> str:
    """dp 2 x pp 2 (fresh groups: a failed job's groups hold unfinished collectives): a good
    step, then one where global rank ``culprit``'s stage fails ``how``. Placed dp-outer
    (replica 0 is ranks 0 and 1), the ranks the test names."""
    mesh = build_mesh(2, 2, order="dp-outer")
    pp_ranks = [mesh.global_rank(mesh.dp_rank, p) for p in range(2)]
    pipe, _ = _pipeline(mesh.pp_group, "1f1b", 2, how, pp_ranks)
    reducer = GradReducer({s: list(st.parameters()) for s, st in pipe.stages.items()},
                          mesh.dp_group, mesh.dp)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    start = 0.0
    for step in range(2):
        if step == 1:
            Fault.armed, start = (culprit, how), time.monotonic()
        try:
            pipe.step(x, y, on_grads_ready=reducer.hook)
            reducer.finish()
        except pt.PipelineError as e:
            return f"{time.monotonic() - start:.2f} {e}"
        finally:
            Fault.armed = None
    return "no error"


def _dp_llama_case(culprit: int) -> str:
    """A Hugging Face Llama built from a config, in dp 2 x pp 2: at step 1 global rank
    ``culprit`` (stage 0 of replica 1) gets token ids beyond the vocabulary, so its embedding
    fails inside the captured graph."""
    from helpers import hf

    mesh = build_mesh(2, 2, order="dp-outer")
    torch.manual_seed(0)
    inputs, targets = hf.batch("llama", rows=8, seq=10)
    pipe = pt.Pipeline(hf.llama(), "1f1b", 4, hf.LOSSES["llama"], group=mesh.pp_group,
                       split_points=hf.points("llama", 2), example_inputs=inputs,
                       timeout=TIMEOUT)
    reducer = GradReducer({s: list(st.parameters()) for s, st in pipe.stages.items()},
                          mesh.dp_group, mesh.dp)
    start = 0.0
    for step in range(2):
        ids = inputs["input_ids"]
        if step == 1:
            start = time.monotonic()
            ids = ids + hf.VOCAB if mesh.rank == culprit else ids
        try:
            pipe.step(pipe.pack(input_ids=ids), targets, on_grads_ready=reducer.hook)
            reducer.finish()
        except pt.PipelineError as e:
            return f"{time.monotonic() - start:.2f} {e}"
    return "no error"


def _dp_cases(ctx: pt.RankContext, cases: list[tuple[str, int]], out: str) -> None:
    results = []
    for how, culprit in cases:
        results.append(_dp_llama_case(culprit) if how == "llama ids" else _dp_case(how, culprit))
        Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(results))


def _check(out: Path, texts_of: dict[int, list[str]] | None, case: int, survivors: list[int],
           named: str | tuple[str, ...], bound: float) -> None:
    texts = texts_of or {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    got = {r: texts[r][case] for r in survivors}
    late = {r: t for r, t in got.items() if not 0 <= float(t.split()[0]) < bound}
    assert late == {}, f"case {case}: ranks that failed late or not at all: {late}"
    names = (named,) if isinstance(named, str) else named
    quiet = {r: t for r, t in got.items() if not any(n in t for n in names)}
    assert quiet == {}, f"case {case}: errors not naming {named!r}: {quiet}"


# in CI: a replica's failure: test_replicas_dist.py
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_every_replica_learns_of_a_failure_in_another(tmp_path: Path) -> None:
    # global rank 3 is pipeline rank 1 of replica 1; rank 1 hangs in replica 0; rank 2 feeds
    # a Llama bad token ids, then dies
    pytest.importorskip("transformers")
    cases = [("raise", 3), ("shape", 0), ("hang", 1), ("llama ids", 2), ("kill", 2)]
    with pytest.raises(pt.PipelineError, match="rank 2 ---\nprocess exited with code 3"):
        pt.launch(_dp_cases, 4, cases, str(tmp_path), timeout=300)
    texts = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    _check(tmp_path, texts, 0, [0, 1, 2], "rank 3 (rank 1 of its pipeline) failed at stage 1",
           TIMEOUT / 2)
    assert "RuntimeError('injected failure')" in texts[0][0]  # the cause, in another replica
    _check(tmp_path, texts, 1, [0, 1, 2, 3], ("rank 1 failed at stage 1", "[rank 1 | stage 1"),
           TIMEOUT / 2)
    _check(tmp_path, texts, 2, [0, 2, 3], "rank 1 is stuck in its own stage code", 3 * HANG_TIMEOUT)
    _check(tmp_path, texts, 3, [0, 1, 2, 3], ("rank 2 (rank 0 of its pipeline) failed at stage 0",
                                              "[rank 2 (rank 0 of its pipeline) | stage 0"),
           TIMEOUT / 2)
    assert "index out of range" in texts[1][3]  # the cause, read in the other replica
    _check(tmp_path, texts, 4, [0, 1, 3], "rank 2", TIMEOUT / 2)


# ------------------------------------------------------------ a user's own env:// launcher


def _user_rank(rank: int, world: int, port: int, out: str, how: str, culprit: int) -> None:
    """What a user writes: env:// rendezvous (rank 0 hosts the store), pipe.step in a loop."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipe, _ = _pipeline(None, "1f1b", world, how, list(range(world)))
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    text, start = "no error", 0.0
    for step in range(2):
        if step == 1:
            Fault.armed, start = (culprit, how), time.monotonic()
        try:
            pipe.step(x, y)
        except pt.PipelineError as e:
            text = f"{time.monotonic() - start:.2f} {e}"
            break
    Path(out, f"rank{rank}.json").write_text(json.dumps([text]))
    dist.destroy_process_group()  # as torch asks; a failed rank 0 then keeps the store up


@pytest.mark.long  # a hang in a user's own launcher, named: test_failures_exit_dist.py
def test_a_plain_env_job_names_a_hung_rank_on_every_rank(tmp_path: Path) -> None:
    # ranks 0, 1 and 3 time out and probe at about the same time; rank 0's script then ends
    # while the others may still probe (a race the store's host lingering at exit removes)
    try:
        mp.start_processes(_user_rank, (4, free_port(), str(tmp_path), "hang", 2), nprocs=4,
                           start_method="spawn")
    except mp.ProcessExitedException as e:  # noted: gloo's teardown after the hung rank's
        # late failure (its sends to exited peers) can abort that process once it is done
        assert e.error_index == 2 and e.signal_name == "SIGABRT", e
        assert (tmp_path / "rank2.json").exists(), e
    _check(tmp_path, None, 0, [0, 1, 3], "rank 2 is stuck in its own stage code: 2F0 of step 1",
           3 * HANG_TIMEOUT)
