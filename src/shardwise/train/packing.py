"""Packing tokenized documents into rows of `seq_len` tokens, resumable at any token.

Owns: `pack(documents, seq_len, tokenize=...)`, the `PackedStream` it returns (iterated
alone, its rows in order; given to the Runner, packed per part of the stream, see
train/stream.py), and the packer itself: documents are concatenated with nothing between
them and cut into rows of exactly `seq_len` tokens, so a document may continue in the next
row. Each row holds:

- `input_ids`: the tokens;
- `labels`: the tokens, with `IGNORE_INDEX` at the first token of each document (its
  prediction would come from the previous document's last token);
- `position_ids`: each token's index in its own document, restarting at 0 where a document
  starts. transformers models (5.x, with no attention mask and no cache) read restarting
  positions as packed documents and keep each token's attention inside its document; under
  context parallelism shardwise finds the documents the same way.

A packed row of two documents therefore trains as the two documents would apart: the same
tokens are predicted, from the same context, at the same positions (the loss must count
tokens, not rows: `TrainConfig.loss_over='tokens'`).

Where a row ends is `(document, offset)`: the next row starts `offset` tokens into the
part's `document`-th document. A resume reopens the part there, skipping whole documents
without tokenizing them. A part's last tokens that do not fill a row are not trained.

Must not: split a stream across ranks or read checkpoints (train/stream.py and the Runner).
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

IGNORE_INDEX = -100
"""The label no loss counts (torch's cross_entropy default, and transformers')."""


@dataclass(frozen=True)
class Packing:
    """How documents become rows: `seq_len` tokens a row, `tokenize` turning one document
    into its token ids (None: the document is a sequence of ids, or a mapping holding one
    under 'input_ids')."""

    seq_len: int
    tokenize: Callable[[Any], Sequence[int]] | None = None

    def __post_init__(self) -> None:
        n = self.seq_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(
                f"pack(seq_len={n!r}): a row needs at least 2 tokens (one to predict from, "
                "one to predict). Use an int >= 2, e.g. the model's context length."
            )

    def token_ids(self, document: Any) -> list[int]:
        """The document's token ids, as ints."""
        if self.tokenize is not None:
            ids = self.tokenize(document)
        elif isinstance(document, dict) and "input_ids" in document:
            ids = document["input_ids"]
        else:
            ids = document
        if isinstance(ids, torch.Tensor):
            return [int(t) for t in ids.reshape(-1).tolist()]
        if isinstance(ids, list):
            return ids  # ints: digest() refuses anything else
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(
                f"pack(): a document gave {type(ids).__name__}, not token ids. Pass "
                "tokenize=fn (a document -> its list of token ids), or documents that are "
                "lists of ids or mappings with 'input_ids'."
            )
        return [int(t) for t in ids]


def digest(ids: Sequence[int]) -> int:
    """A document's fingerprint (crc32 of its ids), to check on resume that a stream still
    gives the same documents in the same order."""
    try:
        return zlib.crc32(array("q", ids).tobytes())
    except (TypeError, OverflowError) as exc:
        raise TypeError(
            f"pack(): a document's token ids must be ints ({exc}). Make tokenize return "
            "a list of int ids."
        ) from None


