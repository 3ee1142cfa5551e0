"""Parallel: FSDP2 and tensor parallelism applied to a rank's stages.

``parallelize.py`` is ``Pipeline(parallelize=)``'s protocol, ``sharded.py`` FSDP2 on the stages
(:class:`ShardedStages`), ``tensor_parallel.py`` Megatron-style splits of the built-in GPT.

May import: the rungs up to :mod:`pipetrain.models`.
"""
