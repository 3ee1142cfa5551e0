"""Published BigScience runs: BLOOM-176B's training and the layouts measured before it."""

from __future__ import annotations

from pipetrain.plan.cluster.published_record import Published, gpt_shape

__all__ = ["BLOOM"]

_REPO = (
    "BigScience, BLOOM's training (https://github.com/bigscience-workshop/bigscience, "
    "train/tr11-176B-ml/; read here from a stored copy at commit 9e64ede, the 48-node slurm "
    "script at 003b250): 48 nodes of 8 A100 80 GB (Jean Zay), Omni-Path between nodes, "
    "Megatron-DeepSpeed with its BF16 optimizer (ZeRO stage 1), sequence 2,048, vocabulary "
    "250,880 (padded), full recomputation ('--checkpoint-activations'), bf16, global batch "
    "2,048; the logged TFLOP/s are Megatron-LM's eq. 3 (they count the recomputation)")
_ASSUMED = (
    "pipetrain's 'megatron-deepspeed' preset: no flash attention (2022's fused softmax), the "
    "dropout of 0.1 over the scores the README says is inherited, no sequence parallelism, "
    "the optimizer's states sharded over dp (ZeRO-1), the gradients reduced after the "
    "backward (DeepSpeed's pipeline engine reduces them once the step's last micro-batch is "
    "done); DeepSpeed's pipeline schedule is run as 1F1B (one forward, one backward in the "
    "steady state); the tied embedding is held by the first and the last stage, as untied "
    "embeddings are; the layers are split evenly by the planner, where BLOOM gave each "
    "embedding a layer's slot ('type:transformer|embedding'); ALiBi in place of learned "
    "positions (no parameters either way); MLP width 4h, GeLU; the network is the 4 Omni-Path "
    "links of a node at the 400 Gb/s the project's bandwidth notes give as their maximum "
    "(experiments/bandwidth/README.md), 50 Gb/s a GPU (--nic-gbps 50); the same notes "
    "measured 15 to 42 Gb/s of all-reduce throughput on 4 such A100 nodes")


def _bloom(key: str, hidden: int, layers: int, heads: int, tp: int, pp: int, micro: int,
           step: float, memory_gb: int, where: str) -> Published:
    return Published(
        trainer="megatron-deepspeed", key=key,
        model=gpt_shape(layers, hidden, heads, 2048, 250880), gpu="A100-80GB", gpus=384,
        tp=tp, pp=pp, dp=384 // (tp * pp), global_batch=2048, micro_batch=micro,
        schedule="1f1b", stages_per_rank=1, recompute="always", precision="bf16",
        metric="step_s", value=step, peak_memory=memory_gb * 1e9 if memory_gb else 0.0,
        nic_gbps=50,
        source=(f"{_REPO}. {where}: hidden {hidden}, {layers} layers, {heads} heads, DP "
                f"{384 // (tp * pp)}, TP {tp}, PP {pp}, micro-batch {micro}: {step:g} s per "
                "iteration" + (f", {memory_gb} GB a GPU (nvidia-smi)." if memory_gb else ".")),
        assumed=_ASSUMED + ".",
    )


BLOOM: list[Published] = [
    _bloom("bloom-176b", 14336, 70, 112, 4, 12, 2, 104.70, 0,
           "README.md, 'Important checkpoints', iteration 85,376 of the run (19.561 samples "
           "per second, 149.77 TFLOP/s)"),
    _bloom("bloom-176b-tp8", 14336, 70, 64, 8, 12, 2, 121.63, 40,
           "chronicles-prequel.md, 'Rebalancing layers', 2022-02-28, the 176B table's row"),
    _bloom("bloom-176b-mbs4", 14336, 70, 64, 4, 12, 4, 102.27, 73,
           "chronicles-prequel.md, 'Rebalancing layers', 2022-02-28, the 176B table's row"),
    _bloom("bloom-184b-pp6", 12288, 100, 64, 8, 6, 4, 120.96, 72,
           "chronicles-prequel.md, 'Rebalancing layers', 2022-02-28, the 184B table's row"),
]
"""The run as it trained, and three of the layouts measured on the same 384 GPUs before it
(other head counts, tp, micro-batches and depths)."""
