"""ShardwiseStrategy under lightning.Trainer at devices=2 on CPU, against Lightning's DDP.

One launch of `_lt_worker.py` (Lightning's launcher starts rank 1) runs every scenario in
one process group; a second, one-process launch resumes its checkpoint at world size 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integrations
pytest.importorskip("lightning")

import torch  # noqa: E402
from _host_runs import (  # noqa: E402
    TOL,
    assert_precision_same,
    assert_same,
    launch,
    params,
    rel_losses,
    rel_params,
)

WORKER = Path(__file__).with_name("_lt_worker.py")
PHASES = ("main", "world1", "tp")


def _launch(out: Path, phase: str) -> dict[str, Any]:
    return launch(WORKER, out, phase, timeout_s=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("lightning")
    results = _launch(out, "main")
    results.update(_launch(out, "world1"))
    results.update(_launch(out, "tp"))
    return out, results


def _params(out: Path, name: str) -> dict[str, torch.Tensor]:
    return params(out, name, PHASES)


def _assert_same(runs: tuple[Path, dict[str, Any]], name: str, ref: str, skip: int = 0) -> None:
    assert_same(runs, name, ref, PHASES, skip)


@pytest.mark.parametrize("name", ["full_shard", "shardwise_ddp", "fairscale_words"])
def test_fit_matches_lightning_ddp(runs: tuple[Path, dict[str, Any]], name: str) -> None:
    _assert_same(runs, name, "lightning_ddp")
    assert runs[1][name]["sharded"] == (name != "shardwise_ddp")
    assert len(runs[1][name]["losses"]) == 8


@pytest.mark.parametrize("precision", ["bf16_mixed", "bf16_true", "16_true"])
def test_precision_plugins_match_lightning_ddp(
    runs: tuple[Path, dict[str, Any]], precision: str
) -> None:
    """Trainer(precision=...) autocasts the step (bf16-mixed) or converts the module before
    the strategy shards it (bf16-true, 16-true), as under Lightning's DDP (measured: bit for
    bit)."""
    assert_precision_same(runs, precision, "lightning_ddp", PHASES)


def test_step_calling_self_matches_lightning_ddp(runs: tuple[Path, dict[str, Any]]) -> None:
    _assert_same(runs, "forward_full_shard", "forward_lightning_ddp")


def test_step_calling_self_gathers_as_often_as_a_plain_step(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    # training_step runs inside the root's forward and calls self(x) inside it: the root
    # must not be all-gathered a second time in backward (it was, before the redirection
    # suspended the nested post-forward hook).
    r = runs[1]["forward_full_shard"]
    assert r["gathers_plain_step"] > 0
    assert r["gathers"] == r["steps"] * r["gathers_plain_step"]


def test_negative_control_other_seed_differs(runs: tuple[Path, dict[str, Any]]) -> None:
    out, r = runs
    assert rel_losses(r["other_seed"]["losses"], r["lightning_ddp"]["losses"]) > 100 * TOL
    assert rel_params(_params(out, "other_seed"), _params(out, "lightning_ddp")) > 100 * TOL


def test_resume_from_last_checkpoint_is_exact(runs: tuple[Path, dict[str, Any]]) -> None:
    out, _ = runs
    assert (out / "ckpt" / "last.ckpt" / "meta.pt").is_file()  # a DCP directory
    _assert_same(runs, "resumed_last", "full_shard", skip=4)


def test_resume_under_another_strategy_is_exact(runs: tuple[Path, dict[str, Any]]) -> None:
    _assert_same(runs, "resumed_as_ddp", "full_shard", skip=4)


def test_resume_at_world_size_one_is_exact(runs: tuple[Path, dict[str, Any]]) -> None:
    # Saved by two FSDP2 ranks, resharded into one process taking the same global batch.
    _assert_same(runs, "resumed_world1", "full_shard", skip=4)


def test_clipping_uses_the_global_norm(runs: tuple[Path, dict[str, Any]]) -> None:
    _, r = runs
    assert min(r["clip_reference"]["norms"]) > 0.05  # clipping acts at every step
    _assert_same(runs, "clip_full_shard", "clip_reference")
    _assert_same(runs, "clip_full_shard", "clip_lightning_ddp")


def test_a_peft_model_trains_equal_to_lightning_ddp(runs: tuple[Path, dict[str, Any]]) -> None:
    out, r = runs
    ours, ref = _params(out, "peft_full_shard"), _params(out, "peft_lightning_ddp")
    print(
        "peft: losses", rel_losses(r["peft_full_shard"]["losses"], r["peft_lightning_ddp"]["losses"]),
        "parameters", rel_params(ours, ref),
    )  # fmt: skip
    _assert_same(runs, "peft_full_shard", "peft_lightning_ddp")  # measured: 1.9e-7, 6.4e-8
    assert r["peft_full_shard"]["sharded"] and len(r["peft_full_shard"]["losses"]) == 8
    start = _params(out, "peft_start")
    adapters = [k for k in start if ".lora_" in k]
    assert len(adapters) == 4 and all(not torch.equal(ours[k], start[k]) for k in adapters)
    assert all(torch.equal(ours[k], start[k]) for k in start if k not in adapters)  # the base


@pytest.mark.parametrize("name", ["llama_tp", "llama_tp_sp"])
def test_tensor_parallel_matches_lightning_ddp(
    runs: tuple[Path, dict[str, Any]], name: str
) -> None:
    # A transformers Llama inside the LightningModule at dp 2 x tp 2 (world 4), its own plan
    # found under `model.`, against Lightning's DDP at world 2 over the same rows a step.
    _, r = runs
    print(name, "losses", rel_losses(r[name]["losses"], r["llama_lightning_ddp"]["losses"]))
    _assert_same(runs, name, "llama_lightning_ddp")  # measured: 1.1e-7
    assert r[name]["sampler"] == {"num_replicas": 2, "rank": 0}  # Lightning's sampler's split
    # q_proj's 32 rows over tp 2, then over dp_shard 2: the split is real.
    assert r[name]["local_rows"] == 8 and len(r[name]["placements"]) == 2


def test_configure_model_builds_on_meta(runs: tuple[Path, dict[str, Any]]) -> None:
    out, r = runs
    assert r["meta"]["built_on_meta"] is True and r["meta"]["sharded"]
    losses = r["meta"]["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert all(bool(t.isfinite().all()) for t in _params(out, "meta").values())


def test_optimizer_built_before_wrap_is_refused(runs: tuple[Path, dict[str, Any]]) -> None:
    message = runs[1]["early_optimizer"]
    assert "built before the strategy wrapped the model" in message
    assert "configure_optimizers" in message


def test_import_shardwise_does_not_import_lightning() -> None:
    code = "import sys, shardwise; assert 'lightning' not in sys.modules, 'lightning imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_strategy_takes_parallel_config_words() -> None:
    from shardwise import ParallelConfig
    from shardwise.integrations.lightning import ShardwiseStrategy

    assert ShardwiseStrategy(strategy="ddp_fully_sharded").config.strategy == "full_shard"
    with pytest.raises(ValueError, match="flatten_parameters"):
        ShardwiseStrategy(strategy="full_shard", flatten_parameters=True)
    with pytest.raises(TypeError, match="not both"):
        ShardwiseStrategy(ParallelConfig(), strategy="ddp")
