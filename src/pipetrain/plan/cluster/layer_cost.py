"""Layer cost: one transformer layer's F, I and W on one GPU of a layout, in seconds and bytes.

For a micro-batch of ``b`` sequences of ``s`` tokens, ``T = b s / cp`` tokens on this GPU, width
``h``, tensor-parallel degree ``t`` (Megatron's sequence parallelism: norms, residuals and
their activations split by ``t`` too)::

    F  matrix multiplies  qkv (T, (a+2g)d/t, h), out (T, h, ad/t), up (T, f'/t, h), down (T, h, f/t)
       attention core     causal flash attention of T queries against s keys, a/t heads
       memory-bound       two norms, two residual adds, the MLP's activation, rotary (bytes / HBM)
       tensor parallel    2 all-gathers + 2 reduce-scatters of T h x 2 bytes (on the critical path)
       context parallel   K and V passed round the cp ring (overlapped with attention), or
                          4 all-to-alls of Q, K, V and the output over the cp ranks (heads for
                          tokens, DeepSpeed-Ulysses; on the critical path)
       expert parallel    2 all-to-alls of T top_k h x 2 bytes (dispatch, combine)
    I  the same multiplies with dX = dY W ("nn"), attention's backward, 2x the memory-bound
       work, the same collectives
    W  the weight gradients dW = dY^T X ("tn")
    fp8 (``--precision fp8``)  the multiplies at the measured fp8 rate, and each operand's cast
       and scale (:mod:`.fp8`)

Activation bytes per micro-batch follow Korthikanti et al. 2022 (section 4.1: 34 s b h bytes per
GPT layer with sequence parallelism, over ``t``; 10 s b h + 24 s b h / t without), generalised
to any MLP width and gated MLPs (no dropout masks: Llama-style models train without dropout),
with flash attention's (no s x s matrices; 5 a s^2 b more without it); full recomputation keeps
only each layer's input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.plan.cluster import fp8
from pipetrain.plan.cluster.arch import Arch
from pipetrain.plan.cluster.collectives import Link
from pipetrain.plan.cluster.kernels import Kernels

__all__ = ["LayerCost", "layer_cost", "head_cost"]

BF16 = 2  # bytes per activation element


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer's F, I and W on one micro-batch, the bytes its F keeps for the
    backward, and the part of each that is communication (``*_comm``)."""

    f: float
    i: float
    w: float
    kept: float
    f_comm: float = 0.0
    i_comm: float = 0.0


@dataclass(frozen=True)
class Shard:
    """How a layer is cut on one GPU, and the links of its groups."""

    tp: int
    cp: int
    ep: int
    tp_link: Link
    cp_link: Link
    ep_link: Link
    sequence_parallel: bool = True
    fp8: bool = False
    """The layers' matrix multiplies in fp8 (attention, norms and the output layer in bf16)."""
    flash: bool = True
    """Flash attention; False: the s x s scores in memory (a fused softmax, as before 2022)."""
    attention_dropout: bool = True
    """With the scores in memory: a dropout over them (its mask and output kept too)."""
    cp_exchange: str = "ring"
    """How cp ranks attend (:data:`pipetrain.plan.cluster.trainers.CP_EXCHANGES`)."""


