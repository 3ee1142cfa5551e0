"""The layout's open degree, inferred from the world (`pipetrain.train.degrees`)."""

from __future__ import annotations

from typing import Any

import pytest

from pipetrain.cli import build_parser
from pipetrain.train.commands.train_command import resolved
from pipetrain.train.degrees import open_degree, said


@pytest.mark.parametrize(("given", "world", "inferred"), [
    ({}, 8, {}),                                        # --pp open: the layout infers it
    ({"dp": 2}, 8, {}),
    ({"pp": 2}, 4, {"dp": 2}),
    ({"pp": 2, "tp": 2}, 8, {"dp": 2}),
    ({"pp": 2, "fsdp": 2}, 8, {"dp": 2}),
    ({"pp": 2, "dp": 2}, 8, {"fsdp": 2}),
    ({"pp": 2, "dp": 1, "tp": 2}, 8, {"fsdp": 2}),
    ({"pp": 2, "dp": 2, "fsdp": 1}, 4, {}),             # every degree given
    ({"pp": 4}, 4, {"dp": 1}),
])
def test_the_one_open_degree_follows_from_the_world(given: dict[str, Any], world: int,
                                                    inferred: dict[str, int]) -> None:
    assert open_degree(given, world) == inferred


@pytest.mark.parametrize(("given", "world", "message"), [
    ({"pp": 3}, 4, "the world has 4 ranks, which pp=3 does not divide, so --dp cannot be "
                   "inferred; start a multiple of 3 processes (--nproc) or give --dp"),
    ({"pp": 2, "dp": 3}, 8, "which pp=2 x dp=3 does not divide, so --fsdp cannot be inferred"),
])
def test_a_world_the_given_degrees_do_not_divide_names_them(given: dict[str, Any], world: int,
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_degree(given, world)


def test_the_printed_line_says_what_and_from_what() -> None:
    assert said({"dp": 2}, 8, {"pp": 2, "tp": 2}) == (
        "--dp 2 (inferred: 8 ranks / pp=2 x tp=2; give --dp to set it)")
    assert said({"fsdp": 2}, 4, {"pp": 2, "dp": 1}) == (
        "--fsdp 2 (inferred: 4 ranks / pp=2 x dp=1; give --fsdp to set it)")


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1"}


@pytest.mark.parametrize(("argv", "env", "layout", "line"), [
    (["--nproc", "4", "--pp", "2"], {}, (2, 2, 1), "--dp 2 (inferred: 4 ranks / pp=2;"),
    (["--nproc", "2", "--pp", "2"], TORCHRUN, (2, 4, 1), "--dp 4 (inferred: 8 ranks / pp=2;"),
    (["--pp", "2", "--dp", "2"], TORCHRUN, (2, 2, 2), "--fsdp 2 (inferred: 8 ranks / pp=2 x "
                                                      "dp=2;"),
    (["--nproc", "4", "--pp", "4"], {}, (4, 1, 1), ""),  # dp 1: nothing to say
    (["--nproc", "4"], {}, (None, 1, 1), ""),
])
def test_the_command_infers_from_nproc_or_torchruns_world(
        argv: list[str], env: dict[str, str], layout: tuple[int | None, int, int],
        line: str) -> None:
    cfg, _, inferred = resolved(build_parser().parse_args(["train", *argv]), env=env)
    assert (cfg.pp, cfg.dp, cfg.fsdp) == layout
    assert inferred.startswith(line) and bool(inferred) == bool(line)


def test_a_toml_key_counts_as_given(tmp_path: Any) -> None:
    path = tmp_path / "run.toml"
    path.write_text("pp = 2\ndp = 2\n")
    cfg, _, inferred = resolved(build_parser().parse_args(
        ["train", "--config", str(path), "--nproc", "8"]), env={})
    assert (cfg.dp, cfg.fsdp) == (2, 2) and inferred.startswith("--fsdp 2")


def test_one_ft_replicas_world_needs_dp_given() -> None:
    pytest.importorskip("torchft")
    args = build_parser().parse_args(["train", "--pp", "2", "--ft", "--ft-replica-id", "0",
                                      "--ft-lighthouse", "127.0.0.1:1"])
    with pytest.raises(ValueError, match="this world is one replica, so --dp"):
        resolved(args, env={**TORCHRUN, "WORLD_SIZE": "2"})
    given = build_parser().parse_args(["train", "--pp", "2", "--dp", "2", "--ft",
                                       "--ft-replica-id", "0", "--ft-lighthouse", "h:1"])
    cfg = resolved(given, env={**TORCHRUN, "WORLD_SIZE": "2"})[0]
    assert (cfg.dp, cfg.fsdp) == (2, 1)  # 2 ranks a replica x 2 replicas = pp 2 x dp 2
