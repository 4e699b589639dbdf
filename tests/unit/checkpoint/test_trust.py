"""What checkpoint/trust.py refuses, one case per class of bad input (issue 34).

The allow-list unpickler is tried with a global of every kind it must refuse (another module,
another name in a module it allows a name of, a torch attribute that is not a dtype) and every
kind it must take; the manifest check with a value out of range for each field that has a
range, and each range's edge (which must pass). No process group, no checkpoint on disk
beyond the file under test.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.checkpoint import CheckpointError, read_dcp_metadata
from shardwise.checkpoint.trust import check_manifest


def _metadata_naming(tmp_path: Path, module: str, name: str) -> Path:
    """A `.metadata` file whose pickle is one global, module.name (protocol 0's GLOBAL)."""
    (tmp_path / ".metadata").write_bytes(f"c{module}\n{name}\n.".encode())
    return tmp_path


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),  # another module
        ("builtins", "eval"),
        ("torch", "load"),  # torch, but not a dtype or Size: torch.load unpickles anything
        ("torch", "Tensor"),
        ("torch.serialization", "load"),  # a module one name of which is allowed
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
        ("torch.distributed.checkpoint.metadata", "Path"),
        ("collections", "namedtuple"),
        ("pathlib", "Path"),
    ],
)
def test_the_unpickler_refuses_every_global_outside_its_list(tmp_path, module, name):
    state = _metadata_naming(tmp_path, module, name)
    with pytest.raises(
        CheckpointError,
        match=rf"\.metadata is not a valid checkpoint metadata file and was not loaded "
        rf"\(refused to load global {module}\.{name}: a checkpoint's metadata may only",
    ):
        read_dcp_metadata(state)


@pytest.mark.parametrize(
    ("module", "name", "found"),
    [
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata", "type"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "type"),
        ("torch", "float32", "dtype"),
        ("torch", "bfloat16", "dtype"),
        ("torch", "Size", "type"),
        ("torch.serialization", "_get_layout", "function"),
        ("pathlib", "PurePosixPath", "type"),
        ("collections", "OrderedDict", "type"),
    ],
)
def test_the_unpickler_takes_the_globals_dcp_metadata_uses(tmp_path, module, name, found):
    # Unpickled, then refused for what it is (a bare class, not a Metadata): the refusal
    # above is not what stopped it.
    state = _metadata_naming(tmp_path, module, name)
    with pytest.raises(CheckpointError, match=rf"does not hold DCP metadata \(found {found}\)"):
        read_dcp_metadata(state)


SHA = "0" * 64


def _manifest(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "step": 3,
        "world_size": 2,
        "skipped_steps": 0,
        "bytes": 10,
        "files": {"state/__0_0.distcp": {"size": 10, "sha256": SHA}},
    }
    return {**base, **fields}


def _entry(**fields: Any) -> dict[str, Any]:
    return {"files": {"state/__0_0.distcp": {"size": 10, "sha256": SHA, **fields}}}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"step": -1}, r"field step is int -1, expected an integer >= 0"),
        ({"step": True}, r"field step is bool True, expected an integer >= 0"),
        ({"step": 2.0}, r"field step is float 2\.0, expected an integer >= 0"),
        ({"world_size": 0}, r"field world_size is int 0, expected an integer >= 1"),
        ({"world_size": -2}, r"field world_size is int -2, expected an integer >= 1"),
        ({"skipped_steps": -1}, r"field skipped_steps is int -1, expected an integer >= 0"),
        ({"bytes": -10}, r"field bytes is int -10, expected an integer >= 0"),
        (_entry(size=-1), r"field files\['state/__0_0\.distcp'\]\.size is int -1, expected a size"),
        (
            _entry(sha256="0" * 63),
            r"field files\['state/__0_0\.distcp'\]\.sha256 is str '0{56}\.\.\., expected 64 "
            r"lowercase hex",
        ),
        (
            _entry(sha256="A" * 64),
            r"field files\['state/__0_0\.distcp'\]\.sha256 is str 'A{56}\.\.\., expected 64 "
            r"lowercase hex",
        ),
        ({"contents": "weights"}, r"field contents is str 'weights', expected 'full' or"),
    ],
)
def test_a_manifest_field_out_of_its_range_is_refused_by_name(tmp_path, fields, said):
    path = tmp_path / "manifest.json"
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: ") + said):
        check_manifest(_manifest(**fields), path)


def test_each_ranges_edge_is_taken(tmp_path):
    path = tmp_path / "manifest.json"
    edge = _manifest(step=0, world_size=1, skipped_steps=0, bytes=0, **_entry(size=0))
    assert check_manifest(edge, path) is edge
    assert check_manifest(_manifest(contents="adapters"), path)["contents"] == "adapters"
    # The optional counters may be absent (checkpoints written before them).
    older = {k: v for k, v in _manifest().items() if k not in ("skipped_steps", "bytes")}
    assert check_manifest(older, path) is older


def test_a_dtype_in_metadata_is_read_as_the_dtype():
    # What the allow-list's torch branch exists for: pickled dtypes come back as themselves.
    from shardwise.checkpoint.trust import _AllowListUnpickler

    data = pickle.dumps([torch.float32, torch.Size([2, 3])], protocol=2)
    assert _AllowListUnpickler(io.BytesIO(data)).load() == [torch.float32, torch.Size([2, 3])]
