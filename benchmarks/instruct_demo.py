"""Instruct demo: a tiny Llama learns 2-digit addition as chat, scored by the pipeline's answers.

Nothing is downloaded. The script saves a randomly initialised Llama with a character-level
tokenizer whose chat template writes ``<|user|>12+34=<|end|><|assistant|>46<|end|>``, writes
the sums of a seeded share of the 8,100 pairs of 2-digit numbers as chat JSONL, and keeps
other pairs apart as held-out test prompts (neither a held-out pair nor its swap is in the
training file). The exact-match
accuracy on those prompts is measured before and after
``pipetrain train --hf DIR --data train.jsonl --chat --nproc 2 --schedule zbv``, both times on
2 processes: a pipeline is built as the training run builds its own
(``pipetrain.train.setup.build``) from the directory's weights (the saved model, then the
run's ``OUT/hf``), and each answer is generated greedily through it, one token per eval step
(``pipetrain.train.infer.generate``), until the end-of-turn token. Exit code 1 when the
accuracy did not rise (except with ``--tiny``, a short run that only checks that every part
works).

    python benchmarks/instruct_demo.py                 # docs/hf.md's figures (1.5 minutes)
    python benchmarks/instruct_demo.py --tiny --out /tmp/demo       # under 30 s, kept in /tmp/demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetrain.runtime.launch import RankContext
    from pipetrain.train.config import TrainConfig

END = "<|end|>"
"""The end-of-turn token: the template closes every turn with it; generation stops at it."""
SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", END]
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
SEQ_LEN = 12
"""Positions per row, which holds SEQ_LEN + 1 tokens: the longest example is 13 (<|user|>, 6
characters, <|end|>, <|assistant|>, 3 digits, <|end|>)."""
MAX_NEW = 4
"""Tokens generated at most per answer: 3 digits and the end-of-turn token."""
NPROC = 2


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run of the demo: the task's size and the training run's settings."""

    steps: int
    train_examples: int
    test_prompts: int
    hidden: int = 64
    layers: int = 4
    batch_size: int = 32
    microbatches: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50


FULL = Settings(steps=1500, train_examples=4000, test_prompts=200)
TINY = Settings(steps=4, train_examples=64, test_prompts=4, warmup=1)


# --------------------------------------------------------------------------- model and task


def make_tokenizer() -> Any:
    """One token per byte (no merges), so every digit is a token, and the chat template."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL + alphabet)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIAL)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=SPECIAL[0],
                                     additional_special_tokens=SPECIAL[1:])
    tok.chat_template = TEMPLATE
    return tok


def save_model(root: Path, settings: Settings, seed: int) -> int:
    """A randomly initialised Llama and its tokenizer, saved at ``root``; its parameters."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    tf.logging.disable_progress_bar()
    tok = make_tokenizer()
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=settings.hidden,
                            intermediate_size=4 * settings.hidden,
                            num_hidden_layers=settings.layers, num_attention_heads=4,
                            num_key_value_heads=4, max_position_embeddings=2 * SEQ_LEN,
                            use_cache=False, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return int(model.num_parameters())


Pair = tuple[int, int]


def make_task(seed: int, n_train: int, n_test: int) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs) of 2-digit numbers in a seeded order: no held-out sum
    is trained on, in either order (neither 12+34 nor 34+12 when 12+34 is held out)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    test = pairs[:n_test]
    held = set(test) | {(b, a) for a, b in test}
    train = [p for p in pairs[n_test:] if p not in held][:n_train]
    if len(train) < n_train:
        raise ValueError(f"{n_train} training pairs besides {n_test} held-out ones are more "
                         f"than the {len(pairs)} pairs allow; ask for fewer")
    return train, test


def prompt(pair: Pair) -> str:
    return f"{pair[0]}+{pair[1]}="


def write_chat(path: Path, pairs: list[Pair]) -> Path:
    """One conversation per pair: the user's sum, the assistant's result."""
    rows = [{"messages": [{"role": "user", "content": prompt(p)},
                          {"role": "assistant", "content": str(sum(p))}]} for p in pairs]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------- answers from the pipeline


