"""Parallel: FSDP2 and tensor parallelism applied to a rank's stages.

``parallelize.py`` is ``Pipeline(parallelize=)``'s protocol, ``sharded.py`` FSDP2 on the stages
(:class:`ShardedStages`), ``tensor_parallel.py`` Megatron-style splits of the built-in GPT.

May import: the rungs up to :mod:`pipetrain.models`.
"""

RESHARD = ("step", "layer", "part")
"""How long FSDP2's gathered weights live (:class:`~pipetrain.parallel.sharded.ShardedStages`),
most memory first. Here, apart from FSDP2's import, for the command line's flags."""
