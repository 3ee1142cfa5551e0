"""Generate command: ``pipetrain generate --hf DIR``: text from a saved model split into stages.

Each rank builds and reads only its own stage of the model (:meth:`pipetrain.generation.
Generator.from_pretrained`), with a KV cache per group of ``--batch`` prompts; rank 0 prints.
One prompt streams as it is generated, a window of decode steps at a time; several print as
each finishes. Outside torchrun the command starts ``--nproc`` local processes (as ``pipetrain
train`` does); under torchrun it is one of them.

    $ pipetrain generate --hf tiny-llama --nproc 2 --prompt "def " --max-new-tokens 40
    $ pipetrain generate --hf tiny-llama --nproc 4 --prompts prompts.txt --batch 2 --json
    $ pipetrain generate --hf tiny-llama --prompt "def " --temperature 0.8 --top-p 0.9 --out a.jsonl
    $ torchrun --nproc-per-node 2 -m pipetrain generate --hf tiny-llama --prompt "def "
    $ pipetrain generate --hf tiny-llava --image cat.png --prompt "What is in the picture?"

Exit codes: 0 done, 1 a rank failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HELP", "configure", "run"]

HELP = "generate text from --hf DIR split into stages over --nproc processes, KV cache per stage"
EXIT_OK, EXIT_FAILED = 0, 1


def configure(parser: argparse.ArgumentParser) -> None:
    """The model, the prompts, the sampling, the layout."""
    parser.add_argument("--hf", required=True, metavar="DIR|ORG/NAME",
                        help="a save_pretrained directory with weights and a tokenizer, or a "
                             "Hub id ORG/NAME[@REVISION]")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt (repeat for several)")
    parser.add_argument("--prompts", metavar="FILE",
                        help="a file of prompts, one per line")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image shown with each prompt (repeat for several), for an "
                             "image-text model: the prompt is the user's turn of its chat "
                             "template, the images before the text")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="K",
                        help="new tokens per prompt at most (default: 64)")
    parser.add_argument("--batch", type=int, default=1, metavar="B",
                        help="prompts per group: groups take turns through the stages "
                             "(default: 1)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 picks the most likely token (greedy); above 0 samples "
                             "(default: 0)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K most likely tokens (default: 0, all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the most likely tokens holding P of the "
                             "probability (default: 1.0, all)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="the sampling seed (default: 0)")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="local processes, one stage each (default: 2; under torchrun: "
                             "its world)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per rank where there are enough, else CPU")
    parser.add_argument("--prefill", type=int, default=256, metavar="N",
                        help="prompt positions per prefill step (default: 256)")
    parser.add_argument("--window", type=int, default=16, metavar="N",
                        help="decode steps between two prints (default: 16)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds any wait for a peer may last (default: 60)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line per prompt (prompt, text, tokens) instead")
    parser.add_argument("--out", metavar="FILE",
                        help="also write those JSON lines to FILE")


@dataclass(frozen=True)
class Request:
    """What every rank generates: the prompts and how (picklable: it travels to workers)."""

    hf: str
    prompts: tuple[str, ...]
    max_new_tokens: int
    batch: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    prefill: int
    window: int
    timeout: float
    json: bool
    out: str | None
    images: tuple[str, ...] = ()
    reports = False  # the worker prints no training config or progress (elastic._work)
    command = "generate"  # the name its failures are printed under

    def __call__(self, cfg: Any, reporter: Any) -> dict[str, Any]:
        return generate(self)


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain generate``: launch local workers, or be one under torchrun.

    Raises:
        ValueError, OSError: bad flags, a missing prompts file or directory.
    """
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.launch import elastic

    request = _request(args)
    cfg = TrainConfig(hf=args.hf, nproc=args.nproc, device=args.device, timeout=args.timeout,
                      out="", progress=False)
    if elastic.under_torchrun():
        elastic.worker(cfg, request)
        return EXIT_OK
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    try:
        elastic.launch_local(cfg, request)
    except elastic.JobFailed as e:
        print(f"pipetrain generate: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _request(args: argparse.Namespace) -> Request:
    prompts = list(args.prompt)
    if args.prompts:
        prompts += [line for line in Path(args.prompts).read_text().splitlines() if line]
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or a --prompts FILE")
    if not Path(args.hf, "config.json").is_file():
        raise ValueError(f"--hf {args.hf!r} has no config.json (a save_pretrained directory, "
                         "or a Hub id ORG/NAME[@REVISION])")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch", args.batch),
                        ("--prefill", args.prefill), ("--window", args.window)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    images = _check_images(args.hf, args.image)
    _check_positions(args.hf, prompts, args.max_new_tokens)
    _check_stages(args.hf, args.nproc, bool(images))
    return Request(args.hf, tuple(prompts), args.max_new_tokens, args.batch, args.temperature,
                   args.top_k, args.top_p, args.seed, args.prefill, args.window, args.timeout,
                   args.json, args.out, images)


def _check_images(hf: str, given: list[str]) -> tuple[str, ...]:
    """The ``--image`` paths, absolute; refused where they do not exist or do not decode, or
    do not fit the model (images for a text model, none for an image-text one)."""
    from pipetrain.hf.image_text import is_image_text
    from pipetrain.hf.model import transformers
    from pipetrain.train.data.image_feed import open_image

    config = transformers().AutoConfig.from_pretrained(hf, local_files_only=True)
    image_text = is_image_text(config)
    if given and not image_text:
        raise ValueError(f"--image: {hf} is a text model (its config has no vision_config); "
                         "drop --image, or give an image-text checkpoint")
    if image_text and not given:
        raise ValueError(f"{hf} is an image-text model: give --image PATH (generation "
                         "without an image is not supported yet)")
    for path in given:
        open_image(path, "--image")
    return tuple(str(Path(p).resolve()) for p in given)


def _check_stages(hf: str, nproc: int, images: bool = False) -> None:
    """Refuse, before any process starts, more ranks than the model has decoder layers (the
    model opened on ``meta``: its config only)."""
    import os

    from pipetrain.hf.model import check_generation_stages, open_model
    from pipetrain.train.launch.elastic import under_torchrun

    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc
    check_generation_stages(open_model(Path(hf), images=images).model, world,
                            "{} torchrun processes" if torchrun else "--nproc {}")


def _check_positions(hf: str, prompts: list[str], new: int) -> None:
    """Refuse, before any process starts, a prompt whose new tokens pass the model's positions."""
    from pipetrain.hf.model import load_tokenizer, transformers

    config = transformers().AutoConfig.from_pretrained(hf, local_files_only=True)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    tok = load_tokenizer(hf)
    longest = max(len(tok(p, add_special_tokens=False)["input_ids"]) or 1 for p in prompts)
    if longest + new - 1 > limit:
        raise ValueError(f"a prompt of {longest} tokens plus --max-new-tokens {new} passes the "
                         f"{limit} positions of {hf}'s model: use --max-new-tokens "
                         f"{max(limit - longest + 1, 0)} or less, or a shorter prompt")


def generate(request: Request) -> dict[str, Any]:
    """One rank's part: build its stage, generate, and (rank 0) print; rank 0's summary."""
    import torch.distributed as dist

    from pipetrain.generation import Generator, Sampling
    from pipetrain.hf.model import load_tokenizer

    tok = load_tokenizer(request.hf)
    ids = [tok(p, add_special_tokens=False)["input_ids"] or [tok.bos_token_id or 0]
           for p in request.prompts]
    visual = None
    if request.images:
        tok, ids, visual = _image_prompts(request)
    longest = max(len(i) for i in ids)
    start = time.perf_counter()
    gen = Generator.from_pretrained(request.hf, rows=request.batch,
                                    length=longest + request.max_new_tokens - 1,
                                    prefill=request.prefill, window=request.window,
                                    timeout=request.timeout,
                                    images=None if visual is None else visual[0])
    built = time.perf_counter() - start
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = _Printer(tok, request, ids, rank == 0)
    sampling = Sampling(request.temperature, request.top_k, request.top_p, request.seed)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or 0)
    start = time.perf_counter()
    tokens = gen.generate(ids, request.max_new_tokens, sampling=sampling, eos_token_id=eos,
                          pad_token_id=pad, on_tokens=out.window, images=visual)
    seconds = time.perf_counter() - start
    out.finish(tokens)
    made = sum(len(t) for t in tokens)
    summary = {"tokens": made, "seconds": seconds, "build_seconds": built,
               "first_token_seconds": out.first, "tokens_per_second": made / seconds}
    if rank == 0:
        print(f"[{made} tokens in {seconds:.2f} s: {made / seconds:.1f} tokens/s, the first "
              f"after {out.first:.2f} s; stages built and read in {built:.1f} s]",
              file=sys.stderr, flush=True)
    return summary


