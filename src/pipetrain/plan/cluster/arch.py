"""Arch: a transformer's shape as the cluster planner needs it, and its FLOPs per token.

Read from a Hugging Face ``config.json`` (decoder-only: Llama, Mistral, Qwen, Mixtral, GPT-2, and
their kin), a built-in preset, or the same keys in a JSON file of one's own. The planner needs
only shapes, never weights::

    Arch.from_config(json.load(open("config.json")))       # what pipetrain plan --hf reads
    arch.params()            # every parameter; arch.active_params(): those a token uses (MoE)
    arch.model_flops(seq)    # training FLOPs per token without recomputation (PaLM's count)

Model FLOPs per token follow Chowdhery et al. 2022 (PaLM, appendix B): 6 x the parameters of the
matrix multiplies a token passes through (the layers and the output projection; the embedding
lookup does no multiply), plus 12 x layers x attention width x sequence for attention's two
matrix products, forward and backward. A mixture of experts counts the ``top_k`` experts each
token is routed to (its active parameters), and its router. Hardware FLOPs add what
recomputation repeats (Narayanan et al. 2021, section 5.1): one more forward of every layer
under full recomputation, attention's core forward under selective recomputation (Korthikanti
et al. 2022).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Arch"]

_PLAIN = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "relu", "quick_gelu")
_NOT_GATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "gpt_bigcode"}


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's shape (MoE when ``experts`` > 0)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    """The MLP's intermediate width (of each expert's, for a mixture of experts)."""
    vocab: int
    head_dim: int = 0
    """0: hidden // heads."""
    gated: bool = True
    """SwiGLU-style MLP (three matrices); False: two (GPT-2)."""
    experts: int = 0
    top_k: int = 0
    shared_ffn: int = 0
    """Intermediate width of the always-on shared experts, all together (0: none)."""
    tied: bool = False
    """The output projection is the embedding's matrix."""
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, field) <= 0:
                raise ValueError(f"the model's {field} must be positive, got "
                                 f"{getattr(self, field)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.kv_heads} key-value heads do not divide {self.heads} "
                             "attention heads")
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..{self.experts} experts, got {self.top_k}")

    @property
    def dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    # -- parameters ------------------------------------------------------------------------
    def attention_params(self) -> int:
        """q, k, v and output projections of one layer."""
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    def mlp_params(self, ffn: int) -> int:
        return (3 if self.gated else 2) * self.hidden * ffn

    def layer_params(self, active: bool = False) -> int:
        """One layer's parameters (``active``: of a mixture of experts, those one token uses)."""
        norms = 2 * self.hidden
        if not self.moe:
            return self.attention_params() + self.mlp_params(self.ffn) + norms
        used = self.top_k if active else self.experts
        return (self.attention_params() + used * self.mlp_params(self.ffn)
                + self.mlp_params(self.shared_ffn) + self.hidden * self.experts + norms)

    def params(self) -> int:
        """Every parameter: layers, embedding, final norm and (untied) output projection."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.vocab * self.hidden + head + self.hidden

    def active_params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return (self.layers * self.layer_params(active=True) + self.vocab * self.hidden + head
                + self.hidden)

    # -- FLOPs -----------------------------------------------------------------------------
    def matmul_params(self) -> int:
        """Parameters a token multiplies by (active experts; the output projection, not the
        embedding lookup), norms left out."""
        return self.layers * (self.layer_params(active=True) - 2 * self.hidden) \
            + self.vocab * self.hidden

    def model_flops(self, seq: int) -> float:
        """Training FLOPs per token, forward and backward, without recomputation."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * self.heads * self.dim * seq

    def projections(self) -> list[tuple[int, int]]:
        """(inputs, outputs) of one layer's matrix multiplies per token, in a forward's order:
        q, k, v and the output projection, then the MLP's gate (gated), up and down (a mixture
        of experts' as wide as the experts a token uses, with its shared expert)."""
        q, kv, h = self.heads * self.dim, self.kv_heads * self.dim, self.hidden
        ffn = self.ffn * (self.top_k if self.moe else 1) + self.shared_ffn
        mlp = [(h, ffn)] * (2 if self.gated else 1) + [(ffn, h)]
        return [(h, q), (h, kv), (h, kv), (q, h), *mlp]

    def hardware_flops(self, seq: int, recompute: str) -> float:
        """Training FLOPs per token the devices run: ``model_flops`` plus what ``recompute``
        (``never``, ``selective``, ``op``, ``always``) runs again; ``op`` (torchtitan's
        per-op policy) runs every second matrix multiply of a layer again."""
        attention_fwd = 4.0 * self.layers * self.heads * self.dim * seq
        if recompute == "op":
            again = sum(i * o for i, o in self.projections()[1::2])
            return self.model_flops(seq) + 2.0 * self.layers * again
        if recompute == "always":
            return self.model_flops(seq) + 2.0 * self.matmul_params() \
                - 2.0 * self.vocab * self.hidden + attention_fwd
        if recompute == "selective":
            return self.model_flops(seq) + attention_fwd
        return self.model_flops(seq)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "") -> Arch:
        """From a Hugging Face ``config.json``'s keys (a composite config's ``text_config``)."""
        c = dict(config.get("text_config") or config)
        kind = str(c.get("model_type", ""))

        def get(*keys: str, default: Any = None) -> Any:
            for key in keys:
                if c.get(key) is not None:
                    return c[key]
            if default is None:
                raise ValueError(f"the model's config has none of {', '.join(keys)} "
                                 f"(model_type {kind!r}); give it in --config-json")
            return default

        hidden = int(get("hidden_size", "n_embd", "d_model"))
        heads = int(get("num_attention_heads", "n_head"))
        act = str(c.get("hidden_act", c.get("activation_function", "silu")))
        experts = int(get("num_local_experts", "n_routed_experts", "num_experts", default=0))
        ffn_key = ("moe_intermediate_size", "intermediate_size") if experts else (
            "intermediate_size", "n_inner", "ffn_dim")
        shared = int(get("n_shared_experts", default=0)) * int(get("moe_intermediate_size",
                                                                   default=0))
        shared += int(get("shared_expert_intermediate_size", default=0))
        return cls(
            layers=int(get("num_hidden_layers", "n_layer", "num_layers")), hidden=hidden,
            heads=heads, kv_heads=int(get("num_key_value_heads", default=heads)),
            ffn=int(get(*ffn_key, default=4 * hidden)), vocab=int(get("vocab_size")),
            head_dim=int(get("head_dim", default=0)),
            gated=kind not in _NOT_GATED and act not in _PLAIN or kind.startswith("gemma"),
            experts=experts, top_k=int(get("num_experts_per_tok", "top_k", default=0)),
            shared_ffn=shared, tied=bool(c.get("tie_word_embeddings", False)),
            name=name or kind)
