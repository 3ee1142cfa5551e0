"""Published record: one published run's model, layout, batch and figure, and the rules a row
keeps (:mod:`pipetrain.plan.cluster.published` holds the rows)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipetrain.plan.cluster.hardware import GPUS
from pipetrain.plan.cluster.trainers import TRAINERS

__all__ = ["Published", "METRICS", "SCHEDULES", "RECOMPUTE", "PRECISIONS", "check", "gpt_shape",
           "llama3_shape"]

METRICS = ("hardware_tflops_per_gpu", "model_tflops_per_gpu", "mfu", "tokens_per_s_per_gpu",
           "step_s")
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "zb-h2", "zb-auto", "zbv",
             "interleaved-zb", "dualpipev")
RECOMPUTE = ("always", "selective", "op", "never")
PRECISIONS = ("bf16", "fp16", "fp8")
_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len")


@dataclass(frozen=True, kw_only=True)
class Published:
    """One published training run: its model, hardware, layout and the figure measured."""

    key: str  # short id, e.g. "megatron-1.7b"
    model: dict[str, int]  # layers, hidden, heads, kv_heads, ffn, vocab, seq_len (+ experts, top_k)
    gpu: str  # a key of hardware.GPUS
    gpus: int
    tp: int
    pp: int
    dp: int  # data-parallel replicas (plain DP); gpus == tp * pp * cp * dp * fsdp
    cp: int = 1
    ep: int = 1
    fsdp: int = 1  # ZeRO-3/FSDP shard degree if used, 1 otherwise
    global_batch: int  # sequences per step
    micro_batch: int  # sequences per micro-batch
    schedule: str  # pipetrain names: "1f1b", "interleaved-1f1b", "gpipe", "zb-h1", ...
    stages_per_rank: int  # v for interleaved, 1 otherwise
    recompute: str  # "always" (full activation recomputation), "selective", "op", "never";
    # "" where the source does not say: the command searches it (the least that fits)
    precision: str  # "bf16" / "fp16" / "fp8"
    metric: str  # one of METRICS
    value: float  # the published figure in that metric's unit (TFLOP/s, fraction, tokens/s, s)
    source: str  # paper, table, row; URL
    assumed: str  # every detail not given in the source and assumed here, and why ("" if none)
    trainer: str  # a preset of pipetrain.plan.cluster.trainers (the stack that ran it)
    activation_limit: float = 0.0  # zb-auto's stage-activations per rank (0: pp, ZB-1p's)
    peak_memory: float = 0.0  # bytes per GPU as the source gives it (0: not given)
    optimizer_dtype: str = ""  # "bf16" where the source keeps AdamW's states so ("": fp32)
    nic_gbps: float = 0.0  # the network per GPU, Gbit/s, where not the GPU entry's (0: its)

    def config(self) -> dict[str, object]:
        """The model as a Hugging Face ``config.json``'s keys (``plan --config-json``): a
        GPT-3-like model (a 4h GeLU MLP) as GPT-2's, any other as Llama's, with experts as
        Mixtral's."""
        m = self.model
        gpt = m["ffn"] == 4 * m["hidden"] and "experts" not in m
        out: dict[str, object] = {
            "model_type": "gpt2" if gpt else "mixtral" if "experts" in m else "llama",
            "hidden_act": "gelu_new" if gpt else "silu", "num_hidden_layers": m["layers"],
            "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
            "num_key_value_heads": m["kv_heads"], "intermediate_size": m["ffn"],
            "vocab_size": m["vocab"], "max_position_embeddings": m["seq_len"]}
        if "experts" in m:
            out |= {"num_local_experts": m["experts"], "num_experts_per_tok": m["top_k"]}
        return out

    def command(self, config: str = "") -> list[str]:
        """``pipetrain plan --cluster ... --json`` for this run, every published detail pinned
        (``config``: the path of :meth:`config`'s file; default ``KEY.json``)."""
        dp = self.dp * self.fsdp
        argv = ["plan", "--cluster", self.gpu, "--gpus", str(self.gpus),
                "--config-json", config or f"{self.key}.json",
                "--seq-len", str(self.model["seq_len"]),
                "--global-batch", str(self.global_batch),
                "--micro-batch-size", str(self.micro_batch),
                "--tp", str(self.tp), "--pp", str(self.pp), "--dp", str(self.dp),
                "--fsdp", str(self.fsdp), "--cp", str(self.cp), "--ep", str(self.ep),
                "--schedule", self.schedule if self.pp > 1 else "1f1b",
                "--stages-per-rank", str(self.stages_per_rank),
                *(["--recompute", self.recompute] if self.recompute else []),
                "--trainer", self.trainer]
        if self.precision == "fp8":
            argv += ["--precision", "fp8"]
        if self.nic_gbps:
            argv += ["--nic-gbps", f"{self.nic_gbps:g}"]
        if self.optimizer_dtype:
            argv += ["--optimizer-dtype", self.optimizer_dtype]
        if self.activation_limit:
            argv += ["--activation-limit", f"{self.activation_limit:g}"]
        if self.global_batch % (dp * self.micro_batch):
            raise ValueError(f"published row {self.key!r}: the batch does not split")
        return argv + ["--json"]


