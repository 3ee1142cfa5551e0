"""Version: the package's version, one place for everything that records it."""

__version__ = "0.1.0"
