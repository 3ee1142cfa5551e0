"""Train commands: the command lines of ``pipetrain train``, ``generate``, ``verify`` and
``export-hf``, and what they resolve before any worker starts."""
