"""Trainers: what a training stack does that changes a job's cost (``plan --cluster --trainer``).

The same model, layout and GPUs run at different speeds and memory under different trainers:
a 2021 Megatron-LM kept attention's s x s scores in memory and reduced its gradients after the
backward; a modern one runs flash attention and shards the optimizer's states. Each preset
names one stack as the published runs of :mod:`.published` ran it; each of its settings can
be overridden by a flag of its own (``--no-flash-attention``, ...)::

    preset              flash  dropout  seq. par.  dist. optim.  overlap  cp exchange  grads
    pipetrain           yes    -        yes        no            no       all-to-all   fp32
    megatron-core       yes    -        yes        yes           yes      ring         fp32
    nemo                yes    -        yes        yes           yes      ring         bf16
    torchtitan          yes    -        yes        no            yes      ring         fp32
    megatron-lm-2021    no     yes      no         no            no       ring         fp32
    megatron-lm-2022    no     yes      yes        no            no       ring         fp32
    zero-bubble         no     no       yes        yes           yes      ring         fp32
    megatron-deepspeed  no     yes      no         yes           no       ring         fp32

``pipetrain`` (the default) is what ``pipetrain train`` runs, so that the plan's ``plan.toml``
is predicted as it trains: transformers' SDPA (a flash kernel on GPUs), sequence parallelism
under ``--tp``, AdamW's states whole on each data-parallel replica (FSDP shards them), each
stage's gradients reduced once the stage's last backward is done (:mod:`pipetrain.train.mesh`,
so nothing overlaps the last stage's), and context parallelism as an all-to-all over heads
(:mod:`pipetrain.runtime.sequence`). Megatron-core's settings are its recommended flags
(``--use-flash-attn``, ``--sequence-parallel``, ``--use-distributed-optimizer``,
``--overlap-grad-reduce``), with fp32 main gradients (Megatron-LM's for bf16); NeMo runs
Megatron-core's model under Apex's distributed fused Adam, whose gradients its recipes sync in
bf16 (``grad_sync_dtype: bf16``); torchtitan's are FSDP2's (the states are sharded by ``fsdp``,
not by a distributed optimizer over ``dp``); the 2021 and 2022 Megatron-LM rows are those of
their papers' sections on their own implementations (Narayanan et al. 2021; Korthikanti et al.
2022, which added sequence parallelism); Megatron-DeepSpeed's (BLOOM's, 2022) is Megatron-LM's
of 2021 with DeepSpeed's ZeRO-1 sharding the optimizer's states; Zero Bubble's runs kept
attention's scores without a dropout over them (Qi et al. 2024's published peak memory says so:
:mod:`.published_pytorch`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Trainer", "TRAINERS", "CP_EXCHANGES", "GRAD_BYTES", "STATE_BYTES", "trainer"]

CP_EXCHANGES = ("all-to-all", "ring")
"""How context parallelism exchanges: heads for tokens (DeepSpeed-Ulysses, four all-to-alls a
layer on the critical path), or keys and values passed round a ring under attention."""
GRAD_BYTES = {"fp32": 4, "bf16": 2}
"""``--grad-dtype``: the bytes of a gradient element."""
STATE_BYTES = {"fp32": 12, "bf16": 6}
"""``--optimizer-dtype``: AdamW's bytes a parameter (weights and two moments)."""


@dataclass(frozen=True)
class Trainer:
    """The settings of one training stack that the cost model reads (:class:`.job.Job`'s)."""

    flash_attention: bool = True
    """False: attention's s x s scores in memory (trainers before 2022)."""
    attention_dropout: bool = False
    """Without flash attention: a dropout over the scores (Megatron-LM's default, 0.1)."""
    sequence_parallel: bool = True
    """Norms and residuals split by tp too (Korthikanti et al. 2022); False: replicated."""
    distributed_optimizer: bool = False
    """AdamW's states sharded over the data-parallel replicas (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """The gradients reduced bucket by bucket under the backward (all but the last layer's);
    False: each stage's after its last backward."""
    cp_exchange: str = "all-to-all"
    """One of :data:`CP_EXCHANGES`."""
    grad_bytes: int = 4
    """Bytes of a gradient element as accumulated and reduced: 4 (fp32 main gradients), or 2
    (bf16, NeMo's ``grad_sync_dtype: bf16``)."""
    state_bytes: int = 12
    """AdamW's bytes a parameter: fp32 weights and moments (12), or bf16 ones (6: Apex's
    distributed fused Adam with ``dtype: bf16``)."""

    def job_options(self) -> dict[str, Any]:
        """These settings as :class:`.job.Job`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


TRAINERS: dict[str, Trainer] = {
    "pipetrain": Trainer(),
    "megatron-core": Trainer(distributed_optimizer=True, overlap_grad_reduce=True,
                             cp_exchange="ring"),
    "torchtitan": Trainer(overlap_grad_reduce=True, cp_exchange="ring"),
    "megatron-lm-2021": Trainer(flash_attention=False, attention_dropout=True,
                                sequence_parallel=False, cp_exchange="ring"),
    "megatron-lm-2022": Trainer(flash_attention=False, attention_dropout=True,
                                cp_exchange="ring"),
    "zero-bubble": Trainer(flash_attention=False, distributed_optimizer=True,
                           overlap_grad_reduce=True, cp_exchange="ring"),
    "nemo": Trainer(distributed_optimizer=True, overlap_grad_reduce=True, cp_exchange="ring",
                    grad_bytes=2),
    "megatron-deepspeed": Trainer(flash_attention=False, attention_dropout=True,
                                  sequence_parallel=False, distributed_optimizer=True,
                                  cp_exchange="ring"),
}
"""The presets of the module docstring's table."""


def trainer(name: str, **overrides: Any) -> Trainer:
    """The preset ``name`` with the settings in ``overrides`` that are not None changed.

    Raises:
        ValueError: for an unknown preset or cp exchange.
    """
    if name not in TRAINERS:
        raise ValueError(f"unknown --trainer {name!r}: one of {', '.join(TRAINERS)}")
    chosen = replace(TRAINERS[name], **{k: v for k, v in overrides.items() if v is not None})
    if chosen.cp_exchange not in CP_EXCHANGES:
        raise ValueError(f"unknown --cp-exchange {chosen.cp_exchange!r}: one of "
                         f"{', '.join(CP_EXCHANGES)}")
    if chosen.state_bytes not in STATE_BYTES.values():
        raise ValueError(f"optimizer states of {chosen.state_bytes} bytes: one of "
                         f"{', '.join(f'{k} ({v})' for k, v in STATE_BYTES.items())}")
    if chosen.grad_bytes not in GRAD_BYTES.values():
        raise ValueError(f"gradients of {chosen.grad_bytes} bytes: one of "
                         f"{', '.join(f'{k} ({v})' for k, v in GRAD_BYTES.items())}")
    return chosen
