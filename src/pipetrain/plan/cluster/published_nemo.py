"""Published NeMo runs: NVIDIA's DGX Cloud benchmark recipes for Nemotron-4 and Llama 3.1."""

from __future__ import annotations

from pipetrain.plan.cluster.published_record import Published, llama3_shape

__all__ = ["NEMO"]

_DGXC = (
    "NVIDIA, DGX Cloud benchmarking recipes (https://github.com/NVIDIA/dgxc-benchmarking), "
    "release {release} (commit {commit}): {readme}'s table '{table}' (the last of 50 or 100 "
    "steps' 'train_step_timing', synthetic or mock data), the layout of {config}; H100 80 GB "
    "SXM in DGX H100 nodes. Read here from a stored copy of the repository")
_NEMOTRON = {"release": "v24.11.1", "commit": "35a9aec",
             "config": "nemotron/configure.sh and the nemotron4-*-synth.yaml it loads"}
_LLAMA = {"release": "v25.02", "commit": "8f5cbb3",
          "config": "llama3.1/configure.sh and llama3.1/llama3.1_*.yaml"}
_ASSUMED = (
    "Megatron-core's model under NeMo (flash or cuDNN fused attention, sequence parallelism "
    "where tp > 1, Apex's distributed fused Adam with its gradient and parameter syncs "
    "overlapped and its gradients in bf16, as the yaml sets them: 'overlap_grad_sync', "
    "'grad_sync_dtype: bf16'): pipetrain's 'nemo' preset; "
    "the recipe's overlap of tensor-parallel communication with the matrix multiplies "
    "(Transformer Engine's userbuffers, 'ub_tp_comm_overlap') and of the interleaved "
    "schedule's sends ('overlap_p2p_comm') have no setting of the preset, so their "
    "collectives stay on the critical path here; the fabric (8 x 400 Gb/s InfiniBand a "
    "node, as DGX H100 has) is assumed, the recipes do not give it")


def _nemotron(size: str, gpus: int, step: float) -> Published:
    big = size == "340b"
    tp, pp, v, micro = (8, 8, 12, 1) if big else (4, 1, 1, 4)
    accumulate = 16 if big else 4
    dp = gpus // (tp * pp)
    shape = ({"layers": 96, "hidden": 18432, "heads": 96, "ffn": 73728} if big else
             {"layers": 32, "hidden": 6144, "heads": 48, "ffn": 24576})
    table = (f"Nemotron4 {size} 24.11 BF16 (TP={tp}, PP={pp}, MBS={micro}, GA={accumulate}"
             + (f", VP={v})" if big else ")"))
    return Published(
        trainer="nemo", key=f"nemo-nemotron4-{size}-{gpus}gpu",
        model={**shape, "kv_heads": 8, "vocab": 256000, "seq_len": 4096}, gpu="H100-SXM",
        gpus=gpus, tp=tp, pp=pp, dp=dp, global_batch=dp * micro * accumulate,
        micro_batch=micro, schedule="interleaved-1f1b" if big else "1f1b", stages_per_rank=v,
        recompute="selective" if big else "never", precision="bf16", metric="step_s",
        value=step, optimizer_dtype="bf16" if big else "",
        source=(_DGXC.format(**_NEMOTRON, readme=f"nemotron/README_{size}.md", table=table)
                + f". {gpus} GPUs, global batch {dp * micro * accumulate}: {step:g} s per "
                "step. The model as the yaml gives it: "
                f"{shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads, "
                f"8 query groups, a squared-ReLU MLP of {shape['ffn']}, a vocabulary of "
                "256,000 with untied embeddings, sequence 4,096; recomputation "
                + ("'selective', bf16, and the optimizer's states in bf16 ('optim: dtype: "
                   "bf16')." if big else "none, bf16.")),
        assumed=(_ASSUMED + "; squared ReLU is costed as GPT's GeLU MLP (both are "
                 "ungated 4h MLPs); Megatron-core's 'selective' recomputes the attention "
                 "core, pipetrain's 'selective'." if big else _ASSUMED + "; squared ReLU "
                 "is costed as GPT's GeLU MLP (both are ungated 4h MLPs)."),
    )


def _llama(size: str, gpus: int, step: float) -> Published:
    tp, pp, cp, v = {"405b": (8, 9, 2, 7), "70b": (4, 4, 2, 5), "8b": (1, 1, 2, 1)}[size]
    accumulate = {"405b": 63, "70b": 64, "8b": 32}[size]
    dp = gpus // (tp * pp * cp)
    model = llama3_shape(size, 8192)
    note = ""
    if size == "405b":  # the recipe's model is not quite Llama 3.1 405B
        model |= {"kv_heads": 16, "vocab": 51200}
        note = ("; the 405B recipe runs 16 query groups (Llama 3.1 has 8) and mock data "
                "through GPT-2's tokenizer (50,257 tokens, padded here to 51,200, a multiple "
                "of Megatron's 128 x tp), as its configure.sh and yaml set")
    layout = f"TP={tp}, PP={pp}, CP={cp}" + (f", VP={v}" if v > 1 else "")
    table = f"Llama 3.1 {size} BF16 ({layout}, MBS=1, GA={accumulate})"
    return Published(
        trainer="nemo", key=f"nemo-llama3.1-{size}-{gpus}gpu", model=model,
        gpu="H100-SXM", gpus=gpus, tp=tp, pp=pp, cp=cp, dp=dp,
        global_batch=dp * accumulate, micro_batch=1,
        schedule="interleaved-1f1b" if v > 1 else "1f1b", stages_per_rank=v,
        recompute="never", precision="bf16", metric="step_s", value=step,
        source=(_DGXC.format(**_LLAMA, readme=f"llama3.1/README_{size}.md", table=table)
                + f". {gpus} GPUs, global batch {dp * accumulate}: {step:g} s per step; no "
                "recomputation ('activations_checkpoint_granularity: null'), bf16."),
        assumed=_ASSUMED + note + ".",
    )


NEMO: list[Published] = [
    _nemotron("340b", 128, 4.61), _nemotron("340b", 2048, 4.84),
    _nemotron("15b", 16, 2.83), _nemotron("15b", 2048, 2.96),
    _llama("405b", 576, 17.50), _llama("405b", 2304, 17.70),
    _llama("70b", 64, 14.61), _llama("70b", 2048, 14.84),
    _llama("8b", 8, 12.78), _llama("8b", 128, 13.16),
]
"""Each recipe's smallest and largest published job (the step times between them differ by
under 5 %)."""
