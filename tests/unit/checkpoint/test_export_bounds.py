"""What checkpoint/export.py promises while it runs, measured as it runs (issue 34).

- Rank 0 holds at most one file's worth of gathered tensors (`max_shard_bytes`, or one larger
  tensor): a spy on DTensor.full_tensor reads the writer's pending bytes at every gather.
- A re-export moves the old entry file out first and the new one in last, so a crash between
  any two moves leaves either a loadable export or none: a spy on os.replace loads `out`
  after every move.
- The index's total_size and the packing of files are at the cast size (dtype="bf16"): read
  back from the files written.

One process. The gathers run on a world-1 gloo group with torch's own fully_shard, so the
parameters are DTensors and every tensor is gathered as it is at any world size.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import export
from shardwise.checkpoint.export import export_weights
from shardwise.parallelize import INDEX_FILE, SINGLE_FILE, WeightsError, load_weights
from shardwise.testing.models import GPT, GPTConfig

CFG = GPTConfig()
SMALL = 20_000  # bytes per file: the GPT's ~150 KB of fp32 weights make several files


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _nbytes(t: torch.Tensor, cast: torch.dtype | None) -> int:
    dtype = cast if cast is not None and t.is_floating_point() else t.dtype
    return t.numel() * dtype.itemsize


@pytest.fixture
def world_1_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_rank_0_holds_at_most_one_files_worth_at_every_gather(
    tmp_path, monkeypatch, world_1_group, dtype
):
    model = _model(0)
    for block in model.blocks:
        fully_shard(block, mesh=world_1_group)
    fully_shard(model, mesh=world_1_group)
    writers: list[export._ShardWriter] = []

    class Watched(export._ShardWriter):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            writers.append(self)

    gathers: list[tuple[int, int, int]] = []  # (bytes pending, tensors pending, bytes gathered)
    real_gather = DTensor.full_tensor

    def gather(self: DTensor, *args, **kwargs) -> torch.Tensor:
        full = real_gather(self, *args, **kwargs)
        (writer,) = writers
        gathers.append((writer.size, len(writer.pending), _nbytes(full, dtype)))
        return full

    monkeypatch.setattr(export, "_ShardWriter", Watched)
    monkeypatch.setattr(DTensor, "full_tensor", gather)
    written = export_weights(model, tmp_path / "w", max_shard_bytes=SMALL, dtype=dtype)
    assert written == tmp_path / "w" / INDEX_FILE
    assert len(gathers) == len(model.state_dict())  # every tensor, each gathered once
    over = [(held, n, new) for held, n, new in gathers if n and held + new > SMALL]
    assert not over, f"gathered beside a pending file over {SMALL} bytes: {over}"
    # Not vacuous: gathers happened beside pending tensors, near the bound.
    assert max(held + new for held, n, new in gathers if n) > SMALL // 2
    files = set(json.loads(written.read_text())["weight_map"].values())
    assert len(files) > 2


def _export_state(out: Path, old: GPT, new: GPT) -> str | None:
    """Which export `out` holds ('old' or 'new'), loaded as a user would; None: no entry."""
    entries = [n for n in (SINGLE_FILE, INDEX_FILE) if (out / n).is_file()]
    assert len(entries) <= 1, f"two entry files at once: {entries}"
    if not entries:
        return None
    target = _model(99)
    try:
        load_weights(target, out)
    except (WeightsError, OSError) as exc:  # OSError: a file the index names is not there
        pytest.fail(f"{out} holds {entries[0]} but does not load: {exc!r}")
    got = target.state_dict()
    for name, model in (("old", old), ("new", new)):
        if all(torch.equal(got[k], v) for k, v in model.state_dict().items()):
            return name
    pytest.fail(f"{out} loads a mixture of the two exports")


@pytest.mark.parametrize(
    ("first", "second"),
    [(SMALL, 30_000), (SMALL, 2**40), (2**40, SMALL)],
    ids=["sharded-to-sharded", "sharded-to-single", "single-to-sharded"],
)
def test_every_move_of_a_re_export_leaves_one_loadable_export_or_none(
    tmp_path, monkeypatch, first, second
):
    out = tmp_path / "w"
    old, new = _model(1), _model(2)
    export_weights(old, out, max_shard_bytes=first)
    states: list[str | None] = []
    real_replace = os.replace

    def move(src, dst, *args, **kwargs) -> None:
        real_replace(src, dst, *args, **kwargs)
        states.append(_export_state(out, old, new))

    monkeypatch.setattr(os, "replace", move)
    export_weights(new, out, max_shard_bytes=second)
    monkeypatch.undo()
    assert len(states) > 2, states  # the old files out and the new ones in, one by one
    # 'old' while the old entry is there, then nothing loadable, then 'new' from the move
    # that brings the new entry in (the last one).
    assert states[-1] == "new" and states.count("new") == 1, states
    assert None in states, states
    first_gone = states.index(None)
    assert set(states[:first_gone]) <= {"old"} and set(states[first_gone:-1]) == {None}, states


def test_index_total_size_and_file_packing_are_at_the_cast_size(tmp_path):
    model = _model(0)
    state = model.state_dict()
    order = list(state)  # the order the export writes them
    index_path = export_weights(model, tmp_path / "bf16", max_shard_bytes=SMALL, dtype="bf16")
    index = json.loads(Path(index_path).read_text())
    weight_map: dict[str, str] = index["weight_map"]
    assert set(weight_map) == set(state)
    size = {k: _nbytes(v, torch.bfloat16) for k, v in state.items()}
    assert index["metadata"]["total_size"] == sum(size.values())
    # Read back: each file holds the tensors the index names for it, in bf16.
    on_disk = 0
    for name in sorted(set(weight_map.values())):
        with safe_open(str(tmp_path / "bf16" / name), "pt") as f:
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == name}
            for key in f.keys():
                tensor = f.get_tensor(key)
                assert tensor.dtype == torch.bfloat16, key
                on_disk += tensor.numel() * tensor.element_size()
    assert on_disk == index["metadata"]["total_size"]
    # Packed at the cast size: files in writing order, each within the bound, and each
    # closed only because the next tensor would have taken it over.
    files = [weight_map[k] for k in order]
    assert files == sorted(files), "tensors out of their writing order"
    held: dict[str, int] = {}
    for k in order:
        held[weight_map[k]] = held.get(weight_map[k], 0) + size[k]
    assert all(n <= SMALL for n in held.values()), held
    for k, after in itertools.pairwise(order):
        if weight_map[k] != weight_map[after]:
            assert held[weight_map[k]] + size[after] > SMALL, (weight_map[k], held, after)
    # The same bound at fp32 needs more files: the cast size is what was packed.
    fp32 = json.loads(
        Path(export_weights(model, tmp_path / "fp32", max_shard_bytes=SMALL)).read_text()
    )
    assert fp32["metadata"]["total_size"] == 2 * index["metadata"]["total_size"]
    assert len(set(fp32["weight_map"].values())) > len(held)
