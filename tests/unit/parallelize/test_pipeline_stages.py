"""Pipeline stages in one process: the split, the stage's forward, and every guard.

The stage's forward is checked without processes: two copies of one model are made stage 0
and stage 1, the first's output is fed to the second, and the loss must equal the whole
model's to the bit. Gemma scales its embeddings' output by sqrt(hidden); a stage that took
the received hidden states in through the embeddings would apply it twice, so gemma is one
of the families. Each guard is checked by its message, before any process group exists.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import re
import sys

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.cli.launch import check_layout
from shardwise.config.pipeline import check_microbatches
from shardwise.distributed.mesh import resolve_mesh
from shardwise.parallelize.pipeline import build_stage
from shardwise.plan.stages import plan_stages
from shardwise.testing.models import GPT, GPTConfig

COMMON = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32,
    max_position_embeddings=16,
    use_cache=False,
)


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def gemma() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON, head_dim=4))


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=6, d_model=16, n_layers=3))


# --- the split -----------------------------------------------------------------------------


def test_auto_split_balances_blocks_and_sends_the_rest_to_the_ends() -> None:
    plan = plan_stages(llama(), 2)
    assert plan.container == "model.layers"
    assert [s.blocks for s in plan.stages] == [
        ("model.layers.0", "model.layers.1"),
        ("model.layers.2", "model.layers.3"),
    ]
    assert plan.stages[0].modules == ("model.embed_tokens",)
    assert set(plan.stages[1].modules) == {"model.norm", "lm_head"}
    assert plan.tied == ()
    three = plan_stages(gpt(), 3)  # 3 blocks: one each; embeddings first, norm and head last
    assert [len(s.blocks) for s in three.stages] == [1, 1, 1]
    assert three.stages[0].modules == ("tok_emb", "pos_emb")
    assert three.stages[1].modules == ()
    assert three.tied == (("tok_emb.weight", "head.weight"),)
    assert [len(s.blocks) for s in plan_stages(llama(), 3).stages] == [2, 1, 1]


def test_the_stages_hold_every_parameter_once_and_the_plan_prints_them() -> None:
    model = llama()
    plan = plan_stages(model, 2)
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in model.parameters())
    text = str(plan)
    assert "stage 0: model.layers.0 .. model.layers.1 + model.embed_tokens" in text
    assert '"container": "model.layers"' in plan.to_json()


def test_a_given_split_is_followed_and_a_wrong_one_refused_by_name() -> None:
    plan = plan_stages(llama(), 2, ("model.layers.3",))
    assert [len(s.blocks) for s in plan.stages] == [3, 1]
    with pytest.raises(ValueError, match=r"pp_split: 'model.layers.0' is not a block at which"):
        plan_stages(llama(), 2, ("model.layers.0",))
    with pytest.raises(ValueError, match=r"pp_split: 'model.layers.9' is not a block"):
        plan_stages(llama(), 2, ("model.layers.9",))
    with pytest.raises(ValueError, match=r"must name blocks in increasing order"):
        plan_stages(llama(), 3, ("model.layers.3", "model.layers.2"))
    with pytest.raises(ValueError, match=r"must name blocks in increasing order, each once"):
        plan_stages(llama(), 3, ("model.layers.2", "model.layers.2"))  # an empty stage
    with pytest.raises(ValueError, match=r"'lm_head' is not a block of a ModuleList"):
        plan_stages(llama(), 2, ("lm_head",))


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pp=5 stages but model.layers holds 4 block\(s\)"):
        plan_stages(llama(), 5)


def test_a_model_without_one_block_list_is_refused_naming_pp_split() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"pp_split: 'auto' splits a model at its one list"):
        plan_stages(model, 2)


# --- the stage's forward -------------------------------------------------------------------


def _chained(make: object, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's loss, and stage 1's loss on stage 0's output (two copies)."""
    whole = make()  # type: ignore[operator]
    expected = _loss(whole(**batch))
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    plan = plan_stages(whole, 2)
    s0, s1 = build_stage(first, plan, 0), build_stage(last, plan, 1)
    s0.running = s1.running = True
    hidden = first(**batch)
    return expected, last(hidden, **batch)


