"""Parallel: FSDP2 and tensor parallelism applied to a rank's stages.

``parallelize.py`` is ``Pipeline(parallelize=)``'s protocol, ``sharded.py`` FSDP2 on the stages
(:class:`ShardedStages`), ``tensor_parallel.py`` Megatron-style splits of the built-in GPT.

May import: the rungs up to :mod:`pipetrain.models`.
"""

from typing import Any

RESHARD = ("step", "layer", "part")
"""How long FSDP2's gathered weights live (:class:`~pipetrain.parallel.sharded.ShardedStages`),
most memory first. Here, apart from FSDP2's import, for the command line's flags."""


_LAZY = {"ShardedStages": "pipetrain.parallel.sharded",
         "TensorParallel": "pipetrain.parallel.tensor_parallel"}
"""``pipetrain.parallel.ShardedStages`` and ``.TensorParallel``, imported on first use (FSDP and
DTensor take half a second to import; their pages are their modules')."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipetrain.parallel' has no attribute {name!r}")
