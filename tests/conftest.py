"""The session's setup: the forkserver every ``pt.launch`` forks its ranks from, and the order
in which pytest-xdist's workers take the test files.

The forkserver imports once what the test ranks import (pytest, transformers and the models
the tests build) on top of pipetrain's own preload. The suite runs on two workers, a file
at a time (``-n 2 --dist loadfile`` in pyproject.toml), each computing on one thread: the
slowest files go out first, so the workers finish together instead of one running a long file
alone at the end.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipetrain.runtime.launch import start_context

# two workers share two cores with the ranks they start: one intra-op thread each, whose pool
# never spins while another worker's ranks wait for the core; the commands the tests start
# inherit the same
# (ranks set their own: pt.launch's threads=1, train's OMP_NUM_THREADS=1)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# inductor compiles in the process that asks (a pool of compile workers per rank, on two busy
# cores, was seen to crash under load)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
start_context(("pytest", "transformers", "transformers.models.llama.modeling_llama",
               "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
               "pipetrain.train.loop", "pipetrain.parallel.sharded",
               "pipetrain.parallel.tensor_parallel", "pipetrain.checkpoint.run",
               # what ranks otherwise import on their own: a run's pictures (rank 0 of every
               # pipetrain train with an --out), sympy's parts that symbolic shapes reach
               "matplotlib.figure", "matplotlib.backends.backend_agg", "sympy.tensor.tensor"))

SLOWEST_FIRST = [  # each file's total on 2 cores under the full suite, the longest first (measured
    # at 2026-12-03's re-tiering, 133 s down to 8 s; test_readme.py's type check is slower on a
    # fresh clone, without mypy's cache; files under 8 s keep their order after these)
    "test_train_launch.py", "test_vision_language.py", "test_zoo.py", "test_replicas_dist.py",
    "test_readme.py", "test_image_text_train_dist.py", "test_cluster.py",
    "test_failures_exit_dist.py", "test_compiled.py", "test_context_parallel_dist.py",
    "test_docs.py", "test_train_dist.py", "test_train_torchrun.py", "test_hf.py",
    "test_sharded_dist.py", "test_hf_moe_weights.py", "test_generation.py",
    "test_expert_parallel_dist.py", "test_tensor_parallel_dist.py", "test_hf_router_loss.py",
    "test_hf_dist.py", "test_examples_train_dist.py", "test_pipedream.py",
    "test_generate_cli.py", "test_plan_module.py", "test_vision_language_dist.py",
    "test_api_docs.py", "test_benchmarks_compute.py", "test_generation_images.py",
    "test_verify.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first; the others, and the tests within each file, keep their order."""
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
