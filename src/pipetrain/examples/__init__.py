"""Examples: small runnable programs (``python -m pipetrain.examples.quickstart``)."""
