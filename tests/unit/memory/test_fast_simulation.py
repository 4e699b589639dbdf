"""The fast simulation (issue 54) against the full one, on small models of each kind: it
traces the run of same blocks at two short lengths and composes the step, and must give
the full simulation's figures. The bar is equality to the byte: every segment of the step
is affine in the run's length (memory/compose.py), so nothing is approximated; a
difference of one byte is a wrong grouping or a wrong segment. Measured: equal to the byte
in every case below (peak, each category at the peak, each category's own peak)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.memory import compose
from shardwise.memory.compose import block_keys, find_run, plan_run
from shardwise.plan.planner import plan_wrap

pytestmark = pytest.mark.heavy
# The comparisons of many models and layouts (minutes) are the `simulation` tier: `make
# test-simulation`, which .ci/run runs; `make test` keeps one model under each path.


@pytest.fixture(autouse=True)
def compose_small_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The models here are short, to keep the full simulations cheap: compose them even
    where tracing them whole would be cheaper (test_a_run_too_short_to_save_is_traced_whole
    checks that rule)."""
    monkeypatch.setattr(compose, "ONLY_IF_SHORTER", False)


def llama(layers: int = 7, **kw: object) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        tie_word_embeddings=False, **kw,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gemma2() -> nn.Module:
    """Sliding and global attention alternating: the same parameters, a different window."""
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
        use_cache=False,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def qwen2_moe() -> nn.Module:
    """Dense and MoE layers alternating (every second layer sparse)."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=2,
        use_cache=False,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def lora_llama() -> nn.Module:
    import peft

    return peft.get_peft_model(  # type: ignore[no-any-return]
        llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    )


class Widening(nn.Module):
    """One block, in the middle, wider than the others: its memory depends on its index."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        widths = [32] * 7 + [48] + [32] * 6
        self.blocks = nn.ModuleList(_Block(w) for w in widths)
        self.head = nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


def _both(factory, config, **kw):  # type: ignore[no-untyped-def]
    kw = {"world": 4, "batch": 2, "seq_len": 16, **kw}
    fast = shardwise.simulate_step(factory, config, **kw)
    full = shardwise.simulate_step(factory, config, path="full", **kw)
    return fast, full


def _same(fast: shardwise.SimReport, full: shardwise.SimReport, paths: bool = True) -> None:
    if paths:
        assert fast.path == "fast" and full.path == "full", fast.notes
    assert fast.peak == full.peak, (fast.peak, full.peak, fast.notes)
    nonzero = {k: v for k, v in full.at_peak.items() if v}
    assert {k: v for k, v in fast.at_peak.items() if v} == nonzero
    own = {k: v for k, v in full.category_peaks.items() if v}
    assert {k: v for k, v in fast.category_peaks.items() if v} == own


@pytest.mark.simulation
@pytest.mark.parametrize("strategy", ["ddp", "no_shard", "shard_grad_op", "hybrid_shard"])
def test_the_fast_path_equals_the_full_simulation_on_a_dense_model(strategy: str) -> None:
    for ac in ("none", "full"):
        config = shardwise.ParallelConfig(strategy=strategy, mixed_precision="bf16")
        _same(*_both(llama, config, activation_checkpointing=ac))


def test_full_shard_with_every_second_block_checkpointed_groups_by_the_choice() -> None:
    """every_2 checkpoints blocks 0, 2, 4...: the run alternates with period 2, and the
    traces keep each block's choice."""
    config = shardwise.ParallelConfig(strategy="full_shard", activation_checkpointing="every_2")
    fast, full = _both(functools.partial(llama, 12), config)
    _same(fast, full)
    assert "2 kinds alternating" in fast.notes[0]


@pytest.mark.simulation
@pytest.mark.parametrize("factory", [gemma2, qwen2_moe, mixtral], ids=lambda f: f.__name__)
def test_alternating_attention_and_moe_models_compose_exactly(factory) -> None:  # type: ignore[no-untyped-def]
    config = shardwise.ParallelConfig(strategy="full_shard")
    _same(*_both(factory, config, activation_checkpointing="full"))
    _same(*_both(factory, config))


