"""Runtime: the interpreter of action lists, its stages, messages, failure news and processes.

``executor.py`` runs exactly the lists of :mod:`pipetrain.schedules`; ``stage.py`` runs F, B, I
and W of one stage (``backward.py``, ``compiled.py``, ``recompute.py``, ``rng.py``);
``transport/`` moves the messages: ``routes.py`` says which stage sends what to which,
``comm.py`` with ``wire.py``, ``encoder.py``, ``receiver.py`` and ``receipts.py`` carry them;
``step_end.py`` ends a step; ``failure/`` (``watchdog.py``, ``job_failure.py``) turns a stuck or
failed peer into an error on every rank; ``async_steps.py`` and ``versions.py`` run an
asynchronous schedule's steps and weight versions; ``tied.py`` keeps weights shared by stages
one; ``launch.py`` starts processes; ``dtensors.py`` reads DTensors.

May import: :mod:`pipetrain.errors`, :mod:`pipetrain.schedules`.
"""
