"""Streamed data: shardwise's StreamLoader against a hand-written torchdata loader, and the
share of a training step spent waiting for data.

The stream: `--docs` generated documents (seeded random words, lengths drawn log-normally,
nothing downloaded) in a datasets IterableDataset of `--shards` shards
(`Dataset.from_dict(...).to_iterable_dataset(num_shards=...)`), tokenized byte by byte
inside the loader's workers and packed into rows of `--seq-len` tokens (input_ids, labels,
position_ids), `--batch` rows a batch. Two loaders read it, at each of `--workers`:

- shardwise: `StreamLoader(pack(stream, seq_len, tokenize=...), parts=shards, ...)` at
  world 1, read with `batches(epoch, 1)`: each part (here one shard) is packed on its own,
  in one global order whatever the worker count, with every part's position kept;
- hand-written: a torch IterableDataset that iterates the same datasets stream (which, in
  a DataLoader worker, reads only that worker's shards), tokenizes and packs with one
  buffer per worker, batched by torchdata's `StatefulDataLoader` (default collate; torch's
  DataLoader where torchdata is missing, named in the report). It keeps no position of its
  own (a resume would replay the stream up to the saved batch count).

A pass is one epoch, from creating the iterator to its end (worker start and shutdown
included); tokens/s is the rows delivered x seq_len over that time. The two loaders do not
deliver the same number of rows: shardwise's epoch ends when the first part runs out (every
rank must take the same steps) and drops each part's last partial row; the hand-written
one drops a partial row per worker. Both counts are reported. Variants run in `--rounds`
rounds, each running every (loader, workers) pair once in a seeded random order; the
figure is the median over rounds. The ratio is shardwise / hand-written tokens/s.

Then the step time of a small GPT (shardwise.testing.models, AdamW, fp32) trained on the
packed rows (inputs = input_ids[:, :-1], targets = labels[:, 1:]; the GPT ignores
position_ids): each step takes its batch from a StreamLoader (`--train-workers`, the wait
for `next()` timed apart) or from the same batches materialised in memory beforehand. The
two phases alternate for `--train-rounds` rounds (on one model: the steps cost the same);
the first `--warmup` steps of each phase (worker start-up included) are dropped. Training
runs on `--train-threads` torch threads (default 1: on a shared 2-core machine two threads
time erratically, and the second core is left to the loader's workers). The data-wait
share is the summed waits over the summed loader-fed step times; the slowdown share is
(loader-fed median - in-memory median) / loader-fed median, which also holds the noise
between phases and the workers' use of the cores.

    python bench/stream_loader.py          # ~2.5 min on a 2-core CPU
    python bench/stream_loader.py --smoke  # seconds
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import torch
from torch.utils.data import DataLoader, IterableDataset

from shardwise.testing.models import GPT, GPTConfig
from shardwise.train.packing import IGNORE_INDEX, pack
from shardwise.train.stream import StreamLoader

# More workers than cores is part of what is measured (2-core CI machines); torch warns.
warnings.filterwarnings("ignore", message="This DataLoader will create")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11

WORDS = [
    "the", "of", "stream", "shard", "token", "packing", "a", "gradient", "worker", "row",
    "and", "to", "in", "model", "epoch", "resume", "checkpoint", "is", "learning", "rate",
    "über", "naïve", "données", "データ", "模型", "train", "loss", "batch", "for", "with",
]  # fmt: skip
"""Some multi-byte words, so a byte-level token count differs from a character count."""

_SMOKE = {
    "docs": 240,
    "seq_len": 128,
    "workers": "0,2",
    "rounds": 1,
    "train_workers": "0,2",
    "train_rounds": 1,
    "steps": 3,
    "warmup": 1,
    "d_model": 32,
    "n_layers": 1,
}


# --- the stream ---------------------------------------------------------------------------


def documents(n: int, seed: int) -> list[str]:
    """`n` documents of seeded random words, lengths log-normal (median ~650 bytes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = max(2, min(2000, int(rng.lognormvariate(4.8, 0.9))))
        out.append(" ".join(rng.choices(WORDS, k=words)))
    return out


def stream(docs: list[str], shards: int) -> Any:
    import datasets

    return datasets.Dataset.from_dict({"text": docs}).to_iterable_dataset(num_shards=shards)


def part_rows(source: Any, parts: int, seq_len: int) -> list[int]:
    """The full rows each part packs (a part is shards/parts of the stream's shards): what
    pack() gives a part, its last partial row dropped."""
    from datasets.distributed import split_dataset_by_node

    return [
        sum(len(byte_tokens(d)) for d in split_dataset_by_node(source, rank=p, world_size=parts))
        // seq_len
        for p in range(parts)
    ]


def byte_tokens(document: dict[str, Any]) -> list[int]:
    """A byte-level tokenizer: the document's UTF-8 bytes (vocabulary 256)."""
    return list(document["text"].encode("utf-8"))


class HandPacked(IterableDataset):
    """The hand-written packing: tokenize each document of this worker's share of the
    stream, concatenate, cut rows of seq_len (labels ignore each document's first token,
    positions restart per document, as pack()'s rows)."""

    def __init__(self, source: Any, seq_len: int) -> None:
        self.source, self.seq_len = source, seq_len

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        n = self.seq_len
        ids: list[int] = []
        pos: list[int] = []
        for document in self.source:  # in a worker, datasets reads that worker's shards
            tokens = byte_tokens(document)
            ids.extend(tokens)
            pos.extend(range(len(tokens)))
            while len(ids) >= n:
                row = torch.tensor(ids[:n], dtype=torch.long)
                positions = torch.tensor(pos[:n], dtype=torch.long)
                del ids[:n], pos[:n]
                labels = row.masked_fill(positions == 0, IGNORE_INDEX)
                yield {"input_ids": row, "labels": labels, "position_ids": positions}


def shardwise_loader(source: Any, args: Any, workers: int) -> StreamLoader:
    return StreamLoader(
        pack(source, args.seq_len, tokenize=byte_tokens),
        "train_data",
        parts=args.shards,
        batch_size=args.batch,
        num_workers=workers,
        rank=0,
        world=1,
        device=torch.device("cpu"),
    )


def baseline_class() -> type:
    """torchdata's StatefulDataLoader; torch's DataLoader where torchdata is not installed
    (it is in no extra of pyproject.toml; the report names the one used)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return DataLoader
    return StatefulDataLoader


def hand_loader(source: Any, args: Any, workers: int) -> Any:
    return baseline_class()(
        HandPacked(source, args.seq_len), batch_size=args.batch, num_workers=workers
    )


def one_pass(kind: str, source: Any, args: Any, workers: int) -> dict[str, Any]:
    """One epoch through a fresh loader: its seconds, rows, and a crc of its rows in order."""
    start = time.perf_counter()
    if kind == "shardwise":
        batches = shardwise_loader(source, args, workers).batches(0, 1)
    else:
        batches = iter(hand_loader(source, args, workers))
    rows, crc, first = 0, 0, None
    for batch in batches:
        ids = batch["input_ids"]
        rows += ids.shape[0]
        crc = zlib.crc32(ids.numpy().tobytes(), crc)
        if first is None:
            first = ids[0].tolist()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rows": rows, "crc": crc, "first_row": first}


def throughput(source: Any, args: Any, workers: list[int]) -> dict[str, Any]:
    variants = [(kind, w) for w in workers for kind in ("shardwise", "handwritten")]
    rng = random.Random(args.seed)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        order = variants[:]
        rng.shuffle(order)
        for kind, w in order:
            runs[kind, w].append(one_pass(kind, source, args, w))
    out: dict[str, Any] = {}
    for w in workers:
        row: dict[str, Any] = {}
        for kind in ("shardwise", "handwritten"):
            passes = runs[kind, w]
            seconds = [p["seconds"] for p in passes]
            tokens = passes[0]["rows"] * args.seq_len
            row[kind] = {
                "rows": passes[0]["rows"],
                "pass_s": [round(s, 3) for s in seconds],
                "tokens_per_s": round(statistics.median(tokens / s for s in seconds)),
                "same_rows_every_round": len({(p["rows"], p["crc"]) for p in passes}) == 1,
            }
        row["ratio"] = round(
            row["shardwise"]["tokens_per_s"] / row["handwritten"]["tokens_per_s"], 3
        )
        out[str(w)] = row
    crcs = {(runs["shardwise", w][0]["rows"], runs["shardwise", w][0]["crc"]) for w in workers}
    kinds = ("shardwise", "handwritten")
    firsts = {w: [runs[k, w][0]["first_row"] for k in kinds] for w in workers}
    return {
        "by_workers": out,
        # shardwise's order does not depend on the worker count (module docstring).
        "shardwise_same_rows_at_every_worker_count": len(crcs) == 1,
        # Without workers both start with shard 0's first document: the same first row.
        "first_row_equal_without_workers": firsts[0][0] == firsts[0][1] if 0 in firsts else None,
    }


# --- training -----------------------------------------------------------------------------


def train_step(model: GPT, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    loss = model(batch["input_ids"][:, :-1], batch["labels"][:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loader_phase(model, opt, source, args, workers: int) -> tuple[list[float], list[float]]:
    """Steps fed by a fresh StreamLoader: each step's time (wait + compute) and its wait."""
    batches = shardwise_loader(source, args, workers).batches(0, 1)
    steps, waits = [], []
    try:
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            batch = next(batches)
            got = time.perf_counter()
            train_step(model, opt, batch)
            end = time.perf_counter()
            if i >= args.warmup:
                steps.append(end - start)
                waits.append(got - start)
    finally:
        batches.close()  # the workers stop outside the timed steps
    return steps, waits


def memory_phase(model, opt, held: list[dict[str, torch.Tensor]], args) -> list[float]:
    steps = []
    for i, batch in enumerate(held):
        seconds, _ = common.timed(lambda b=batch: train_step(model, opt, b))
        if i >= args.warmup:
            steps.append(seconds)
    return steps


def training(source: Any, args: Any, workers: list[int]) -> dict[str, Any]:
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(args.train_threads)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The in-memory batches are the loader's own first batches, read beforehand.
    reader = shardwise_loader(source, args, 0).batches(0, 1)
    held = [next(reader) for _ in range(args.warmup + args.steps)]
    reader.close()
    out: dict[str, Any] = {
        "model": {**vars(cfg), "params": model.num_params()},
        "steps_per_phase": args.steps,
        "warmup_per_phase": args.warmup,
    }
    for w in workers:
        fed: list[float] = []
        waits: list[float] = []
        mem: list[float] = []
        for r in range(args.train_rounds):
            for phase in ("loader", "memory") if r % 2 == 0 else ("memory", "loader"):
                if phase == "loader":
                    s, wt = loader_phase(model, opt, source, args, w)
                    fed += s
                    waits += wt
                else:
                    mem += memory_phase(model, opt, held, args)
        fed_ms, mem_ms = statistics.median(fed) * 1e3, statistics.median(mem) * 1e3
        compute = [s - wt for s, wt in zip(fed, waits, strict=True)]
        out[f"workers_{w}"] = {
            "step_ms_from_loader": round(fed_ms, 2),
            "step_ms_from_memory": round(mem_ms, 2),
            # The loader-fed steps less their waits: as from memory, but for noise and the
            # workers' share of the cores.
            "compute_ms_from_loader": round(statistics.median(compute) * 1e3, 2),
            "wait_ms_median": round(statistics.median(waits) * 1e3, 3),
            "wait_ms_max": round(max(waits) * 1e3, 3),
            "wait_share": round(sum(waits) / sum(fed), 4),
            "slowdown_share": round((fed_ms - mem_ms) / fed_ms, 4),
            "tokens_per_s_from_loader": round(args.batch * args.seq_len / (fed_ms / 1e3)),
        }
    torch.set_num_threads(threads)
    return out


# --- report ---------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| workers | shardwise tokens/s (rows) | hand-written tokens/s (rows) | **ratio** |",
        "|---|---|---|---|",
    ]
    for w, r in report["throughput"]["by_workers"].items():
        s, h = r["shardwise"], r["handwritten"]
        lines.append(
            f"| {w} | {s['tokens_per_s']:,} ({s['rows']:,}) | {h['tokens_per_s']:,} "
            f"({h['rows']:,}) | **{r['ratio']:.3f}** |"
        )
    lines += [
        "",
        "| loader workers | step, from loader | of which compute | step, from memory "
        "| wait (median / max) | **wait share** | slowdown share |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, t in report["training"].items():
        if not key.startswith("workers_"):
            continue
        lines.append(
            f"| {key.split('_')[1]} | {t['step_ms_from_loader']:.1f} ms | "
            f"{t['compute_ms_from_loader']:.1f} ms | {t['step_ms_from_memory']:.1f} ms | "
            f"{t['wait_ms_median']:.2f} / "
            f"{t['wait_ms_max']:.1f} ms | **{100 * t['wait_share']:.1f}%** | "
            f"{100 * t['slowdown_share']:.1f}% |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = common.arg_parser(__doc__)
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--shards", type=int, default=8, help="datasets shards = stream parts")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--workers", default="0,2,4", help="DataLoader workers to compare at")
    p.add_argument("--rounds", type=int, default=3, help="passes per (loader, workers)")
    p.add_argument("--train-workers", default="0,2", help="StreamLoader workers in training")
    p.add_argument("--train-rounds", type=int, default=4, help="loader/memory phase pairs")
    p.add_argument("--train-threads", type=int, default=1, help="torch threads in training")
    p.add_argument("--steps", type=int, default=6, help="timed training steps per phase")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per phase")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"a small stream and model: {_SMOKE}")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = common.parse_with_smoke(p, argv, _SMOKE)
    workers, train_workers = _ints(args.workers), _ints(args.train_workers)
    for w in {*workers, *train_workers}:
        if w and args.shards % w:
            p.error(f"{w} workers do not share {args.shards} parts evenly: give divisors.")
    counts = (args.rounds, args.steps, args.train_rounds, args.train_threads)
    if min(counts) < 1 or args.warmup < 0:
        p.error("--rounds, --steps, --train-rounds, --train-threads must be >= 1, --warmup >= 0.")

    start = time.perf_counter()
    docs = documents(args.docs, args.seed)
    source = stream(docs, args.shards)
    total = sum(len(d.encode("utf-8")) for d in docs)
    per_part = part_rows(source, args.shards, args.seq_len)
    ends = min(p + args.shards * n for p, n in enumerate(per_part))
    report: dict[str, Any] = {
        **common.dated_header(
            "stream_loader", common.command_line(), common.device_description("cpu", 1)
        ),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "stream": {
            "documents": args.docs,
            "tokens": total,
            "full_rows": total // args.seq_len,
            "rows_per_part": per_part,
            # shardwise's epoch ends at the first global index g = part + parts * n whose
            # part has no row n, less what does not fill a batch (world 1, window 1).
            "shardwise_epoch_rows_expected": ends - ends % args.batch,
            "torch_threads": torch.get_num_threads(),
        },
        "baseline_loader": f"{baseline_class().__module__}.{baseline_class().__name__}",
        "throughput": throughput(source, args, workers),
        "training": training(source, args, train_workers),
    }
    report["wall_s"] = round(time.perf_counter() - start, 1)
    common.emit_json(report, None if args.out is None else Path(args.out))
    print(markdown(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
