"""Prompt-answer examples: image chats of one exchange, for a processor without a chat template
that takes the answer itself (PaliGemma's ``suffix``).

PaliGemma is trained on a prefix (its images, then a prompt) and a suffix (the answer), not on
a rendered conversation: its processor writes ``<image>`` placeholders, ``<bos>``, the prompt
and a newline, then the suffix and ``<eos>``, and gives token types of 1 on the suffix, where
the model attends causally (the prefix attends both ways). pipetrain reads the same chat rows as
for other image-text models, each one user turn (images and text) then one assistant turn, and
trains the suffix's tokens: those the processor types 1.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["answer_ids", "prefix", "prompt_answer", "rendered", "takes_answers"]


def takes_answers(processor: Any) -> bool:
    """Whether ``processor`` has no chat template and takes the answer as ``suffix``."""
    if getattr(processor, "chat_template", None):
        return False
    try:
        return "suffix" in inspect.signature(processor.__call__).parameters
    except (TypeError, ValueError):
        return False


def _text(content: Any) -> str:
    if not isinstance(content, list):
        return str(content or "")
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


def prompt_answer(processor: Any, messages: list[dict[str, Any]], images: int, label: str
                  ) -> tuple[str, str]:
    """The prompt (one placeholder per image, then the user's text) and the answer of a row's
    ``messages`` (as :meth:`ImageChatEncoder.sources` gives them), which show ``images``.

    Raises:
        ValueError: naming ``label`` unless the row is one user turn then one assistant turn,
            with an image, none of them in the answer.
    """
    name = type(processor).__name__
    roles = [m["role"] for m in messages]
    if roles != ["user", "assistant"]:
        raise ValueError(f"{label}: {name} has no chat template: it takes one prompt and its "
                         "answer (a prefix and a suffix), so a row is one user turn then one "
                         f"assistant turn, not the roles {roles}; give each exchange a row "
                         "of its own")
    answer = messages[1]["content"]
    if isinstance(answer, list) and any(p.get("type") == "image" for p in answer):
        raise ValueError(f"{label}: an image in the assistant's turn; {name} shows images in "
                         "the prompt only: move it to the user's turn")
    if images == 0:
        raise ValueError(f"{label}: no image; {name} takes images with every prompt: give "
                         "the row an image, or leave text-only rows out")
    return prefix(processor, _text(messages[0]["content"]), images), _text(answer)


def prefix(processor: Any, prompt: str, images: int) -> str:
    """The text a prompt showing ``images`` images is given to the processor as: one
    placeholder per image, then the prompt (the processor adds ``<bos>`` and the newline)."""
    return str(processor.image_token) * images + prompt


def answer_ids(processor: Any, prompt: str, answer: str, images: list[Any], label: str
               ) -> tuple[list[int], list[int]]:
    """The processor's ids of ``prompt`` with ``images`` and its ``answer``, and per token
    whether it is trained (the answer's, typed 1 by the processor)."""
    try:
        out = processor(text=[prompt], images=[images], suffix=[answer],
                        add_special_tokens=False)
    except Exception as e:  # noqa: BLE001  (the processor's own errors share no base)
        raise ValueError(f"{label}: the processor refused the prompt, its answer and its "
                         f"{len(images)} image(s) ({type(e).__name__}: {e})") from None
    ids = [int(t) for t in out["input_ids"][0]]
    return ids, [int(t) for t in out["token_type_ids"][0]]


def rendered(processor: Any, messages: list[dict[str, Any]], images: int
             ) -> tuple[str, str | None]:
    """One exchange (``messages`` showing ``images``) as the processor takes it: the text its
    chat template renders, or, for a processor that takes answers, the prompt and the answer."""
    if takes_answers(processor):
        return prompt_answer(processor, messages, images, "the chat")
    return str(processor.apply_chat_template(messages, tokenize=False)), None
