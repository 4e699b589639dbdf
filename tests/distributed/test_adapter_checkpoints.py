"""Adapter checkpoints and exports of peft models under FSDP2, across world sizes.

Two transformers families get LoRA (r=4 on q/v/down, `init_lora_weights=False` so that
both halves of every adapter move): llama with `modules_to_save=["lm_head"]` (a trained
copy of the head beside the adapters), and qwen2 with tied embeddings and attention biases.
Each trains 2 AdamW steps at world 2 (full_shard), every rank on its half of each global
batch, then saves an adapters-only checkpoint (`adapters_only=True`), a full checkpoint,
and a negative control, exports the adapter in peft's format and the merged weights, and
takes a third step: the uninterrupted run.

A fresh model with other adapters loads the adapters-only checkpoint at world 1 (this
process) and at world 4 (hybrid_shard 2 x 2, full_shard over 4, and for qwen2 dp 2 x tp 2,
where the adapters are split with their base layers): every adapter element
and every AdamW state tensor equal the saved ones (torch.equal), the frozen base is
bit-identical to where training started, and the next step's loss and adapters equal the
uninterrupted run's (1e-5 relative). The full checkpoint loads every tensor exactly there
too, into a model with another base. The negative control keeps only rank 0's shard of
each adapter (what accelerate's adapter_only save from rank 0 kept, accelerate PR #4206)
and fails the same comparison; a save that only rank 0 writes is refused. The peft export
opens with `PeftModel.from_pretrained` and the merged one with
`AutoModelForCausalLM.from_pretrained`, both with the trained model's logits (1e-5).
Worlds 2 and 4 run in one spawned group each (`make test-adapters`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

import shardwise
import shardwise.checkpoint.save as save_module
from shardwise.checkpoint import (
    CheckpointError,
    export_weights,
    load_checkpoint,
    read_dcp_metadata,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
)
from shardwise.checkpoint.adapters import peft_key
from shardwise.testing import run_distributed
from shardwise.testing.parity import split_batch

pytestmark = pytest.mark.adapters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, BATCH, SEQ = 32, 8, 6
RTOL = 1e-5
DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ["lm_head"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}, None),
}
LAYOUTS = {
    "one process": None,
    "hybrid_shard x4": {"strategy": "hybrid_shard"},  # replicate 2 x shard 2
    "full_shard x4": {"strategy": "full_shard"},
    "dp 2 x tp 2": {"strategy": "full_shard", "tp": 2},  # the adapters split with their bases
}
# tp wraps a modules_to_save copy of lm_head in peft's wrapper, which ColwiseParallel
# refuses (not an nn.Linear): llama with modules_to_save is loaded without tp.
CASES = [
    (f, layout) for f in FAMILIES for layout in LAYOUTS if (f, layout) != ("llama", "dp 2 x tp 2")
]
PROBE = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
WHOLE = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)


def base_model(family: str, seed: int = 0) -> nn.Module:
    config_cls, model_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**DECODER, **extra})
    return getattr(transformers, model_cls)(config)


def build(family: str, adapter_seed: int, base_seed: int = 0) -> nn.Module:
    base = base_model(family, base_seed)
    torch.manual_seed(adapter_seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False, modules_to_save=FAMILIES[family][3],
    )  # fmt: skip
    return peft.get_peft_model(base, config)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(3)]


def wrapped(model: nn.Module, layout: dict[str, Any] | None) -> nn.Module:
    return model if layout is None else shardwise.wrap(model, shardwise.ParallelConfig(**layout))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One step on this rank's part of the global batch; the loss of the whole batch."""
    info = shardwise.wrap_info(model)
    rank, world = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    mine = split_batch((ids,), rank, world)[0]  # a tp group shares its part
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    optimizer.step()
    loss = loss.detach()
    return shardwise.mean_across_ranks(loss) if dist.is_initialized() else float(loss)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Adapters, AdamW state and frozen base, whole and on CPU (a collective: every rank)."""
    named = list(shardwise.unwrap(model).named_parameters())
    _, optim = get_state_dict(model, optimizer, options=WHOLE)
    return {
        "adapters": {n: _whole(p) for n, p in named if p.requires_grad},
        "frozen": {n: _whole(p) for n, p in named if not p.requires_grad},
        "optim": {f"{n}/{k}": _whole(v) for n, s in optim["state"].items() for k, v in s.items()},
    }


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, int]:
    """Elements that differ, by tensor (an absent or reshaped tensor counts whole)."""
    out = {}
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            out[name] = w.numel()
        elif not torch.equal(g, w):
            out[name] = int((g != w).sum())
    return out


# --- the negative controls: saves that keep only rank 0's part -----------------------------

_STATE_DICTS = save_module._state_dicts


def _zeros_off_rank0(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _zeros_off_rank0(v) for k, v in tree.items()}
    if isinstance(tree, DTensor) and dist.get_rank() != 0:
        zeros = torch.zeros_like(tree.to_local())
        return DTensor.from_local(
            zeros, tree.device_mesh, tree.placements, shape=tree.shape, stride=tree.stride()
        )
    return tree


def rank0_shard_only(model: nn.Module, optimizer: Any, contents: str) -> tuple[dict, dict]:
    """The state a save from rank 0's slice holds: rank 0's shard of every adapter and of its
    AdamW state, nothing (zeros) of the other ranks'."""
    model_sd, optim_sd = _STATE_DICTS(model, optimizer, contents)
    return _zeros_off_rank0(model_sd), {**optim_sd, "state": _zeros_off_rank0(optim_sd["state"])}


