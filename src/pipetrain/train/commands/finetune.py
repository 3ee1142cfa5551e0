"""Fine-tuning defaults: the optimiser settings of a ``--hf`` run that starts from stored weights.

:class:`~pipetrain.train.config.TrainConfig`'s own defaults (``lr=1e-2``, ``warmup=50``,
``weight_decay=0.1``) make a 220 k-parameter GPT learn bytes from scratch in about 90 s; on a
pretrained model they would undo its pretraining. So when
``--hf DIR`` holds weights (:func:`pipetrain.hf.model.has_weights`), the optimiser settings the
user did not give, neither as a flag nor as a ``--config`` key, take the values below instead;
a directory without weights trains from ``--seed`` and keeps the from-scratch defaults.

- ``lr`` :data:`LR` (2e-5), a common starting point for a full fine-tune (not a value this
  project has measured: try a few on a short run);
- ``min_lr`` :data:`MIN_LR_FRACTION` of the run's ``lr`` (the one given, or 2e-5): the cosine
  ends at a tenth of the peak, so the last steps still learn;
- ``warmup`` :data:`WARMUP_FRACTION` of the run's ``steps`` (3 %, rounded), so a short or a
  long run warms up over the same share of it;
- ``weight_decay`` :data:`WEIGHT_DECAY` (0.0): AdamW's decay pulls the weights towards zero,
  not towards the pretrained ones, so it is no regulariser of a fine-tune; and at ``lr=2e-5``
  even 0.1 would shrink them by only ``steps x lr x 0.1`` (0.3 % over 1500 steps). As in every
  run, biases, norms and embeddings never decay (:func:`pipetrain.train.optim.no_decay_names`).

Example:
    >>> fine_tuning_defaults({"hf": "llama-local", "steps": 1000})  # doctest: +SKIP
    {'lr': 2e-05, 'min_lr': 2e-06, 'warmup': 30, 'weight_decay': 0.0}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetrain.train.config import TrainConfig

__all__ = ["LR", "MIN_LR_FRACTION", "WARMUP_FRACTION", "WEIGHT_DECAY", "SETTINGS", "SHOWN",
           "warmup_steps", "fine_tuning_defaults"]

LR = 2e-5
"""Peak learning rate of a fine-tune."""
MIN_LR_FRACTION = 0.1
"""``min_lr`` as a fraction of the run's ``lr``."""
WARMUP_FRACTION = 0.03
"""``warmup`` as a fraction of the run's ``steps``."""
WEIGHT_DECAY = 0.0
"""AdamW weight decay of a fine-tune."""
SETTINGS = ("lr", "min_lr", "warmup", "weight_decay")
"""The settings that have a fine-tuning default."""
SHOWN = {"lr": f"{LR:g}", "min_lr": f"lr*{MIN_LR_FRACTION:g}",
         "warmup": f"{WARMUP_FRACTION:.0%} of steps", "weight_decay": f"{WEIGHT_DECAY:g}"}
"""Each fine-tuning default as ``--help`` shows it."""


def warmup_steps(steps: int) -> int:
    """The fine-tuning warm-up of a run of ``steps`` steps: 3 % of them, rounded.

    Example:
        >>> warmup_steps(1500), warmup_steps(100), warmup_steps(10)
        (45, 3, 0)
    """
    return round(WARMUP_FRACTION * steps)


def fine_tuning_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """The fine-tuning defaults a run takes: those of :data:`SETTINGS` that ``given`` (the
    ``--config`` file's settings and the flags on the command line, by field name) leaves out,
    when ``given["hf"]`` is a directory with stored weights; empty otherwise (a preset, or
    ``--hf`` without weights, keeps TrainConfig's defaults).

    ``min_lr`` and ``warmup`` follow the ``lr`` and ``steps`` given (or their defaults).
    """
    from pipetrain.hf.model import has_weights

    hf = given.get("hf", TrainConfig.hf)
    if not hf or not has_weights(hf):
        return {}
    lr = given.get("lr", LR)
    values = {"lr": LR, "min_lr": float(f"{lr * MIN_LR_FRACTION:.12g}"),  # 2e-06, not ...03e-06
              "warmup": warmup_steps(given.get("steps", TrainConfig.steps)),
              "weight_decay": WEIGHT_DECAY}
    return {name: value for name, value in values.items() if name not in given}
