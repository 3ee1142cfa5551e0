"""Plan: predicted step time and memory per layout, and the search over layouts.

``planner.py`` predicts a layout's step time and peak bytes per rank and searches the layouts;
``shardcost.py`` adds what dp, FSDP and tensor parallelism cost; ``cli.py`` is ``pipetrain
plan`` (it profiles the model), ``calibrate.py`` measures collectives on the ranks.

May import: every rung below it, :mod:`pipetrain.train` included.
"""
