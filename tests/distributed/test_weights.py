"""Consolidated safetensors: export from sharded models and checkpoints, load into wrapped
models, names without wrapper prefixes, and a Hugging Face model loading our export."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from shardwise import Engine, ParallelConfig, shutdown, wrap
from shardwise.checkpoint import CheckpointError, read_dcp_metadata, save_checkpoint
from shardwise.checkpoint.export import export_weights
from shardwise.parallelize import INDEX_FILE, SINGLE_FILE, WeightsError, load_weights
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import full_parameters, split_batch

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


# --- a corrupted checkpoint is refused ---------------------------------------------------------


def _flip_a_bit_in(checkpoint: Path, tensor: torch.Tensor) -> tuple[Path, bytes]:
    """Flip one bit inside `tensor`'s bytes in the checkpoint's data file, so the export
    would silently differ; returns the file and its clean bytes."""
    raw = tensor.detach().numpy().tobytes()
    for shard in sorted((checkpoint / "state").glob("*.distcp")):
        clean = shard.read_bytes()
        at = clean.find(raw)
        if at >= 0:
            data = bytearray(clean)
            data[at + 5] ^= 0x01
            shard.write_bytes(bytes(data))
            return shard, clean
    raise AssertionError("the tensor's bytes are in no data file of the checkpoint")


def export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "checkpoint", "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_export_refuses_a_corrupted_checkpoint_and_writes_nothing(tmp_path):
    engine = trained_engine()
    ck = save_checkpoint(tmp_path / "ck", engine)
    shard, clean = _flip_a_bit_in(ck, engine.model.tok_emb.weight)
    victim = f"state/{shard.name}"
    out = tmp_path / "out"
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint {re.escape(str(ck))} failed verification \(1 problem\(s\)\): "
        rf"{victim}: content differs from the recorded SHA-256 \(corrupted\)\. "
        rf"Nothing was written to {re.escape(str(out))}",
    ):
        export_weights(tmp_path / "ck", out)
    assert not out.exists()
    run = export_cli(str(tmp_path / "ck"), "--out", str(out))
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{victim}: content differs from the recorded SHA-256" in run.stderr
    assert f"Nothing was written to {out}" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()
    # verify=False reads the bytes as they are: the export differs from the model.
    flipped = load_file(str(export_weights(ck, tmp_path / "unchecked", verify=False)))
    assert not torch.equal(flipped["tok_emb.weight"], engine.model.tok_emb.weight)
    # The intact checkpoint exports, through the function and the CLI.
    shard.write_bytes(clean)
    exported = load_file(str(export_weights(ck, out)))
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in exported.items())
    run = export_cli(str(ck), "--out", str(tmp_path / "out_cli"))
    assert run.returncode == 0 and (tmp_path / "out_cli" / SINGLE_FILE).is_file(), run.stderr


def _end(stored) -> int:
    return int(stored.offset + stored.length)


def test_an_unreadable_checkpoint_leaves_no_partial_export(tmp_path):
    engine = trained_engine()
    ck = save_checkpoint(tmp_path / "ck", engine)
    # Tear the file inside the model's last tensor: the ones before it read (and are written
    # as parts, at this shard size) before the read fails.
    stored = read_dcp_metadata(ck / "state").storage_data
    last = max((s for i, s in stored.items() if i.fqn.startswith("model.")), key=_end)
    shard = ck / "state" / last.relative_path
    shard.write_bytes(shard.read_bytes()[: last.offset + 10])
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"could not read checkpoint {re.escape(str(ck))}: "):
        export_weights(ck, out, max_shard_bytes=20_000, verify=False)
    assert not out.exists() and not list(tmp_path.glob(".shardwise-export-*"))
    run = export_cli(str(ck), "--out", str(out), "--max-shard-bytes", "20000", "--no-verify")
    assert run.returncode == 2 and "could not read checkpoint" in run.stderr, run.stderr
    assert not out.exists()


# --- distributed ------------------------------------------------------------------------------


class _HostCopies(TorchFunctionMode):
    """Counts `.cpu()` (export's move to host memory, one per tensor kept; a no-op on a CPU
    tensor, a copy from an accelerator) and clones (the writer clones only the second name
    of a tied storage)."""

    copies = 0
    clones = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # (broadcast_object_list moves its uint8 buffers too: only weights are counted)
        self.copies += name == "cpu" and args[0].is_floating_point()
        self.clones += name == "clone"
        return func(*args, **kwargs)


def export_and_load(out: str) -> dict:
    result = {}
    for strategy in ("ddp", "full_shard", "hybrid_shard"):
        if strategy == "hybrid_shard" and dist.get_world_size() != 4:
            continue
        engine = trained_engine(strategy)
        with _HostCopies() as copies:
            path = export_weights(engine.model, f"{out}/{strategy}")
        result[f"host_copies_{strategy}"] = copies.copies
        result[f"clones_{strategy}"] = copies.clones
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
    try:  # `out` is a file on rank 0: every rank must raise, none may wait in a gather
        export_weights(engine.model, f"{out}/ddp/model.safetensors")
        result["bad_out"] = "no error"
    except WeightsError as exc:
        result["bad_out"] = str(exc)
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_export_and_load_match_single_process(tmp_path, world):
    results = run_distributed(export_and_load, world, args=(str(tmp_path),), timeout_s=180)
    want = full_parameters(trained_engine().model)  # single-process training, same batches
    for strategy in ("ddp", "full_shard") + (("hybrid_shard",) if world == 4 else ()):
        assert (
            results[0][f"export_{strategy}"] and results[1][f"export_{strategy}"] is None
        )  # rank 0 writes
        # ...and only rank 0 copies the gathered tensors to host memory (before: every rank)
        assert results[0][f"host_copies_{strategy}"] == len(
            load_file(results[0][f"export_{strategy}"])
        )
        assert all(r[f"host_copies_{strategy}"] == 0 for r in results[1:])
        # No copy per tensor beyond the gather: one clone at most, for the tied embedding.
        assert results[0][f"clones_{strategy}"] <= 1
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
        assert "must be a directory, not a file" in results[0]["bad_out"]
        for rank_result in results[1:]:
            assert rank_result["bad_out"].startswith(
                "rank 0 could not prepare the export directory: WeightsError: export_weights(out="
            ), rank_result["bad_out"]
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
    export_weights(engine.model, out)  # with config.json, which from_pretrained needs
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


PROBE = torch.arange(16).unsqueeze(0)


def tiny_gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


def hf_export(out: str) -> dict:
    """Export a GPT-2 LM wrapped by each strategy; return its logits on PROBE."""
    from transformers import GPT2LMHeadModel

    logits = {}
    for strategy in ("ddp", "full_shard"):  # a wrapper around the model, and FSDP2's subclass
        torch.manual_seed(0)
        model = wrap(GPT2LMHeadModel(tiny_gpt2_config()), ParallelConfig(strategy=strategy))
        export_weights(model, f"{out}/{strategy}")
        model.eval()
        with torch.no_grad():
            logits[strategy] = model(PROBE).logits
    return logits


def test_from_pretrained_opens_the_export_of_a_wrapped_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    results = run_distributed(hf_export, 2, args=(str(tmp_path),), timeout_s=180)
    for strategy in ("ddp", "full_shard"):
        out = tmp_path / strategy
        assert (out / "generation_config.json").is_file(), strategy
        # The model's own class, not FSDP2's generated FSDPGPT2LMHeadModel (vLLM reads it).
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["GPT2LMHeadModel"], strategy
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_embd == 32
        assert model.generation_config.eos_token_id == 0  # ours, not GPT-2's 50256
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(PROBE).logits, results[0][strategy])
    # A model without a generation config gets config.json alone; a plain module neither.
    torch.manual_seed(0)
    base = transformers.GPT2Model(tiny_gpt2_config())
    export_weights(base, tmp_path / "base")
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == ["config.json", SINGLE_FILE]
    assert base.config.architectures is None  # the user's config is left as it was
    loaded = transformers.AutoModel.from_pretrained(str(tmp_path / "base")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROBE).last_hidden_state, base.eval()(PROBE)[0])
    export_weights(GPT(CFG), tmp_path / "plain")
    assert [p.name for p in (tmp_path / "plain").iterdir()] == [SINGLE_FILE]