def _image_prompts(request: Request) -> tuple[Any, list[list[int]], list[dict[str, Any]]]:
    """The processor's tokenizer, and per prompt its ids and visual tensors: the user's turn
    of the chat template (``--image`` images, then the prompt's text) with the generation
    prompt, as the checkpoint's processor writes it; for a processor without a template that
    takes prompts and answers (PaliGemma), the images' placeholders and the prompt."""
    from pipetrain.hf.image_text import load_processor
    from pipetrain.train.data.image_feed import open_image
    from pipetrain.train.data.prompt_answer import prefix, takes_answers

    processor = load_processor(request.hf)
    images = [open_image(p, "--image") for p in request.images]
    ids, visual = [], []
    for prompt in request.prompts:
        chat = [{"role": "user", "content": [{"type": "image"} for _ in images]
                 + [{"type": "text", "text": prompt}]}]
        text = prefix(processor, prompt, len(images)) if takes_answers(processor) \
            else processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=[images], add_special_tokens=False,
                        return_tensors="pt")
        ids.append(out["input_ids"][0].tolist())
        visual.append({k: v for k, v in out.items() if k not in ("attention_mask", "labels")})
    return processor.tokenizer, ids, visual


class _Printer:
    """Rank 0's output: one prompt streamed, several each printed once finished."""

    def __init__(self, tok: Any, request: Request, ids: list[list[int]], speaks: bool) -> None:
        self.tok, self.request, self.ids, self.speaks = tok, request, ids, speaks
        self.made: list[list[int]] = [[] for _ in ids]
        self.shown: list[str] = ["" for _ in ids]
        self.printed: set[int] = set()
        self.start, self.first = time.perf_counter(), 0.0
        self.eos = tok.eos_token_id

    def window(self, new: list[list[int]]) -> None:
        if not self.first:
            self.first = time.perf_counter() - self.start
        for row, tokens in enumerate(new):
            self.made[row] += tokens
        if not self.speaks or self.request.json:
            return
        if len(self.ids) == 1:  # stream: what the decoded text gained
            if 0 not in self.printed:
                print(self.request.prompts[0], end="", flush=True)
                self.printed.add(0)
            self._stream(final=False)
            return
        for row, tokens in enumerate(self.made):
            if row not in self.printed and self.eos is not None and self.eos in tokens:
                self._block(row, tokens[:tokens.index(self.eos) + 1])

    def finish(self, tokens: list[list[int]]) -> None:
        if not self.speaks:
            return
        lines = [json.dumps({"prompt": self.request.prompts[row],
                             "text": self._text(row, made), "tokens": made})
                 for row, made in enumerate(tokens)]
        if self.request.out:
            Path(self.request.out).write_text("".join(line + "\n" for line in lines))
        if self.request.json:
            print("\n".join(lines), flush=True)
        elif len(self.ids) == 1:
            self._stream(final=True)
            print(flush=True)
        else:
            for row, made in enumerate(tokens):
                if row not in self.printed:
                    self._block(row, made)

    def _stream(self, final: bool) -> None:
        """Print what the one prompt's text gained; a character whose bytes are not all
        there yet (U+FFFD at the end) waits for the next window."""
        text = self._text(0, self.made[0])
        if not final and text.endswith("\ufffd"):
            return
        print(text[len(self.shown[0]):], end="", flush=True)
        self.shown[0] = text

    def _text(self, row: int, made: list[int]) -> str:
        kept = made[:made.index(self.eos)] if self.eos in made else made  # pads after it
        return str(self.tok.decode(kept, skip_special_tokens=True))

    def _block(self, row: int, made: list[int]) -> None:
        self.printed.add(row)
        print(f"--- [{row}] {self.request.prompts[row]!r}\n"
              f"{self.request.prompts[row]}{self._text(row, made)}", flush=True)
