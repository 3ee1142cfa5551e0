"""Records: the rows of a data set file read with Hugging Face ``datasets``, and their tokens.

``--data`` names a data set when it ends in ``.jsonl``, ``.json``, ``.parquet`` or ``.csv``, or
is a directory written by ``datasets.Dataset.save_to_disk``. It is read with ``datasets``
(imported only then; nothing is downloaded: its packaged readers convert the local file into
Arrow under the token cache). Each row becomes one example, a list of token ids and, for each
id, whether the loss trains on predicting it:

* a text column (``--text-field``, default ``text``): the tokenizer's ids of the text, with its
  own special tokens (a BOS where it adds one) and the end-of-text token appended; all trained;
* ``--chat``: the ``messages`` column, a list of ``{"role", "content"}``, rendered by the
  tokenizer's own chat template (``apply_chat_template``) and tokenized as
  ``apply_chat_template(..., tokenize=True)`` does; only the assistant's turns are trained.

An assistant turn is found by rendering the conversation up to it: the text of
``messages[:i]`` with the generation prompt ends where turn ``i`` begins, the text of
``messages[:i + 1]`` where it ends (its end-of-turn marker included, so the model learns to
stop). The tokens that begin inside such a span are trained (the tokenizer's character
offsets). A template that renders a conversation's start differently from the whole (one that
drops earlier turns' reasoning, say) is refused, row by row, with the reason.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DATASET_SUFFIXES", "Encoder", "is_dataset", "read_rows", "require_datasets"]

DATASET_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
INSTALL = 'pip install -e ".[data]"'
"""How to install the optional reader (from a checkout; ``pip install datasets`` works too)."""


def is_dataset(data: str | None) -> bool:
    """Whether ``--data`` names a data set (by its suffix, or a ``save_to_disk`` directory)."""
    if not data:
        return False
    path = Path(data)
    if path.suffix.lower() in DATASET_SUFFIXES:
        return True
    return path.is_dir() and any((path / f).is_file() for f in ("state.json",
                                                               "dataset_dict.json"))


def require_datasets() -> Any:
    """The ``datasets`` module.

    Raises:
        ImportError: when it is not installed, saying how to install it.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading a JSONL, JSON, Parquet or CSV file or a save_to_disk "
                          f"directory needs Hugging Face datasets ({e}); install it with "
                          f"{INSTALL} (or pip install 'datasets>=3')") from None
    return datasets


def read_rows(path: Path, cache_dir: Path) -> Any:
    """The rows of ``path`` as a ``datasets.Dataset`` (a file converted into ``cache_dir``).

    Raises:
        ImportError: without ``datasets``.
        ValueError: for a file ``datasets`` cannot read, a ``DatasetDict``, or no rows.
    """
    datasets = require_datasets()
    if path.is_dir():
        rows = datasets.load_from_disk(str(path))
        if isinstance(rows, datasets.DatasetDict):
            raise ValueError(f"--data {path} holds a DatasetDict (splits {list(rows)}); save "
                             "one split, ds['train'].save_to_disk(DIR), and pass that DIR")
    else:
        reader = _READERS[path.suffix.lower()]
        try:
            with _quiet(datasets):
                rows = datasets.load_dataset(reader, data_files=str(path), split="train",
                                             cache_dir=str(cache_dir))
        except Exception as e:  # noqa: BLE001  (datasets' own errors name no common base class)
            cause = e.__cause__ or e
            bad = _bad_line(path) if path.suffix.lower() == ".jsonl" else None
            if bad:
                raise ValueError(f"--data {path}: {bad}") from None
            raise ValueError(f"--data {path}: datasets could not read it as {reader} "
                             f"({type(cause).__name__}: {cause}); check the file's format "
                             "(JSONL: one JSON object per line)") from None
    if len(rows) == 0:
        raise ValueError(f"--data {path} has no rows")
    return rows


def _bad_line(path: Path) -> str | None:
    """The first line of a JSONL file that is not one JSON object, by its 1-based number."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return (f"line {number} is not JSON ({e.msg} at column {e.colno}): "
                        f"{line.strip()[:80]!r}; each line holds one JSON object")
            if not isinstance(value, dict):
                return (f"line {number} holds a {type(value).__name__}, not a JSON object "
                        "({\"column\": value, ...})")
    return None


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """``datasets``' own progress bars and log lines off while converting: pipetrain shows its
    own bar, and a file it cannot read is pipetrain's one message, not also datasets' log."""
    was = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if was:
            datasets.enable_progress_bars()


SHAREGPT = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
            "assistant": "assistant", "chatgpt": "assistant", "tool": "tool"}
"""ShareGPT's speakers ("from") as chat template roles."""