def rank0_writes_alone(model: nn.Module, optimizer: Any, contents: str) -> tuple[dict, dict]:
    model_sd, optim_sd = _STATE_DICTS(model, optimizer, contents)
    if dist.get_rank() == 0:
        return model_sd, optim_sd
    return {}, {"state": {}, "param_groups": optim_sd["param_groups"]}


# --- the runs ----------------------------------------------------------------------------------


def world2(root: str) -> dict[str, Any]:
    """Train 2 steps at world 2, save (three ways), export (two ways), take the next step."""
    out: dict[str, Any] = {}
    for family in FAMILIES:
        model = wrapped(build(family, adapter_seed=1), {"strategy": "full_shard"})
        optimizer = adamw(model)
        start = snapshot(model, optimizer)["frozen"]
        data = batches()
        for ids in data[:2]:
            step(model, optimizer, ids)
        d = f"{root}/{family}"
        save_checkpoint(f"{d}/adapters", model, optimizer, step=2, adapters_only=True)
        save_checkpoint(f"{d}/full", model, optimizer, step=2)
        with mock.patch.object(save_module, "_state_dicts", rank0_shard_only):
            save_checkpoint(f"{d}/rank0", model, optimizer, step=2, adapters_only=True)
        refused = None
        with mock.patch.object(save_module, "_state_dicts", rank0_writes_alone):
            try:
                save_checkpoint(f"{d}/alone", model, optimizer, step=2, adapters_only=True)
            except CheckpointError as exc:
                refused = str(exc)
        saved = snapshot(model, optimizer)
        full_state = {n: _whole(t) for n, t in shardwise.unwrap(model).state_dict().items()}
        export_weights(model, f"{d}/peft")  # kind="auto": an adapter model's own format
        export_weights(model, f"{d}/merged", kind="merged")
        with torch.no_grad():
            logits = _whole(model(input_ids=PROBE).logits)
        next_loss = step(model, optimizer, data[2])
        out[family] = {
            "start": start,
            "saved": saved,
            "full_state": full_state,
            "logits": logits,
            "refused": refused,
            "next_loss": next_loss,
            "next_adapters": snapshot(model, optimizer)["adapters"],
        }
    return out


def load_and_step(root: str, family: str, layout: dict[str, Any] | None) -> dict[str, Any]:
    """Into a fresh model with other adapters: load, read back, take the next step; and the
    full checkpoint into a model with another base too."""
    model = wrapped(build(family, adapter_seed=99), layout)
    optimizer = adamw(model)
    manifest = load_checkpoint(f"{root}/{family}/adapters", model, optimizer)
    loaded = snapshot(model, optimizer)
    next_loss = step(model, optimizer, batches()[2])
    other = wrapped(build(family, adapter_seed=99, base_seed=5), layout)
    load_checkpoint(f"{root}/{family}/full", other, adamw(other))
    full_state = {n: _whole(t) for n, t in shardwise.unwrap(other).state_dict().items()}
    return {
        "step": manifest["step"],
        "loaded": loaded,
        "next_loss": next_loss,
        "next_adapters": snapshot(model, optimizer)["adapters"],
        "full_state": full_state,
    }


def world4(root: str) -> dict[tuple[str, str], Any]:
    return {
        (family, name): load_and_step(root, family, LAYOUTS[name])
        for family, name in CASES
        if LAYOUTS[name] is not None
    }


