"""A tiny Llama saved with a tokenizer that has a chat template, and small instruction data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML-like template: each turn between <|im_start|>ROLE and <|im_end|>."""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("add one and two then say the sum of the numbers in words please what is "
         "three four five six seven eight nine ten").split()


def tokenizer(template: str | None = TEMPLATE) -> Any:
    """A byte-level BPE of 300 ids trained on :data:`WORDS`, the template set (or none)."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                     additional_special_tokens=SPECIAL[1:])
    tok.chat_template = template
    return tok


def save_model(root: Path, template: str | None = TEMPLATE) -> Path:
    """A 4-layer Llama (hidden 32) with weights, and the tokenizer, saved at ``root``."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    tok = tokenizer(template)
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, use_cache=False,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations of one or two exchanges, of several lengths."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "say the sum"}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            ask = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            say = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
            turns += [{"role": "user", "content": ask}, {"role": "assistant", "content": say}]
        out.append(turns)
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