class Encoder:
    """Rows of a data set to (token ids, trained flags), by ``tokenizer``.

    Args:
        tokenizer: the model's tokenizer.
        field: the text column, or with ``chat`` the messages column.
        chat: render the messages (``{role, content}``, or ShareGPT's ``{from, value}``) by
            the tokenizer's chat template.
        where: the data set, for messages.

    Raises:
        ValueError: with ``chat``, when the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Any, field: str, chat: bool, where: str) -> None:
        self.tokenizer, self.chat, self.where = tokenizer, chat, where
        self.column = field
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat: the tokenizer has no chat template (its chat_template "
                             "is unset), so messages cannot be rendered; save the model's "
                             "template with the tokenizer (tok.chat_template = TEMPLATE; "
                             "tok.save_pretrained(DIR)), or train on a text column without "
                             "--chat (--text-field NAME)")

    def check(self, columns: Sequence[str]) -> None:
        """Raise ValueError, naming the columns there are, when the wanted one is missing."""
        if self.column in columns:
            return
        if self.chat:
            raise ValueError(f"--chat: {self.where} has no {self.column!r} column (its "
                             f"columns: {', '.join(columns)}); name the column of messages "
                             "(lists of {role, content} or ShareGPT's {from, value}) with "
                             "--chat-field, or leave out --chat and pick a text column with "
                             "--text-field")
        raise ValueError(f"--text-field {self.column!r}: {self.where} has no such column (its "
                         f"columns: {', '.join(columns)}); pass --text-field with one of "
                         "them, or --chat for a 'messages' column")

    media = False  # (ids, trained) only

    def encode_rows(self, rows: dict[str, list[Any]], first: int
                    ) -> list[tuple[list[int], list[int]]]:
        """Rows ``first``, ``first + 1``, ... (a slice of the data set's columns) as (ids,
        trained)."""
        return self.encode(rows[self.column], first)

    def encode(self, values: list[Any], first: int) -> list[tuple[list[int], list[int]]]:
        """Each value of the column (rows ``first``, ``first + 1``, ...) as (ids, trained)."""
        if self.chat:
            return [self._chat(v, first + i) for i, v in enumerate(values)]
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise ValueError(f"{self.where} row {first + i}: column {self.column!r} holds "
                                 f"{type(v).__name__}, not text; pick a text column with "
                                 "--text-field (or --chat for messages)")
        eos = self.tokenizer.eos_token_id
        out = []
        for ids in self.tokenizer(values)["input_ids"]:
            ids = list(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append((ids, [1] * len(ids)))
        return out

    def _render(self, messages: list[Any], prompt: bool, row: int) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=prompt)
        except Exception as e:  # noqa: BLE001  (a Jinja error, or any the template raises)
            raise ValueError(f"{self.where} row {row}: the chat template failed on "
                             f"{len(messages)} messages ({type(e).__name__}: {e})") from None
        return str(text)

    def _chat(self, given: Any, row: int) -> tuple[list[int], list[int]]:
        messages = self._messages(given, row)
        whole = self._render(messages, False, row)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, row) if i else ""
            upto = self._render(messages[:i + 1], False, row)
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise ValueError(
                    f"{self.where} row {row}: the chat template renders the conversation up "
                    f"to message {i} differently from the start of the whole conversation, "
                    "so the assistant's tokens cannot be told apart; use a template that "
                    "renders each turn the same whatever follows")
            spans.append((len(before), len(upto)))
        return self._tokens(whole, spans)

    def _messages(self, given: Any, row: int) -> list[dict[str, Any]]:
        """``given`` as {role, content} messages; ShareGPT's {from, value} turns mapped (its
        ``human`` is the user, ``gpt`` the assistant)."""
        if (not isinstance(given, list) or not given
                or not all(isinstance(m, dict) for m in given)):
            raise ValueError(f"{self.where} row {row}: {self.column!r} must be a non-empty list "
                             f"of {{role, content}} (or ShareGPT's {{from, value}}) objects, "
                             f"got {str(given)[:80]!r} (a CSV holds text only: use JSONL or "
                             "Parquet for --chat)")
        if all(isinstance(m.get("role"), str) for m in given):
            for turn, m in enumerate(given):
                content = m.get("content")
                if isinstance(content, list) and any(
                        isinstance(p, dict) and p.get("type") in ("image", "image_url")
                        for p in content):
                    raise ValueError(
                        f"{self.where} row {row}, turn {turn}: an image, but the model is a "
                        "text model (its config has no vision_config); give --hf an "
                        "image-text checkpoint (LLaVA, Gemma 3, Qwen2-VL, ...), or data "
                        "without images")
            return given
        out = []
        for turn, m in enumerate(given):
            speaker = m.get("from")
            if speaker not in SHAREGPT or not isinstance(m.get("value"), str):
                raise ValueError(
                    f"{self.where} row {row}, turn {turn}: neither {{role, content}} nor "
                    f"ShareGPT's {{from, value}} with 'from' one of {sorted(SHAREGPT)}: "
                    f"{str(m)[:80]!r}")
            out.append({"role": SHAREGPT[speaker], "content": m["value"]})
        return out

    def _tokens(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """``text``'s ids (no added special tokens: the template wrote them), trained where a
        token begins inside one of ``spans``."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer: the pieces one by one
            return self._pieces(text, spans)
        ids = list(enc["input_ids"])
        trained = [int(any(a <= start < b for a, b in spans))
                   for start, _ in enc["offset_mapping"]]
        return ids, trained

    def _pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        trained: list[int] = []
        cuts = [0, *[c for s in spans for c in s], len(text)]
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            piece = self.tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
            ids += piece
            trained += [k % 2] * len(piece)  # odd pieces are assistant spans
        return ids, trained
