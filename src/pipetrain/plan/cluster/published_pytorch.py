"""Published PyTorch-side runs: Zero Bubble's schedules, torchtitan's benchmarks and Llama 3's
training layouts."""

from __future__ import annotations

import re

from pipetrain.plan.cluster.published_record import (
    Published,
    gpt_shape,
    llama3_shape,
)

__all__ = ["ZERO_BUBBLE", "TORCHTITAN", "LLAMA3"]

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
        trainer="zero-bubble",
        key=f"zb-{size.lower()}-{kind}", model=gpt_shape(layers, hidden, heads, 1024, 32000),
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
        trainer="torchtitan",
        key=key, model=llama3_shape(size, seq_len), gpu="H100-SXM", gpus=gpus, tp=tp, pp=pp, dp=1,
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
    "(no reshard), which this layout cannot say; recomputation is not given: the table does "
    "not say, and sec. 3.3.2's pre-training of 8K sequences without activation checkpointing "
    "(from memory, not verified here) does not fit 80 GB at this layout in this model (in "
    "the interleaved warm-up rank 0 holds 47 stage-activations of 4 layers each, 120 GB at "
    "8K), so the command searches it: the fewest of each stage's layers recomputed wholly "
    "that fit (Megatron-LM's block method), which the table's recompute column shows; "
    "metric: the paper's TFLOPs/GPU, model FLOPs (its MFU is "
    "TFLOPs / 989), bf16")


def _llama3_row(key: str, gpus: int, cp: int, dp: int, seq_len: int, per_dp: int,
                tflops: float, mfu: int) -> Published:
    return Published(
        trainer="torchtitan",
        key=key, model=llama3_shape("405b", seq_len), gpu="H100-SXM", gpus=gpus, tp=8, pp=16,
        dp=1, cp=cp, fsdp=dp, global_batch=dp * per_dp, micro_batch=1,
        schedule="interleaved-1f1b", stages_per_rank=2, recompute="",
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

ZERO_BUBBLE, TORCHTITAN, LLAMA3 = _ZB_ROWS, _TORCHTITAN_ROWS, _LLAMA3_ROWS
