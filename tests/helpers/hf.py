"""Models we did not write, built from small configs (nothing is downloaded): Hugging Face
GPT-2 (tied head), Llama (grouped-query attention, rotary tables), BERT (keyword inputs,
padding mask), and a torchvision-style residual CNN with BatchNorm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

VOCAB, LAYERS = 64, 4


def _quiet() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2() -> nn.Module:
    tf = _quiet()
    cfg = tf.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)  # type: ignore[no-any-return]


def llama() -> nn.Module:
    tf = _quiet()
    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, use_cache=False, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return tf.LlamaForCausalLM(cfg)  # type: ignore[no-any-return]


def bert() -> nn.Module:
    tf = _quiet()
    cfg = tf.BertConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        num_labels=3, pad_token_id=0)
    return tf.BertForSequenceClassification(cfg)  # type: ignore[no-any-return]


def blocks(name: str) -> str:
    """The module path of a model's decoder/encoder layers (``blocks(name) + ".2"``)."""
    return {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer",
            "resnet": "layers"}[name]


def points(name: str, n_stages: int) -> list[str]:
    """Split points at layer boundaries for 2 or 4 stages (4 layers)."""
    return [f"{blocks(name)}.{i}" for i in {2: [2], 4: [1, 2, 3]}[n_stages]]


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a ``CausalLMOutput``'s logits."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def cls_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, y)


def batch(name: str, rows: int = 8, seq: int = 12, seed: int = 0
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Keyword inputs and targets for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    if name == "resnet":
        return {"x": torch.randn(rows, 3, 8, 8, generator=g)}, torch.randint(
            0, 10, (rows,), generator=g)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    if name != "bert":
        return {"input_ids": ids}, ids
    mask = torch.ones(rows, seq, dtype=torch.long)
    for r in range(1, rows, 3):  # padded rows of several lengths
        mask[r, seq - 2 - r % 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (rows,),
                                                                        generator=g)


class BasicBlock(nn.Module):
    """A torchvision-style residual block: conv-BN-ReLU(inplace), conv-BN, += identity."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A small ResNet: stem, four residual blocks, pooled linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2),
                                    BasicBlock(16, 16, 1), BasicBlock(16, 16, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def on_meta(name: str) -> nn.Module:
    """Model ``name`` described on the ``meta`` device (no storage)."""
    with torch.device("meta"):
        return MODELS[name]()


def materialized(model: nn.Module, seed: int) -> nn.Module:
    """The single-device reference of a meta model: materialised whole, by name."""
    from pipetrain.split.lazy import NamedInit

    return NamedInit(model, seed).materialize(model)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "bert": bert,
                                               "resnet": ResNet}
LOSSES = {"gpt2": lm_loss, "llama": lm_loss, "bert": cls_loss, "resnet": cls_loss}


# ---------------------------------------------------------------- saved checkpoint directories


def python_text(n_files: int = 6) -> str:
    """Some Python source from this machine's standard library (local files, no download)."""
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py", "keyword.py",
             "glob.py", "heapq.py"]
    return "\n".join((stdlib / n).read_text() for n in names[:n_files])


def tokenizer(text: str, vocab: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` (as GPT-2's, but ``vocab`` tokens)."""
    from pipetrain.testing import train_tokenizer

    _quiet()
    return train_tokenizer(text, vocab)


def saved_config(name: str, vocab: int, layers: int = LAYERS) -> Any:
    """A tiny config of ``name`` (no dropout, 64 positions) for a tokenizer of ``vocab``."""
    tf = _quiet()
    if name == "gpt2":
        return tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=vocab,
                             n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0)
    return tf.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                          max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                          pad_token_id=0)


def save_dir(name: str, path: Any, text: str, *, weights: bool = True, seed: int = 0,
             layers: int = LAYERS) -> Any:
    """A ``save_pretrained`` directory of a tiny ``name`` ("gpt2" or "llama") with its
    tokenizer trained on ``text``; without ``weights``, config and tokenizer only."""
    from pathlib import Path

    tf = _quiet()
    tok = tokenizer(text)
    config = saved_config(name, len(tok), layers)
    directory = Path(path)
    if weights:
        torch.manual_seed(seed)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------- generation

GENERATING = ("llama", "gpt2", "mixtral", "qwen2")
"""Causal LM families the generation tests cover: dense (Llama, Qwen2), learned positions and
a tied head (GPT-2), a mixture of experts (Mixtral)."""


def causal_lm(name: str, seed: int = 0) -> nn.Module:
    """A tiny causal LM of family ``name`` (:data:`GENERATING`), in eval mode."""
    tf = _quiet()
    torch.manual_seed(seed)
    dec = dict(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**dec))
    elif name == "gpt2":
        model = gpt2()
    elif name == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**dec, num_local_experts=4,
                                                       num_experts_per_tok=2))
    else:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**dec))
    return model.eval()


def prompts(lengths: tuple[int, ...] = (5, 3, 8, 2, 6), seed: int = 1) -> list[list[int]]:
    """Token-id prompts of ``lengths`` (no pad or special ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_generate(model: nn.Module, batch: list[list[int]], new: int,
                eos: int | None = None) -> list[list[int]]:
    """transformers' own greedy ``generate`` on the batch padded on the left; each row's new
    tokens up to and including its first ``eos``."""
    width = max(len(p) for p in batch)
    device = next(model.parameters()).device
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    import copy

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos  # None: no end token (not the config's)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         do_sample=False, pad_token_id=0, generation_config=config,
                         use_cache=True)[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos is not None and eos in row else row
            for row in out]
