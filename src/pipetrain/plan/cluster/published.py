"""Published: runs whose layout, batch, sequence and hardware are all given, and their throughput.

Each :class:`Published` row is one measured step of one run from a paper or a project's own
benchmark page: the model's shape, the GPU (a key of :data:`pipetrain.plan.cluster.hardware.GPUS`)
and
the layout, the batch and micro-batch, the schedule (pipetrain's names), the recomputation and
precision, and the one figure the source publishes for it (``metric``/``value``), so that
``pipetrain plan --cluster`` can be checked against it. Layout convention, as in
:class:`pipetrain.plan.shardcost.Sharding`: ``gpus == tp * pp * cp * dp * fsdp``, where ``dp``
counts replicas (plain data parallelism) and ``fsdp`` the ranks each replica's state is sharded
over (ZeRO-3/FSDP), and the ``ep`` expert-parallel ranks are drawn from the ``dp * fsdp``
data-parallel ones. ``global_batch`` and ``micro_batch`` are sequences of ``model["seq_len"]``
tokens. Every row's ``source`` says where each figure was read (paper, table, row, URL, and
whether it was verified from a stored copy here); ``assumed`` lists what the source does not
give and what was taken for it.

Metrics: ``hardware_tflops_per_gpu`` (FLOP/s per GPU counting recomputation, TFLOP/s),
``model_tflops_per_gpu`` (without recomputation, TFLOP/s), ``mfu`` (a fraction),
``tokens_per_s_per_gpu`` and ``step_s`` (seconds per optimizer step).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from pipetrain.plan.cluster.hardware import GPUS

__all__ = ["Published", "PUBLISHED", "METRICS", "SCHEDULES", "RECOMPUTE", "PRECISIONS", "rows"]

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
    recompute: str  # "always" (full activation recomputation), "selective", "op", "never"
    precision: str  # "bf16" / "fp16" / "fp8"
    metric: str  # one of METRICS
    value: float  # the published figure in that metric's unit (TFLOP/s, fraction, tokens/s, s)
    source: str  # paper, table, row; URL
    assumed: str  # every detail not given in the source and assumed here, and why ("" if none)
    activation_limit: float = 0.0  # zb-auto's stage-activations per rank (0: pp, ZB-1p's)
    peak_memory: float = 0.0  # bytes per GPU as the source gives it (0: not given)


def _gpt(layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> dict[str, int]:
    """A GPT-2/3 style model: multi-head attention, a 4h GeLU MLP."""
    return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads,
            "ffn": 4 * hidden, "vocab": vocab, "seq_len": seq_len}


_LLAMA3 = {  # Llama 3/3.1: GQA with 8 KV heads, SwiGLU MLP of width ffn, 128,256 tokens
    "8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336},
    "70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672},
    "405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248},
}


def _llama3(size: str, seq_len: int) -> dict[str, int]:
    return {**_LLAMA3[size], "vocab": 128256, "seq_len": seq_len}


# -- 1. Megatron-LM, Narayanan et al., SC'21, Table 1 -----------------------------------------

_MEGATRON_PAPER = (
    "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM', SC'21, arXiv 2104.04473 (https://arxiv.org/abs/2104.04473), Table 1 "
    "(weak scaling, GPT, s = 2048, V = 51,200, Selene: DGX A100 80 GB nodes, 8 x 200 Gb/s HDR "
    "InfiniBand per node, sec. 5)")
_MEGATRON_SCRIPT = (
    "Micro-batch, interleaving, recomputation and fp16 from the authors' script reproducing "
    "Table 1: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh "
    "(https://github.com/NVIDIA/Megatron-LM/tree/main/examples/sc21; read here at commits "
    "cf547de and 79a3bb6, which agree) and its CONFIG.sh (seq 2048, '--fp16'; read from "
    "stored copies).")


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops: float, percent: int, aggregate: float, micro: int,
              chunks: int) -> Published:
    dp = gpus // (tp * pp)
    if chunks > 1:
        schedule = (f"interleaved 1F1B with {chunks} model chunks per rank (the script's "
                    f"--num-layers-per-virtual-pipeline-stage {layers // (pp * chunks)})")
    elif pp > 1:
        schedule = "the non-interleaved 1F1B schedule (the script sets no virtual stages)"
    else:
        schedule = "no pipeline (pp = 1): gradient accumulation over the micro-batches"
    tp_vocab = {1: 50304, 2: 50432, 4: 50688, 8: 51200}[tp]
    return Published(
        key=f"megatron-{size.lower()}", model=_gpt(layers, hidden, heads, 2048, 51200),
        gpu="A100-80GB", gpus=gpus, tp=tp, pp=pp, dp=dp, global_batch=batch, micro_batch=micro,
        schedule="interleaved-1f1b" if chunks > 1 else "1f1b", stages_per_rank=chunks,
        recompute="always", precision="fp16", metric="hardware_tflops_per_gpu", value=tflops,
        source=(
            f"{_MEGATRON_PAPER}, row {size}: {heads} heads, hidden {hidden}, {layers} layers, "
            f"TP {tp}, PP {pp}, {gpus} GPUs, batch {batch}: {tflops:g} TFLOP/s per GPU "
            f"({percent}% of the 312 TFLOP/s peak, {aggregate:g} PFLOP/s aggregate). The paper "
            "itself is not stored here; the row was checked against three agreeing stored "
            "transcriptions of Table 1 (study notes in public repositories). Its TFLOP/s count "
            "the recomputed forward (eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) per step). "
            + _MEGATRON_SCRIPT),
        assumed=(
            f"Micro-batch {micro} and {schedule} are the reproduction script's, not the "
            "paper's table (the paper says only that the interleaved schedule with scatter/"
            f"gather was used for the large runs); DP = GPUs / (TP x PP) = {dp}, plain data "
            "parallelism without ZeRO; full activation recomputation of every layer (the "
            "script's '--activations-checkpoint-method uniform'; the default of 1 layer per "
            "checkpoint is from memory), as the paper's FLOP count (4 passes) implies; fp16 "
            "with loss scaling (CONFIG.sh '--fp16'); MLP width 4h, multi-head attention, "
            "learned positions (GPT-3 style); "
            f"vocabulary 51,200 as the paper's formulas use (Megatron pads the 50,257-token "
            f"GPT-2 BPE to a multiple of 128 x TP, which is {tp_vocab} at TP {tp})."),
    )


_MEGATRON_ROWS = [
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, 16, 1),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, 16, 1),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, 16, 1),
    _megatron("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, 8, 1),
    _megatron("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, 4, 1),
    _megatron("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, 2, 3),
    _megatron("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, 2, 2),
    _megatron("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, 1, 2),
    _megatron("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, 1, 3),
    _megatron("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, 1, 1),
]

# -- 2. Korthikanti et al., selective recomputation and sequence parallelism, Tables 3 and 5 --

_KORTHIKANTI = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
    "MLSys 2023, arXiv 2205.05198 (https://arxiv.org/abs/2205.05198), Table 3 (configurations: "
    "A100 80 GB, s = 2048, V = 51,200, no data parallelism) and Table 5 (end-to-end iteration "
    "time)")
_KORTHIKANTI_CHECK = (
    "Read here from one stored third-party transcription of Tables 3 and 5; the MFU figures "
    "agree with the paper's model-FLOP formula (eq. 7, 72 B L s h^2 (1 + s/6h + V/12hL)) at "
    "these batch sizes and times, and the abstract's 530B figures are confirmed on "
    "https://mlsys.org/virtual/2023/poster/2445.")


def _korthikanti(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
                 batch: int, micro: int, chunks: int, full_s: float, present_s: float,
                 mfu: float, hfu: float, selective: bool) -> Published:
    what = ("'present work' (sequence parallelism + selective recomputation)" if selective
            else "the full-recomputation baseline")
    chunk_note = (f"the interleaved schedule with {chunks} stages per rank (as the "
                  "transcription of Table 3 gives it)" if chunks > 1 else
                  "the non-interleaved 1F1B schedule (the transcription gives interleaving "
                  "only for 175B and 530B)" if pp > 1 else "no pipeline")
    return Published(
        key=f"korthikanti-{size.lower()}-{'selective' if selective else 'full'}",
        model=_gpt(layers, hidden, heads, 2048, 51200), gpu="A100-80GB", gpus=gpus, tp=tp,
        pp=pp, dp=gpus // (tp * pp), global_batch=batch, micro_batch=micro,
        schedule="interleaved-1f1b" if chunks > 1 else "1f1b", stages_per_rank=chunks,
        recompute="selective" if selective else "always", precision="bf16", metric="step_s",
        value=present_s if selective else full_s,
        source=(
            f"{_KORTHIKANTI}, {size}: {heads} heads, hidden {hidden}, {layers} layers, TP {tp}, "
            f"PP {pp}, {gpus} GPUs, global batch {batch}, micro-batch {micro}; {what}: "
            f"{present_s if selective else full_s:g} s per iteration (full recompute {full_s:g} "
            f"s, present work {present_s:g} s, MFU {mfu:g}%, HFU {hfu:g}%). "
            + _KORTHIKANTI_CHECK),
        assumed=(
            chunk_note[0].upper() + chunk_note[1:] + "; "
            + ("sequence parallelism is on in this row and has no field here (it shards the "
               "LayerNorm/dropout activations over TP and replaces each all-reduce by a "
               "reduce-scatter and an all-gather); 'selective' recomputes only the attention "
               "core (QK^T, softmax, dropout, attention over V); " if selective else
               "full recomputation of each transformer layer without sequence parallelism "
               "(the paper's baseline); ")
            + "bf16 mixed precision is assumed (the transcription says 'mixed precision'); "
            "MLP width 4h, multi-head attention; no data parallelism, so no gradient "
            "all-reduce."),
    )


_KORTHIKANTI_ROWS = [
    _korthikanti(size, heads, hidden, layers, tp, pp, gpus, batch, micro, chunks, full_s,
                 present_s, mfu, hfu, selective)
    for size, heads, hidden, layers, tp, pp, gpus, batch, micro, chunks, full_s, present_s,
    mfu, hfu in (
        ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 41.5, 43.7),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 51.4, 52.8),
        ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 56.0, 57.0),
        ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 56.3, 57.0),
    )
    for selective in (True, False)
]

# -- 3. Zero Bubble pipeline parallelism, Qi et al., ICLR 2024, Tables 3 and 4 ---------------

_ZB = (
    "Qi, Wan, Huang, Lin, 'Zero Bubble (Almost) Pipeline Parallelism', ICLR 2024, arXiv "
    "2401.10241 (https://arxiv.org/abs/2401.10241), sec. 5.1-5.2: Table 3 (models: sequence "
    "1024, 'Pipelines (GPUs)', micro-batch size, number of micro-batches) and Table 4 "
    "(samples per GPU per second, memory); up to 32 A100 SXM 80 GB in 4 nodes joined by RoCE "
    "RDMA. Verified here against two stored transcriptions of the paper that agree")
_ZB_NAMES = {"1f1b": "1F1B", "zb1p": "ZB-1p", "zb2p": "ZB-2p"}


def _zb(size: str, layers: int, heads: int, hidden: int, gpus: int, micro: int, m: int,
        kind: str, samples: float, memory_gb: int) -> Published:
    schedule = {"1f1b": "1f1b", "zb1p": "zb-h1", "zb2p": "zb-auto"}[kind]
    mapping = {
        "1f1b": "the 1F1B baseline is Megatron-LM's (synchronous optimizer step)",
        "zb1p": ("ZB-1p (searched under a memory limit of p micro-batches' activations) is "
                 "given pipetrain's 'zb-h1', because the paper's Table 5 gives ZB-1p the same "
                 "bubble rate as ZB-H1 in every setting"),
        "zb2p": ("ZB-2p is pipetrain's 'zb-auto' under a memory limit of 2p stage-"
                 "activations (Target(memory_limit=2 * pp)), the paper's 2 p M_B"),
    }[kind]
    return Published(
        key=f"zb-{size.lower()}-{kind}", model=_gpt(layers, hidden, heads, 1024, 32000),
        gpu="A100-80GB", gpus=gpus, tp=1, pp=gpus, dp=1, global_batch=micro * m,
        micro_batch=micro, schedule=schedule, stages_per_rank=1, recompute="never",
        precision="fp16", metric="tokens_per_s_per_gpu", value=round(samples * 1024, 2),
        activation_limit=2.0 * gpus if kind == "zb2p" else 0.0, peak_memory=memory_gb * 1e9,
        source=(
            f"{_ZB}. Model {size}: {layers} layers, {heads} heads, hidden {hidden}, {gpus} "
            f"GPUs, micro-batch {micro}, {m} micro-batches; {_ZB_NAMES[kind]}: {samples:g} "
            f"samples per GPU per second (= {samples:g} x 1024 tokens), peak memory "
            f"{memory_gb} GB."),
        assumed=(
            f"Pure pipeline: pp = #GPUs ({gpus}), TP 1, DP 1 (Table 3's 'Pipelines (GPUs)'); "
            "the first and last stages hold one layer fewer than the others (sec. 5.1), which "
            "a planner's even split does not; " + mapping + "; vocabulary 32,000 with untied "
            "embeddings is assumed from the authors' released scripts (a SentencePiece "
            "tokenizer from their sample dataset, '--untie-embeddings-and-output-weights'), "
            "as are fp16 and no activation recomputation "
            "(sail-sg/zero-bubble-pipeline-parallelism examples/pretrain_zero_bubble.sh, "
            "first committed 2024-08-19, after the paper); attention keeps its s x s scores "
            "(no flash attention) without a dropout over them, as the paper's own peak "
            "memory of its four 1F1B runs says: 30, 39, 32 and 43 GB, against 27.3, 39.9, "
            "34.9 and 42.4 GB predicted so, 20-36 GB with flash attention and 38-52 GB with "
            "a dropout (its mask and output kept: 5 bytes a score instead of 2); MLP width "
            "4h; the inter-node RoCE bandwidth is not "
            "given (the A100-80GB entry's 25 GB/s per GPU is assumed for the 16- and 32-GPU "
            "runs; the 8-GPU runs are one node)."),
    )


_ZB_ROWS = [
    _zb(size, layers, heads, hidden, gpus, micro, m, kind, samples, memory_gb)
    for size, layers, heads, hidden, gpus, micro, m, cells in (
        ("1.5B", 22, 24, 2304, 8, 6, 32, {"1f1b": (12.5, 30), "zb1p": (13.4, 32),
                                         "zb2p": (14.8, 59)}),
        ("6.2B", 30, 32, 4096, 8, 3, 32, {"1f1b": (3.70, 39), "zb1p": (4.00, 42),
                                         "zb2p": (4.35, 70)}),
        ("14.6B", 46, 40, 5120, 16, 1, 64, {"1f1b": (1.49, 32), "zb1p": (1.67, 33),
                                           "zb2p": (1.83, 51)}),
        ("28.3B", 62, 48, 6144, 32, 1, 128, {"1f1b": (0.80, 43), "zb1p": (0.90, 44),
                                            "zb2p": (1.00, 74)}),
    )
    for kind, (samples, memory_gb) in cells.items()
]

# -- 4. torchtitan, Llama 3.1 on H100 (Liang et al., arXiv 2410.06511; benchmark page) --------

_TORCHTITAN = (
    "torchtitan team, 'llama3_h100_202412_torchtitan' benchmark page (pytorch/torchtitan "
    "benchmarks/llama3_h100_202412_torchtitan.md, https://github.com/pytorch/torchtitan/blob/"
    "main/benchmarks/llama3_h100_202412_torchtitan.md; read here from the repository "
    "snapshot), torchtitan 9dec370, torch 1963fc8, December 2024: Grand Teton hosts, 8 H100 "
    "per host over NVLink, 96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W power "
    "limit; TPS/GPU read at the 90th iteration. The same experiments are in Liang et al., "
    "'TorchTitan: One-stop PyTorch native solution for production ready LLM pre-training', "
    "arXiv 2410.06511 (https://arxiv.org/abs/2410.06511), whose tables (not stored here; a "
    "third-party summary gives e.g. 405B 1F1B 100 -> interleaved 130, 70B 897 -> 1,010 "
    "TPS/GPU) differ slightly from the page; this row uses the page")
_TORCHTITAN_ASSUMED = (
    "The H100s were 96 GB HBM2e parts at 500 W whose peak the page says is between H100 SXM "
    "and NVL and unknown; mapped to H100-SXM (80 GB, 700 W), so predicted times are "
    "optimistic and the memory limit conservative; sequence length 8,192 from torchtitan's "
    "llama3 train configs at 9dec370 (training.seq_len) unless the row gives another; "
    "model shapes from torchtitan's llama3_configs at that commit (FFN widths computed from "
    "ffn_dim_multiplier and multiple_of), vocabulary 128,256 (the Llama 3 tokenizer)")


def _gib(text: str) -> float:
    """The '(N GiB)' a torchtitan table row gives, in bytes; 0 where it gives none."""
    found = re.search(r"\(([\d.]+) GiB\)", text)
    return float(found.group(1)) * 2**30 if found else 0.0


def _torchtitan(key: str, size: str, seq_len: int, gpus: int, fsdp: int, tp: int, pp: int,
                cp: int, local_batch: int, micro: int, schedule: str, chunks: int,
                recompute: str, fp8: bool, tps: float, table: str, extra: str) -> Published:
    return Published(
        key=key, model=_llama3(size, seq_len), gpu="H100-SXM", gpus=gpus, tp=tp, pp=pp, dp=1,
        cp=cp, fsdp=fsdp, global_batch=local_batch * fsdp, micro_batch=micro,
        schedule=schedule, stages_per_rank=chunks, recompute=recompute,
        precision="fp8" if fp8 else "bf16", metric="tokens_per_s_per_gpu", value=tps,
        source=f"{_TORCHTITAN}. {table}: {tps:g} TPS/GPU.",
        peak_memory=_gib(table),
        assumed=(f"{_TORCHTITAN_ASSUMED}; " + extra
                 + ("; fp8 means torchao Float8 (dynamic tensorwise scaling) on the "
                    "transformer blocks' nn.Linear layers with fp8 FSDP all-gather, the rest "
                    "bf16" if fp8 else "; bf16 mixed precision (FSDP2 default policy)")
                 + "."),
    )


_TORCHTITAN_ROWS = [
    _torchtitan("torchtitan-8b-8gpu-fsdp", "8b", 8192, 8, 8, 1, 1, 1, 2, 2, "1f1b", 1,
                "op", False, 5762,
                "Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, global batch 16, "
                "selective activation checkpointing, row 'FSDP' (82.4 GiB)",
                "no pipeline, so one micro-batch of the local batch per step; selective is "
                "torchtitan's 'op' policy; eager (no torch.compile)"),
    _torchtitan("torchtitan-8b-128gpu-fsdp", "8b", 8192, 128, 128, 1, 1, 1, 2, 2, "1f1b", 1,
                "op", False, 5605,
                "Table 3: Llama 3.1 8B, 128 GPUs, FSDP, local batch 2, global batch 256, "
                "selective activation checkpointing, row 'FSDP' (67.0 GiB)",
                "no pipeline, one micro-batch per step; selective is torchtitan's 'op' "
                "policy; eager"),
    _torchtitan("torchtitan-8b-128gpu-fsdp-fp8", "8b", 8192, 128, 128, 1, 1, 1, 2, 2, "1f1b",
                1, "op", True, 8380,
                "Table 3: Llama 3.1 8B, 128 GPUs, row 'FSDP + torch.compile + Float8' "
                "(61.8 GiB)",
                "no pipeline, one micro-batch per step; selective is torchtitan's 'op' "
                "policy; torch.compile on"),
    _torchtitan("torchtitan-8b-8gpu-cp2-64k", "8b", 65536, 8, 4, 1, 1, 2, 1, 1, "1f1b", 1,
                "always", True, 2540,
                "Table 2: Llama 3.1 8B, 8 GPUs, FSDP + CP + torch.compile + Float8, local "
                "batch 1, full activation checkpointing, row 'FSDP 4, CP 2', sequence 65,536 "
                "(84.2 GiB)",
                "global batch = local batch 1 x 4 FSDP ranks = 4 sequences (CP ranks share a "
                "sequence); context parallelism is torchtitan's ring attention"),
    _torchtitan("torchtitan-70b-256gpu-2d-fp8", "70b", 8192, 256, 32, 8, 1, 1, 16, 16, "1f1b",
                1, "always", True, 829,
                "Table 4: Llama 3.1 70B, 256 GPUs (FSDP 32, TP 8), 2D + torch.compile + "
                "Float8, local batch 16, global batch 512, full activation checkpointing, row "
                "'2D' (71.9 GiB; 876 TPS/GPU with AsyncTP)",
                "no pipeline, so the local batch of 16 is one micro-batch; TP without async "
                "TP, with sequence parallelism (torchtitan's TP plan shards the norms' "
                "activations)"),
    _torchtitan("torchtitan-405b-512gpu-3d-1f1b", "405b", 8192, 512, 8, 8, 8, 1, 32, 4,
                "1f1b", 1, "always", True, 100,
                "Table 5: Llama 3.1 405B, 512 GPUs (FSDP 8, TP 8, PP 8), 3D + torch.compile + "
                "Float8 + AsyncTP, local batch 32, global batch 256, full activation "
                "checkpointing, row '1F1B' (82.5 GiB, the largest over the PP ranks)",
                "the page gives no micro-batch count: torchtitan's default at 9dec370 is "
                "pp-degree micro-batches (experimental.pipeline_parallel_microbatches = "
                "None -> 8), i.e. 4 sequences each; layers split by torchtitan's "
                "generate_split_points (126 layers over 8 stages, uneven); async TP on"),
    _torchtitan("torchtitan-405b-512gpu-3d-interleaved", "405b", 8192, 512, 8, 8, 8, 1, 32, 4,
                "interleaved-1f1b", 2, "always", True, 128,
                "Table 5: Llama 3.1 405B, 512 GPUs (FSDP 8, TP 8, PP 8), local batch 32, "
                "global batch 256, full activation checkpointing, row 'Interleaved 1F1B' "
                "(72.7 GiB)",
                "2 stages per rank: torchtitan's default for a multi-stage schedule without "
                "split points at 9dec370 (generate_split_points), not stated on the page; 8 "
                "micro-batches of 4 sequences (the default, as for 1F1B); 126 layers over 16 "
                "stages, uneven; async TP on"),
]

# -- 5. Llama 3 405B pre-training, Table 4 of 'The Llama 3 Herd of Models' -------------------

_LLAMA3_PAPER = (
    "Llama Team, AI @ Meta, 'The Llama 3 Herd of Models', arXiv 2407.21783 "
    "(https://arxiv.org/abs/2407.21783), sec. 3.3.2, Table 4 (scaling configurations of "
    "Llama 3 405B pre-training). GPUs, TP, CP, PP, 16M tokens per batch and TFLOPs/GPU are "
    "verified here against https://glennklockwood.com/garden/llama-3.1 (the same rows as "
    "presented by P. Balaji at SC'24); DP, batch size per DP rank and BF16 MFU are from "
    "memory of the paper's table, not verified here. Hardware (sec. 3.3.1): H100 at 700 W "
    "with 80 GB HBM3, 8 per Grand Teton server over NVLink, 400 Gb/s RoCE per GPU, verified "
    "against https://ai-papers.xuzou.cn/papers/llama3_2024; the 405B shape against "
    "https://aarnphm.xyz/thoughts/Llama-3 (Table 3) and torchtitan's llama3 405B config")
_LLAMA3_ASSUMED = (
    "Micro-batch 1 (not given); the paper's interleaved schedule (modified to take any "
    "number of micro-batches, with one layer fewer on the first and last stages) as "
    "'interleaved-1f1b' with 2 stages per rank, the stage count per rank not verified here; "
    "data parallelism as FSDP over all DP ranks (fsdp = DP, dp = 1): from memory the paper "
    "shards optimizer states and gradients but keeps parameters gathered after the forward "
    "(no reshard), which this layout cannot say; 'selective' recomputation is a guess (the "
    "table does not say); metric: the paper's TFLOPs/GPU, model FLOPs (its MFU is "
    "TFLOPs / 989), bf16")


def _llama3_row(key: str, gpus: int, cp: int, dp: int, seq_len: int, per_dp: int,
                tflops: float, mfu: int) -> Published:
    return Published(
        key=key, model=_llama3("405b", seq_len), gpu="H100-SXM", gpus=gpus, tp=8, pp=16,
        dp=1, cp=cp, fsdp=dp, global_batch=dp * per_dp, micro_batch=1,
        schedule="interleaved-1f1b", stages_per_rank=2, recompute="selective",
        precision="bf16", metric="model_tflops_per_gpu", value=tflops,
        source=(f"{_LLAMA3_PAPER}. Row: {gpus:,} GPUs, TP 8, CP {cp}, PP 16, DP {dp}, "
                f"sequence {seq_len:,}, batch size/DP {per_dp}, 16M tokens per batch: "
                f"{tflops:g} TFLOPs/GPU (BF16 MFU {mfu}%)."),
        assumed=(f"{_LLAMA3_ASSUMED}; global batch {dp * per_dp} sequences = DP {dp} x "
                 f"{per_dp} (= 16M tokens / {seq_len:,})."),
    )


_LLAMA3_ROWS = [
    _llama3_row("llama3-405b-8k-8192gpu", 8192, 1, 64, 8192, 32, 430, 43),
    _llama3_row("llama3-405b-8k-16384gpu", 16384, 1, 128, 8192, 16, 400, 41),
    _llama3_row("llama3-405b-128k-16384gpu", 16384, 16, 8, 131072, 16, 380, 38),
]

# -- 6. MegaScale's Megatron-LM baseline, Jiang et al., NSDI 2024, Tables 1 and 2 ------------

_MEGASCALE = (
    "Jiang et al., 'MegaScale: Scaling Large Language Model Training to More Than 10,000 "
    "GPUs', NSDI 2024, arXiv 2402.15627 (https://arxiv.org/abs/2402.15627), sec. 6.1, Table 1 "
    "(175B: 128 heads, hidden 12288, 96 layers, TP 8, PP 8), Table 2 (strong scaling of the "
    "175B model, Megatron-LM commit 285068c8 rows), interleaved schedule with six stages per "
    "rank, sequence 2,048, vocabulary 64,000; nodes of 8 'NVIDIA Ampere GPUs' with eight "
    "200G NICs (sec. 3.6). Verified here against a stored transcription of the paper")
_MEGASCALE_ASSUMED = (
    "The GPU is named only 'Ampere': A100 80 GB assumed; micro-batch 1 (not given); "
    "'selective' recomputation with sequence parallelism and bf16 are assumed (Megatron-LM "
    "at that commit supports them; the paper does not say; without them the 175B stage "
    "would not fit); dp = GPUs / 64 plain data parallelism; MLP width 4h, multi-head "
    "attention with the 128 heads Table 1 gives (GPT-3 itself has 96)")


def _megascale(gpus: int, batch: int, step: float, tokens: str, mfu: float) -> Published:
    return Published(
        key=f"megascale-megatron-175b-{gpus}gpu", model=_gpt(96, 12288, 128, 2048, 64000),
        gpu="A100-80GB", gpus=gpus, tp=8, pp=8, dp=gpus // 64, global_batch=batch,
        micro_batch=1, schedule="interleaved-1f1b", stages_per_rank=6, recompute="selective",
        precision="bf16", metric="step_s", value=step,
        source=(f"{_MEGASCALE}. Megatron-LM, batch {batch}, {gpus:,} GPUs: iteration time "
                f"{step:g} s ({tokens} tokens/s, MFU {mfu:g}%)."),
        assumed=_MEGASCALE_ASSUMED + ".",
    )


_MEGASCALE_ROWS = [
    _megascale(256, 768, 40.0, "39.3k", 53.0),
    _megascale(3072, 6144, 29.02, "433.6k", 48.7),
]

PUBLISHED: list[Published] = [
    *_MEGATRON_ROWS, *_KORTHIKANTI_ROWS, *_ZB_ROWS, *_TORCHTITAN_ROWS, *_LLAMA3_ROWS,
    *_MEGASCALE_ROWS,
]


def _check(published: Iterable[Published]) -> None:
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
        if r.schedule not in SCHEDULES or r.recompute not in RECOMPUTE \
                or r.precision not in PRECISIONS or r.metric not in METRICS:
            raise ValueError(f"{where}: unknown schedule, recompute, precision or metric")
        if (r.stages_per_rank > 1) != r.schedule.startswith("interleaved"):
            raise ValueError(f"{where}: stages_per_rank {r.stages_per_rank} does not match "
                             f"{r.schedule!r}")
        if not r.value > 0 or not r.source:
            raise ValueError(f"{where}: no value or no source")


_check(PUBLISHED)


def rows(keys: Iterable[str] | None = None) -> list[Published]:
    """The rows named by ``keys``, in that order (all of :data:`PUBLISHED` when ``None``).

    A key may also be a prefix ending in ``-`` or ``*`` (``"megatron-"``, ``"zb-*"``) for every
    row it begins. An unknown key raises :class:`ValueError` listing the known ones.
    """
    if keys is None:
        return list(PUBLISHED)
    by_key = {r.key: r for r in PUBLISHED}
    out: list[Published] = []
    for key in keys:
        if key in by_key:
            out.append(by_key[key])
            continue
        prefix = key[:-1] if key.endswith("*") else key if key.endswith("-") else ""
        matched = [r for r in PUBLISHED if prefix and r.key.startswith(prefix)]
        if not matched:
            raise ValueError(f"unknown published run {key!r}; known: {', '.join(by_key)}")
        out.extend(matched)
    return out
