"""Packing: whole examples laid one after another in full rows, each attending to itself only.

``--pack`` (``cfg.pack``) turns a data set's examples (:mod:`pipetrain.train.data.examples`) into
rows of ``seq_len + 1`` tokens holding as many whole examples as fit, in each epoch's order
(an example longer than a row is cut to it, alone), instead of one right-padded example a
row::

    row:        [ a0 a1 a2 a3 | b0 b1 b2 | c0 c1 c2 c3 c4 | pad pad ]
    positions:    0  1  2  3    0  1  2    0  1  2  3  4    0   1
    labels:      a1 a2 a3  -   b1 b2  -   c1 c2 c3 c4  -    -        (- : -100)

The model gets ``{input_ids, position_ids}`` and no attention mask: transformers builds a
block-diagonal causal mask from positions that restart (its packed-sequence support), so each
example attends to itself only, and a label never crosses into the next example. The rows of
epoch ``e`` are a pure function of ``(seed, e)``, and batch ``k`` takes rows ``k*B .. k*B +
B - 1`` of the endless sequence of epochs, so a resumed run takes what an uninterrupted one
would. The loss is :func:`~pipetrain.train.data.examples.masked_lm_loss` as for padded rows: the
mean over the batch's trained tokens, which equals the same examples unpacked.

:func:`check_model` refuses a model whose attention does not keep packed examples apart: it
compares a small copy's logits on two examples packed and apart.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from pipetrain.train.data.examples import (
    IGNORE,
    Batch,
    ExampleBatches,
    ExampleCorpus,
    example_batches,
)

__all__ = ["PackedBatches", "check_model", "packed_batches", "packed_record"]


class PackedBatches(ExampleBatches):
    """Batches of packed rows: batch ``k`` from ``(seed, k)`` (see the module docstring)."""

    def __init__(self, corpus: ExampleCorpus, indices: torch.Tensor, batch_size: int,
                 seq_len: int, *, seed: int = 0, replicas: int = 1) -> None:
        super().__init__(corpus, indices, batch_size, seq_len, seed=seed, replicas=replicas)
        self._rows: dict[int, list[list[int]]] = {}
        self._counts: dict[int, int] = {}  # rows per epoch, kept: a batch skips whole epochs

    def rows(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s rows, each the examples (data set row numbers) it holds."""
        if epoch not in self._rows:
            if len(self._rows) > 1:
                self._rows.pop(min(self._rows))
            width, c = self.seq_len + 1, self.corpus
            rows: list[list[int]] = [[]]
            room = width
            for i in self._order(epoch).tolist():
                e = int(self.indices[i])
                n = min(int(c.offsets[e + 1] - c.offsets[e]), width)
                if n > room:
                    rows.append([])
                    room = width
                rows[-1].append(e)
                room -= n
            self._rows[epoch] = rows
            self._counts[epoch] = len(rows)
        return self._rows[epoch]

    def examples(self, step: int) -> list[int]:
        """The examples of batch ``step``, row after row."""
        return [e for row in self._row_lists(step) for e in row]

    def _row_lists(self, step: int) -> list[list[int]]:
        out: list[list[int]] = []
        epoch, skip = 0, step * self.batch_size
        while len(out) < self.batch_size:
            count = self._counts.get(epoch)
            if count is not None and skip >= count:  # a whole epoch before this batch
                skip -= count
            else:
                rows = self.rows(epoch)
                out += rows[skip:skip + self.batch_size - len(out)]
                skip = max(0, skip - len(rows))
            epoch += 1
        return out

    def batch(self, step: int) -> Batch:
        """Batch ``step``: ({input_ids, position_ids}, {labels, weight})."""
        c, width = self.corpus, self.seq_len + 1
        window = torch.full((self.batch_size, width), c.pad_id, dtype=torch.long)
        positions = torch.zeros(self.batch_size, width, dtype=torch.long)
        labels = torch.full((self.batch_size, width - 1), IGNORE, dtype=torch.long)
        for r, row in enumerate(self._row_lists(step)):
            at = 0
            for e in row:
                a = int(c.offsets[e])
                n = min(int(c.offsets[e + 1]) - a, width)
                ids = c.ids[a:a + n].long()
                window[r, at:at + n] = ids
                positions[r, at:at + n] = torch.arange(n)
                trained = c.trained[a + 1:a + n].bool()
                labels[r, at:at + n - 1] = torch.where(trained, ids[1:], IGNORE)
                at += n
            positions[r, at:] = torch.arange(width - at)  # the padding: a block of its own
        n = int((labels != IGNORE).sum())
        weight = torch.full((self.batch_size,), self.replicas / n, dtype=torch.float32)
        return ({"input_ids": window[:, :-1].contiguous(),
                 "position_ids": positions[:, :-1].contiguous()},
                {"labels": labels, "weight": weight})


def packed_batches(corpus: ExampleCorpus, batch_size: int, seq_len: int, seed: int,
                   replicas: int, eval_batches: int
                   ) -> tuple[PackedBatches, list[Batch], dict[str, Any]]:
    """:func:`~pipetrain.train.data.examples.example_batches` of packed rows, held-out ones too,
    with the ``data`` record of :func:`packed_record`."""
    batches, held_out, record = example_batches(corpus, batch_size, seq_len, seed, replicas,
                                                eval_batches, PackedBatches)
    packed = cast(PackedBatches, batches)  # example_batches made it of that class
    return packed, held_out, packed_record(packed, record)


def packed_record(batches: PackedBatches, record: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` record of a packed run: its layout, and the padding of the first epoch's
    rows beside the padding the same examples would have one a row."""
    rows, width, c = batches.rows(0), batches.seq_len, batches.corpus
    used = sum(min(int(c.offsets[e + 1] - c.offsets[e]), width + 1) - 1
               for row in rows for e in row)  # positions with a next token of their example
    return {**record, "layout": "packed", "rows": len(rows),
            "padding_unpacked": record["padding_fraction"],
            "padding_fraction": max(0.0, 1 - used / max(len(rows) * width, 1))}


def check_model(config: Any, where: str) -> None:
    """Refuse ``--pack`` for a model whose attention lets packed examples see each other.

    A copy with 2 layers of width 32 at most, in float64, from seed 0, reads two examples
    packed in one row (positions restarting) and each alone, without a KV cache as in
    training (transformers looks for packed rows only then); their logits must agree.

    Raises:
        ValueError: naming the architecture, when they do not (or it fails on packed input).
    """
    from pipetrain.hf.model import transformers
    from pipetrain.train.commands.verify_hf import shrink

    tf = transformers()
    small = shrink(config, 2, 32)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(small, dtype=torch.float64).eval()
    vocab = int(small.vocab_size)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (5,), generator=g), torch.randint(0, vocab, (7,), generator=g)
    name = type(model).__name__
    try:
        with torch.no_grad():
            packed = model(input_ids=torch.cat([a, b])[None], use_cache=False,
                           position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None]
                           ).logits[0]
            apart = torch.cat([model(input_ids=a[None], use_cache=False).logits[0],
                               model(input_ids=b[None], use_cache=False).logits[0]])
    except Exception as e:  # noqa: BLE001 - any failure means it cannot pack
        raise ValueError(f"--pack: {name} ({where}) fails on packed rows ({type(e).__name__}: "
                         f"{e}); leave out --pack") from None
    if not torch.allclose(packed, apart, rtol=1e-9, atol=1e-9):
        raise ValueError(f"--pack: {name} ({where}) lets packed examples attend to each other "
                         "(its attention mask does not follow restarting position_ids), so "
                         "a packed step would not equal the examples apart; leave out --pack")
