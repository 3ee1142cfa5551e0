"""TrainConfig: every setting of a ``pipetrain train`` run, one field per flag."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["TrainConfig", "config_toml", "format_config"]


@dataclass
class TrainConfig:
    """One training run. Each field is a ``--flag`` of ``pipetrain train`` and a TOML key.

    Sizes are global: ``batch_size`` sequences per step over all data-parallel replicas
    (each replica takes ``batch_size // dp``, each of its shards ``// fsdp`` of that, and splits
    it into ``microbatches``).
    """

    # model and data
    preset: str = "tiny"
    """GPT preset (:data:`pipetrain.models.gpt.PRESETS`)."""
    hf: str = ""
    """A local Hugging Face ``save_pretrained`` directory (config, safetensors weights or none,
    tokenizer), or a Hub id ``ORG/NAME[@REVISION]`` fetched into the Hugging Face cache
    (:mod:`pipetrain.hf.hub`), to train instead of the preset; empty: the preset."""
    data: str | None = None
    """A text file or directory; None uses the default corpus (the stdlib's own sources). With
    ``hf``, also a data set of examples: a .jsonl, .json, .parquet or .csv file or a
    ``save_to_disk`` directory, one example per row (needs ``pip install -e ".[data]"``)."""
    text_field: str = "text"
    """With a data set as ``data``: the column of text to train on."""
    chat: bool = False
    """With a data set as ``data``: train on its ``chat_field`` column (lists of {role,
    content}, or ShareGPT's {from, value}) rendered by the tokenizer's chat template, the loss
    on the assistant's tokens only."""
    pack: bool = False
    """With a data set as ``data``: pack whole examples into full rows, each attending to
    itself only (positions restarting), instead of one right-padded example a row."""
    chat_field: str = "messages"
    """With ``chat``: the column of messages (ShareGPT data names it ``conversations``)."""
    images_field: str = "images"
    """With ``chat`` and an image-text ``hf``: the column of each row's images, in the order
    of its ``{"type": "image"}`` placeholders (TRL's convention)."""
    freeze_vision: bool = False
    """With an image-text ``hf``: train without the vision tower's weights (its projector
    still trains)."""
    freeze_projector: bool = False
    """With an image-text ``hf``: train without the projector's weights (the layers between
    the vision tower and the language model)."""
    lora_r: int = 0
    """With ``hf``: train peft's LoRA adapters of this rank on the frozen model (0: every
    weight); written to ``out/adapter`` in peft's format."""
    lora_alpha: float = 0.0
    """With ``lora_r``: the adapters' scale numerator (0: 2 x lora_r)."""
    lora_dropout: float = 0.0
    """With ``lora_r``: dropout on the adapters' input."""
    lora_targets: str = ""
    """With ``lora_r``: the module names to adapt, commas (empty: peft's default for the
    architecture, e.g. q_proj,v_proj for Llama)."""
    merge: bool = False
    """With ``lora_r``: also write ``out/hf``, the model with the adapter merged in (built
    whole on global rank 0)."""
    seq_len: int = 64
    """Tokens per training sequence."""
    token_cache: str = "~/.cache/pipetrain/tokens"
    """With ``hf``: where tokenized corpora are kept (int32 ids, memory-mapped; one file per
    corpus and tokenizer)."""
    batch_size: int = 32
    """Sequences per step over all data-parallel replicas."""
    seed: int = 0
    """Seed of the initialisation and of the data order."""
    # layout
    nproc: int = 2
    """Processes a local launch starts (ignored under torchrun, which sets the world)."""
    pp: int | None = None
    """Pipeline ranks; None: world size // (dp x fsdp x cp x tp)."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline; on the command line, when left out with
    ``pp`` given, world size // (pp x fsdp x tp)."""
    fsdp: int = 1
    """Shards of each replica: this many ranks hold the same stages, each a slice of every
    weight, gradient and optimizer state (FSDP2), each its own rows of the batch; on the
    command line, when left out with ``pp`` and ``dp`` given, world size // (pp x dp x tp)."""
    tp: int = 1
    """Tensor-parallel ranks per pipeline rank: they split each block's attention heads and
    MLP (Megatron style), see the same rows, and each hold a slice of those weights."""
    cp: int = 1
    """Context-parallel ranks per data-parallel rank: they take the same rows, each a slice
    of every sequence (seq_len / cp tokens), and attention exchanges heads for tokens among
    them (all-to-all); for sequences too long for one device's activations."""
    ep: int = 1
    """Expert-parallel ranks (--hf mixtures of experts): this many consecutive data-parallel
    ranks share each MoE layer's experts, each holding 1/ep of them; tokens travel to their
    experts' ranks and back by all-to-all (the model's own base_model_ep_plan)."""
    mesh_order: str = "pp-outer"
    """Rank placement: ``pp-outer`` (pipeline outermost, as torchtitan and Megatron: the stages
    cross nodes, a stage's FSDP shards and tensor-parallel ranks stay on one node) or
    ``dp-outer`` (each replica's whole pipeline on consecutive ranks: for pipelines that fit
    in a node)."""
    sequence_parallel: bool = True
    """With --tp: split the activations between the split matrices along the sequence too
    (layer norms, residuals and the messages between stages; seq_len must divide by tp)."""
    fsdp_reshard: str = "part"
    """With --fsdp: how long gathered weights live: step (from a layer's first use to the
    step's reduction: most memory, fewest all-gathers), layer (while a layer computes), part
    (while each large part of a layer computes: least memory, most all-gathers)."""
    schedule: str = "1f1b"
    """Schedule name (``pipetrain schedules``), or a schedule file run as written."""
    microbatches: int = 8
    """Micro-batches per step on each replica."""
    stages_per_rank: int | None = None
    """None takes the schedule's own."""
    balance: str = "params"
    """``params``, ``time``, ``memory``, ``even`` or layers per stage such as ``3,4,4,3``."""
    recompute: str = "never"
    """Activation recomputation: ``never``, ``always`` or ``except_last``."""
    compile: bool = False
    """Compile each stage with ``torch.compile`` (inductor) as three programs, F, I and W,
    so split-backward schedules run compiled too (not with --recompute, --fsdp, --tp or
    --ep)."""
    device: str = "auto"
    """``auto`` (CUDA + NCCL when there is a GPU, else CPU + gloo), ``cpu`` or ``cuda``."""
    verify: bool = False
    """With ``hf``: before training, check one float64 step of the model at hidden size 64
    (all its layers, cut where this run cuts them) under this run's pipeline layout against
    one process, gradient by gradient (``pipetrain verify``); stop with exit 1 if one
    differs."""
    # optimisation
    steps: int = 1500
    """Optimizer steps of the whole run."""
    lr: float = 1e-2
    """Peak learning rate, reached after ``warmup`` steps, then cosine down to ``min_lr``."""
    min_lr: float = 3e-4
    """Learning rate at the last step."""
    warmup: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases, norms and embeddings)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all stages, tied weights once) to this; 0: off."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (autocast; fp16 with a dynamic loss scale)."""
    nonfinite: str = "skip"
    """A NaN/Inf loss or gradient on any rank: ``skip`` the step on every rank, or ``abort``."""
    # evaluation and outputs
    eval_every: int = 250
    """Held-out loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Batches of the held-out split per evaluation."""
    sample_tokens: int = 200
    """Tokens to generate through the pipeline at the end; 0: none."""
    prompt: str = "def "
    """Start of the generated text."""
    sample_top_k: int = 5
    """0: generate the most likely token each time; k > 0: sample among the k most likely
    (seeded by ``seed``, so the text is reproducible)."""
    out: str = "runs/pipetrain"
    """Directory of logs, pictures and checkpoints (``<out>/checkpoints``); empty: none."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (and at the end); 0: only at the end."""
    save_hf_every: int = 0
    """With ``hf``: also write ``<out>/hf`` (``save_pretrained`` format) every this many
    steps; it is always written at the end."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints (older ones are deleted); 0: keep all."""
    resume: bool = True
    """Continue from the newest committed checkpoint under ``out`` when there is one."""
    max_restarts: int = 0
    """Times a local launch restarts the job after a rank fails (resuming from a checkpoint);
    with ``ft``, times each failed replica is restarted (recovering from a peer), 3 when not
    given, 0 to let a failed replica go."""
    ft: bool = False
    """Fault-tolerant replicas (torchft): each of the ``dp`` replicas is a whole pipeline
    with its own elastic agent; a failure restarts that replica only, which then loads a
    healthy replica's state over the network while the others go on (needs ``pip install
    torchft``)."""
    ft_replica_id: int | None = None
    """With ``ft`` under torchrun: which replica (0 .. dp-1) this torchrun's processes are; a
    local launch numbers its replicas itself."""
    ft_lighthouse: str = ""
    """With ``ft`` under torchrun: the torchft Lighthouse's address, ``HOST:PORT`` or
    ``http://HOST:PORT``; a local launch starts its own."""
    ft_min_replicas: int = 1
    """With ``ft``: replicas that must take part in a step for it to count (torchft's
    ``min_replica_size``, and the local Lighthouse's ``min_replicas``); with ``dp`` the
    others wait for a failed replica to come back, and every step has every replica's
    rows."""
    timeout: float = 60.0
    """Seconds any wait for a peer may last before every rank stops with an error."""
    progress: bool = True
    """A live progress bar on rank 0 (JSON logs are written either way)."""
    verbose: bool = False
    """Print what a run holds back: the torch profiler's and allocator's notes, and every
    rank's copy of an error that several ranks raise alike."""
    log: str = ""
    """Also send the step and eval scalars to tensorboard, wandb or both (commas), under
    ``out``; ``log.jsonl`` is written either way."""


