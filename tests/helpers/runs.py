"""A ``pipetrain train`` run in this process, as a user's shell would start it (no
``PIPETRAIN_`` variables), and the records of its log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import main


def train(argv: list[str], out: Path) -> dict[str, Any]:
    """Run ``pipetrain`` with ``argv`` (which must succeed) and return ``out``'s summary."""
    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
            env.delenv(key)
        assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def records(out: Path, kind: str) -> list[dict[str, Any]]:
    """The records of ``out/log.jsonl`` of one kind (``step``, ``data``, ``start``, ...)."""
    lines = (out / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]
