"""An architecture zoo: Hugging Face models of every family, built from tiny configs (nothing is
downloaded), captured with ``split_points="auto"``, split into 3 or 4 stages on local ranks and
stepped once (dropout as the config has it), against the same micro-batches run one after
another through the unsplit model: the loss and every parameter's gradient within a stated
tolerance of the largest reference gradient (1e-9 in float64; fp32 where a kernel has no
float64), and the pipeline's parameter names exactly the model's, so that a stage whose
parameters went missing fails. One model per family also runs on 2 gloo processes.

Each ``Arch`` declares its expected outcome (a tolerance, or a failure with its reason, run as
a strict expected failure), and the table of docs/models.md is rendered from ``ZOO``
(``test_docs_table_is_rendered_from_the_zoo`` keeps the two equal). To regenerate it:
``python3 tests/test_zoo.py`` prints the table; ``python3 tests/test_zoo.py --write`` puts it
into docs/models.md between its markers.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

M, ROWS, SEQ, V, LAYERS = 4, 8, 12, 64, 2  # 2 layers: encoder-decoders 2 each
PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
BEGIN = "<!-- begin zoo table: rendered by tests/test_zoo.py (python3 tests/test_zoo.py) -->"
END = "<!-- end zoo table -->"
SLOW = os.environ.get("PIPETRAIN_ZOO_SLOW") == "1"


# ------------------------------------------------------------------ inputs, targets and losses


def _ids(rows: int = ROWS, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, V, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    for r in range(1, ROWS, 3):  # padded rows of several lengths
        mask[r, SEQ - 2 - r % 5:] = 0
    return mask


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


Batch = tuple[dict[str, Any], torch.Tensor]


def causal() -> Batch:
    ids = _ids()
    return {"input_ids": ids}, ids


def masked() -> Batch:
    """Every third token predicted; padded positions carry no label."""
    ids, mask = _ids(), _padding_mask()
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def seq2seq() -> Batch:
    return {"input_ids": _ids(), "attention_mask": _padding_mask(),
            "labels": _ids(ROWS, 7, seed=1)}, torch.zeros(ROWS)


def images(size: int) -> Callable[[], Batch]:
    def batch() -> Batch:
        return {"pixel_values": _randn(ROWS, 3, size, size)}, torch.arange(ROWS) % 3
    return batch


def mel_features() -> Batch:
    return {"input_features": _randn(ROWS, 16, 32), "labels": _ids(ROWS, 7)}, torch.zeros(ROWS)


def waveform() -> Batch:
    return {"input_values": _randn(ROWS, 400)}, _ids(ROWS, 5) % 15 + 1


def image_text() -> Batch:
    return {"input_ids": _ids(), "pixel_values": _randn(ROWS, 3, 16, 16),
            "return_loss": True}, torch.zeros(ROWS)


def lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mlm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def cls_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, y)


def ctc_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    rows, frames = out.logits.shape[:2]
    return F.ctc_loss(out.logits.log_softmax(-1).transpose(0, 1), y,
                      torch.full((rows,), frames), torch.full((rows,), y.shape[1]))


def own_loss(out: Any, _: torch.Tensor) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------- the zoo


@dataclass(frozen=True)
class Failure:
    """An expected failure: the exception, a pattern of its message, and why."""

    error: type[BaseException]
    match: str
    reason: str


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build, feed and score it, and its expected outcome."""

    name: str
    family: str
    cls: str  # the transformers class, built from config()
    config: Callable[[], Any]
    data: Callable[[], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    note: str = ""
    dtype: torch.dtype = torch.float64
    tol: float = 1e-9
    schedule: str = "zbv"  # on 2 ranks: 4 stages; "1f1b" on 3 ranks: 3 stages
    fails: Failure | None = None
    slow: str = ""  # why its symbolic capture is left out of CI (PIPETRAIN_ZOO_SLOW=1 runs it;
    # CI captures it at fixed shapes, dynamic=False)

    @property
    def ranks(self) -> int:
        return 2 if self.schedule == "zbv" else 3

    @property
    def stages(self) -> int:
        return 4 if self.schedule == "zbv" else 3


def _dec(**extra: Any) -> dict[str, Any]:
    return dict(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, max_position_embeddings=64, vocab_size=V,
                use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)


GQA = dict(num_key_value_heads=2)
ENC = dict(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
           max_position_embeddings=64, vocab_size=V, pad_token_id=0)
S2S = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
           decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False, pad_token_id=1,
           bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
GPT = dict(n_layer=LAYERS, n_head=4, vocab_size=V, use_cache=False, bos_token_id=0, eos_token_id=0)
W2V = dict(vocab_size=16, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
           intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
           num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, pad_token_id=0)
VIT = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=LAYERS,
           num_attention_heads=4, intermediate_size=64, num_labels=3)
