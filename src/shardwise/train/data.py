"""Data for the Runner: each rank's own slice of every epoch, and where a resume continues.

Owns: turning a Dataset or DataLoader into a per-rank DataLoader over a DistributedSampler
(its own generator, so creating an iterator does not shift the global RNG), the sampler
that starts an epoch a number of samples in, and mapping a saved loop position onto this
world and batch size (`map_position`).

The last uneven batch: torch's DistributedSampler pads the dataset to a multiple of the
world size by repeating its first samples (drop_last=False) or drops the tail
(drop_last=True), so every rank runs the same number of batches; unequal counts would
hang the gradient collectives. The DataLoader then keeps a final partial batch unless
`drop_last`; its mean loss counts like a full batch's.

At another world size (or per-rank batch size) the position is kept by the global samples
consumed in the epoch: DistributedSampler deals one epoch-wide order `order[rank::world]`,
so after b batches of B on each of W ranks exactly `order[:b*B*W]` was trained, and W'
ranks that each skip b*B*W/W' samples train `order[b*B*W:]`, each sample once. When W'
does not divide that count the resume is refused (an uneven split would need unequal
batch counts, which hang the collectives).

Must not: train, or read checkpoints (train/resume.py does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from shardwise.config.training import RunnerConfig
from shardwise.distributed.worker_errors import refused
from shardwise.train.progress import say
from shardwise.train.stream import StreamLoader


class ResumableSampler(DistributedSampler[int]):
    """DistributedSampler that can start its next epoch a number of samples in (resume)."""

    skip = 0

    def __iter__(self) -> Any:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return int(super().__len__()) - self.skip


def make_loader(
    data: Any,
    name: str,
    shuffle: bool,
    config: RunnerConfig,
    rank: int,
    world: int,
    *,
    pin_memory: bool = False,
    device: torch.device | None = None,
) -> DataLoader[Any] | None:
    """This rank's DataLoader over `data`: a map-style Dataset (batches in pinned memory
    when `pin_memory`, as a CUDA job wants), or a DataLoader whose own settings are all
    kept (batch size, collate function, workers and their init function, prefetching,
    persistent workers, pinned memory, drop_last); only its sampler is replaced. An
    IterableDataset (or a DataLoader over one) becomes a StreamLoader (train/stream.py),
    whose collectives run on `device`."""
    if data is None:
        return None
    cfg = config
    if isinstance(getattr(data, "dataset", data), IterableDataset):
        return StreamLoader(  # type: ignore[return-value]  # the Runner tells them apart
            data,
            name,
            parts=cfg.stream_parts,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            rank=rank,
            world=world,
            device=device or torch.device("cpu"),
            pin_memory=pin_memory,
        )
    kept: dict[str, Any] = {"pin_memory": pin_memory}
    if isinstance(data, DataLoader):
        dataset, batch_size = data.dataset, data.batch_size
        collate, workers, drop_last = data.collate_fn, data.num_workers, data.drop_last
        kept = {
            "pin_memory": data.pin_memory,
            "worker_init_fn": data.worker_init_fn,
            "persistent_workers": data.persistent_workers,
            "prefetch_factor": data.prefetch_factor,
            "timeout": data.timeout,
            "multiprocessing_context": data.multiprocessing_context,
        }
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        dataset, batch_size, collate, workers, drop_last = (
            data,
            cfg.batch_size,
            None,
            cfg.num_workers,
            cfg.drop_last,
        )
    else:
        raise TypeError(
            f"Runner({name}=...) got {type(data).__name__}; expected a map-style Dataset, "
            "an IterableDataset (a stream), or a DataLoader over either."
        )
    sampler: DistributedSampler[Any] = ResumableSampler(
        dataset,
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=cfg.seed,
        drop_last=cfg.drop_last,
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        drop_last=drop_last,
        # Its own generator: creating an iterator draws a base seed, and drawing it from
        # the global RNG would shift dropout masks after a resume.
        generator=torch.Generator().manual_seed(cfg.seed),
        **kept,
    )
    if len(loader) == 0:
        raise ValueError(
            f"Runner: {name} yields no batches: {len(dataset)} sample(s) over "  # type: ignore[arg-type]
            f"{world} rank(s) with batch_size={batch_size} and drop_last={drop_last} "
            "gives 0 batches per rank. Use more data, a smaller batch_size, or drop_last=False."
        )
    return loader


def map_position(
    position: dict[str, Any],
    saved_world: int,
    loader: DataLoader[Any] | None,
    world: int,
    resume: str | None,
) -> tuple[int, int]:
    """(epoch, samples to skip per rank) for the saved position at this world size."""
    epoch, done, total = position["epoch"], position["batches_done"], position["total_batches"]
    if done >= total:
        return epoch + 1, 0
    batch = (loader.batch_size if loader else None) or 1
    saved = int(position.get("world_size", saved_world))
    saved_batch = int(position.get("batch_size", batch))  # older checkpoints: unchanged
    consumed = int(position.get("samples_done", done * saved_batch * saved))
    if (saved, saved_batch) == (world, batch):
        return epoch, consumed // saved
    if consumed % world:
        fits = [d for d in range(1, min(consumed, 64) + 1) if consumed % d == 0]
        raise refused(  # the same on every rank; one line from `shardwise run`
            ValueError(
                f"RunnerConfig.resume={resume!r}: the checkpoint was saved by "
                f"{saved} rank(s) {consumed} samples into epoch {epoch} ({done} batch(es) of "
                f"{saved_batch} per rank). {consumed} does not split evenly over this world "
                f"size {world}, so the ranks cannot continue exactly where it stopped "
                "(an uneven split would train a sample twice, skip one, or give ranks unequal "
                f"batch counts). Resume at a world size dividing {consumed} (e.g. {fits}), "
                "or from a checkpoint saved at the end of an epoch."
            )
        )
    skip = consumed // world
    sampler = loader.sampler if loader else None
    per_rank = int(getattr(sampler, "num_samples", skip + 1))
    say(
        f"resuming at world size {world} ({batch} per rank and batch) from a "
        f"checkpoint saved at world size {saved} ({saved_batch} per rank and batch): epoch "
        f"{epoch} continues after the {consumed} samples it consumed, each rank skipping "
        f"{skip}. RNG states are restored only at the saving world size."
    )
    return (epoch + 1, 0) if skip >= per_rank else (epoch, skip)