def run_config(hf: Path, data: Path, work: Path, settings: Settings, seed: int
               ) -> TrainConfig:
    """The training run's settings, as a TrainConfig (the answers' pipelines use it too)."""
    from pipetrain.train.config import TrainConfig

    return TrainConfig(hf=str(hf), data=str(data), chat=True, seq_len=SEQ_LEN,
                       token_cache=str(work / "tokens"), batch_size=settings.batch_size,
                       seed=seed, nproc=NPROC, schedule="zbv",
                       microbatches=settings.microbatches, steps=settings.steps,
                       lr=settings.lr, min_lr=settings.min_lr, warmup=settings.warmup,
                       weight_decay=0.0, eval_every=0, eval_batches=1, sample_tokens=0,
                       out=str(work / "run"), resume=False, progress=False)


def _answer_all(ctx: RankContext, cfg: TrainConfig, prompts: list[str]) -> list[str]:
    """On every rank: build the run's pipeline from ``cfg.hf`` and answer each prompt, greedy,
    one token per eval step, stopping at the end-of-turn token (the same on every rank)."""
    from pipetrain.train.infer import generate
    from pipetrain.train.setup import build
    from pipetrain.train.sources.hf_source import HFSource

    trainer = build(cfg)
    source = trainer.source
    if not isinstance(source, HFSource):
        raise RuntimeError(f"cfg.hf={cfg.hf!r} gave no Hugging Face model; give the "
                           "save_pretrained directory to answer with")
    tok = source.tokenizer
    stop = tok.convert_tokens_to_ids(END)
    answers = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        new: list[int] = []
        while len(new) < MAX_NEW:
            token = generate(trainer.pipe, trainer.mesh, ids + new, 1, context=cfg.seq_len,
                             feed=trainer.feed, logits=source.logits)[0]
            if token == stop:
                break
            new.append(token)
        answers.append(tok.decode(new))
    return answers


def answers(cfg: TrainConfig, hf: Path, prompts: list[str]) -> list[str]:
    """The pipeline's answers to ``prompts`` with the weights in ``hf``, on 2 processes."""
    from pipetrain.runtime.launch import launch

    cfg = dataclasses.replace(cfg, hf=str(hf), out="")
    return list(launch(_answer_all, NPROC, cfg, prompts, backend="gloo",
                       timeout=600)[0])


def train(cfg: TrainConfig) -> None:
    """``pipetrain train`` on the chat data, through its command line, in this process."""
    from pipetrain.cli import main

    argv = ["train", "--hf", cfg.hf, "--data", str(cfg.data), "--chat", "--nproc", str(NPROC),
            "--schedule", cfg.schedule, "--seq-len", str(cfg.seq_len),
            "--batch-size", str(cfg.batch_size), "--microbatches", str(cfg.microbatches),
            "--steps", str(cfg.steps), "--lr", f"{cfg.lr:g}", "--min-lr", f"{cfg.min_lr:g}",
            "--warmup", str(cfg.warmup), "--weight-decay", f"{cfg.weight_decay:g}",
            "--seed", str(cfg.seed), "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--token-cache", cfg.token_cache, "--out", cfg.out,
            "--no-resume", "--no-progress"]
    print("running: pipetrain " + " ".join(argv), flush=True)
    code = main(argv)
    if code != 0:
        raise RuntimeError(f"pipetrain train exited with {code}; its error is printed above")


# ------------------------------------------------------------------------------------ report


def scored(pairs: list[Pair], said: list[str]) -> int:
    return sum(answer == str(sum(p)) for p, answer in zip(pairs, said, strict=True))


def shown(answer: str, width: int = 14) -> str:
    """``answer`` quoted, characters outside printable ASCII as ?, cut to ``width``."""
    text = '"' + "".join(c if " " <= c <= "~" else "?" for c in answer) + '"'
    return text if len(text) <= width else text[:width - 3] + '..."'


