"""Runtime: the interpreter of action lists, its stages, messages, failure news and processes.

``executor.py`` runs exactly the lists of :mod:`pipetrain.schedules`; ``stage.py`` runs F, B, I
and W of one stage (``backward.py``, ``compiled.py``, ``recompute.py``, ``rng.py``);
``routes.py`` says which stage sends what to which; ``comm.py`` with ``wire.py``,
``receiver.py`` and ``delivery.py`` move the messages; ``finish.py`` ends a
step; ``watchdog.py`` and ``news.py`` turn a stuck or failed peer into an error on every rank;
``tied.py`` keeps weights shared by stages one; ``launch.py`` starts processes; ``dtensors.py``
reads DTensors.

May import: :mod:`pipetrain.errors`, :mod:`pipetrain.schedules`.
"""
