"""Checkpoint: save and load a pipelined run by the model's own names, at any layout.

``run.py`` saves and loads through torch.distributed.checkpoint, ``state.py`` gathers a run's
tensors by name (parameters, optimizer state, RNG), ``store.py`` lays them out on disk with an
atomic commit.

May import: the rungs up to :mod:`pipetrain.parallel`.
"""