def format_config(cfg: TrainConfig, *, world: int | None = None, width: int = 100,
                  fine_tuned: Collection[str] = ()) -> str:
    """The resolved config as wrapped ``key=value`` lines, printed at the start of a run.

    ``fine_tuned``: the settings that took the fine-tuning defaults
    (:mod:`pipetrain.train.commands.finetune`), marked ``*`` and explained on a last line.
    """
    head = "pipetrain train" + (f": {world} processes" if world is not None else "")
    pairs = [f"{f.name}={_shown(getattr(cfg, f.name))}" + "*" * (f.name in fine_tuned)
             for f in dataclasses.fields(TrainConfig)]
    body = textwrap.wrap("  ".join(pairs), width - 2, break_on_hyphens=False)
    if fine_tuned:
        body += textwrap.wrap("* the fine-tuning defaults, as --hf has stored weights (--help "
                              "says how each is chosen); a flag or --config key overrides each",
                              width - 2, break_on_hyphens=False)
    return "\n".join([f"{head}; config:", *("  " + line for line in body)])


def config_toml(cfg: TrainConfig, *, left_out: Collection[str] = ()) -> str:
    """The resolved config as a TOML file that ``--config`` reads back (None fields left out,
    and those of ``left_out``, as comments: ``pipetrain train`` chooses them itself)."""
    lines = ["# pipetrain train --config FILE"]
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        lines.append(f"# {f.name}: automatic" if value is None
                     else f"# {f.name}: the default" if f.name in left_out
                     else f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _shown(value: object) -> str:
    return "auto" if value is None else str(value) if not isinstance(value, str) else (
        value if value and " " not in value else repr(value))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
