"""Split: a model cut into stages (a layer list or a captured graph), balanced, built per rank.

``layers.py`` is what a Pipeline cuts: a layer list, or a model captured once by torch.export
(``capture.py``) and cut into stages (``trace.py``, ``autosplit.py``) whose dataflow is proven
(``provenance.py``), its step input read as ``forward`` takes it (``inputs.py``).
``partition.py``, ``balance.py``, ``minmax.py`` and ``profile.py`` choose the layers per stage;
``lazy.py`` builds only a rank's own layers; ``capture_reuse.py`` reuses a capture in a
process, ``shared_capture.py`` shares one across a pipeline group, ``eval_graph.py`` adds the
evaluation graph.

May import: :mod:`pipetrain.errors`, :mod:`pipetrain.schedules`, :mod:`pipetrain.runtime`.
"""