def load_rank0_control(root: str, family: str) -> dict[str, Any]:
    model = build(family, adapter_seed=99)
    optimizer = adamw(model)
    load_checkpoint(f"{root}/{family}/rank0", model, optimizer)
    return snapshot(model, optimizer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapter_checkpoints")
    trained = run_distributed(world2, 2, args=(str(root),), timeout_s=600)[0]
    loads = run_distributed(world4, 4, args=(str(root),), timeout_s=600)[0]
    for family in FAMILIES:
        loads[(family, "one process")] = load_and_step(str(root), family, None)
    control = {family: load_rank0_control(str(root), family) for family in FAMILIES}
    return {"root": root, "trained": trained, "loads": loads, "control": control}


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_checkpoint_holds_the_adapters_and_their_state_alone(runs, family):
    path = Path(runs["root"]) / family / "adapters"
    manifest = read_manifest(path)
    assert (manifest["contents"], manifest["world_size"]) == ("adapters", 2)
    adapters = runs["trained"][family]["saved"]["adapters"]
    assert manifest["adapters"]["trainable"] == list(adapters)
    keys = read_dcp_metadata(resolve_checkpoint(path) / "state").state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == set(adapters)  # nothing of the frozen base
    optim = {k.removeprefix("optim.") for k in keys if k.startswith("optim.")}
    assert optim == {f"{n}.{s}" for n in adapters for s in ("step", "exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_every_adapter_element_loads_exactly_and_the_base_stays(runs, family, layout):
    trained, got = runs["trained"][family], runs["loads"][(family, layout)]
    assert got["step"] == 2
    assert mismatches(got["loaded"]["adapters"], trained["saved"]["adapters"]) == {}
    assert mismatches(got["loaded"]["optim"], trained["saved"]["optim"]) == {}
    assert len(got["loaded"]["optim"]) == 3 * len(trained["saved"]["adapters"])
    assert mismatches(got["loaded"]["frozen"], trained["start"]) == {}  # bit-identical


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_the_next_step_equals_the_uninterrupted_run(runs, family, layout):
    trained, got = runs["trained"][family], runs["loads"][(family, layout)]
    want = trained["next_loss"]
    # measured: the loss at most 2.1e-7 apart, each adapter at most 2.8e-8 (a world's own
    # reduction order; the loaded state itself is exact)
    assert abs(got["next_loss"] - want) <= RTOL * abs(want), (got["next_loss"], want)
    for name, w in trained["next_adapters"].items():
        rel = float((got["next_adapters"][name] - w).norm() / w.norm())
        assert rel <= RTOL, f"{name}: {rel:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_save_of_rank_0s_shard_alone_fails_the_same_comparison(runs, family):
    saved = runs["trained"][family]["saved"]
    control = runs["control"][family]
    lost = mismatches(control["adapters"], saved["adapters"])
    # Every adapter loses rank 1's half. Measured: 13 of 13 tensors, 672 of 1344 elements
    # (llama), 12 of 12 and 416 of 832 (qwen2); the AdamW moments likewise.
    assert len(lost) == len(saved["adapters"]), sorted(set(saved["adapters"]) - set(lost))
    total = sum(t.numel() for t in saved["adapters"].values())
    assert 0.4 * total <= sum(lost.values()) <= 0.6 * total, (sum(lost.values()), total)
    assert mismatches(control["optim"], saved["optim"]) != {}
    # Saved by rank 0 alone (the other ranks write nothing), DCP refuses the plan: the
    # shards do not fill the tensors. Nothing becomes visible.
    refused = runs["trained"][family]["refused"]
    assert refused is not None and "could not write checkpoint step_00000002" in refused
    assert "invalid fill" in refused
    assert not (Path(runs["root"]) / family / "alone" / "step_00000002").exists()


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_a_full_checkpoint_of_a_peft_model_loads_exactly(runs, family, layout):
    want = runs["trained"][family]["full_state"]
    got = runs["loads"][(family, layout)]["full_state"]
    assert mismatches(got, want) == {}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_peft_export_opens_in_peft_with_the_trained_logits(runs, family):
    directory = Path(runs["root"]) / family / "peft"
    trained = runs["trained"][family]
    written = load_file(directory / "adapter_model.safetensors")
    # Under peft's own names, and every element of every adapter, gathered from both ranks.
    want = {peft_key(n, "default"): t for n, t in trained["saved"]["adapters"].items()}
    assert set(written) == set(peft.get_peft_model_state_dict(build(family, 0)))
    assert mismatches(written, want) == {}
    opened = peft.PeftModel.from_pretrained(base_model(family), directory).eval()
    with torch.no_grad():
        logits = opened(input_ids=PROBE).logits
    rel = float((logits - trained["logits"]).norm() / trained["logits"].norm())
    assert rel <= 1e-5, rel  # measured: 0 (the same tensors, the same arithmetic)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_merged_export_opens_in_transformers_with_the_trained_logits(runs, family):
    directory = Path(runs["root"]) / family / "merged"
    trained = runs["trained"][family]
    opened = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(opened).__name__ == FAMILIES[family][1]
    with torch.no_grad():
        logits = opened(input_ids=PROBE).logits
    rel = float((logits - trained["logits"]).norm() / trained["logits"].norm())
    assert rel <= 1e-5, rel  # measured: at most 2.0e-7 (x(W + sBA) rounds unlike xW + s(xA)B)
