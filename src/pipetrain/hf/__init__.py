"""Hugging Face: a local ``save_pretrained`` directory trained through the pipeline, and back.

* :mod:`pipetrain.hf.model`: the config as a model on ``meta``, its split points at decoder
  layers, and each rank's own tensors read by name from the safetensors files;
* :mod:`pipetrain.hf.tokens`: a text corpus through the model's own tokenizer, cached on disk
  and memory-mapped;
* :mod:`pipetrain.hf.save`: the trained parameters written back as a ``save_pretrained``
  directory, each rank its own shard.

Everything here reads local files only; nothing is downloaded. It needs the ``hf`` extra
(``transformers``, ``safetensors``).
"""