FP32 = dict(dtype=torch.float32, tol=1e-5)
NO_F64 = "grouped_mm experts (the default): no float64 kernel"
DENSE, MOE, ENCODER, ENC_DEC = ("dense decoder-only", "MoE decoder-only", "encoder-only (MLM)",
                                "encoder-decoder")
VISION, SPEECH, MULTI = "vision", "speech", "multimodal"


def _moe(cfg: str, experts: str, impl: str, **extra: Any) -> Callable[[], Any]:
    return lambda: getattr(tf, cfg)(**_dec(**GQA, **extra), **{experts: 4},
                                    num_experts_per_tok=2, experts_implementation=impl)


ZOO: list[Arch] = [
    Arch("llama", DENSE, "LlamaForCausalLM", lambda: tf.LlamaConfig(**_dec(**GQA)), causal,
         lm_loss, "grouped-query attention, rotary tables"),
    Arch("mistral", DENSE, "MistralForCausalLM",
         lambda: tf.MistralConfig(**_dec(**GQA), sliding_window=4), causal, lm_loss,
         "sliding-window attention"),
    Arch("qwen2", DENSE, "Qwen2ForCausalLM", lambda: tf.Qwen2Config(**_dec(**GQA)), causal,
         lm_loss, "q/k/v biases"),
    Arch("qwen3", DENSE, "Qwen3ForCausalLM", lambda: tf.Qwen3Config(**_dec(**GQA), head_dim=8),
         causal, lm_loss, "q/k norms"),
    Arch("gemma", DENSE, "GemmaForCausalLM", lambda: tf.GemmaConfig(**_dec(**GQA), head_dim=8),
         causal, lm_loss, "tied head, scaled embedding"),
    Arch("gemma2", DENSE, "Gemma2ForCausalLM", lambda: tf.Gemma2Config(
        **_dec(**GQA), head_dim=8, sliding_window=4), causal, lm_loss,
         "logit soft-capping, sliding and global layers"),
    Arch("gemma3", DENSE, "Gemma3ForCausalLM", lambda: tf.Gemma3TextConfig(
        **_dec(**GQA), head_dim=8, sliding_window=4), causal, lm_loss,
         "sliding-window layers, q/k norms"),
    Arch("phi", DENSE, "PhiForCausalLM", lambda: tf.PhiConfig(**_dec()), causal, lm_loss,
         "partial rotary, attention and MLP in parallel"),
    Arch("phi3", DENSE, "Phi3ForCausalLM", lambda: tf.Phi3Config(**_dec(**GQA)), causal,
         lm_loss, "fused qkv and gate-up projections"),
    Arch("olmo2", DENSE, "Olmo2ForCausalLM", lambda: tf.Olmo2Config(**_dec(**GQA)), causal,
         lm_loss, "norms after attention and MLP, q/k norms"),
    Arch("gpt2", DENSE, "GPT2LMHeadModel", lambda: tf.GPT2Config(**GPT, n_embd=32, n_positions=64),
         causal, lm_loss, "tied head, learned positions"),
    Arch("gpt_neox", DENSE, "GPTNeoXForCausalLM", lambda: tf.GPTNeoXConfig(**_dec()), causal,
         lm_loss, "parallel residual", schedule="1f1b"),
    Arch("gptj", DENSE, "GPTJForCausalLM", lambda: tf.GPTJConfig(
        **GPT, n_embd=32, n_positions=64, rotary_dim=4), causal, lm_loss,
         "partial rotary, attention and MLP in parallel"),
    Arch("opt", DENSE, "OPTForCausalLM", lambda: tf.OPTConfig(
        **{k: v for k, v in _dec().items() if k != "intermediate_size"}, ffn_dim=64,
        word_embed_proj_dim=32), causal, lm_loss, "learned positions"),
    Arch("bloom", DENSE, "BloomForCausalLM", lambda: tf.BloomConfig(
        n_layer=LAYERS, hidden_size=32, n_head=4, vocab_size=V, use_cache=False, bos_token_id=0,
        eos_token_id=0), causal, lm_loss, "ALiBi positions"),
    Arch("falcon", DENSE, "FalconForCausalLM", lambda: tf.FalconConfig(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, vocab_size=V,
        use_cache=False, bos_token_id=0, eos_token_id=0), causal, lm_loss,
         "multi-query attention, attention and MLP in parallel"),
    Arch("mixtral", MOE, "MixtralForCausalLM",
         _moe("MixtralConfig", "num_local_experts", "grouped_mm"), causal, lm_loss, NO_F64,
         **FP32),
    Arch("mixtral-batched", MOE, "MixtralForCausalLM",
         _moe("MixtralConfig", "num_local_experts", "batched_mm"), causal, lm_loss,
         "`experts_implementation=\"batched_mm\"`"),
    Arch("qwen2_moe", MOE, "Qwen2MoeForCausalLM", _moe(
        "Qwen2MoeConfig", "num_experts", "grouped_mm", moe_intermediate_size=32,
        shared_expert_intermediate_size=32), causal, lm_loss, NO_F64 + "; a shared expert",
         **FP32),
    Arch("qwen3_moe", MOE, "Qwen3MoeForCausalLM", _moe(
        "Qwen3MoeConfig", "num_experts", "batched_mm", head_dim=8, moe_intermediate_size=32),
         causal, lm_loss, "`experts_implementation=\"batched_mm\"`"),
    Arch("olmoe", MOE, "OlmoeForCausalLM", _moe("OlmoeConfig", "num_experts", "grouped_mm"),
         causal, lm_loss, NO_F64, **FP32),
    Arch("olmoe-eager", MOE, "OlmoeForCausalLM", _moe("OlmoeConfig", "num_experts", "eager"),
         causal, lm_loss, "`experts_implementation=\"eager\"`", fails=Failure(
             PartitionError, "for expert_idx in expert_hit", "eager experts loop over the "
             "experts that got tokens (data-dependent control flow, which torch.export cannot "
             "capture): use `grouped_mm` or `batched_mm`")),
    Arch("bert", ENCODER, "BertForMaskedLM", lambda: tf.BertConfig(**ENC), masked, mlm_loss,
         "padding mask"),
    Arch("roberta", ENCODER, "RobertaForMaskedLM", lambda: tf.RobertaConfig(
        **dict(ENC, max_position_embeddings=80, pad_token_id=1)), masked, mlm_loss,
         "padding mask, positions counted from it"),
    Arch("xlm_roberta", ENCODER, "XLMRobertaForMaskedLM", lambda: tf.XLMRobertaConfig(
        **dict(ENC, max_position_embeddings=80, pad_token_id=1)), masked, mlm_loss,
         "padding mask"),
    Arch("distilbert", ENCODER, "DistilBertForMaskedLM", lambda: tf.DistilBertConfig(
        n_layers=LAYERS, dim=32, hidden_dim=64, n_heads=4, vocab_size=V, max_position_embeddings=64,
        pad_token_id=0), masked, mlm_loss, "padding mask, tied head", schedule="1f1b"),
    Arch("electra", ENCODER, "ElectraForMaskedLM", lambda: tf.ElectraConfig(
        **ENC, embedding_size=16), masked, mlm_loss, "padding mask, embedding projection"),
    Arch("deberta_v2", ENCODER, "DebertaV2ForMaskedLM", lambda: tf.DebertaV2Config(**ENC),
         masked, mlm_loss, "padding mask, disentangled relative attention"),
    Arch("modernbert", ENCODER, "ModernBertForMaskedLM", lambda: tf.ModernBertConfig(
        **ENC, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
        local_attention=4), masked, mlm_loss, "padding mask, rotary, local and global attention"),
    Arch("albert", ENCODER, "AlbertForMaskedLM", lambda: tf.AlbertConfig(
        **ENC, embedding_size=16), masked, mlm_loss, "padding mask; layers sharing one module",
         schedule="1f1b", fails=Failure(PartitionError, "2 layers cannot fill 3 stages", "auto "
             "finds 2 units (`albert`, `predictions`): the layers are one module called "
             "repeatedly, not a stack of layers to open, so there is no cut between them")),
    Arch("t5", ENC_DEC, "T5ForConditionalGeneration", lambda: tf.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1), seq2seq, own_loss, "`labels`, padding mask, relative position bias"),
    Arch("bart", ENC_DEC, "BartForConditionalGeneration", lambda: tf.BartConfig(**S2S), seq2seq,
         own_loss, "`labels`, padding mask"),
    Arch("mbart", ENC_DEC, "MBartForConditionalGeneration", lambda: tf.MBartConfig(**S2S),
         seq2seq, own_loss, "`labels`, padding mask; `shift_tokens_right` writes the "
         "decoder's inputs in place, sent written"),
    Arch("pegasus", ENC_DEC, "PegasusForConditionalGeneration", lambda: tf.PegasusConfig(**S2S),
         seq2seq, own_loss, "`labels`, padding mask"),
    Arch("marian", ENC_DEC, "MarianMTModel", lambda: tf.MarianConfig(**S2S), seq2seq, own_loss,
         "`labels`, padding mask", schedule="1f1b"),
    Arch("vit", VISION, "ViTForImageClassification", lambda: tf.ViTConfig(**VIT), images(16),
         cls_loss, "patch embedding, class token"),
    Arch("deit", VISION, "DeiTForImageClassification", lambda: tf.DeiTConfig(**VIT), images(16),
         cls_loss, "distillation token", schedule="1f1b"),
    Arch("convnext", VISION, "ConvNextForImageClassification", lambda: tf.ConvNextConfig(
        hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=3), images(32), cls_loss,
         "depthwise convolutions, downsampling"),
    Arch("swin", VISION, "SwinForImageClassification", lambda: tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, num_labels=3), images(32), cls_loss, "shifted windows",
         slow="that capture takes about 60 s: with height and width symbolic, torch.export "
         "takes 52 s (0.4 s at fixed shapes)"),
    Arch("resnet", VISION, "ResNetForImageClassification", lambda: tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=3),
         images(32), cls_loss, "BatchNorm; a unit adds in place into the activation it "
         "received (`hidden_state += residual`): it works on a copy"),
    Arch("whisper", SPEECH, "WhisperForConditionalGeneration", lambda: tf.WhisperConfig(
        **{k: v for k, v in S2S.items() if k != "max_position_embeddings"}, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32), mel_features, own_loss,
         "log-mel features through convolutions, `labels`"),
    Arch("wav2vec2", SPEECH, "Wav2Vec2ForCTC", lambda: tf.Wav2Vec2Config(
        **W2V, mask_time_prob=0.0, layerdrop=0.0), waveform, ctc_loss,
         "CTC loss; `mask_time_prob=0`, `layerdrop=0`"),
    Arch("wav2vec2-default", SPEECH, "Wav2Vec2ForCTC", lambda: tf.Wav2Vec2Config(**W2V),
         waveform, ctc_loss, "the config's SpecAugment and LayerDrop", fails=Failure(
             PartitionError, "could not capture Wav2Vec2ForCTC", "SpecAugment draws its mask "
             "with NumPy and LayerDrop skips a layer on a random draw: neither can be captured")),
    Arch("clip", MULTI, "CLIPModel", lambda: tf.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4), projection_dim=16),
         image_text, own_loss, "two towers, contrastive loss (`return_loss=True`)"),
]
BY_NAME = {a.name: a for a in ZOO}
ACROSS_PROCESSES = ["llama", "mixtral", "bert", "t5", "vit", "whisper"]  # a model per family
IN_CI = ("llama", "mixtral", "bert", "t5", "swin", "whisper", "clip", "olmoe-eager",
         "wav2vec2-default")