def gpt_shape(layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> dict[str, int]:
    """A GPT-2/3 style model: multi-head attention, a 4h GeLU MLP."""
    return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads,
            "ffn": 4 * hidden, "vocab": vocab, "seq_len": seq_len}


_LLAMA3 = {  # Llama 3/3.1: GQA with 8 KV heads, SwiGLU MLP of width ffn, 128,256 tokens
    "8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336},
    "70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672},
    "405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248},
}


def llama3_shape(size: str, seq_len: int) -> dict[str, int]:
    return {**_LLAMA3[size], "vocab": 128256, "seq_len": seq_len}


# -- 1. Megatron-LM, Narayanan et al., SC'21, Table 1 -----------------------------------------


def check(published: Iterable[Published]) -> None:
    """Raise ValueError on a row that is not self-consistent (run once, at import)."""
    seen: set[str] = set()
    for r in published:
        where = f"published row {r.key!r}"
        if r.key in seen:
            raise ValueError(f"{where}: duplicate key")
        seen.add(r.key)
        missing = [k for k in _MODEL_KEYS if k not in r.model]
        if missing or (("experts" in r.model) != ("top_k" in r.model)):
            raise ValueError(f"{where}: model lacks {missing or ['experts/top_k']}")
        if r.gpu not in GPUS:
            raise ValueError(f"{where}: gpu {r.gpu!r} is not in hardware.GPUS")
        if r.tp * r.pp * r.cp * r.dp * r.fsdp != r.gpus:
            raise ValueError(f"{where}: tp*pp*cp*dp*fsdp != gpus ({r.gpus})")
        if (r.dp * r.fsdp) % r.ep:
            raise ValueError(f"{where}: ep {r.ep} does not divide dp*fsdp")
        if r.global_batch % (r.dp * r.fsdp * r.micro_batch):
            raise ValueError(f"{where}: global_batch is not a whole number of micro-batches "
                             "per data-parallel rank")
        if r.schedule not in SCHEDULES or r.recompute not in (*RECOMPUTE, "") \
                or r.precision not in PRECISIONS or r.metric not in METRICS:
            raise ValueError(f"{where}: unknown schedule, recompute, precision or metric")
        if (r.stages_per_rank > 1) != r.schedule.startswith("interleaved"):
            raise ValueError(f"{where}: stages_per_rank {r.stages_per_rank} does not match "
                             f"{r.schedule!r}")
        if not r.value > 0 or not r.source:
            raise ValueError(f"{where}: no value or no source")
        if r.trainer not in TRAINERS:
            raise ValueError(f"{where}: trainer {r.trainer!r} is not a preset of "
                             f"{', '.join(TRAINERS)}")