def _loss(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [llama, gemma], ids=["llama", "gemma"])
def test_two_stages_chained_give_the_whole_models_loss(make: object) -> None:
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    expected, got = _chained(make, {"input_ids": ids, "labels": ids})
    assert torch.equal(got, expected)


def llama_bf16() -> nn.Module:
    return llama().to(torch.bfloat16)


def test_two_stages_of_a_bf16_model_give_its_loss() -> None:
    """The stand-in embedding on a later stage makes zeros of the model's dtype: in fp32 a
    bf16 model's next stage would refuse them (third audit)."""
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    expected, got = _chained(llama_bf16, {"input_ids": ids, "labels": ids})
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_two_stages_of_our_gpt_give_its_loss() -> None:
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    expected, got = _chained(gpt, {"idx": ids, "targets": ids})
    assert torch.equal(got, expected)


def test_a_stage_keeps_the_whole_models_names_and_only_its_own_parameters() -> None:
    model = gemma()
    whole = {n for n, _ in model.named_parameters()}
    plan = plan_stages(model, 2)
    build_stage(model, plan, 1)
    names = {n for n, _ in model.named_parameters()}
    assert names <= whole | {"lm_head.weight"}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert not any(".layers.0." in n or ".layers.1." in n for n in names)


def test_calling_a_stage_like_a_plain_module_says_what_to_call() -> None:
    model = llama()
    build_stage(model, plan_stages(model, 2), 0)
    with pytest.raises(RuntimeError, match=r"shardwise.pipeline_step\(model, batch\)"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_pipeline_step_on_a_model_without_stages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the model has no pipeline stages"):
        shardwise.pipeline_step(llama(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})


# --- guards, before any group --------------------------------------------------------------


def test_config_guards_name_the_field_and_the_fix() -> None:
    cases = [
        (dict(pp=0), ValueError, r"ParallelConfig.pp=0 must be >= 1"),
        (dict(pp=2, pp_schedule="1fb1"), ValueError, r"pp_schedule='1fb1' is not a schedule.*"),
        (dict(pp=2, pp_schedule="zbv"), NotImplementedError, r"'zbv' is not built yet: its V"),
        (
            dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=1),
            ValueError,
            r"pp_stages_per_rank=1 with pp_schedule='interleaved_1f1b': that schedule runs 2 or "
            r"more stage\(s\) per rank. Set pp_stages_per_rank to 2 or more",
        ),
        (
            dict(pp=2, pp_stages_per_rank=2),
            ValueError,
            r"pp_stages_per_rank=2 with pp_schedule='1f1b': that schedule runs 1 stage\(s\) per "
            r"rank.*or choose interleaved_1f1b",
        ),
        (
            dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=3),
            ValueError,
            r"runs 2 stage\(s\) per rank",
        ),
        (
            dict(pp=2, pp_schedule="interleaved_1f1b", pp_split=["model.layers.2"]),
            ValueError,
            r"lists 1 module name\(s\) for 4 stages \(pp=2 × pp_stages_per_rank=2\): give 3",
        ),
        (dict(pp=2, pp_microbatches=0), ValueError, r"pp_microbatches=0 must be >= 1"),
        (
            dict(pp=3, pp_split=["model.layers.1"]),
            ValueError,
            r"lists 1 module name\(s\) for 3 stages \(pp=3 × pp_stages_per_rank=1\): give 2",
        ),
        (dict(pp=2, pp_split="even"), ValueError, r"give 'auto' or a list"),
        (dict(pp=2, pp_split=[3]), TypeError, r"each entry must be a module name"),
        (dict(pp=2, strategy="auto"), NotImplementedError, r"does not simulate pipeline stages"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            shardwise.ParallelConfig(**kwargs)


def test_interleaving_cuts_pp_times_stages_per_rank_and_places_them_in_a_loop() -> None:
    config = shardwise.ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    assert config.stages_per_rank == 2  # None picks 2 for interleaving
    assert shardwise.ParallelConfig(pp=2).stages_per_rank == 1
    plan = plan_stages(llama(), 2, per_rank=2)
    assert [s.blocks for s in plan.stages] == [(f"model.layers.{i}",) for i in range(4)]
    assert (plan.pp, plan.degree) == (4, 2)
    assert [plan.held_by(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert "4 stages over model.layers, 2 per rank (rank r holds stages r, r + 2, ...)" in str(plan)
    with pytest.raises(
        ValueError,
        match=r"pp=2 × 3 per rank = 6 stages but model.layers holds 4 block\(s\).*"
        r"Use pp × pp_stages_per_rank <= 4",
    ):
        plan_stages(llama(), 2, per_rank=3)


def test_a_rank_holding_two_stages_runs_each_through_its_own_module() -> None:
    """Four stages over two ranks, chained by hand as the schedule chains them: the loss
    equals the whole model's; each rank's model holds the union of its stages' parameters
    under the whole model's names, and each stage's module holds only its own."""
    whole = llama()
    batch = {"input_ids": torch.randint(0, 32, (2, 6)), "labels": torch.randint(0, 32, (2, 6))}
    expected = _loss(whole(**batch))
    plan = plan_stages(whole, 2, per_rank=2)
    ranks = [copy.deepcopy(whole), copy.deepcopy(whole)]
    states = [build_stage(m, plan, r) for r, m in enumerate(ranks)]
    for s in states:
        s.running = True
    assert [[c.index for c in s.chunks] for s in states] == [[0, 2], [1, 3]]
    layers = {n.split(".")[2] for n, _ in ranks[0].named_parameters() if ".layers." in n}
    assert layers == {"0", "2"} and "lm_head.weight" not in dict(ranks[0].named_parameters())
    own = {n.split(".")[2] for n, _ in states[0].chunks[1].module.named_parameters()}
    assert own == {"2"}  # stage 2: layer 2 alone, its parameters the model's own objects
    shared = dict(ranks[0].named_parameters())
    assert all(p is shared[n] for n, p in states[0].chunks[1].module.named_parameters())
    hidden = states[0].chunks[0].module(**batch)
    for state, k in ((states[1], 0), (states[0], 1)):
        hidden = state.chunks[k].module(hidden, **batch)
    got = states[1].chunks[1].module(hidden, **batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"shardwise.pipeline_step\(model, batch\)"):
        ranks[0](**batch)  # the union is trained and saved, never called


def test_torchs_spelling_of_a_schedule_is_read_as_ours() -> None:
    assert shardwise.ParallelConfig(pp=2, pp_schedule="GPipe").pp_schedule == "gpipe"


def test_micro_batch_rules_of_the_schedules() -> None:
    check_microbatches(2, "1f1b", 2, 4)
    check_microbatches(4, "interleaved_1f1b", 3, 6)  # one round: torch's flexible rule
    check_microbatches(4, "interleaved_1f1b", 10, 10)  # two rounds of 5
    with pytest.raises(
        ValueError,
        match=r"pp_microbatches=9 with pp_schedule='interleaved_1f1b' and pp=4: .* 9 does not "
        r"divide into its 2 rounds. Use one of \[4, 5, 6, 7, 8, 10\]",
    ):
        check_microbatches(4, "interleaved_1f1b", 9, 9)
    check_microbatches(4, "gpipe", 2, 4)  # GPipe takes fewer micro-batches than stages
    with pytest.raises(ValueError, match=r"1F1B needs at least as many micro-batches as stages"):
        check_microbatches(4, "1f1b", 2, 8)
    with pytest.raises(
        ValueError, match=r"pp_microbatches=4 does not divide this rank's batch of 6"
    ):
        check_microbatches(2, "1f1b", 4, 6)


def test_the_mesh_puts_pp_outermost_and_refuses_what_does_not_fit() -> None:
    spec = resolve_mesh("hybrid_shard", -1, 8, pp=2)
    assert (spec.pp, spec.dp_replicate, spec.dp_shard, spec.world_size) == (2, 2, 2, 8)
    assert resolve_mesh("full_shard", -1, 8, pp=2, tp=2).dp_size == 2
    with pytest.raises(ValueError, match=r"pp=4 does not divide the job's 6 rank\(s\)"):
        resolve_mesh("full_shard", -1, 6, pp=4)
    with pytest.raises(ValueError, match=r"pp=2 with strategy='ddp' is not built yet"):
        resolve_mesh("ddp", -1, 4, pp=2)


def test_wrap_refuses_a_weights_file_with_stages() -> None:
    with pytest.raises(NotImplementedError, match=r"wrap\(weights=...\) with ParallelConfig.pp=2"):
        shardwise.wrap(llama(), shardwise.ParallelConfig(pp=2), weights="w.safetensors")


def test_wrap_at_world_one_refuses_stages() -> None:
    with pytest.raises(ValueError, match=r"pp=2 at world size 1: each pipeline stage needs"):
        shardwise.wrap(llama(), shardwise.ParallelConfig(pp=2))


def test_run_refuses_a_pp_the_world_cannot_hold_before_spawning(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  strategy: full_shard\n")
    check_layout(["--config", str(config), "parallel.pp=2"], 4)
    with pytest.raises(ValueError, match=r"at world size 3: ParallelConfig.pp=2 does not divide"):
        check_layout(["--config", str(config), "parallel.pp=2"], 3)


def test_hosts_refuse_pipeline_stages_with_the_reason() -> None:
    mmengine = pytest.importorskip("shardwise.integrations.mmengine")
    with pytest.raises(NotImplementedError, match=r"pp=2 inside mmengine's Runner is not built"):
        mmengine.ShardwiseDataParallel(nn.Linear(2, 2), strategy="full_shard", pp=2)
    lightning = pytest.importorskip("shardwise.integrations.lightning")
    with pytest.raises(NotImplementedError, match=r"pp=2 inside Lightning's Trainer"):
        lightning.ShardwiseStrategy(config=shardwise.ParallelConfig(pp=2))


def test_wraps_signature_is_unchanged_by_the_new_dimension() -> None:
    params = list(inspect.signature(shardwise.wrap).parameters)
    assert params == ["model", "config", "weights", "broadcast_from_rank0"]


def test_combinations_not_built_are_refused_before_any_group() -> None:
    from shardwise.parallelize.apply import _refuse_unbuilt

    spec = resolve_mesh("full_shard", -1, 8, pp=2, tp=2)
    _refuse_unbuilt(gemma(), shardwise.ParallelConfig(pp=2, tp=2), spec, False, None)
    moe = llama()
    moe.config.output_router_logits = True
    spec = resolve_mesh("full_shard", -1, 4, pp=2)
    with pytest.raises(NotImplementedError, match=r"router auxiliary loss"):
        _refuse_unbuilt(moe, shardwise.ParallelConfig(pp=2), spec, False, None)
    with pytest.raises(NotImplementedError, match=r"a model built on the meta device"):
        _refuse_unbuilt(llama(), shardwise.ParallelConfig(pp=2), spec, True, None)
    _refuse_unbuilt(llama(), shardwise.ParallelConfig(pp=2), spec, False, None)


def test_tied_ends_on_two_stages_must_be_split_alike_by_the_tp_plan() -> None:
    from shardwise.parallelize.tensor import (
        CheckedPlan,
        check_split_ties,
        check_tensor_parallel,
    )

    model = gemma()
    ties = plan_stages(model, 2).tied

    def checked(tp_plan: object) -> CheckedPlan:
        return check_tensor_parallel(model, shardwise.ParallelConfig(pp=2, tp=2, tp_plan=tp_plan))

    check_split_ties(model, checked("auto"), ties)  # gemma's own plan splits both vocabularies
    mlp = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    head_only = {**mlp, "lm_head": "colwise_gather_output"}
    with pytest.raises(
        ValueError,
        match=r"splits the tied weights model.embed_tokens.weight and lm_head.weight "
        r"differently \(\{'model.embed_tokens.weight': 'whole', 'lm_head.weight': 'dim 0'\}\)",
    ):
        check_split_ties(model, checked(head_only), ties)
    crossed = {**head_only, "model.embed_tokens": "colwise"}
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight': 'dim 1'"):
        check_split_ties(model, checked(crossed), ties)
    check_split_ties(model, checked(mlp), ties)  # both whole: alike
    with pytest.raises(NotImplementedError, match=r"tied embeddings and a callable tp_plan"):
        check_split_ties(model, checked(lambda m, t: m), ties)
    check_split_ties(llama(), checked("auto"), ())  # nothing tied: nothing to check


@pytest.mark.heavy
def test_plan_shows_each_stage_and_its_model_states(capsys) -> None:  # type: ignore[no-untyped-def]
    from shardwise.cli.main import main

    argv = ["plan", "shardwise.testing.models:GPT", "--world", "4", "--pp", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("full_shard: pp 2 x 1 replica group(s) x 2 shard rank(s) = world 4")
    assert "stage 0: blocks.0 + tok_emb, pos_emb (15,168 parameters)" in out
    assert "stage 1: blocks.1 + ln_f, head (14,720 parameters)" in out
    assert "stage 1, over its 2 data-parallel rank(s), optimizer adamw" in out
    assert "ddp " not in out  # refused under pp: not offered
    # 15,168 fp32 parameters over 2 ranks: 29.6 KiB each, gradients alike, AdamW twice that.
    assert "full_shard               1x2     29.6 KiB     29.6 KiB     59.2 KiB" in out
    assert main([*argv, "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)
    assert [s["blocks"] for s in machine["stages"]["stages"]] == [["blocks.0"], ["blocks.1"]]
    assert [e["strategy"] for e in machine["memory"][0]] == [
        "no_shard",
        "shard_grad_op",
        "full_shard",
    ]
    assert main([*argv, "--simulate", "--seq-len", "6"]) == 0
    out = capsys.readouterr().out
    assert "full_shard x pp 2 at world 4, batch 4 x seq 6" in out
    assert re.search(r"stage 0: peak .*, 2 micro-batch\(es\) in flight", out)
    assert main(["plan", "shardwise.testing.models:GPT", "--world", "3", "--pp", "2"]) == 2
    assert "ParallelConfig.pp=2 does not divide the job's 3 rank(s)" in capsys.readouterr().err


def test_plan_shows_each_stage_split_over_tp(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from shardwise.cli.main import main

    (tmp_path / "stages_llm.py").write_text(
        "import transformers as tf\n"
        "def llama():\n"
        "    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, "
        "intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, "
        "num_key_value_heads=2))\n"
        "def llama4():\n"
        "    m = llama()\n"
        "    return tf.LlamaForCausalLM(m.config.__class__(**{**m.config.to_dict(), "
        "'num_hidden_layers': 4}))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert main(["plan", "stages_llm:llama", "--world", "8", "--pp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 0, over its 2 data-parallel rank(s) x tp 2, optimizer adamw" in out
    # Stage 0: the embedding (128 x 64) and layer 0 (36,992 parameters, 128 of them in its
    # two norms): 45,184 in all, every one split over tp but the norms' 128, so one tp rank
    # holds 22,656 (88.5 KiB in fp32), and full_shard halves that over dp 2.
    assert re.search(r"no_shard +2x1 +88\.5 KiB", out)
    assert re.search(r"full_shard +1x2 +44\.2 KiB", out)
    assert "stage 1, over its 2 data-parallel rank(s) x tp 2" in out
    argv = [
        "plan",
        "stages_llm:llama",
        "--world",
        "4",
        "--pp",
        "2",
        "parallel.pp_schedule=interleaved_1f1b",
    ]
    assert main(argv) == 2  # two layers cannot make four stages
    assert "pp=2 × 2 per rank = 4 stages but model.layers holds 2" in capsys.readouterr().err
    argv[1] = "stages_llm:llama4"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 stages over model.layers, 2 per rank" in out
    assert "pipeline rank 0 (stages [0, 2]), over its 2 data-parallel rank(s)" in out
    assert "pipeline rank 1 (stages [1, 3])" in out


def test_the_simulation_refuses_what_it_cannot_cut() -> None:
    with pytest.raises(
        ValueError, match=r"pp_microbatches=4 does not divide this rank's batch of 2"
    ):
        shardwise.simulate_step(
            gpt, shardwise.ParallelConfig(pp=2, pp_microbatches=4), world=4, batch=2, seq_len=6
        )


# --- memory ----------------------------------------------------------------------------------


def test_each_stage_runs_its_micro_batches_in_its_schedules_order() -> None:
    from shardwise.memory.stages import stage_order

    assert stage_order("1f1b", 2, 0, 4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert stage_order("1f1b", 2, 1, 4) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3),
    ]  # fmt: skip
    assert stage_order("gpipe", 2, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for schedule, pp, index, m in [("1f1b", 4, 0, 8), ("1f1b", 4, 3, 4), ("gpipe", 3, 1, 3)]:
        order = stage_order(schedule, pp, index, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))


@pytest.mark.heavy
def test_the_simulation_steps_each_stage_with_its_micro_batches_in_flight() -> None:
    def run(schedule: str) -> shardwise.SimReport:
        config = shardwise.ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=4)
        return shardwise.simulate_step(gpt, config, world=4, batch=4, seq_len=6)

    one_f_one_b, gpipe = run("1f1b"), run("gpipe")
    assert [s["in_flight"] for s in one_f_one_b.stages] == [2, 1]
    assert [s["in_flight"] for s in gpipe.stages] == [4, 4]
    assert one_f_one_b.pp == 2 and one_f_one_b.peak == max(s["peak"] for s in one_f_one_b.stages)
    # GPipe holds every micro-batch's activations; 1F1B at most pp of them.
    for a, b in zip(one_f_one_b.stages, gpipe.stages, strict=True):
        assert b["peak"] > a["peak"] and b["model_states"] == a["model_states"]
    assert "x pp 2 at world 4" in str(one_f_one_b) and "stage 1: peak" in str(one_f_one_b)


def test_error_paths_of_the_stage_say_what_to_give() -> None:
    from shardwise.memory.stages import hidden_width
    from shardwise.parallelize.pipeline import _rows
    from shardwise.parallelize.stages import loss_of as _loss_of
    from shardwise.train.engine import _check_pipelined

    with pytest.raises(ValueError, match=r"the last stage's forward must return the loss"):
        _loss_of(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"the batch holds no tensor to cut into micro-batches"):
        _rows({"idx": 3})
    plan = plan_stages(llama(), 2)
    no_embedding = dataclasses.replace(plan, before=())
    with pytest.raises(ValueError, match=r"the first stage holds no nn.Embedding"):
        hidden_width(llama(), no_embedding)

    class Own(nn.Module):  # parameters on the path to the block list
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(2))

    with pytest.raises(ValueError, match=r"holds parameters of its own, which no stage"):
        plan_stages(Own(), 2)
    config = shardwise.ParallelConfig(pp=2)
    with pytest.raises(NotImplementedError, match=r"fp16 loss scaling with .*pp=2"):
        _check_pipelined(llama(), config, scaler=object())

    class MM(nn.Module):
        def data_preprocessor(self, batch, training):  # type: ignore[no-untyped-def]
            return batch

    with pytest.raises(NotImplementedError, match=r"OpenMMLab-style model"):
        _check_pipelined(MM(), config, scaler=None)


def test_the_simulation_of_stages_refuses_what_it_cannot_model() -> None:
    config = shardwise.ParallelConfig(pp=2)
    with pytest.raises(ValueError, match=r"pp=2 does not divide world=3"):
        shardwise.simulate_step(gpt, config, world=3, batch=4, seq_len=6)
    with pytest.raises(NotImplementedError, match=r"pp and example_input is not built yet"):
        shardwise.simulate_step(
            gpt, config, world=4, batch=4, seq_len=6, example_input=lambda: torch.zeros(4, 6)
        )