def _gemms(arch: Arch, tokens: float, t: int, ep: int) -> list[tuple[float, float, float]]:
    """(m, n, k) of each forward matrix multiply of one layer on one GPU."""
    a, g, d, h = arch.heads, arch.kv_heads, arch.dim, arch.hidden
    out = [(tokens, (a + 2 * g) * d / t, h), (tokens, h, a * d / t)]
    up = 2 if arch.gated else 1
    if not arch.moe:
        return out + [(tokens, up * arch.ffn / t, h), (tokens, h, arch.ffn / t)]
    per_expert = tokens * ep * arch.top_k / arch.experts  # tokens each local expert gets
    for _ in range(max(1, arch.experts // ep)):
        out += [(per_expert, up * arch.ffn / t, h), (per_expert, h, arch.ffn / t)]
    if arch.shared_ffn:
        out += [(tokens, up * arch.shared_ffn / t, h), (tokens, h, arch.shared_ffn / t)]
    return out


def _memory_bytes(arch: Arch, tokens: float, shard: Shard) -> tuple[float, float]:
    """Bytes a layer's memory-bound forward work moves: (elementwise, norms)."""
    t = shard.tp
    wide = tokens * arch.hidden * BF16 / (t if shard.sequence_parallel else 1)
    ffn = arch.ffn * (arch.top_k if arch.moe else 1) + arch.shared_ffn
    act = tokens * ffn * BF16 / t * (3 if arch.gated else 2)
    rotary = 2 * tokens * (arch.heads + arch.kv_heads) * arch.dim * BF16 / t if arch.gated else 0
    return 2 * 3 * wide + act + rotary, 2 * 2 * wide


def kept_bytes(arch: Arch, tokens: float, shard: Shard, recompute: str) -> float:
    """Bytes one layer's F keeps for its backward, per micro-batch (Korthikanti et al.; for
    ``op``, torchtitan's per-op policy: the layer's input, flash attention's output and the
    output of the first, third, ... matrix multiply, everything else recomputed)."""
    t, h = shard.tp, arch.hidden
    sp = t if shard.sequence_parallel else 1
    if recompute == "always":
        return tokens * h * BF16 / sp
    if recompute == "op":  # the input, the attention's output, every other multiply's output
        odd = sum(o for _, o in arch.projections()[0::2])
        return tokens * BF16 * (h / sp + (arch.heads * arch.dim + odd) / t)
    qkv = tokens * (arch.heads + 2 * arch.kv_heads) * arch.dim * BF16 / t
    ffn = arch.ffn * (arch.top_k if arch.moe else 1) + arch.shared_ffn
    mlp = tokens * ffn * BF16 / t * (4 if arch.gated else 2)  # the activation's in and out
    narrow = tokens * h * BF16 / t  # attention's output, the output projection's input
    wide = tokens * h * BF16 * 4 / sp  # both norms' inputs, the qkv and the MLP's inputs
    masks = 0.0 if arch.gated else 2 * tokens * h / sp  # GPT's two dropouts, a byte each
    return qkv + mlp + narrow + wide + masks


def layer_cost(arch: Arch, kernels: Kernels, micro_batch: int, seq: int, shard: Shard,
               recompute: str) -> LayerCost:
    """One layer's :class:`LayerCost` (see the module docstring)."""
    tokens = micro_batch * seq / shard.cp
    gemms = _gemms(arch, tokens, shard.tp, shard.ep)
    q = shard.fp8
    f = sum(kernels.gemm(m, n, k, "nt", q) for m, n, k in gemms)
    i = sum(kernels.gemm(m, k, n, "nn", q) for m, n, k in gemms)
    w = sum(kernels.gemm(n, k, m, "tn", q) for m, n, k in gemms)
    if q:  # the operands' casts and the tp ranks' maxima (.fp8)
        cast, scales = fp8.casts(kernels, gemms), fp8.scale_reductions(gemms, shard.tp,
                                                                       shard.tp_link)
        f, i, w = f + cast[0] + scales[0], i + cast[1] + scales[1], w + cast[2] + scales[2]
    heads = micro_batch * arch.heads / shard.tp
    attn_f, attn_b, scores = (_flash(kernels, heads, tokens / micro_batch, seq, arch.dim)
                              if shard.flash else
                              _materialized(kernels, heads, tokens / micro_batch, seq, arch.dim,
                                            shard.attention_dropout))
    elementwise, norms = _memory_bytes(arch, tokens, shard)
    mem_f = kernels.memory(elementwise) + kernels.memory(norms, "norm")
    comm = _tp_comm(arch, tokens, shard) + _ep_comm(arch, tokens, shard)
    ring_f, ring_b = _cp_exposed(arch, tokens, shard, attn_f, attn_b)
    f_total = f + attn_f + mem_f + comm + ring_f
    i_total = i + attn_b + 2 * mem_f + comm + ring_b
    if recompute == "always":
        i_total += f_total
    elif recompute == "selective":
        i_total += attn_f
    elif recompute == "op":  # every second multiply again, and the memory-bound work
        i_total += mem_f + sum(kernels.gemm(tokens, o / shard.tp, i, "nt", q)
                               for i, o in arch.projections()[1::2])
    kept = kept_bytes(arch, tokens, shard, recompute) + (scores if recompute == "never"
                                                          else 0.0)  # selective: rebuilt
    return LayerCost(f_total, i_total, w, kept,
                     comm + ring_f, comm + ring_b + (comm if recompute == "always" else 0.0))


def _flash(kernels: Kernels, heads: float, seq_q: float, seq: int, dim: int
           ) -> tuple[float, float, float]:
    """Flash attention's forward and backward seconds; it keeps no s x s scores."""
    return (kernels.attention(heads, seq_q, seq, dim),
            kernels.attention(heads, seq_q, seq, dim, backward=True), 0.0)


def _materialized(kernels: Kernels, heads: float, seq_q: float, seq: int, dim: int,
                  dropout: bool) -> tuple[float, float, float]:
    """Attention with its scores in memory: two batched matrix multiplies forward (Q K^T, then
    the probabilities times V), a fused scale-mask-softmax and (``dropout``) a dropout over the
    s x s scores; four multiplies and their gradients backward. Kept: the softmax's output (2
    bytes a score), and the dropout's mask and output (Korthikanti et al.'s 5 a s^2 b bytes)."""
    scores = heads * seq_q * seq
    product = kernels.gemm(heads * seq_q, seq, dim)
    drop = kernels.memory(5 * scores) if dropout else 0.0
    forward = 2 * product + kernels.memory(4 * scores, "norm") + drop
    backward = 4 * product + kernels.memory(6 * scores, "norm") + drop
    return forward, backward, (5 if dropout else 2) * scores


def _tp_comm(arch: Arch, tokens: float, shard: Shard) -> float:
    """Tensor parallelism's collectives of one layer's F (and again of its I)."""
    size = tokens * arch.hidden * BF16
    if shard.sequence_parallel:
        return 2 * (shard.tp_link.all_gather(size, shard.tp)
                    + shard.tp_link.reduce_scatter(size, shard.tp))
    return 2 * shard.tp_link.all_reduce(size, shard.tp)


def _ep_comm(arch: Arch, tokens: float, shard: Shard) -> float:
    if not arch.moe or shard.ep <= 1:
        return 0.0
    size = tokens * arch.top_k * arch.hidden * BF16 / shard.tp
    return 2 * shard.ep_link.all_to_all(size, shard.ep)


def _cp_exposed(arch: Arch, tokens: float, shard: Shard, attn_f: float, attn_b: float
                ) -> tuple[float, float]:
    """Context parallelism's exchanges on the critical path, F and I: a ring's K and V
    beyond the attention it overlaps, or the four all-to-alls over heads (each holding this
    GPU's tokens of its tp rank's heads; key-value heads repeated up to a multiple of cp),
    again in the backward for their gradients."""
    if shard.cp <= 1:
        return 0.0, 0.0
    kv_heads = arch.kv_heads // shard.tp
    if shard.cp_exchange == "all-to-all":
        kv_heads = math.lcm(kv_heads, shard.cp)  # repeated until the cp ranks divide them
        row = tokens * arch.dim * BF16  # one head's
        a2a = sum(shard.cp_link.all_to_all(row * n, shard.cp)  # Q, K, V, the output
                  for n in (arch.heads // shard.tp, kv_heads, kv_heads, arch.heads // shard.tp))
        return a2a, a2a
    kv = 2 * tokens * kv_heads * arch.dim * BF16
    ring = (shard.cp - 1) * shard.cp_link.send(kv)
    return max(0.0, ring - attn_f), max(0.0, 2 * ring - attn_b)


def head_cost(arch: Arch, kernels: Kernels, micro_batch: int, seq: int, shard: Shard
              ) -> LayerCost:
    """The output projection and the loss on the last stage (vocabulary split by ``tp``);
    logits and their gradient in fp32 are the stage's largest temporary (``kept``)."""
    tokens = micro_batch * seq / shard.cp
    n, h = arch.vocab / shard.tp, arch.hidden
    logits = tokens * n * 4
    loss = kernels.memory(3 * logits, "norm")
    return LayerCost(kernels.gemm(tokens, n, h, "nt") + loss,
                     kernels.gemm(tokens, h, n, "nn") + loss, kernels.gemm(n, h, tokens, "tn"),
                     2 * logits)
