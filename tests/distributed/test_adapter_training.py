"""The Runner on a model the run file's `adapter` section turns into a LoRA one.

One run file (below) drives every run: a GPT from shardwise.testing, SGD with momentum,
accumulation over 2 micro-batches, clipping at a norm every step exceeds, 6 optimizer steps
over an epoch boundary, checkpoints at steps 3 and 6. Its `adapter` section is what makes
the run LoRA: the Engine applies it with peft before wrapping. (Not AdamW: it divides each
gradient by its own running scale, and LoRA's first gradients of A are near zero, B
starting at 0, so fp32 summation-order differences reached the adapters at 4e-4, measured;
tests/distributed/test_adapters.py holds AdamW to 1e-4.)

At world 2 (one spawned group): the run under full_shard and under ddp, the same file with
`adapter=null` (a full fine-tune), a negative control with another data seed, and a
resume of the step-3 checkpoint into a model whose adapters were drawn from another seed.
In this process (world 1, the same global batch of 8): the reference run, and a resume of
the world-2 step-3 checkpoint. Compared:

- each logged loss and gradient norm, and the final adapters, against one process within
  1e-5 relative (measured: 1.1e-7 and 2.8e-7); the frozen base bit-identical to where it
  started;
- the checkpoints of the LoRA run hold the adapters only (RunnerConfig.save_adapters_only
  left at None), those of the full fine-tune everything;
- the resumed run equals the uninterrupted one from step 4 on: bit for bit at world 2 (the
  metrics as written), within 1e-5 at world 1.

Marker `adapters` (`make test-adapters`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise
from shardwise.checkpoint import read_dcp_metadata, read_manifest
from shardwise.config.run_file import Config, load_config
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import full_parameters, worst_of
from shardwise.train import read_metrics

pytestmark = pytest.mark.adapters
pytest.importorskip("peft")

RTOL = 1e-5
RUN_FILE = """\
parallel: {strategy: full_shard}
train: {accumulate_steps: 2, max_grad_norm: 0.05}
optimizer: {name: sgd, lr: 0.5, momentum: 0.9}
runner: {max_steps: 6, max_epochs: null, batch_size: 2, save_every: 3, seed: 5, progress: false}
adapter: {r: 4, alpha: 8, target_modules: [qkv, proj, fc]}
"""
STEPS_PER_EPOCH = 5  # 40 samples, 8 per optimizer step


def dataset() -> TensorDataset:
    return TensorDataset(*random_lm_batches(GPTConfig(), 1, 40, seed=1)[0])


def fit(root: str, name: str, overrides: list[str], adapter_seed: int = 0) -> dict[str, Any]:
    """The run file plus `overrides`, trained by the Runner into ROOT/NAME. The base is
    drawn from seed 0 (the same base in every run), the adapters from `adapter_seed`."""
    cfg: Config = load_config(
        Path(root) / "run.yaml", [f"runner.run_dir={root}/{name}", *overrides]
    )
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    torch.manual_seed(adapter_seed)
    engine = shardwise.Engine(
        base, cfg.optimizer.build, cfg.parallel, train=cfg.train, adapter=cfg.adapter
    )
    start = full_parameters(engine.model)
    runner = shardwise.Runner(engine, dataset(), config=cfg.runner)
    runner.fit()
    end = full_parameters(engine.model)
    trains = {n for n, p in shardwise.unwrap(engine.model).named_parameters() if p.requires_grad}
    return {
        "trained": {n: t for n, t in end.items() if n in trains},
        "frozen_start": {n: t for n, t in start.items() if n not in trains},
        "frozen_end": {n: t for n, t in end.items() if n not in trains},
        "adapters_only": runner.adapters_only,
        "classes": [c.__name__ for c in type(shardwise.unwrap(engine.model)).__mro__],
    }


def world2(root: str) -> dict[str, Any]:
    return {
        "lora": fit(root, "lora", []),
        "ddp": fit(root, "ddp", ["parallel.strategy=ddp"]),
        "full": fit(root, "full", ["adapter=null", "optimizer.lr=0.05"]),
        "other_seed": fit(root, "other_seed", ["runner.seed=6"]),
        "resumed": fit(
            root, "resumed", [f"runner.resume={root}/lora/checkpoints/step_00000003"], 99
        ),
    }


def world1(root: str, world2_root: str) -> dict[str, Any]:
    whole = "runner.batch_size=4"  # the global batch of two ranks of 2
    step3 = f"{world2_root}/lora/checkpoints/step_00000003"
    out = {"reference": fit(root, "reference", [whole])}
    with pytest.warns(UserWarning, match=r"runner.batch_size: checkpoint 2, now 4"):
        out["resumed_w1"] = fit(root, "resumed_w1", [whole, f"runner.resume={step3}"], 99)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    w2, w1 = tmp_path_factory.mktemp("w2"), tmp_path_factory.mktemp("w1")
    for root in (w1, w2):
        (root / "run.yaml").write_text(RUN_FILE)  # here: a rank writing it races the other's read
    ranks = run_distributed(world2, 2, args=(str(w2),), timeout_s=240)
    out = {"w2": w2, "w1": w1, "ranks": ranks, **ranks[0]}
    out.update(world1(str(w1), str(w2)))
    return out


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The logged training values (not the throughput) of each step."""
    keys = ("step", "epoch", "loss", "grad_norm", "lr")
    return [{k: r[k] for k in keys} for r in read_metrics(run_dir) if r["split"] == "train"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys() and want
    return worst_of(
        float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)) for k in want
    )


