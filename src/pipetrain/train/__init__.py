"""Training: the ``pipetrain train`` job (a pipelined GPT on a byte corpus) and its parts.

May import: the rungs up to :mod:`pipetrain.hf` (not :mod:`pipetrain.plan`).
"""