def test_the_sliding_and_global_layers_are_two_kinds() -> None:
    with torch.device("meta"):
        model = gemma2()
    run, _ = plan_run(model, shardwise.ParallelConfig())
    assert run is not None and run.period == 2 and run.run == 12


@pytest.mark.simulation
def test_tp_ep_and_adapters_compose_exactly() -> None:
    _same(*_both(llama, shardwise.ParallelConfig(strategy="full_shard", tp=2)))
    sp = shardwise.ParallelConfig(tp=2, sequence_parallel=True, activation_checkpointing="full")
    _same(*_both(llama, sp))
    _same(*_both(mixtral, shardwise.ParallelConfig(strategy="full_shard", ep=2)))
    _same(*_both(lora_llama, shardwise.ParallelConfig(strategy="full_shard")))
    _same(*_both(lora_llama, shardwise.ParallelConfig(strategy="ddp")))


@pytest.mark.simulation
def test_each_pipeline_stage_composes_exactly() -> None:
    config = shardwise.ParallelConfig(pp=2, pp_microbatches=2, activation_checkpointing="full")
    fast, full = _both(functools.partial(llama, 16), config)
    assert fast.peak == full.peak
    assert [s["peak"] for s in fast.stages] == [s["peak"] for s in full.stages]
    assert [s["path"] for s in fast.stages] == ["fast", "fast"]


def test_an_index_dependent_block_is_traced_whole_and_said() -> None:
    fast, full = _both(Widening, shardwise.ParallelConfig(strategy="full_shard"), seq_len=8)
    _same(fast, full)
    assert "blocks[0:7] (7 blocks, one kind of block)" in fast.notes[0]
    assert "7 other block(s) traced whole" in fast.notes[0]


def test_a_model_too_short_to_compose_is_simulated_whole_and_says_so() -> None:
    report = shardwise.simulate_step(
        functools.partial(llama, 3), shardwise.ParallelConfig(), world=2, batch=1, seq_len=8
    )
    assert report.path == "full"
    assert report.notes[0].startswith("fast simulation not possible, every block traced")
    assert "(full simulation)" in str(report).splitlines()[0]
    assert report.to_dict()["path"] == "full" and "segments" not in report.to_dict()


def test_blocks_differing_in_dtype_or_checkpointing_are_not_the_same() -> None:
    with torch.device("meta"):
        model = llama(14)
    model.model.layers[5].to(torch.bfloat16)
    plan = plan_wrap(model, shardwise.ParallelConfig())
    keys = block_keys(model.model.layers, "model.layers", plan)
    assert keys[4] != keys[5] and keys[4] == keys[6]
    every_2 = plan_wrap(model.float(), shardwise.ParallelConfig(activation_checkpointing="every_2"))
    keys = block_keys(model.model.layers, "model.layers", every_2)
    assert keys[0] != keys[1] and keys[0] == keys[2]
    run = find_run(keys, "model.layers")
    assert run is not None and run.period == 2


def test_simulate_step_refuses_an_unknown_path() -> None:
    with pytest.raises(ValueError, match=r"path='quick'\): use 'fast'"):
        shardwise.simulate_step(
            llama,
            shardwise.ParallelConfig(),
            world=2,
            batch=1,
            seq_len=8,
            path="quick",  # type: ignore[arg-type]
        )