"""The architectures CI steps (its time, CONTRIBUTING.md: tests): one of each kind (dense and
MoE decoder-only, encoder-only, encoder-decoder, vision, speech, image-text; Swin, whose row
says how CI captures it) and two cheap expected failures; the others in the long tier."""


# ------------------------------------------------------------------------------- the check


def build(arch: Arch) -> nn.Module:
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(tf, arch.cls)(arch.config()).to(arch.dtype)  # type: ignore[no-any-return]


def batch(arch: Arch) -> Batch:
    inputs, targets = arch.data()
    return {k: v.to(arch.dtype) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs.items()}, targets


def differences(pipe: pt.Pipeline, ref: nn.Module, tol: float) -> list[str]:
    """Gradients farther than ``tol`` of the largest reference gradient; differing buffers."""
    refs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    bad = []
    for name, p in pipe.named_parameters():
        want = refs[name].grad
        if (p.grad is None) != (want is None):
            bad.append(f"{name}: a gradient on one side only")
        elif p.grad is not None and want is not None:
            diff = (p.grad - want).abs().max().item()
            if not diff <= tol * want.abs().max().item():  # a NaN too
                bad.append(f"{name}: max |diff| {diff:.3g} of {want.abs().max().item():.3g}")
    return bad + [f"buffer {n} differs" for n, b in pipe.named_buffers()
                  if not torch.equal(b, refs[n])]


