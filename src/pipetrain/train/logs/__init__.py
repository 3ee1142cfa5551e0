"""Train logs: the records a run emits, its progress on the console and its files, and
the TensorBoard and W&B sinks."""
