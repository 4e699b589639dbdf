"""Streamed data for the Runner: a stream cut into parts, dealt to data-parallel ranks, read
in one order at any world size and worker count, and resumed where it stopped.

Owns: `StreamLoader`, what the Runner makes of an IterableDataset (a datasets
IterableDataset, a torch one, `pack()`'s PackedStream, or a DataLoader over any of them).

The order. The stream is cut into `RunnerConfig.stream_parts` parts (P), fixed for the run:
a datasets stream whose shard count P divides gets whole shards per part (each file is
read once); any other stream is dealt item by item, item i to part i % P (every reader then
reads the whole stream and keeps its parts' items). Packed, each part packs its own
documents. Sample n of part p has the global index g = p + P*n, and training follows g:
data-parallel rank r of W reads the parts p with p % W == r, in order of g, so the W ranks'
batches of one step are together the next W*batch_size*accumulate_steps samples of the
global order. That order does not depend on W, nor on the DataLoader workers (a rank's
parts are dealt to its workers so that the DataLoader's round robin over workers gives
them back in order of g). Hence:

- a resume at the same world and workers gives the same batches, bit for bit;
- at another data-parallel world (with the global batch kept, as for map-style data) or
  another worker count, the steps take the same samples as without the change: none twice,
  none skipped. P must be a multiple of each world size used, and P / world of the worker
  count; what does not divide is refused, in one line, before anything is read.

The end of an epoch: a stream's length is unknown until it runs out, and every rank must
take the same number of steps (the collectives of a step wait for all). Before each
optimizer step every rank reads its whole window of micro-batches and the ranks agree (one
all-reduce of a flag) that all have it; the epoch ends at the first step some rank cannot
fill, on every rank. The samples of that incomplete step, and a part's last tokens that do
not fill a row, are not trained.

The state: each part's position (samples taken, and for packed parts the document and
token the next row starts at), with a fingerprint of the last document or sample taken.
Saved in the Runner's checkpoints with the world and worker count, gathered from every
rank; a resume reopens each part there and checks the fingerprint: a stream that gives
other items in that place (shuffled without a seed, files changed) is refused in one line
before training.

Must not: train, or read checkpoints (the Runner and train/resume.py do).
"""

from __future__ import annotations

import itertools
import pickle
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from shardwise.distributed.process_group import rank_and_world
from shardwise.distributed.worker_errors import refused
from shardwise.train.packing import PackedStream, Packer, Packing, count_label_tokens, digest

END, REFUSED = "end", "refused"


@dataclass
class PartStart:
    """Where part p continues: `rows` samples taken; packed, the next row starts `offset`
    tokens into document `document`; `last`/`check` name the last document (or sample)
    taken and its fingerprint (None: nothing taken yet)."""

    rows: int = 0
    document: int = 0
    offset: int = 0
    last: int = -1
    check: int | None = None

    def as_list(self) -> list[int | None]:
        return [self.rows, self.document, self.offset, self.last, self.check]


