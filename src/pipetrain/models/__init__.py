"""Models: the built-in GPT (``gpt.py``) that ``pipetrain train`` trains without ``--hf``.

May import: :mod:`pipetrain.errors` and the rungs up to :mod:`pipetrain.split`.
"""