def stepped(arch: Arch, local: bool = True, compile: bool | str = False, dynamic: bool = True
            ) -> tuple[pt.Pipeline, nn.Module, list[str]]:
    """``arch`` stepped once through the pipeline (``compile`` and ``dynamic``: as ``Pipeline``
    takes them) and once as the reference (same weights, same random streams); problems with
    the stage count or the loss."""
    model = build(arch)
    ref = copy.deepcopy(model)
    inputs, targets = batch(arch)
    example = {k: v[:2] if torch.is_tensor(v) else v for k, v in inputs.items()}
    pipe = pt.Pipeline(model, arch.schedule, M, arch.loss, split_points="auto",
                       example_inputs=example, local_ranks=arch.ranks if local else None,
                       compile=compile, dynamic=dynamic)
    torch.manual_seed(1)
    got = pipe.step(inputs, targets).loss
    torch.manual_seed(1)
    want = reference_step(ref, inputs, targets, arch.loss, M, rng=pipe.rng)
    problems = [] if len(pipe.balance) == arch.stages else [f"{len(pipe.balance)} stages"]
    if got is None or abs(got.item() - want.item()) > arch.tol * abs(want.item()):
        problems.append(f"loss {got} != {want.item()}")
    return pipe, ref, problems


def check(arch: Arch, local: bool = True, dynamic: bool = True) -> tuple[list[str], set[str]]:
    """The problems found, and the names of the parameters this process holds."""
    pipe, ref, problems = stepped(arch, local, dynamic=dynamic)
    return problems + differences(pipe, ref, arch.tol), {n for n, _ in pipe.named_parameters()}