def table(pairs: list[Pair], before: list[str], after: list[str], steps: int,
          n_train: int, shown_rows: int) -> str:
    """Accuracy before and after, then the first ``shown_rows`` prompts with both answers."""
    n = len(pairs)
    right = scored(pairs, before), scored(pairs, after)
    lines = [f"held-out prompts: {n} sums, none of them (nor its swap, 34+12 for 12+34) among "
             f"the {n_train:,} conversations of train.jsonl",
             f"answers: greedy, through the {NPROC}-rank zbv pipeline, until {END}; exact "
             "match of the whole answer",
             "",
             f"{'':<18}{'right':>9}{'accuracy':>10}"]
    for label, k in (("before training", right[0]), (f"after {steps} steps", right[1])):
        lines.append(f"{label:<18}{k:>5}/{n:<3}{100 * k / n:>9.1f}%")
    lines += ["", f"{'prompt':<9}{'expected':<10}{'before':<16}{'after':<8}"]
    for p, b, a in list(zip(pairs, before, after, strict=True))[:shown_rows]:
        mark = "right" if a == str(sum(p)) else "wrong"
        lines.append(f"{prompt(p):<9}{sum(p):<10}{shown(b):<16}{shown(a):<8}{mark}")
    lines.append("(? stands for a character outside printable ASCII)")
    return "\n".join(lines)


def demo(settings: Settings, seed: int, work: Path, tiny: bool) -> int:
    """Make the model and the task, answer, train, answer again; print what was measured."""
    start = time.perf_counter()
    hf, data = work / "tiny-llama", work / "train.jsonl"
    n_params = save_model(hf, settings, seed)
    train_pairs, test_pairs = make_task(seed, settings.train_examples, settings.test_prompts)
    write_chat(data, train_pairs)
    print(f"model: Llama, {settings.layers} layers, hidden {settings.hidden}, {n_params:,} "
          f"parameters, random init (seed {seed}), saved at {hf}")
    print(f"task: {len(train_pairs):,} training conversations ({data}), "
          f"{len(test_pairs)} held-out prompts", flush=True)
    cfg = run_config(hf, data, work, settings, seed)
    prompts = [prompt(p) for p in test_pairs]
    clock = time.perf_counter()
    before = answers(cfg, hf, prompts)
    print(f"answers before training: {time.perf_counter() - clock:.1f} s", flush=True)
    clock = time.perf_counter()
    train(cfg)
    print(f"training: {time.perf_counter() - clock:.1f} s", flush=True)
    clock = time.perf_counter()
    after = answers(cfg, work / "run" / "hf", prompts)
    print(f"answers after training: {time.perf_counter() - clock:.1f} s\n")
    print(table(test_pairs, before, after, settings.steps, len(train_pairs), 8))
    print(f"\nwall time: {time.perf_counter() - start:.0f} s", flush=True)
    if scored(test_pairs, after) <= scored(test_pairs, before) and not tiny:
        print("instruct_demo: the accuracy did not rise; train longer (--steps) or check the "
              "run's loss above", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {FULL.steps}; {TINY.steps} with --tiny)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model, the task's split and the run (default 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help="work directory kept after the run (model, data, run; default: "
                             "a temporary one)")
    parser.add_argument("--tiny", action="store_true",
                        help="a short run that checks every part works (accuracy need not rise)")
    args = parser.parse_args(argv)
    settings = TINY if args.tiny else FULL
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be at least 1, got {args.steps}")
        settings = dataclasses.replace(settings, steps=args.steps,
                                       warmup=min(settings.warmup, args.steps // 10))
    if args.out is not None:
        if (args.out / "run").exists():
            parser.error(f"{args.out / 'run'} holds an earlier run of the demo; pass another "
                         "--out, or delete that directory")
        args.out.mkdir(parents=True, exist_ok=True)
        return demo(settings, args.seed, args.out, args.tiny)
    with tempfile.TemporaryDirectory(prefix="instruct-demo-") as work:
        return demo(settings, args.seed, Path(work), args.tiny)


if __name__ == "__main__":
    sys.exit(main())