def test_the_plan_says_which_simulation_made_each_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--simulate` is the fast path, `--simulate=full` the full one; each row says which.
    An override right after `--simulate` is still an override."""
    from shardwise.cli.main import main

    argv = ["plan", f"{__file__}:llama", "--world", "2", "--seq-len", "8", "--memory-budget",
            "80GB"]  # fmt: skip
    assert main([*argv, "--simulate", "parallel.strategy=auto"]) == 0
    fast = capsys.readouterr().out
    assert main([*argv, "--simulate=full", "parallel.strategy=auto"]) == 0
    full = capsys.readouterr().out
    row = r"  ddp\s+none\s+\S+ \S+\s+(\S+ \S+) (fast|full)  yes  <- chosen"
    fast_row, full_row = re.search(row, fast), re.search(row, full)
    assert fast_row and full_row, (fast, full)
    assert fast_row[2] == "fast" and full_row[2] == "full"
    assert fast_row[1] == full_row[1]  # the same figure


def test_simulations_under_tp_in_one_process_each_use_their_own_groups() -> None:
    """DTensor caches its sharding decisions with the mesh they were made on, and a mesh
    equals one of an earlier simulation with the same layout: hybrid_shard after full_shard
    at world 512 with tp sent a collective to a group full_shard's simulation had destroyed
    (the fast path, two traces per answer, made it common). Each simulation forgets them."""
    short = functools.partial(llama, 3)  # simulated whole: the cheapest

    def hybrid() -> int:
        config = shardwise.ParallelConfig(strategy="hybrid_shard", tp=2)
        return shardwise.simulate_step(short, config, world=512, batch=1, seq_len=8).peak

    first = hybrid()
    shardwise.simulate_step(
        short, shardwise.ParallelConfig(strategy="full_shard", tp=2), world=512, batch=1, seq_len=8
    )
    assert hybrid() == first


def test_a_run_too_short_to_save_is_traced_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """7 same blocks would be traced at 4 and 5: the whole model is cheaper, and says so."""
    monkeypatch.setattr(compose, "ONLY_IF_SHORTER", True)
    report = shardwise.simulate_step(llama, shardwise.ParallelConfig(), world=2, batch=1, seq_len=8)
    assert report.path == "full"
    assert "a run of 7 same blocks, and composing traces 4 + 5" in report.notes[0]


def test_the_comparison_rejects_a_composition_that_drops_the_edge_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control: with one period traced apart at each end instead of two, the
    second block's prefetching is composed as a middle block's, and the comparison above
    sees it (measured: 450,080 against 469,776 B under shard_grad_op, bf16, AC full)."""
    monkeypatch.setattr(compose, "EDGE_PERIODS", 1)
    config = shardwise.ParallelConfig(strategy="shard_grad_op", mixed_precision="bf16")
    fast, full = _both(llama, config, activation_checkpointing="full")
    assert fast.path == "fast" and fast.peak != full.peak
    with pytest.raises(AssertionError):
        _same(fast, full)


def test_simulate_takes_fast_or_full(capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.cli.main import main

    with pytest.raises(SystemExit):
        main(["plan", f"{__file__}:llama", "--world", "2", "--simulate=quick"])
    assert "--simulate=quick: --simulate takes fast or full" in capsys.readouterr().err


@pytest.mark.parametrize("word", ["fast", "full"])
def test_a_bare_simulate_never_takes_the_model(word: str) -> None:
    from shardwise.cli.main import _bare_simulate

    # Before --simulate took a value, `plan --simulate MODEL` worked: it still does.
    assert _bare_simulate(["plan", "--simulate", "m.py:f", "--world", "2"]) == [
        "plan", "--simulate=fast", "m.py:f", "--world", "2",
    ]  # fmt: skip
    assert _bare_simulate(["plan", "m.py:f", "--simulate", "a.b=1"])[2] == "--simulate=fast"
    assert _bare_simulate(["plan", "m.py:f", "--simulate"])[-1] == "--simulate=fast"
    assert _bare_simulate(["plan", "m.py:f", "--simulate", word])[-2:] == ["--simulate", word]
    # A script's own --simulate under `shardwise run` is left alone.
    assert _bare_simulate(["run", "s.py", "--simulate", "x"]) == ["run", "s.py", "--simulate", "x"]


_DERIVED = re.compile(r"stage\(s\) ([\d, ]+) hold the same blocks")


def _derived(report: shardwise.SimReport) -> list[int]:
    found = _DERIVED.search(report.notes[0])
    return [int(i) for i in found.group(1).split(", ")] if found else []


@pytest.mark.simulation
@pytest.mark.parametrize(
    ("schedule", "pp", "world", "derived"),
    [("1f1b", 4, 8, []), ("gpipe", 4, 4, [2]), ("1f1b", 5, 5, [2])],
)
def test_pipeline_stages_holding_the_same_blocks_are_derived_exactly(
    schedule: str, pp: int, world: int, derived: list[int]
) -> None:
    """Middle stages holding the same blocks: under GPipe one is traced and copied (the
    same step); under 1F1B the fewest and most micro-batches in flight are traced and the
    stages between interpolated (pp 5: stage 2, 3 in flight, between 4 and 2). Measured:
    every stage equal to the byte."""
    config = shardwise.ParallelConfig(pp=pp, pp_schedule=schedule)
    fast, full = _both(functools.partial(llama, 2 * pp), config, world=world, batch=2 * pp)
    _same(fast, full, paths=False)  # stages of 2 blocks: each traced whole
    assert [s["peak"] for s in fast.stages] == [s["peak"] for s in full.stages]
    assert [s["model_states"] for s in fast.stages] == [s["model_states"] for s in full.stages]
    assert _derived(fast) == derived and _derived(full) == []
    distinct = 3 if schedule == "gpipe" else pp  # in flight differs: every stage differs
    assert len({s["peak"] for s in full.stages}) == distinct


@pytest.mark.simulation
def test_stages_holding_different_blocks_are_each_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp_split gives the middle stages 2, 3 and 2 blocks: stage 2 is not derived from
    stages 1 and 3 (which are, with 4 and 2 in flight, both traced). The negative control:
    with every derived stage given the lower traced stage's figures instead of the line
    between them, the comparison of the test above rejects stage 2 of the plain split
    (measured: 621,948 against 554,616 B)."""
    split = [f"model.layers.{i}" for i in (2, 4, 7, 9)]
    config = shardwise.ParallelConfig(pp=5, pp_split=split)
    fast, full = _both(functools.partial(llama, 10), config, world=5, batch=10)
    assert _derived(fast) == []
    assert [s["peak"] for s in fast.stages] == [s["peak"] for s in full.stages]
    from shardwise.memory import stage_groups

    monkeypatch.setattr(stage_groups, "_line", lambda x, y, at, span: x)
    fast, full = _both(
        functools.partial(llama, 10), shardwise.ParallelConfig(pp=5), world=5, batch=10
    )
    assert _derived(fast) == [2] and fast.peak == full.peak  # the reported stage is a traced one
    assert fast.stages[2]["peak"] != full.stages[2]["peak"]


class _SteppedAdamW(torch.optim.AdamW):
    """Not AdamW itself: its warm-up state comes from a whole step on zero gradients."""


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_adams_state_made_without_a_step_is_the_steps(strategy: str) -> None:
    """Adam and AdamW make their state for the tracked step without the warm-up step's
    arithmetic (memory/tracking.py): the figures equal those of a warm-up step (a subclass
    takes that path). Measured: equal to the byte."""
    config = shardwise.ParallelConfig(strategy=strategy, mixed_precision="bf16")
    kw = {"world": 2, "batch": 2, "seq_len": 16, "path": "full"}
    made = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)
    fast = shardwise.simulate_step(llama, config, optimizer=made, **kw)
    stepped = shardwise.simulate_step(
        llama, config, optimizer=made.__class__(_SteppedAdamW, **made.keywords), **kw
    )
    _same_figures = (fast.peak, fast.at_peak, fast.category_peaks)
    assert _same_figures == (stepped.peak, stepped.at_peak, stepped.category_peaks)
    assert fast.at_peak["optimizer"] > 0


def test_traces_side_by_side_give_the_reports_of_traces_one_after_another() -> None:
    """simulate_steps runs every config's traces (each stage's too) in forked workers
    (memory/workers.py): each report equals, field for field, the one made in this
    process one trace after another, and simulate_step's for that config alone."""
    import dataclasses

    configs = [
        shardwise.ParallelConfig(strategy="ddp"),
        shardwise.ParallelConfig(strategy="full_shard", mixed_precision="bf16"),
        shardwise.ParallelConfig(strategy="full_shard", pp=2, pp_microbatches=2),
    ]
    kw = {"world": 4, "batch": 2, "seq_len": 16}
    build = functools.partial(llama, 16)
    forked = shardwise.memory.simulate_steps(build, configs, workers=2, **kw)
    here = shardwise.memory.simulate_steps(build, configs, workers=1, **kw)
    alone = shardwise.simulate_step(build, configs[1], workers=1, **kw)
    assert [r.path for r in forked] == ["fast", "fast", "fast"]
    assert [dataclasses.asdict(r) for r in forked] == [dataclasses.asdict(r) for r in here]
    assert dataclasses.asdict(forked[1]) == dataclasses.asdict(alone)
