"""torch.compile of planned blocks (inductor, world size 1): same numbers as eager.

Multi-process parity with compiled blocks runs in tests/distributed/test_parity.py with the
aot_eager backend (same ops, no code generation), which keeps that suite fast.
"""

from __future__ import annotations

import pytest
import torch

from shardwise import ParallelConfig, shutdown, wrap
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

CFG = GPTConfig()


@pytest.fixture(autouse=True)
def _no_group():
    shutdown()


@pytest.mark.heavy
def test_inductor_compiled_blocks_match_eager():
    batch = random_lm_batches(CFG, 1, 4)[0]
    torch.manual_seed(0)
    eager = GPT(CFG)
    eager_loss = eager(*batch)
    eager_loss.backward()
    torch.manual_seed(0)
    model = wrap(GPT(CFG), ParallelConfig(compile=True))
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert "blocks.0.attn.qkv.weight" in dict(model.named_parameters())  # names unchanged
    loss = model(*batch)
    loss.backward()
    assert abs(float(loss.detach()) - float(eager_loss.detach())) <= 1e-5 * abs(
        float(eager_loss.detach())
    )
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        rel = float((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-12))
        assert rel <= 1e-5, (name, rel)  # measured: at most 5.4e-7 (inductor, CPU)


def test_compile_config_errors():
    with pytest.raises(
        ValueError,
        match=r"ParallelConfig\.compile=3 is not valid\. Use False, True \(inductor\) or a torch\.compile backend name",
    ):
        ParallelConfig(compile=3)