def all_names(arch: Arch) -> set[str]:
    return {n for n, _ in build(arch).named_parameters()}


@pytest.mark.parametrize("arch", [
    a if a.name in IN_CI else pytest.param(a, marks=pytest.mark.long) for a in ZOO],
    ids=[a.name for a in ZOO])
def test_architecture_split_matches_the_unsplit_model(arch: Arch) -> None:
    dynamic = not arch.slow or SLOW  # a slow symbolic capture: at fixed shapes in CI
    if arch.fails is not None:
        with pytest.raises(arch.fails.error, match=arch.fails.match):
            check(arch)
        pytest.xfail(arch.fails.reason)
    problems, names = check(arch, dynamic=dynamic)
    assert problems == []
    assert names == all_names(arch)  # every parameter accounted for


def test_the_comparison_catches_a_gradient_off_by_1e_8_and_a_stage_left_out() -> None:
    arch = BY_NAME["gpt_neox"]
    pipe, ref, problems = stepped(arch)
    assert problems == [] and differences(pipe, ref, arch.tol) == []
    name, p = next(iter(pipe.named_parameters(stage=1)))
    p.grad.mul_(1 + 1e-8)  # type: ignore[union-attr]
    assert [b.split(":")[0] for b in differences(pipe, ref, arch.tol)] == [name]
    for left_out in range(arch.stages):
        held = {n for s in range(arch.stages) if s != left_out
                for n, _ in pipe.named_parameters(stage=s)}
        assert held != all_names(arch), f"stage {left_out}'s parameters are held elsewhere too"


