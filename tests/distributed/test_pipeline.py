"""Pipeline parallel × FSDP2 at world 4 (pp 2 × dp 2) equals one process.

Six transformers families (llama, gemma with tied embeddings, qwen2, mistral, olmo2 and
the mixture of experts qwen3_moe) and shardwise's own GPT (tied) are built tiny with four
blocks, wrapped through the Engine with `pp_split='auto'`, and trained 3 SGD steps with
clipping active, under 1F1B and GPipe. Each data-parallel rank reads its half of every
global batch; both stages of one pipeline read the same half. Compared with one process
on the whole batch: the loss at every step (on every rank), every gradient of the first
step (after clipping, whose norm spans both stages) and the final parameters, each within
rel 1e-5. The labels of a Hugging Face batch carry padding (-100) spread unevenly over
micro-batches: each micro-batch is weighted by the tokens the whole batch counts.

The layout is shown to be real: the first stage holds the embeddings and the first two
blocks and no head, the last holds the other blocks, the norm and the head and no
embedding (a tied one excepted: both ends hold it and step it identically), and every
name is the whole model's. The negative control, tied gradients not summed between the
two stages, fails the same comparison. A batch that gives its own num_items_in_batch, and
a first stage that trains nothing (its parts frozen), also train as one process.

What the step costs (issue 47): a micro-step waits for the device not at all and an update
once, on every stage; an accumulation window of two steps reduce-scatters as often as one
step (torch's schedule turned FSDP's gradient sync on at every step). All cases run in one
spawned group of 4.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.memory.stages import real_stage_step
from shardwise.parallelize import pipeline
from shardwise.testing import count_collectives, count_host_syncs, run_distributed
from shardwise.testing.models import GPT, GPTConfig
from shardwise.testing.parity import worst_of

pytestmark = [pytest.mark.pipeline, pytest.mark.timeout(1500)]

VOCAB, BATCH, SEQ, STEPS, LAYERS = 32, 8, 6, 3, 4
MAX_NORM = 0.5  # below the gradients' norm: clipping acts
RTOL = 1e-5
_COMMON = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=16,
    use_cache=False,
)


def _hf(family: str) -> nn.Module:
    t = transformers
    if family == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(**_COMMON, head_dim=4))
    if family == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(
            **_COMMON, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
        )
        return t.Qwen3MoeForCausalLM(cfg)
    classes = {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    return model_cls(config_cls(**_COMMON))


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=LAYERS))
    model = _hf(family)
    model.config._attn_implementation = "eager"
    return model


FAMILIES = ("llama", "gemma", "qwen2", "mistral", "olmo2", "qwen3_moe", "gpt")
INTERLEAVED = ("llama", "gemma", "gpt")
TIED = {
    "gemma": ("model.embed_tokens.weight", "lm_head.weight"),
    "gpt": ("tok_emb.weight", "head.weight"),
}


def batches(family: str, padded: bool = True) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    out: list[Any] = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if family == "gpt":
            out.append((ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)))
            continue
        labels = ids.clone()
        if not padded:  # every rank counts alike at any dp size
            out.append({"input_ids": ids, "labels": labels})
            continue
        labels[0, :3] = -100  # micro-batch 0 of data-parallel rank 0, not its micro-batch 1
        labels[5, :3] = -100  # micro-batch 0 of data-parallel rank 1 (ranks count alike)
        out.append({"input_ids": ids, "labels": labels})
    return out


def _rows(batch: Any, rank: int, size: int) -> Any:
    per = BATCH // size
    if isinstance(batch, dict):
        return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _with_items(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The batch with its own num_items_in_batch: the labels its loss averages over."""
    return {**batch, "num_items_in_batch": int((batch["labels"][..., 1:] != -100).sum())}


def _frozen_first_stage(model: nn.Module) -> nn.Module:
    """What the first of two stages holds (the embeddings, blocks 0 and 1) frozen: that
    stage trains nothing (LoRA on the last layers only, say)."""
    for name in ("model.embed_tokens", "model.layers.0", "model.layers.1"):
        model.get_submodule(name).requires_grad_(False)
    return model