def rows_rel(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    return worst_of(
        rel(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in ("loss", "grad_norm")
    )


def path(runs: dict[str, Any], name: str) -> Path:
    return (runs["w1"] if name in ("reference", "resumed_w1") else runs["w2"]) / name


# --- the run file's section makes it LoRA -------------------------------------------------


def test_the_adapter_section_makes_a_lora_run_and_null_a_full_one(runs):
    lora, full = runs["lora"], runs["full"]
    assert "PeftModel" in lora["classes"] and "GPT" in full["classes"]
    assert "PeftModel" not in full["classes"]
    assert lora["trained"] and all(".lora_" in n for n in lora["trained"])
    assert not full["frozen_start"]  # every parameter trains
    # the base stays where it started in the LoRA run, bit for bit, and moves in the full one
    for name, start in lora["frozen_start"].items():
        assert torch.equal(lora["frozen_end"][name], start), name
    start = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): t
        for n, t in lora["frozen_start"].items()
    }  # the base's own names: the full fine-tune's
    assert start.keys() == full["trained"].keys()
    moved = [n for n, t in full["trained"].items() if not torch.equal(t, start[n])]
    assert moved == list(start)


@pytest.mark.parametrize("name", ["lora", "ddp"])
def test_lora_from_the_run_file_at_world2_equals_one_process(runs, name):
    ref = train_rows(path(runs, "reference"))
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
    assert {r["epoch"] for r in ref} == {0, 1}  # crosses an epoch boundary
    assert min(r["grad_norm"] for r in ref) > 0.05  # clipping acts at every step
    loss_rel = rows_rel(train_rows(path(runs, name)), ref)
    param_rel = max_rel(runs[name]["trained"], runs["reference"]["trained"])
    print(f"{name}: losses and norms {loss_rel:.1e}, adapters {param_rel:.1e}")
    assert loss_rel <= RTOL and param_rel <= RTOL  # measured: 1.1e-7, 2.8e-7
    for rank in runs["ranks"]:  # every rank ends with the same whole adapters
        assert max_rel(rank[name]["trained"], runs[name]["trained"]) == 0.0


def test_negative_control_another_data_seed_fails_the_comparison(runs):
    ref = train_rows(path(runs, "reference"))
    assert rows_rel(train_rows(path(runs, "other_seed")), ref) > 100 * RTOL
    assert max_rel(runs["other_seed"]["trained"], runs["reference"]["trained"]) > 100 * RTOL


# --- checkpoints: adapters only by default, and resumed -------------------------------------


def test_checkpoints_of_the_lora_run_hold_the_adapters_only(runs):
    assert runs["lora"]["adapters_only"] and not runs["full"]["adapters_only"]
    lora = read_manifest(path(runs, "lora") / "checkpoints" / "step_00000003")
    full = read_manifest(path(runs, "full") / "checkpoints" / "step_00000003")
    assert lora["contents"] == "adapters" and full["contents"] == "full"
    assert sorted(lora["adapters"]["trainable"]) == sorted(runs["lora"]["trained"])

    saved = read_dcp_metadata(path(runs, "lora") / "checkpoints" / "step_00000003" / "state")
    model_keys = {
        k.removeprefix("model.") for k in saved.state_dict_metadata if k.startswith("model.")
    }
    assert model_keys == set(runs["lora"]["trained"])  # no frozen tensor, every adapter


def test_an_adapters_only_checkpoint_resumes_exactly_at_world2(runs):
    # Metrics as written (bit for bit): the adapters (drawn from another seed here) and
    # their AdamW state came from the checkpoint, the base from the model built again.
    assert train_rows(path(runs, "resumed")) == train_rows(path(runs, "lora"))[3:]
    assert max_rel(runs["resumed"]["trained"], runs["lora"]["trained"]) == 0.0


def test_an_adapters_only_checkpoint_resumes_at_world1(runs):
    got = train_rows(path(runs, "resumed_w1"))
    assert rows_rel(got, train_rows(path(runs, "lora"))[3:]) <= RTOL
    assert max_rel(runs["resumed_w1"]["trained"], runs["lora"]["trained"]) <= RTOL
    for name, start in runs["resumed_w1"]["frozen_start"].items():
        assert torch.equal(runs["resumed_w1"]["frozen_end"][name], start), name
