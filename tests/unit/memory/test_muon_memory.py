"""The memory plan counts Muon (issue 52): one state per matrix element where AdamW keeps two,
the fallback's states for the rest, and the step's whole-matrix temporaries on the owner.

The one-process figures are held to a real step measured by torch's MemTracker (exact); the
sharded ones to sizes where the plausible wrong formulas (two buffers, every matrix
assembled on every rank, shards without padding) give other numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import shardwise
from shardwise import ParallelConfig, plan_wrap
from shardwise.memory.model_states import estimate_memory, format_memory
from shardwise.memory.muon_states import MuonShares, muon_shares, muon_step_bytes


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(40, 24)
        self.up = nn.Linear(24, 70)  # 70 rows: uneven over 4 ranks
        self.down = nn.Linear(70, 24)
        self.lm_head = nn.Linear(24, 40, bias=False)


def _estimate(model: nn.Module, world: int, strategy: str, optimizer: str = "muon", **kw):
    plan = plan_wrap(model, ParallelConfig())
    shares = muon_shares(model, **kw) if optimizer == "muon" else None
    (row,) = estimate_memory(plan, world, optimizer=optimizer, strategies=(strategy,), muon=shares)
    return row


def test_muon_keeps_one_state_per_matrix_element_and_the_fallback_two_for_the_rest():
    model = TinyLM()
    matrices = 70 * 24 + 24 * 70  # up and down; the embedding and head go to the fallback
    rest = sum(p.numel() for p in model.parameters()) - matrices
    muon = _estimate(model, 4, "full_shard")
    assert muon.optimizer == -(-(4 * matrices + 8 * rest) // 4)
    adamw = _estimate(model, 4, "full_shard", optimizer="adamw")
    assert adamw.optimizer - muon.optimizer == 4 * matrices // 4  # the second buffer
    sgd_fallback = _estimate(model, 4, "full_shard", fallback_states=1)
    assert sgd_fallback.optimizer == -(-(4 * matrices + 4 * rest) // 4)


def test_the_one_process_state_is_what_shardwise_muon_holds_after_a_step():
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = shardwise.Muon(model.named_parameters(), lr=0.02)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    held = sum(
        t.nbytes for s in optimizer.state.values() for k, t in s.items() if k != "step"
    )  # AdamW's step counters are scalars, not per-element state
    assert _estimate(model, 1, "ddp").optimizer == held


SHAPES = [
    ("a.weight", (96, 40)),
    ("b.weight", (40, 96)),
    ("c.weight", (33, 17)),
    ("experts.gate_up_proj", (4, 24, 16)),  # each expert on its own, then stacked
]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_the_one_process_step_temporaries_are_what_a_real_step_allocates(ns_dtype, nesterov):
    torch.manual_seed(0)
    named = [(n, nn.Parameter(torch.randn(*s))) for n, s in SHAPES]
    optimizer = shardwise.Muon(
        named, lr=0.02, ns_dtype=ns_dtype, nesterov=nesterov, fallback_names=()
    )
    for _ in range(2):  # the second step: the momentum exists, as in every later step
        for _, p in named:
            p.grad = torch.randn_like(p)
        if _ == 0:
            optimizer.step()
    tracker = MemTracker()
    tracker.track_external(*(p for _, p in named), optimizer)
    with tracker:
        optimizer.step()
        # after the step: what stays (parameters, gradients, momentum); the tracker counts
        # gradients set before it started only once the optimizer reads them
        after = sum(v["Total"] for v in tracker.get_tracker_snapshot().values())
    peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    shares = MuonShares(tuple(s for _, s in SHAPES), ns_bytes=ns_dtype.itemsize, nesterov=nesterov)
    assert muon_step_bytes(shares, 1, 1, ddp=False) == peak - after  # measured: equal, all 4


def test_sharded_step_temporaries_count_the_busiest_owner_and_padded_pieces():
    # Four 70x32 matrices at full_shard over 4 ranks: each rank owns one. A piece is
    # ceil(70/4) = 18 rows (576 elements), not 70*32/4 = 560.
    shares = MuonShares(((70, 32),) * 4, ns_bytes=2)
    pad = 18 * 32
    every_rank = 4 * 4 * pad + 4 * 4 * pad  # Nesterov update + kept result, every matrix
    message = 4 * pad  # the owner's one matrix, padded
    owner = message + 2 * 4 * message  # sent, gathered (4 pieces), scattered (4 parts)
    newton_schulz = 2 * max(2 * 70 * 32 + 2 * 32 * 32, 70 * 32 + 3 * 32 * 32)  # bf16
    whole = (4 + 4) * 70 * 32 + newton_schulz  # assembled fp32, NS, result back in fp32
    assert muon_step_bytes(shares, 4, 4, ddp=False) == every_rank + owner + whole
    # world 2: 35-row pieces, and each rank owns two matrices, whose pieces travel together
    pad = 35 * 32
    message = 2 * 4 * pad
    expected = 2 * 4 * 4 * pad + message + 2 * 2 * message + whole
    assert muon_step_bytes(shares, 2, 2, ddp=False) == expected


def test_plan_rows_carry_the_step_temporaries_and_refuse_muon_without_its_split():
    model = TinyLM()
    row = _estimate(model, 4, "full_shard")
    assert row.step_temporaries == muon_step_bytes(muon_shares(model), 4, 4, ddp=False)
    assert "Muon's step temporaries on its busiest owner" in format_memory([row])
    assert _estimate(model, 4, "full_shard", optimizer="adamw").step_temporaries is None
    plan = plan_wrap(model, ParallelConfig())
    with pytest.raises(ValueError, match=r"optimizer='muon'\) needs muon=muon_shares\(model\)"):
        estimate_memory(plan, 4, optimizer="muon")


def test_shardwise_plan_reads_muon_from_the_run_file_and_refuses_what_it_does_not_count(
    tmp_path, capsys
):
    from shardwise.cli.main import main

    config = tmp_path / "muon.yaml"
    config.write_text("optimizer: {name: muon, lr: 0.02, ns_dtype: float32}\n")
    target = "shardwise.testing.models:GPT"
    assert main(["plan", target, "--world", "4", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "optimizer muon" in out and "Muon's step temporaries on its busiest owner" in out
    assert main(["plan", target, "--world", "4", "--tp", "2", "--config", str(config)]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "optimizer.name='muon' with tp=2 is not planned yet" in line