def _is_datasets_stream(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and hasattr(source, "num_shards")


def _items(source: Any) -> Iterator[Any]:
    """The source's items in order, in this process. A datasets stream is read with
    `.iter()`, which (unlike iterating it inside a DataLoader worker) does not split it
    across the worker processes itself."""
    if hasattr(source, "iter") and _is_datasets_stream(source):
        for batch in source.iter(batch_size=64):
            keys = list(batch)
            for i in range(len(batch[keys[0]]) if keys else 0):
                yield {k: batch[k][i] for k in keys}
        return
    yield from source


def _fingerprint(item: Any) -> int:
    """A sample's fingerprint: crc32 of its tensors' bytes and its other values' repr."""
    if isinstance(item, torch.Tensor):
        raw = item.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        return zlib.crc32(raw.tobytes())
    if isinstance(item, dict):
        return zlib.crc32(pickle.dumps([(k, _fingerprint(v)) for k, v in sorted(item.items())]))
    if isinstance(item, (list, tuple)):
        return zlib.crc32(pickle.dumps([_fingerprint(v) for v in item]))
    return zlib.crc32(repr(item).encode())


class _Parts:
    """Items of a set of parts, each with its index in its part: from a datasets stream's
    own shards (`shards`), or one pass over the whole stream dealt by index modulo P."""

    def __init__(self, source: Any, count: int, parts: list[int], begin: dict[int, int]) -> None:
        self.count, self.begin = count, begin
        self.shards = _is_datasets_stream(source) and source.num_shards % count == 0
        self.queues: dict[int, deque[tuple[int, Any]]] = {p: deque() for p in parts}
        if self.shards:
            from datasets.distributed import split_dataset_by_node

            self.own = {
                p: itertools.islice(
                    enumerate(_items(split_dataset_by_node(source, rank=p, world_size=count))),
                    begin[p],
                    None,
                )
                for p in parts
            }
        else:
            first = min(p + count * begin[p] for p in parts)
            self.base = enumerate(itertools.islice(_items(source), first, None), start=first)

    def next(self, part: int) -> tuple[int, Any] | None:
        """(index in the part, item), or None: the part has no more."""
        if self.shards:
            return next(self.own[part], None)
        queue = self.queues[part]
        while not queue:
            got = next(self.base, None)
            if got is None:
                return None
            i, item = got
            p, n = i % self.count, i // self.count
            if p in self.queues and n >= self.begin[p]:
                self.queues[p].append((n, item))
        return queue.popleft()


@dataclass(frozen=True)
class StreamSpec:
    """What every reader of one stream shares (pickled into DataLoader workers)."""

    source: Any
    count: int
    packing: Packing | None


def read_parts(
    spec: StreamSpec, parts: list[int], starts: dict[int, PartStart]
) -> Iterator[tuple[Any, ...]]:
    """(part, n, end, sample) for the given parts in order of g = part + count*n, then
    (END,) when the part whose turn it is has no more; (REFUSED, message) when a part's
    place no longer holds what was taken there (the stream's order changed)."""
    P, packing = spec.count, spec.packing
    # Reopen one item early where there is a fingerprint to check.
    begin = {}
    for p in parts:
        s = starts[p]
        held = s.document if packing is not None else s.rows
        begin[p] = s.last if s.check is not None and s.last >= 0 else held
    items = _Parts(spec.source, P, parts, begin)
    packers = {p: Packer(packing.seq_len) for p in parts} if packing is not None else {}
    offsets = {p: starts[p].offset for p in parts}
    for p in parts:
        s = starts[p]
        if s.check is None or s.last < 0:
            continue
        got = items.next(p)
        seen = None
        if got is not None:
            seen = digest(packing.token_ids(got[1])) if packing else _fingerprint(got[1])
        if seen != s.check:
            yield (
                REFUSED,
                f"part {p} of {P} of the stream no longer holds, at item {s.last}, the "
                "item the checkpoint's run took there: the stream's order changed "
                "(shuffled without a fixed seed, or its files changed), so the resume "
                "cannot continue exactly where it stopped. Restore the stream's order "
                "(a seeded shuffle, the same files), or start a fresh run.",
            )
            return
        if packing is not None and got is not None and s.last == s.document:
            packers[p].feed(got[0], packing.token_ids(got[1]), s.offset)  # a row ended inside it
            offsets[p] = 0
    for p in parts:
        if p in packers:
            packers[p].next_document = max(packers[p].next_document, starts[p].document)
    taken = {p: starts[p].rows for p in parts}
    while True:
        p = min(parts, key=lambda q: q + P * taken[q])
        if packing is None:
            got = items.next(p)
            if got is None:
                yield (END,)
                return
            n, item = got
            yield p, taken[p], (n + 1, 0, n, _fingerprint(item)), item
        else:
            packer = packers[p]
            while (row := packer.row()) is None:
                doc = items.next(p)
                if doc is None:
                    yield (END,)
                    return
                packer.feed(doc[0], packing.token_ids(doc[1]), offsets[p])
                offsets[p] = 0
            yield p, taken[p], row[1], row[0]
        taken[p] += 1


class _WorkerParts(IterableDataset[Any]):
    """In DataLoader worker w: read_parts over the parts dealt to w, `chunk` items a message,
    their tensors as bytes (a tensor crossing processes costs a shared-memory file each)."""

    def __init__(
        self, spec: StreamSpec, dealt: list[list[int]], starts: dict[int, PartStart], chunk: int
    ) -> None:
        self.spec, self.dealt, self.starts, self.chunk = spec, dealt, starts, chunk

    def __iter__(self) -> Iterator[list[Any]]:
        info = get_worker_info()
        mine = self.dealt[info.id if info is not None else 0]
        items = read_parts(self.spec, mine, {p: self.starts[p] for p in mine})
        while chunk := [_to_wire(item) for item in itertools.islice(items, self.chunk)]:
            yield chunk


def _map(value: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`value` with `fn` applied to each `kind` inside its dicts, lists and tuples."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(v, kind, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, kind, fn) for v in value)
    return value


def _tensor_to_wire(tensor: torch.Tensor) -> _Wire:
    t = tensor.detach().cpu().contiguous()
    return _Wire(t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _wire_to_tensor(wire: _Wire) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8)
    return raw.view(wire.dtype).reshape(wire.shape)


def _to_wire(value: Any) -> Any:
    return _map(value, torch.Tensor, _tensor_to_wire)


def _from_wire(value: Any) -> Any:
    return _map(value, _Wire, _wire_to_tensor)


@dataclass(frozen=True)
class _Wire:
    """A tensor as bytes, for the queue from a DataLoader worker."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes


def _as_is(item: Any) -> Any:
    return item


class StreamLoader:
    """This data-parallel rank's batches of a stream (see the module's docstring)."""

    def __init__(
        self,
        data: Any,
        name: str,
        *,
        parts: int,
        batch_size: int,
        num_workers: int,
        rank: int,
        world: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        collate: Callable[[list[Any]], Any] = default_collate
        self.worker_init_fn = None
        if isinstance(data, DataLoader):
            if data.batch_size is None:
                raise ValueError(
                    f"Runner({name}=DataLoader(..., batch_size=None)): shardwise batches a "
                    "stream itself. Give the DataLoader a batch_size, or the dataset alone "
                    "with RunnerConfig.batch_size."
                )
            batch_size, num_workers = data.batch_size, data.num_workers
            collate, self.worker_init_fn = data.collate_fn, data.worker_init_fn
            pin_memory = data.pin_memory
            data = data.dataset
        packing = None
        if isinstance(data, PackedStream):
            data, packing = data.documents, data.packing
        self.name, self.batch_size, self.num_workers = name, batch_size, num_workers
        self.collate, self.pin_memory = collate, pin_memory
        self.rank, self.world, self.device = rank, world, device
        self.spec = StreamSpec(data, parts, packing)
        self.starts = {p: PartStart() for p in range(parts)}
        self._check_split(0)  # the workers once it is known whether a resume saved others
        self._workers_checked = False

    def _check_split(self, workers: int, saved_workers: int | None = None) -> None:
        P, W = self.spec.count, self.world
        if P % W:
            raise refused(
                ValueError(
                    f"RunnerConfig.stream_parts={P} does not split over {W} data-parallel "
                    f"rank(s): each rank reads whole parts of the stream, so the parts must "
                    f"be a multiple of the world. Set stream_parts to a multiple of {W} (and "
                    "of every world size the run may resume at, e.g. 64), for a new run."
                )
            )
        if workers and (P // W) % workers:
            was = f" (the checkpoint was saved with {saved_workers})" if saved_workers else ""
            raise refused(
                ValueError(
                    f"num_workers={workers}{was}: each of the {W} data-parallel rank(s) reads "
                    f"{P // W} part(s) of the stream (RunnerConfig.stream_parts={P}), which "
                    f"its DataLoader workers must share evenly to keep the order. Use a "
                    f"num_workers dividing {P // W}, or 0."
                )
            )

    # --- reading ---------------------------------------------------------------------

    def _mine(self) -> list[int]:
        return [p for p in range(self.spec.count) if p % self.world == self.rank]

    def _samples(self, epoch: int) -> Iterator[tuple[Any, ...]]:
        source = self.spec.source
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)  # a datasets stream reshuffles per epoch, seeded
        mine = self._mine()
        starts = {p: self.starts[p] for p in mine}
        if not self.num_workers:
            yield from read_parts(self.spec, mine, starts)
            return
        # Worker w gets the rank's samples w, w+workers, ... (the DataLoader's round
        # robin): with the parts in order of their next g, every workers-th part.
        P = self.spec.count
        turn = sorted(mine, key=lambda p: p + P * starts[p].rows)
        dealt = [turn[w :: self.num_workers] for w in range(self.num_workers)]
        chunk = self.batch_size
        loader = DataLoader(
            _WorkerParts(self.spec, dealt, starts, chunk),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_as_is,
            worker_init_fn=self.worker_init_fn,
        )
        # One chunk from each worker in turn (the DataLoader's order), dealt back item by
        # item; every worker's items end with END (or REFUSED) where its parts run out.
        chunks = iter(loader)
        while True:
            got = [next(chunks, [(END,)]) for _ in range(self.num_workers)]
            for i in range(chunk):
                for items in got:
                    item = _from_wire(items[i]) if i < len(items) else (END,)
                    yield item
                    if item[0] in (END, REFUSED):
                        return

    def batches(self, epoch: int, window: int) -> Iterator[Any]:
        """Batches of `batch_size` for epoch `epoch`, `window` at a time (one optimizer
        step's), while every rank can fill its window (see the module's docstring)."""
        if not self._workers_checked:
            self._check_split(self.num_workers)
            self._workers_checked = True
        samples = self._samples(epoch)
        need = window * self.batch_size
        try:
            while True:
                taken = list(itertools.islice(samples, need))
                for item in taken:
                    if item[0] == REFUSED:
                        raise refused(ValueError(f"Runner({self.name}=...) resume: {item[1]}"))
                full = len(taken) == need and all(item[0] != END for item in taken)
                if not self._all_ranks(full):
                    self.restart()  # the next epoch starts every part afresh
                    return
                for b in range(window):
                    chunk = taken[b * self.batch_size : (b + 1) * self.batch_size]
                    batch = self.collate([item[3] for item in chunk])
                    for p, _, end, _ in chunk:
                        self.starts[p] = PartStart(self.starts[p].rows + 1, *end)
                    if self.pin_memory:
                        batch = _map(batch, torch.Tensor, torch.Tensor.pin_memory)
                    yield batch
        finally:
            close = getattr(samples, "close", None)
            if close is not None:
                close()

    def restart(self) -> None:
        """Read the stream from its start again (validation reads all of it each time)."""
        self.starts = {p: PartStart() for p in range(self.spec.count)}

    def _all_ranks(self, full: bool) -> bool:
        if rank_and_world()[1] == 1:
            return full
        flag = torch.tensor([1.0 if full else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)

    # --- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every part's position, gathered from every rank (a collective: all ranks call
        it at the same point), with the split it was saved at."""
        mine = {p: self.starts[p].as_list() for p in self._mine()}
        found: list[Any] = [mine]
        if rank_and_world()[1] > 1:
            found = [None] * rank_and_world()[1]
            dist.all_gather_object(found, mine)
        parts: dict[str, Any] = {}
        for got in found:
            parts.update({str(p): v for p, v in got.items()})
        return {
            "parts": self.spec.count,
            "packed": self.spec.packing is not None,
            "seq_len": self.spec.packing.seq_len if self.spec.packing else None,
            "positions": parts,
            "world_size": self.world,
            "num_workers": self.num_workers,
        }

    def load_state_dict(self, state: dict[str, Any], resume: str | None) -> None:
        """Continue each part where `state` left it (any world, any worker count that
        divides the parts)."""
        P = self.spec.count
        seq_len = self.spec.packing.seq_len if self.spec.packing else None
        saved = (int(state["parts"]), bool(state["packed"]), state.get("seq_len"))
        if saved != (P, self.spec.packing is not None, seq_len):
            raise refused(
                ValueError(
                    f"RunnerConfig.resume={resume!r}: the checkpoint's stream was cut into "
                    f"{saved[0]} part(s), {'packed' if saved[1] else 'not packed'}"
                    f"{f' into rows of {saved[2]} tokens' if saved[1] else ''}; this run's is "
                    f"{P} part(s), {'packed' if seq_len else 'not packed'}"
                    f"{f' into rows of {seq_len} tokens' if seq_len else ''}. The positions "
                    "it saved mean nothing in another cut. Use the checkpoint's "
                    "stream_parts and packing, or start a fresh run."
                )
            )
        self._check_split(self.num_workers, int(state.get("num_workers", 0)))
        self._workers_checked = True
        saved_at = state["positions"]
        self.starts = {
            p: PartStart(*saved_at[str(p)]) if str(p) in saved_at else PartStart() for p in range(P)
        }


def micro_batches(
    loader: Any, engine: Any, epoch: int, window: Any, dp_world: int
) -> Iterator[tuple[Any, bool, float | None]]:
    """(micro-batch, whether it must update, its loss weight) for one epoch of the Runner's
    training data (a DataLoader or a StreamLoader), timing the waits for data into
    `window.wait`. Under `loss_over='tokens'` the weight is the micro-batch's tokens x
    data-parallel ranks x accumulate_steps over the tokens its whole step predicts on every
    rank (one all-reduce a step; the ranks of a tp group hold the same batch and count
    once), else None."""
    steps = engine.train_config.accumulate_steps
    source: Iterator[tuple[Any, bool]]
    if isinstance(loader, StreamLoader):
        source = ((d, False) for d in loader.batches(epoch, steps))
    else:
        n = len(loader)
        source = ((d, i == n - 1) for i, d in enumerate(loader))
    tokens = engine.train_config.loss_over == "tokens"
    pending: list[tuple[Any, bool]] = []
    while True:
        start = time.perf_counter()
        got = next(source, None)
        window.wait += time.perf_counter() - start
        if got is None:
            return
        if not tokens:
            yield got[0], got[1], None
            continue
        pending.append(got)
        if len(pending) == steps or got[1]:
            counts = [count_label_tokens(d) for d, _ in pending]
            total = _all_ranks_tokens(sum(counts), dp_world, engine.device)
            for (data, last), c in zip(pending, counts, strict=True):
                yield data, last, c * dp_world * steps / max(total, 1)
            pending = []


def _all_ranks_tokens(mine: int, dp_world: int, device: torch.device) -> int:
    world = rank_and_world()[1]
    if world == 1:
        return mine
    moved = torch.tensor([float(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(moved)
    return round(float(moved.item()) * dp_world / world)
