"""Lines a run prints once, from rank 0, not once per rank (issue 50: "the script's
optimizer is used" printed by every rank)."""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch

import shardwise
from shardwise.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


@pytest.mark.parametrize(("rank", "warned"), [("0", True), ("1", False), (None, True)])
def test_the_scripts_optimizer_over_the_files_is_said_by_rank_0_only(
    tmp_path, monkeypatch, rank, warned
):  # type: ignore[no-untyped-def]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    monkeypatch.setenv("SHARDWISE_FROM", str(path))
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = shardwise.Engine(GPT(CFG), functools.partial(torch.optim.SGD, lr=0.1))
    assert isinstance(engine.optimizer, torch.optim.SGD)  # the script's, on every rank
    said = [w for w in caught if "the script's optimizer is used" in str(w.message)]
    assert len(said) == (1 if warned else 0)