class Packer:
    """Rows of `seq_len` tokens from documents fed in order (each with its index in the
    part), starting `offset` tokens into the first."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.pending: deque[tuple[int, int, list[int]]] = deque()
        """(document, its first token not yet in a row, its ids), oldest first."""
        self.size = 0
        """Tokens pending."""
        self.digests: dict[int, int] = {}
        self.next_document = 0

    def feed(self, index: int, ids: list[int], offset: int = 0) -> None:
        """Add document `index` (its ids from token `offset` on)."""
        self.digests[index] = digest(ids)
        if len(ids) > offset:
            self.pending.append((index, offset, ids))
            self.size += len(ids) - offset
        self.next_document = index + 1

    def row(self) -> tuple[dict[str, torch.Tensor], tuple[int, int, int, int]] | None:
        """The next full row and where it ends: (document, offset) the next row starts
        at, and the index and digest of the last document this row touched; None until
        enough tokens were fed."""
        if self.size < self.seq_len:
            return None
        ids: list[int] = []
        positions: list[int] = []
        need, last = self.seq_len, -1
        while need:
            last, start, doc = self.pending[0]
            take = min(need, len(doc) - start)
            ids += doc[start : start + take]
            positions += range(start, start + take)
            need -= take
            if start + take == len(doc):
                self.pending.popleft()
            else:
                self.pending[0] = (last, start + take, doc)
        self.size -= self.seq_len
        end = self.pending[0][:2] if self.pending else (self.next_document, 0)
        for done in [d for d in self.digests if d < last]:
            del self.digests[done]
        input_ids = torch.tensor(ids, dtype=torch.long)
        position_ids = torch.tensor(positions, dtype=torch.long)
        labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
        row = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        return row, (end[0], end[1], last, self.digests[last])


class PackedStream(IterableDataset[dict[str, torch.Tensor]]):
    """Documents packed into rows (`pack`). Iterated alone: every row in order. Given to
    the Runner: split into parts across data-parallel ranks and packed per part."""

    def __init__(self, documents: Any, packing: Packing) -> None:
        self.documents = documents
        self.packing = packing

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        packer = Packer(self.packing.seq_len)
        for index, document in enumerate(self.documents):
            packer.feed(index, self.packing.token_ids(document))
            while (got := packer.row()) is not None:
                yield got[0]


def pack(
    documents: Iterable[object],
    seq_len: int,
    *,
    tokenize: Callable[[Any], Sequence[int]] | None = None,
) -> PackedStream:
    """Documents (any iterable: a datasets IterableDataset or Dataset, a torch
    IterableDataset, a list) as rows of `seq_len` tokens with `input_ids`, `labels` and
    `position_ids` (see the module's docstring). `tokenize` turns one document into its
    token ids; without it a document is its ids, or a mapping with 'input_ids'."""
    return PackedStream(documents, Packing(seq_len, tokenize))


def packed_attention_notice(model: torch.nn.Module) -> str:
    """One line for a model that may not keep packed documents apart ('' when it does).
    A transformers model does, from the restarting position_ids, but only without a cache:
    its `config.use_cache` is turned off here for training (it only keeps keys and values
    for generation). Any other model gets position_ids, and only it knows whether its
    attention uses them to stay inside each document."""
    from shardwise.parallelize.wrapped import unwrap

    inner = unwrap(model)
    # The transformers models inside (a user's module may hold one, peft holds one).
    held = [
        m for m in inner.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    ]
    if held:
        cached = [m for m in held if getattr(m.config, "use_cache", False)]
        for m in cached:
            m.config.use_cache = False  # type: ignore[union-attr]
        if not cached:
            return ""
        return (
            f"packed rows: {type(cached[0]).__name__}.config.use_cache set to False, since "
            "transformers finds packed documents from position_ids only without a cache "
            "(with it, attention would cross documents)"
        )
    return (
        f"packed rows: {type(inner).__name__} gets position_ids that restart at each "
        "document; shardwise cannot tell whether its attention uses them to stay inside each "
        "document. If it does not, tokens attend across documents: mask attention by document "
        "(a transformers model does this itself)."
    )


def count_label_tokens(batch: Any) -> int:
    """The tokens a causal language model's loss counts in `batch`: labels other than
    IGNORE_INDEX after the first position of each row (the shift transformers makes)."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        raise ValueError(
            "TrainConfig.loss_over='tokens' counts the labels a causal language model "
            "predicts, and this batch has no 'labels' tensor of shape (rows, tokens). Give "
            "batches as mappings with 'labels' (pack() makes them), or loss_over='batches'."
        )
    return int((labels[..., 1:] != IGNORE_INDEX).sum())