def train(
    family: str,
    config: shardwise.ParallelConfig | None,
    *,
    padded: bool = True,
    items: bool = False,
    prepare: Any = None,
) -> dict[str, Any]:
    """3 SGD steps through the Engine; each rank reads its data-parallel rows (`items`: each
    with its num_items_in_batch)."""
    model = build(family)
    engine = shardwise.Engine(
        prepare(model) if prepare is not None else model,
        functools.partial(torch.optim.SGD, lr=0.5),
        config,
        train=shardwise.TrainConfig(max_grad_norm=MAX_NORM),
    )
    info = shardwise.wrap_info(engine.model)
    rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    data = [_rows(b, rank, size) for b in batches(family, padded)]
    if items:
        data = [_with_items(b) for b in data]
    first: dict[str, torch.Tensor] = {}

    def record(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not first:
            for name, p in engine.model.named_parameters():
                first[name] = _full(p.grad) if p.grad is not None else torch.zeros(p.shape)

    engine.optimizer.register_step_pre_hook(record)
    losses = [engine.train_step(b)["loss"] for b in data]
    params = {n: _full(p) for n, p in engine.model.named_parameters()}
    return {"losses": losses, "grads": first, "params": params, "dp": (rank, size)}


def accumulate_and_evaluate(config: shardwise.ParallelConfig | None) -> dict[str, Any]:
    """Two updates of two accumulated batches each, then val_step on a fifth batch."""
    engine = shardwise.Engine(
        build("llama"),
        functools.partial(torch.optim.SGD, lr=0.5),
        config,
        train=shardwise.TrainConfig(accumulate_steps=2, max_grad_norm=MAX_NORM),
    )
    info = shardwise.wrap_info(engine.model)
    rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    data = batches("llama") + batches("llama", padded=False)[:2]
    results = [engine.train_step(_rows(b, rank, size)) for b in data[:4]]
    out = engine.val_step(_rows(data[4], rank, size))
    val = out["loss"] if isinstance(out, dict) else out.loss
    return {
        "losses": [r["loss"] for r in results[1::2]],
        "val": float(shardwise.mean_across_ranks(val) if info is not None else val),
        "params": {n: _full(p) for n, p in engine.model.named_parameters()},
    }


def _accumulating(accumulate: int) -> shardwise.Engine:
    engine = shardwise.Engine(
        build("llama"),
        functools.partial(torch.optim.SGD, lr=0.5),
        shardwise.ParallelConfig(strategy="full_shard", pp=2),
        train=shardwise.TrainConfig(accumulate_steps=accumulate, max_grad_norm=MAX_NORM),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    for b in batches("llama")[:accumulate]:  # a window first: lazy initialisation
        engine.train_step(_rows(b, info.dp_rank, info.dp_size))
    return engine


def host_syncs_and_reductions() -> dict[str, Any]:
    """Under pp 2 x dp 2 (llama, 1F1B): the host syncs of each train_step of an
    accumulation window of 2, outside optimizer.step (transformers' own sync of a forward,
    in find_packed_sequence_indices, is taken out: it returns None for this batch anyway);
    and the gradient reduce-scatters of a window of 2 steps and of 1."""
    import transformers.masking_utils as masking

    out: dict[str, Any] = {"reduce_scatters": {}}
    engine = _accumulating(2)
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    data = [_rows(b, info.dp_rank, info.dp_size) for b in batches("llama")]
    per_call = []
    with (
        mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None),
        count_host_syncs() as syncs,
    ):
        engine.optimizer.register_step_pre_hook(lambda *_: setattr(syncs, "paused", True))
        engine.optimizer.register_step_post_hook(lambda *_: setattr(syncs, "paused", False))
        for batch in data[:2]:
            before = sum(syncs.values())
            logs = engine.train_step(batch)
            per_call.append(("grad_norm" in logs, sum(syncs.values()) - before))
    out["syncs"] = per_call
    for accumulate in (1, 2):
        engine = _accumulating(accumulate)
        with count_collectives(("reduce_scatter_single",)) as calls:  # FSDP2's
            for batch in data[:accumulate]:
                engine.train_step(batch)
        out["reduce_scatters"][accumulate] = calls["reduce_scatter_single"]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(got: list[dict[str, Any]], ref: dict[str, Any], family: str, last: int = 2) -> float:
    """The largest relative difference of losses, first gradients and final parameters.
    `got[0]` holds stage 0, `got[last]` stage 1."""
    stage_0, stage_1 = got[0], got[last]
    grads = {**stage_1["grads"], **stage_0["grads"]}
    params = {**stage_1["params"], **stage_0["params"]}
    assert set(ref["params"]) <= set(params), set(ref["params"]) - set(params)
    diffs = [
        abs(a - b) / abs(b) for r in got for a, b in zip(r["losses"], ref["losses"], strict=True)
    ]
    for name in ref["params"]:
        diffs.append(_rel(grads[name], ref["grads"][name]))
        diffs.append(_rel(params[name], ref["params"][name]))
    if family in TIED:  # the last stage's copy of the tie steps as the first's
        first, last = TIED[family]
        diffs.append(_rel(stage_1["params"][last], ref["params"][first]))
    return worst_of(diffs)


def _layout_model(family: str) -> nn.Module:
    return shardwise.wrap(build(family), shardwise.ParallelConfig(pp=2))


def _other_shape() -> str:
    """A step after the first whose batch has another shape is refused, not sent."""
    model = _layout_model("llama")
    batch = _rows(batches("llama")[0], 0, 2)
    shardwise.pipeline_step(model, batch)
    try:
        shardwise.pipeline_step(model, {k: v[:, :4] for k, v in batch.items()})
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _refusal(call: Any) -> str:
    try:
        call()
    except NotImplementedError as exc:
        return str(exc)
    return "not refused"


def _layout(family: str, schedule: str) -> dict[str, Any]:
    engine = shardwise.Engine(
        build(family),
        functools.partial(torch.optim.SGD, lr=0.5),
        shardwise.ParallelConfig(strategy="full_shard", pp=2, pp_schedule=schedule),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None and info.stages is not None
    return {
        "names": sorted(n for n, _ in engine.model.named_parameters()),
        "pp_rank": info.pp_rank,
        "dp": (info.dp_rank, info.dp_size),
        "plan": str(info.stages),
    }


def _ckpt_engine(config: shardwise.ParallelConfig | None) -> shardwise.Engine:
    return shardwise.Engine(
        build("gemma"),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        config,
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    )


def _steps(engine: shardwise.Engine, which: slice) -> list[float]:
    info = shardwise.wrap_info(engine.model)
    rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    return [
        engine.train_step(_rows(b, rank, size))["loss"]
        for b in batches("gemma", padded=False)[which]
    ]


def save_then_step(root: str, config: shardwise.ParallelConfig) -> dict[str, Any]:
    """Two AdamW steps, a checkpoint, then the uninterrupted third step."""
    engine = _ckpt_engine(config)
    _steps(engine, slice(0, 2))
    shardwise.save_checkpoint(root, engine)
    saved = {n: _full(p) for n, p in engine.model.named_parameters()}
    return {"saved": saved, "next": _steps(engine, slice(2, 3))[0]}


def load_then_step(root: str, config: shardwise.ParallelConfig | None) -> dict[str, Any]:
    engine = _ckpt_engine(config)
    shardwise.load_checkpoint(root, engine)
    loaded = {n: _full(p) for n, p in engine.model.named_parameters()}
    lr = engine.optimizer.param_groups[0]["lr"]
    return {"loaded": loaded, "next": _steps(engine, slice(2, 3))[0], "lr": lr}


MEM_GPT = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4)
MEM_BATCH = 8


def _mem_config(schedule: str) -> shardwise.ParallelConfig:
    return shardwise.ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=4)


