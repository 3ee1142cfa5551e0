"""Hugging Face: a local ``save_pretrained`` directory trained through the pipeline, and back.

* :mod:`pipetrain.hf.model`: the config as a model on ``meta``, its tokenizer, its split
  points at decoder layers, and each rank's own tensors read by name from the safetensors
  files (a corpus through that tokenizer is :mod:`pipetrain.train.tokens`);
* :mod:`pipetrain.hf.save`: the trained parameters written back as a ``save_pretrained``
  directory, each rank its own shard.

Everything here reads local files only; nothing is downloaded. It needs the ``hf`` extra
(``transformers``, ``safetensors``).

May import: the rungs up to :mod:`pipetrain.pipeline` (not :mod:`pipetrain.train`).
"""
