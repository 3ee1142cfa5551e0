"""`--ft`'s pieces that need no process group: addresses, buckets, and bad input (exit 2)."""

from __future__ import annotations

import importlib.util
import socket
import time
from pathlib import Path

import pytest
import torch

from pipetrain.cli import main
from pipetrain.train.launch import replicas
from pipetrain.train.mesh import BUCKET_BYTES


def test_lighthouse_address_takes_host_port_or_a_url() -> None:
    assert replicas.lighthouse_url("node7:29510") == "http://node7:29510"
    assert replicas.lighthouse_url("http://10.0.0.2:29510/") == "http://10.0.0.2:29510"
    with pytest.raises(ValueError, match="give HOST:PORT"):
        replicas.lighthouse_url("node7")


def test_each_replica_writes_under_its_own_directory() -> None:
    assert replicas.replica_out("runs/a", 2) == str(Path("runs/a") / "replica-2")
    assert replicas.replica_out("", 2) == ""


def test_buckets_keep_order_dtype_and_size() -> None:
    big = torch.zeros(BUCKET_BYTES // 4 + 1)  # float32: over one bucket alone
    small = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    buckets = replicas._buckets([small[0], big, *small[1:]])
    assert [[t.numel() for t in b] for b in buckets] == [[3], [big.numel()], [2], [4]]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("argv, said", [
    (["--ft", "--dp", "1"], "give --dp 2 or more"),
    (["--ft", "--dp", "2", "--ft-min-replicas", "3"], "between 1 and --dp 2"),
    (["--ft", "--dp", "2", "--schedule", "pipedream-2bw"], "synchronous schedules"),
    (["--ft", "--dp", "2", "--ft-replica-id", "2", "--ft-lighthouse", "h:1"],
     "between 0 and --dp - 1 = 1"),
    (["--ft", "--dp", "2", "--ft-replica-id", "0"], "needs --ft-lighthouse"),
    (["--dp", "2", "--ft-replica-id", "0"], "belong to a run with --ft"),
    (["--ft", "--dp", "2", "--nproc", "3"], "which dp=2 does not divide"),
])
def test_bad_ft_settings_exit_2_saying_what_to_do(argv: list[str], said: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchft")
    assert main(["train", "--steps", "1", "--out", "", *argv]) == 2
    assert said in capsys.readouterr().err


def test_an_unreachable_lighthouse_exits_2_within_the_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchft")
    start = time.monotonic()
    code = main(["train", "--steps", "1", "--out", "", "--nproc", "1", "--ft", "--dp", "2",
                 "--ft-replica-id", "1", "--ft-lighthouse", f"127.0.0.1:{_closed_port()}",
                 "--timeout", "1"])
    assert code == 2 and time.monotonic() - start < 30  # --timeout 1, not the default 60
    assert "no Lighthouse answered within --timeout 1 s" in capsys.readouterr().err


def test_without_torchft_ft_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    assert main(["train", "--steps", "1", "--out", "", "--ft", "--dp", "2"]) == 2
    assert 'pip install "pipetrain[ft]"' in capsys.readouterr().err


def test_changes_name_who_left_and_who_joined_from_whom() -> None:
    said = replicas.Turnout(1.0, (0, 2), {2: 0})
    assert replicas.changes((0, 1), said, 5) == [
        ("replica_left", {"replica": 1, "step": 5}),
        ("replica_joined", {"replica": 2, "step": 5, "recovered_from": 0})]
    assert replicas.changes((0, 2), said, 6) == []


def test_the_local_launch_names_a_replica_that_stopped_for_good_and_why() -> None:
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.launch.elastic import JobFailed
    from pipetrain.train.launch.replica_launch import _Ended, _verdict

    why = "the job failed after 3 restarts: rank 0 failed first: killed by SIGKILL (pid 7)"
    cfg = TrainConfig(ft=True, dp=3, out="", max_restarts=3)
    ok, failed = _Ended(0, ""), _Ended(1, why)
    with pytest.raises(JobFailed) as e:
        _verdict(cfg, [ok, failed, ok])
    assert str(e.value) == (f"replica 1 stopped for good after 3 restarts (--max-restarts 3), "
                            f"exit code 1: {why}\nreplicas 0, 2 finished")
    let_go = TrainConfig(ft=True, dp=3, out="runs/a", max_restarts=0)
    with pytest.raises(JobFailed) as e:
        _verdict(let_go, [_Ended(1, ""), _Ended(1, why), ok])
    assert str(e.value).splitlines() == [
        "replica 0 stopped for good, not restarted (--max-restarts 0 lets a failed replica go), "
        "exit code 1: its error is above",
        "replica 1 stopped for good, not restarted (--max-restarts 0 lets a failed replica go), "
        f"exit code 1: {why}",
        f"replica 2 finished (under {Path('runs/a') / 'replica-2'})"]
    assert _verdict(cfg, [ok, ok, ok]) == {}


@pytest.mark.parametrize(("argv", "restarts"), [
    (["--ft", "--dp", "2"], 3), (["--ft", "--dp", "2", "--max-restarts", "0"], 0),
    (["--dp", "2"], 0), (["--ft", "--dp", "2", "--max-restarts", "5"], 5)])
def test_ft_restarts_a_failed_replica_unless_told_not_to(argv: list[str], restarts: int
                                                         ) -> None:
    """--ft's promise (a failed replica comes back and recovers from a peer) needs no second
    flag: a bounded number of restarts by default, printed in the config line."""
    from pipetrain.cli import build_parser
    from pipetrain.train.commands.train_command import FT_RESTARTS, resolved
    from pipetrain.train.config import format_config

    pytest.importorskip("torchft")
    cfg = resolved(build_parser().parse_args(["train", "--nproc", "4", *argv]), env={})[0]
    assert cfg.max_restarts == restarts and FT_RESTARTS == 3
    assert f"max_restarts={restarts}" in format_config(cfg)


def test_a_replicas_stderr_passes_through_and_its_last_verdict_is_kept(
        capfd: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    from pipetrain.train.launch.replica_launch import _Tee

    script = ("import sys; w = sys.stderr.write; w('pipetrain train: restart 1\\n'); "
              "w('pipetrain train: the job failed: rank 1 failed first\\n'); "
              "w('  then rank 0: exit code 1\\n'); w('done\\n')")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    tee = _Tee(proc)
    proc.wait()
    assert tee.joined() == "the job failed: rank 1 failed first\n  then rank 0: exit code 1"
    assert "pipetrain train: restart 1\n" in capfd.readouterr().err