RUN_GPT = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=LAYERS)


def _lm_data(samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def runner_losses(root: str, config: shardwise.ParallelConfig | None, batch: int) -> dict[str, Any]:
    """Two steps of the Runner on 16 samples, unshuffled; and its refusal of 20 samples,
    whose last batch would be short on each data-parallel rank."""
    torch.manual_seed(0)
    engine = shardwise.Engine(
        GPT(RUN_GPT), functools.partial(torch.optim.SGD, lr=0.5), config,
        train=shardwise.TrainConfig(max_grad_norm=MAX_NORM),
    )  # fmt: skip
    where = f"{root}/runner-{'pp' if config else 'one'}"
    cfg = shardwise.RunnerConfig(
        batch_size=batch, max_steps=2, shuffle=False, run_dir=where, progress=False
    )
    runner = shardwise.Runner(engine, _lm_data(16), config=cfg)
    losses = []
    for data in runner.train_loader:
        losses.append(engine.train_step(data)["loss"])
    refusal = ""
    if config is not None:
        try:
            shardwise.Runner(engine, _lm_data(20), config=cfg)
        except ValueError as exc:
            refusal = str(exc)
    return {"losses": losses, "split": (runner.dp_rank, runner.dp_world), "refusal": refusal}


def run_cases(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["runner"] = runner_losses(root, shardwise.ParallelConfig(pp=2), batch=4)
    for schedule in ("1f1b", "gpipe"):  # each stage's real peak, for the simulation
        out[f"memory/{schedule}"] = real_stage_step(
            functools.partial(GPT, MEM_GPT),
            _mem_config(schedule),
            batch=MEM_BATCH,
            seq_len=MEM_GPT.seq_len,
        )
    # Checkpoints across pp degrees (gemma: the tie's optimizer state moves too).
    out["ckpt/pp2 saved"] = save_then_step(f"{root}/pp2", shardwise.ParallelConfig(pp=2))
    out["ckpt/pp1 saved"] = save_then_step(f"{root}/pp1", shardwise.ParallelConfig())
    out["ckpt/pp1 into pp2"] = load_then_step(f"{root}/pp1", shardwise.ParallelConfig(pp=2))
    for family in FAMILIES:
        for schedule in ("1f1b", "gpipe"):
            config = shardwise.ParallelConfig(strategy="full_shard", pp=2, pp_schedule=schedule)
            out[f"{family}/{schedule}"] = train(family, config)
    interleaved = shardwise.ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    for family in INTERLEAVED:  # two stages per rank: rank 0 holds stages 0 and 2
        out[f"{family}/interleaved_1f1b"] = train(family, interleaved)
    out["layout/interleaved"] = _layout("llama", "interleaved_1f1b")
    out["ckpt/interleaved saved"] = save_then_step(f"{root}/interleaved", interleaved)
    # The negative control: ties whose gradients each stage keeps to itself.
    original = pipeline.sync_tied_grads
    pipeline.sync_tied_grads = lambda model: None  # type: ignore[assignment]
    try:
        out["gemma/no tie sum"] = train("gemma", shardwise.ParallelConfig(pp=2))
    finally:
        pipeline.sync_tied_grads = original
    out["accumulate/1f1b"] = accumulate_and_evaluate(shardwise.ParallelConfig(pp=2))
    out["syncs and reductions"] = host_syncs_and_reductions()
    pp2 = shardwise.ParallelConfig(strategy="full_shard", pp=2)
    out["llama/items given"] = train("llama", pp2, padded=False, items=True)
    out["llama/frozen first stage"] = train("llama", pp2, prepare=_frozen_first_stage)
    out["layout/llama"] = _layout("llama", "1f1b")
    out["layout/gemma"] = _layout("gemma", "1f1b")
    out["other shape"] = _other_shape()
    out["live export"] = _refusal(
        lambda: shardwise.export_weights(_layout_model("gemma"), f"{root}/live")
    )
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("pipeline_checkpoints"))


@pytest.fixture(scope="module")
def results(root: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    got = run_distributed(run_cases, 4, args=(root,), timeout_s=900)
    refs = {family: train(family, None) for family in FAMILIES}
    return got, refs


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) <= set(b), set(a) - set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_pp2_checkpoint_loads_at_world_2_and_1_exactly_and_steps_on(
    results: Any, root: str
) -> None:
    got, _ = results
    saved_0, saved_1 = got[0]["ckpt/pp2 saved"], got[2]["ckpt/pp2 saved"]
    whole = {**saved_1["saved"], **saved_0["saved"]}
    uninterrupted = saved_0["next"]
    assert saved_1["next"] == uninterrupted  # both stages report the pipeline's loss
    at_2 = run_distributed(
        load_then_step, 2, args=(f"{root}/pp2", shardwise.ParallelConfig()), timeout_s=600
    )
    at_1 = load_then_step(f"{root}/pp2", None)
    out = Path(root) / "export"  # every stage's tensors, read from the checkpoint
    shardwise.export_weights(f"{root}/pp2", out)
    fresh = build("gemma")
    shardwise.load_weights(fresh, out)
    exported = {n: _full(p) for n, p in fresh.named_parameters()}
    _same(exported, whole)
    for loaded in [*at_2, at_1]:
        _same(loaded["loaded"], whole)
        assert loaded["lr"] == pytest.approx(1e-2 * 0.25)  # the scheduler's two steps
        assert abs(loaded["next"] - uninterrupted) / uninterrupted < RTOL
    assert at_2[0]["next"] == uninterrupted  # at world 2 bit for bit


def test_a_pp1_checkpoint_loads_into_two_stages_with_the_ties_optimizer_state(
    results: Any,
) -> None:
    got, _ = results
    whole = got[0]["ckpt/pp1 saved"]["saved"]
    uninterrupted = got[0]["ckpt/pp1 saved"]["next"]
    for rank in range(4):
        loaded = got[rank]["ckpt/pp1 into pp2"]
        _same(loaded["loaded"], {**whole, "lm_head.weight": whole["model.embed_tokens.weight"]})
        assert abs(loaded["next"] - uninterrupted) / uninterrupted < RTOL


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_dp2_trains_equal_to_one_process(results: Any, family: str, schedule: str) -> None:
    got, refs = results
    per_rank = [r[f"{family}/{schedule}"] for r in got]
    assert [r["dp"] for r in per_rank] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    worst = compare(per_rank, refs[family], family)
    print(f"{family} {schedule}: rel {worst:.2e}")
    assert worst < RTOL, f"{family} {schedule}: rel {worst:.2e}"


@pytest.mark.parametrize("family", INTERLEAVED)
def test_interleaved_1f1b_with_two_stages_per_rank_trains_equal_to_one_process(
    results: Any, family: str
) -> None:
    got, refs = results
    per_rank = [r[f"{family}/interleaved_1f1b"] for r in got]
    worst = compare(per_rank, refs[family], family)
    print(f"{family} interleaved_1f1b: rel {worst:.2e}")
    assert worst < RTOL, f"{family} interleaved_1f1b: rel {worst:.2e}"


def test_under_interleaving_each_rank_holds_every_other_stage(results: Any) -> None:
    got, _ = results
    first, last = got[0]["layout/interleaved"], got[2]["layout/interleaved"]
    assert {n.split(".")[2] for n in first["names"] if ".layers." in n} == {"0", "2"}
    assert {n.split(".")[2] for n in last["names"] if ".layers." in n} == {"1", "3"}
    assert "model.embed_tokens.weight" in first["names"]
    assert not any(n.startswith(("lm_head", "model.norm")) for n in first["names"])
    assert not any(n.startswith("model.embed_tokens") for n in last["names"])
    assert "4 stages over model.layers, 2 per rank" in first["plan"]


def test_an_interleaved_checkpoint_loads_in_one_process_exactly_and_steps_on(
    results: Any, root: str
) -> None:
    got, _ = results
    saved_0, saved_1 = got[0]["ckpt/interleaved saved"], got[2]["ckpt/interleaved saved"]
    whole = {**saved_1["saved"], **saved_0["saved"]}
    at_1 = load_then_step(f"{root}/interleaved", None)
    _same(at_1["loaded"], whole)
    assert abs(at_1["next"] - saved_0["next"]) / saved_0["next"] < RTOL


def test_tied_gradients_not_summed_between_the_stages_fail_the_comparison(results: Any) -> None:
    got, refs = results
    worst = compare([r["gemma/no tie sum"] for r in got], refs["gemma"], "gemma")
    print(f"gemma without the tie sum: rel {worst:.2e}")
    assert worst > 100 * RTOL, f"rel {worst:.2e}: the control did not fail"


def test_each_stage_holds_only_its_part_under_the_whole_models_names(results: Any) -> None:
    got, _ = results
    first, last = got[0]["layout/llama"], got[2]["layout/llama"]
    assert (first["pp_rank"], last["pp_rank"]) == (0, 1)
    whole = {n for n, _ in build("llama").named_parameters()}
    assert set(first["names"]) | set(last["names"]) == whole
    assert not set(first["names"]) & set(last["names"])
    assert "model.embed_tokens.weight" in first["names"]
    assert not any(n.startswith(("lm_head", "model.norm")) for n in first["names"])
    assert not any(n.startswith("model.embed_tokens") for n in last["names"])
    assert {n.split(".")[2] for n in first["names"] if ".layers." in n} == {"0", "1"}
    assert {n.split(".")[2] for n in last["names"] if ".layers." in n} == {"2", "3"}
    assert "stage 0: model.layers.0 .. model.layers.1 + model.embed_tokens" in first["plan"]
    tied_first, tied_last = got[0]["layout/gemma"], got[2]["layout/gemma"]
    assert "model.embed_tokens.weight" in tied_first["names"]
    assert "lm_head.weight" not in tied_first["names"]
    assert "lm_head.weight" in tied_last["names"]
    assert (
        "tied: model.embed_tokens.weight (stage 0) = lm_head.weight (stage 1)"
        in (tied_first["plan"])
    )


def test_accumulation_and_val_step_equal_one_process(results: Any) -> None:
    got, _ = results
    ref = accumulate_and_evaluate(None)
    params = {**got[2]["accumulate/1f1b"]["params"], **got[0]["accumulate/1f1b"]["params"]}
    diffs = [_rel(params[n], ref["params"][n]) for n in ref["params"]]
    for r in got:
        mine = r["accumulate/1f1b"]
        diffs += [abs(a - b) / b for a, b in zip(mine["losses"], ref["losses"], strict=True)]
        diffs.append(abs(mine["val"] - ref["val"]) / ref["val"])
    worst = worst_of(diffs)
    print(f"accumulation 2 and val_step: rel {worst:.2e}")
    assert worst < RTOL


def three_d() -> dict[str, Any]:
    """llama at pp 2 x dp 2 x tp 2, and what the stage's first block holds on this rank."""
    out = train("llama", shardwise.ParallelConfig(strategy="full_shard", pp=2, tp=2))
    # The tied model: gemma's own plan splits its embedding's and its head's vocabulary alike.
    tied = train("gemma", shardwise.ParallelConfig(strategy="full_shard", pp=2, tp=2))
    out["gemma"] = tied
    engine_model = shardwise.Engine(
        build("llama"),
        functools.partial(torch.optim.SGD, lr=0.5),
        shardwise.ParallelConfig(pp=2, tp=2),
    ).model
    info = shardwise.wrap_info(engine_model)
    assert info is not None
    block = next(
        n
        for n in ("model.layers.0", "model.layers.2")
        if n in dict(engine_model.named_modules())
        and any(True for _ in engine_model.get_submodule(n).parameters())
    )
    q = engine_model.get_submodule(f"{block}.self_attn.q_proj").weight
    out["q_proj"] = (tuple(q.to_local().shape), tuple(q.shape), q.device_mesh.mesh_dim_names)
    out["pp_rank"] = info.pp_rank
    out["memory"] = real_stage_step(_mem_llama, MEM_3D, batch=8, seq_len=64)
    return out


MEM_3D = shardwise.ParallelConfig(pp=2, tp=2, pp_microbatches=4)


def _mem_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def test_pp2_dp2_tp2_at_world_8_trains_equal_to_one_process() -> None:
    got = run_distributed(three_d, 8, timeout_s=900)
    ref = train("llama", None)
    assert [r["pp_rank"] for r in got] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["dp"] for r in got] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2
    for r in got:  # q_proj is split over tp (and its rows over dp) inside each stage
        local, whole, dims = r["q_proj"]
        assert whole == (16, 16) and local[0] == 4 and dims == ("dp_shard", "tp"), r["q_proj"]
    worst = compare([got[0], got[1], got[4], got[5]], ref, "llama", last=2)
    print(f"llama pp 2 x dp 2 x tp 2: rel {worst:.2e}")
    assert worst < RTOL
    tied = [got[i]["gemma"] for i in (0, 1, 4, 5)]
    worst = compare(tied, train("gemma", None), "gemma", last=2)
    print(f"gemma (tied) pp 2 x dp 2 x tp 2: rel {worst:.2e}")
    assert worst < RTOL
    # Each stage's simulated peak (tp inside the stage) against the real one.
    sim = shardwise.simulate_step(_mem_llama, MEM_3D, world=8, batch=8, seq_len=64, backend="gloo")
    for st in sim.stages:
        ratio = st["peak"] / got[4 * st["index"]]["memory"]["peak"]
        print(f"3-D stage {st['index']}: simulated / real = {ratio:.4f}")
        assert 0.9 <= ratio <= 1.1


