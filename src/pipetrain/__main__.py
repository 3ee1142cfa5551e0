"""Entry point for ``python -m pipetrain``: the ``pipetrain`` command line."""

import sys

from pipetrain.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
