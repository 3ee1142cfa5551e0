"""Hugging Face: a local ``save_pretrained`` directory trained through the pipeline, and back.

* :mod:`pipetrain.hf.model`: the config as a model on ``meta``, its tokenizer, its split
  points at decoder layers, and each rank's own tensors read by name from the safetensors
  files (a corpus through that tokenizer is :mod:`pipetrain.train.data.tokens`);
* :mod:`pipetrain.hf.save`: the trained parameters written back as a ``save_pretrained``
  directory, each rank its own shard.

* :mod:`pipetrain.hf.hub`: a Hub id, ``ORG/NAME[@REVISION]``, resolved to a local snapshot
  through ``huggingface_hub`` (its cache, token and offline mode).

Everything else reads local files only. It needs the ``hf`` extra (``transformers``,
``safetensors``, ``huggingface_hub``).

May import: the rungs up to :mod:`pipetrain.pipeline` (not :mod:`pipetrain.train`).
"""
