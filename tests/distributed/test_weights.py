"""Consolidated safetensors: export from sharded models and checkpoints, load into wrapped
models, names without wrapper prefixes, and a Hugging Face model loading our export."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardwise import Engine, ParallelConfig, shutdown, unwrap, wrap
from shardwise.checkpoint import save_checkpoint
from shardwise.models import GPT, GPTConfig, random_lm_batches
from shardwise.parity import full_parameters, split_batch
from shardwise.testing import run_distributed
from shardwise.weights import INDEX_FILE, WeightsError, export_weights, load_weights

CFG = GPTConfig()
DATA = random_lm_batches(CFG, 2, 8, seed=1)


def trained_engine(strategy: str = "full_shard") -> Engine:
    torch.manual_seed(0)
    engine = Engine(
        GPT(CFG), lambda p: torch.optim.AdamW(p, lr=1e-3), ParallelConfig(strategy=strategy)
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    for batch in DATA:
        engine.train_step(split_batch(batch, rank, world))
    return engine


@pytest.fixture(autouse=True)
def _no_group():
    shutdown()


# --- single process ---------------------------------------------------------------------------


def test_export_names_equal_state_dict_keys_and_round_trip(tmp_path):
    engine = trained_engine()
    path = export_weights(engine.model, tmp_path / "w")
    assert path.name == "model.safetensors"
    tensors = load_file(str(path))
    sd = engine.model.state_dict()
    assert sorted(tensors) == sorted(sd)  # both tied keys present, no prefixes
    assert torch.equal(tensors["tok_emb.weight"], tensors["head.weight"])
    fresh = GPT(CFG)
    assert load_weights(fresh, tmp_path / "w") == {"missing": [], "unexpected": []}
    for name, value in sd.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_broadcast_from_rank0_without_a_group_reads_the_file(tmp_path):
    torch.manual_seed(3)
    export_weights(GPT(CFG), tmp_path / "w")
    fresh = GPT(CFG)
    load_weights(fresh, tmp_path / "w", broadcast_from_rank0=True)
    assert torch.equal(
        fresh.head.weight, load_file(str(tmp_path / "w" / "model.safetensors"))["head.weight"]
    )


def test_sharded_export_with_index_and_dtype_cast(tmp_path):
    model = trained_engine().model
    export_weights(model, tmp_path / "w", max_shard_bytes=20_000, dtype="bf16")
    index = json.loads((tmp_path / "w" / INDEX_FILE).read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    assert set(index["weight_map"]) == set(model.state_dict())
    assert (
        load_file(str(tmp_path / "w" / files[0]))[
            next(iter(load_file(str(tmp_path / "w" / files[0]))))
        ].dtype
        == torch.bfloat16
    )
    fresh = GPT(CFG)
    load_weights(fresh, tmp_path / "w" / INDEX_FILE)
    torch.testing.assert_close(fresh.ln_f.weight, model.ln_f.weight.to(torch.bfloat16).float())


def test_export_from_checkpoint_equals_export_from_model(tmp_path):
    engine = trained_engine()
    save_checkpoint(tmp_path / "ck", engine)
    a = load_file(str(export_weights(engine.model, tmp_path / "from_model")))
    b = load_file(str(export_weights(tmp_path / "ck", tmp_path / "from_ckpt")))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_weights_errors_list_names_and_shapes(tmp_path):
    export_weights(GPT(CFG), tmp_path / "w")
    with pytest.raises(
        WeightsError,
        match=r"do not match GPT\. Missing: \['blocks\.2\.attn\.proj\.bias'.*Shape mismatches: \['blocks\.0\.attn\.proj\.bias: file \(32,\) vs model \(48,\)'",
    ):
        load_weights(GPT(GPTConfig(d_model=48, n_layers=3)), tmp_path / "w")
    with pytest.raises(
        WeightsError, match=r"holds neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        load_weights(GPT(CFG), tmp_path)
    with pytest.raises(WeightsError, match=r"must be a directory, not a file"):
        export_weights(GPT(CFG), tmp_path / "w" / "model.safetensors")


# --- distributed ------------------------------------------------------------------------------


def export_and_load(out: str) -> dict:
    result = {}
    for strategy in ("ddp", "full_shard", "hybrid_shard"):
        if strategy == "hybrid_shard" and dist.get_world_size() != 4:
            continue
        engine = trained_engine(strategy)
        path = export_weights(engine.model, f"{out}/{strategy}")
        result[f"export_{strategy}"] = str(path) if path else None
        result[f"params_{strategy}"] = full_parameters(engine.model)
        fresh = wrap(GPT(GPTConfig()), ParallelConfig(strategy=strategy))  # a different init
        load_weights(fresh, f"{out}/ddp")
        result[f"loaded_{strategy}"] = full_parameters(fresh)
        if strategy == "ddp":  # bf16, split over several files with an index
            export_weights(engine.model, f"{out}/bf16", max_shard_bytes=20_000, dtype="bf16")
        # Only rank 0 reads (the others get a path that does not exist); cast up to fp32.
        fresh = wrap(GPT(GPTConfig()), ParallelConfig(strategy=strategy))
        only_rank0 = f"{out}/bf16" if dist.get_rank() == 0 else "/nonexistent"
        load_weights(fresh, only_rank0, broadcast_from_rank0=True)
        result[f"loaded_bf16_rank0_{strategy}"] = full_parameters(fresh)
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_export_and_load_match_single_process(tmp_path, world):
    results = run_distributed(export_and_load, world, args=(str(tmp_path),), timeout_s=180)
    want = full_parameters(trained_engine().model)  # single-process training, same batches
    for strategy in ("ddp", "full_shard") + (("hybrid_shard",) if world == 4 else ()):
        assert (
            results[0][f"export_{strategy}"] and results[1][f"export_{strategy}"] is None
        )  # rank 0 writes
        exported = load_file(f"{tmp_path}/{strategy}/model.safetensors")
        assert "module.tok_emb.weight" not in exported and "tok_emb.weight" in exported
        for name, value in want.items():
            # Exactly the model's own (gathered) parameters...
            mine = results[0][f"params_{strategy}"][name]
            assert torch.equal(exported[name], mine), (strategy, name)
            # ...which match single-process training (the parity bar).
            assert float((exported[name] - value).norm() / value.norm()) <= 1e-5, (strategy, name)
        bf16 = {}
        for file in sorted((tmp_path / "bf16").glob("*.safetensors")):
            bf16.update(load_file(str(file)))
        assert len(list((tmp_path / "bf16").glob("*.safetensors"))) > 1
        for rank_result in results:
            for name, value in rank_result[f"loaded_bf16_rank0_{strategy}"].items():
                assert value.dtype == torch.float32
                assert torch.equal(value, bf16[name].float()), (strategy, name)
            for name, value in rank_result[f"loaded_{strategy}"].items():
                assert (
                    torch.equal(value, exported[name])
                    or float((value - exported[name]).norm()) <= 1e-6
                )


# --- a model library loads our export ----------------------------------------------------------


def hf_train_and_export(out: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    engine = Engine(
        GPT2LMHeadModel(config), lambda p: torch.optim.AdamW(p, lr=1e-2), ParallelConfig()
    )
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.train_step({"input_ids": ids, "labels": ids})  # zero configuration: .loss is used
    export_weights(engine.model, out)
    if dist.get_rank() == 0:
        unwrap(engine.model).config.save_pretrained(out)
    probe = torch.arange(16).unsqueeze(0)
    logits = engine.val_step({"input_ids": probe}).logits
    units = [u.fqn for u in engine.model._shardwise_wrap_info.plan.units]
    return {"logits": logits, "units": units}


def test_hugging_face_loads_our_export_with_its_own_loader(tmp_path):
    transformers = pytest.importorskip("transformers")
    results = run_distributed(hf_train_and_export, 2, args=(str(tmp_path),), timeout_s=180)
    assert results[0]["units"] == ["transformer.h.0", "transformer.h.1", ""]  # found GPT2Block
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    model.eval()
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
