"""grad_mismatches given a Pipeline in one process: what each line of its answer names."""

from __future__ import annotations

import torch

from pipetrain.testing import grad_mismatches
from test_testing_dist import _dropping, _stepped


def test_a_local_pipeline_names_each_problem() -> None:
    pipe, ref = _stepped(local_ranks=2)
    assert grad_mismatches(pipe, ref) == []
    assert grad_mismatches(_dropping(pipe, "1.0.bias", "6.0.weight"), ref) == [
        "1.0.bias: held by no stage", "6.0.weight: held by no stage"]
    assert grad_mismatches(_dropping(pipe, "6.0.weight"), ref, skip={"6.0.weight"}) == []
    named = dict(pipe.named_parameters())
    with torch.no_grad():
        named["2.0.weight"].grad[0, 0] += 0.5  # type: ignore[index]
    assert grad_mismatches(pipe, ref) == ["2.0.weight: max abs difference 0.5"]
    named["2.0.weight"].grad = None
    assert grad_mismatches(pipe, ref) == ["2.0.weight: grad is None on one side only"]


def test_pairs_outside_a_job_are_this_process_only() -> None:
    pipe, ref = _stepped(local_ranks=2)
    pairs = [(n, p) for n, p in pipe.named_parameters() if not n.startswith("7.")]
    pairs.append(("extra.weight", pairs[0][1]))
    assert grad_mismatches(pairs, ref) == [
        "extra.weight: not a parameter name of the reference model",
        "7.0.weight: held by no stage", "7.0.bias: held by no stage"]