def _across(ctx: pt.RankContext) -> list[tuple[list[str], set[str]]]:
    torch.set_num_threads(1)
    return [check(BY_NAME[name], local=False) for name in ACROSS_PROCESSES]


# in CI: a model per family across processes: test_hf_dist.py
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_a_model_of_each_family_on_two_processes() -> None:
    assert all(BY_NAME[name].ranks == 2 for name in ACROSS_PROCESSES)
    ranks = pt.launch(_across, 2, timeout=300)
    for i, name in enumerate(ACROSS_PROCESSES):
        held = [ranks[r][i][1] for r in range(2)]
        assert [p for r in range(2) for p in ranks[r][i][0]] == [], name
        assert all(held) and set().union(*held) == all_names(BY_NAME[name]), name


# ------------------------------------------------------------------------------- the table


def _tol(x: float) -> str:
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def result(arch: Arch) -> str:
    if arch.fails is not None:
        return f"fails (strict xfail): {arch.fails.reason}"
    within = f"loss and every gradient within {_tol(arch.tol)}"
    return (f"{within}; in CI captured at fixed shapes (`dynamic=False`), with every size "
            f"symbolic out of CI (`PIPETRAIN_ZOO_SLOW=1`): {arch.slow}") if arch.slow else within


def render() -> str:
    """docs/models.md's table of architectures, one row per entry of ``ZOO``."""
    rows = ["| family | model class | what it exercises | stages | dtype | tolerance | result "
            "| 2 processes |", "|---|---|---|---|---|---|---|---|"]
    for a in ZOO:
        dtype = str(a.dtype).removeprefix("torch.")
        across = "yes" if a.name in ACROSS_PROCESSES else ""
        rows.append(f"| {a.family} | `{a.cls}` | {a.note} | {a.stages} ({a.schedule}, "
                    f"{a.ranks} ranks) | {dtype} | {_tol(a.tol)} | {result(a)} | {across} |")
    return "\n".join(rows)


def _readme_span() -> re.Match[str]:
    found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), PAGE.read_text(), re.S)
    assert found is not None, f"docs/models.md has no {BEGIN!r} ... {END!r} section"
    return found


def test_docs_table_is_rendered_from_the_zoo() -> None:
    assert _readme_span().group(1) == render() + "\n", \
        "docs/models.md's table is stale: python3 tests/test_zoo.py --write"


def _write_readme() -> None:
    span, text = _readme_span(), PAGE.read_text()
    PAGE.write_text(text[:span.start()] + f"{BEGIN}\n{render()}\n{END}" + text[span.end():])


if __name__ == "__main__":
    _write_readme() if "--write" in sys.argv else print(render())