def test_a_live_pipelined_model_is_not_exported_but_its_checkpoint_is(results: Any) -> None:
    got, _ = results  # the checkpoint's export is checked with the checkpoints above
    for r in got:
        assert "export_weights of a model wrapped with ParallelConfig.pp=2" in r["live export"]
        assert "export_weights(checkpoint_dir, out)" in r["live export"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_simulated_peak_of_each_stage_is_within_ten_percent_of_the_real_one(
    results: Any, schedule: str
) -> None:
    got, _ = results
    sim = shardwise.simulate_step(
        functools.partial(GPT, MEM_GPT),
        _mem_config(schedule),
        world=4,
        batch=MEM_BATCH,
        seq_len=MEM_GPT.seq_len,
        backend="gloo",
    )
    for st in sim.stages:
        real = got[2 * st["index"]][f"memory/{schedule}"]
        assert real["stage"] == st["index"]
        ratio = st["peak"] / real["peak"]
        print(f"{schedule} stage {st['index']}: simulated / real = {ratio:.4f}")
        assert 0.9 <= ratio <= 1.1, (st, real)


def test_the_runner_gives_both_stages_of_a_pipeline_the_same_rows(results: Any, root: str) -> None:
    got, _ = results
    ref = runner_losses(root, None, batch=8)
    assert [r["runner"]["split"] for r in got] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    for r in got:
        mine = r["runner"]["losses"]
        assert len(mine) == len(ref["losses"]) == 2
        for a, b in zip(mine, ref["losses"], strict=True):
            assert abs(a - b) / b < RTOL, (mine, ref["losses"])
        assert (
            "each data-parallel rank reads 10 sample(s) in batches of 4" in r["runner"]["refusal"]
        )
        assert "RunnerConfig.drop_last=True" in r["runner"]["refusal"]


def test_a_batch_of_another_shape_is_refused_before_the_schedule_sends(results: Any) -> None:
    got, _ = results
    for r in got:
        assert "but the pipeline's first batch had" in r["other shape"], r["other shape"]
        assert "'input_ids': (4, 4)" in r["other shape"]


def test_the_example_trains_a_pipeline_as_a_user_runs_it(tmp_path: Path) -> None:
    """`shardwise run --nproc 4 examples/train_lm.py parallel.pp=2`: trained, validated,
    exported from a final checkpoint; without drop_last, refused in one line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    base = [
        sys.executable, "-m", "shardwise.cli", "run", "--nproc", "4",
        str(root / "examples" / "train_lm.py"), "--config", str(root / "examples" / "train_lm.yaml"),
        "parallel.pp=2", "runner.max_steps=2", "runner.val_every=2", "runner.val_batches=2",
    ]  # fmt: skip

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *extra], capture_output=True, text=True, timeout=600, cwd=tmp_path
        )

    done = run("runner.drop_last=true", "runner.run_dir=ok")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: step 2" in done.stdout
    assert (tmp_path / "ok" / "export" / "model.safetensors").is_file()
    refused = run("runner.run_dir=short")
    assert refused.returncode != 0
    said = [line for line in refused.stderr.splitlines() if "drop_last=True" in line]
    assert len(said) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]


def test_a_micro_step_waits_for_nothing_and_an_update_once(results: Any) -> None:
    """Issue 47, item 9: the pipeline's token count was an int() per micro-step on every
    stage; it stays a device tensor."""
    got, _ = results
    for rank, r in enumerate(got):
        calls = r["syncs and reductions"]["syncs"]
        print(f"rank {rank}: (updated, host syncs) per train_step {calls}")
        assert calls == [(False, 0), (True, 1)], (rank, calls)


def test_an_accumulation_window_reduce_scatters_once(results: Any) -> None:
    """Issue 47, item 10: torch's schedule turned FSDP's gradient sync on at every step,
    so a window of k steps reduce-scattered k times."""
    got, _ = results
    for rank, r in enumerate(got):
        counts = r["syncs and reductions"]["reduce_scatters"]
        print(f"rank {rank}: reduce-scatters per window of 1 and of 2 steps {counts}")
        assert counts[1] > 0 and counts[2] == counts[1], (rank, counts)


def test_the_batchs_own_num_items_in_batch_weighs_each_micro_batch_as_one_process(
    results: Any,
) -> None:
    """A batch that gives its own num_items_in_batch (as the Hugging Face Trainer does):
    each micro-batch's loss is already its share of the batch's mean, so the schedule
    must not divide by the micro-batches again (it did, by 2)."""
    got, _ = results
    ref = train("llama", None, padded=False, items=True)
    worst = compare([r["llama/items given"] for r in got], ref, "llama")
    print(f"llama with num_items_in_batch given: rel {worst:.2e}")
    assert worst < RTOL


def test_a_stage_that_trains_nothing_trains_equal_to_one_process(results: Any) -> None:
    got, _ = results
    ref = train("llama", None, prepare=_frozen_first_stage)
    worst = compare([r["llama/frozen first stage"] for r in got], ref, "llama")
    print(f"llama, first stage frozen: rel {worst:.2e}")
    assert worst < RTOL
    assert all(not g.any() for n, g in got[0]["llama/frozen first stage"]["grads"].items())
