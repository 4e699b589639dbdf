"""strategy='auto' and the instant peak estimate: budgets, the choice, the error, and the
estimate against the fake-tensor simulation."""

from __future__ import annotations

import functools

import pytest
import torch

import shardwise
from shardwise import ParallelConfig, wrap
from shardwise.config import parse_memory_budget
from shardwise.memory import InstantPeak, NoPlanFitsError, choose_plan, simulate_step
from shardwise.memory.activations import ActivationTrace
from shardwise.memory.auto import Candidate, format_rows
from shardwise.memory.model_states import estimate_memory, estimate_peak
from shardwise.testing.models import GPT, GPTConfig

MiB = 2**20
# Big enough that activations and states dominate fixed overheads (as in real models).
MODEL = functools.partial(
    GPT, GPTConfig(vocab_size=8192, seq_len=256, d_model=256, n_heads=8, n_layers=6)
)


def test_memory_budget_spellings() -> None:
    assert parse_memory_budget("70GiB") == 70 * 2**30
    assert parse_memory_budget("80 GB") == 80 * 10**9
    assert parse_memory_budget("512MiB") == 512 * MiB
    assert parse_memory_budget("85%") == pytest.approx(0.85)
    assert parse_memory_budget(1234) == 1234
    assert parse_memory_budget(None) is None
    for bad in ("lots", "0GiB", "150%", -5, "12 parsecs", True):
        with pytest.raises(ValueError, match=r"memory_budget=.*not valid.*70GiB"):
            ParallelConfig(memory_budget=bad)


def test_wrap_refuses_an_unresolved_auto_config_with_the_fix() -> None:
    with pytest.raises(ValueError, match="choose_plan"):
        wrap(torch.nn.Linear(2, 2), ParallelConfig(strategy="auto"))
    with pytest.raises(ValueError, match="choose_plan"):
        wrap(torch.nn.Linear(2, 2), ParallelConfig(activation_checkpointing="auto"))


def _bench_llama() -> torch.nn.Module:
    """A Hugging Face Llama with untied embedding and head (a large root unit, whose
    gather and reduce are moments of their own), as bench/memory_sim.py's scale runs."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, use_cache=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


# The bench models (bench/memory_sim.py's GPT and a Llama), each at a world where hybrid
# has two dimensions; mixed precision where the Llama trains in it.
BENCH = {
    "gpt_fp32": (MODEL, 4, 2, 256, "fp32"),
    "llama_bf16": (_bench_llama, 8, 1, 256, "bf16"),
    "llama_fp32": (_bench_llama, 8, 1, 256, "fp32"),
}
TOLERANCE = 0.10  # docs/memory.md; shardwise.memory.auto.ESTIMATE_TOLERANCE marks wider gaps


@pytest.mark.parametrize("bench", list(BENCH))
@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.heavy
def test_instant_estimate_within_ten_percent_of_the_simulation(bench: str, ac: str) -> None:
    factory, world, batch, seq_len, precision = BENCH[bench]
    with torch.device("meta"):
        model = factory()
    instant = InstantPeak(model, world, batch, seq_len)
    ratios = {}
    for strategy in ("ddp", "no_shard", "shard_grad_op", "full_shard", "hybrid_shard",
                     "hybrid_shard_zero2"):  # fmt: skip
        cfg = ParallelConfig(strategy=strategy, activation_checkpointing=ac,
                             mixed_precision=precision)  # fmt: skip
        simulated = simulate_step(factory, cfg, world=world, batch=batch, seq_len=seq_len).peak
        ratios[strategy] = round(instant(cfg) / simulated, 3)
    assert all(abs(r - 1) <= TOLERANCE for r in ratios.values()), ratios


def _choose(budget: str, **kw: object) -> object:
    config = ParallelConfig(strategy="auto", memory_budget=budget, **kw)  # type: ignore[arg-type]
    return choose_plan(MODEL, config, world=4, batch=2, seq_len=256)


@pytest.mark.heavy
def test_auto_picks_ddp_when_it_fits() -> None:
    plan = _choose("1GiB")
    assert plan.chosen is not None and plan.chosen.strategy == "ddp"
    assert plan.chosen.simulated is not None and plan.chosen.simulated <= plan.budget
    assert plan.config.strategy == "ddp" and plan.config.activation_checkpointing == "none"
    assert "cheapest candidate" in plan.reason and "ddp" in str(plan)


@pytest.mark.heavy
def test_auto_picks_a_sharded_plan_when_ddp_does_not_fit() -> None:
    ddp = simulate_step(MODEL, ParallelConfig(strategy="ddp"), world=4, batch=2, seq_len=256)
    full = simulate_step(
        MODEL, ParallelConfig(strategy="full_shard"), world=4, batch=2, seq_len=256
    )
    budget = (ddp.peak + full.peak) // 2
    plan = choose_plan(
        MODEL, ParallelConfig(strategy="auto", memory_budget=budget), world=4, batch=2, seq_len=256
    )
    assert plan.chosen is not None and plan.chosen.strategy != "ddp"
    assert plan.rows[0].strategy == "ddp" and plan.rows[0].fits is False
    assert plan.chosen.peak <= budget
    # nothing cheaper than the choice fits
    assert all(r.fits is False for r in plan.rows[: plan.rows.index(plan.chosen)])


@pytest.mark.heavy
def test_auto_checkpointing_comes_after_every_strategy_without_it() -> None:
    no_ac = simulate_step(
        MODEL, ParallelConfig(strategy="full_shard"), world=4, batch=2, seq_len=256
    )
    plan = choose_plan(
        MODEL,
        ParallelConfig(
            strategy="auto", activation_checkpointing="auto", memory_budget=no_ac.peak - MiB
        ),
        world=4,
        batch=2,
        seq_len=256,
    )
    assert plan.chosen is not None and plan.chosen.activation_checkpointing != "none"
    assert [r.activation_checkpointing for r in plan.rows[:4]] == ["none"] * 4


def test_nothing_fits_names_the_smallest_peak_and_the_fixes() -> None:
    with pytest.raises(NoPlanFitsError) as caught:
        _choose("8MiB", activation_checkpointing="auto")
    message = str(caught.value)
    best = min(caught.value.plan.rows, key=lambda r: r.peak)
    assert "No plan fits" in message and best.strategy in message
    assert "8.0 MiB" in message
    for fix in ("--world", "cpu_offload=True", "smaller micro-batch", "memory_budget"):
        assert fix in message


def test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ() -> None:
    """The root unit's gather and reduce, no_shard's unsharded copies and the update's
    temporaries, from the model's own sizes (untied embedding and head: the root unit,
    16,384,512 parameters, holds most of them; bf16 compute, 8 ranks)."""
    with torch.device("meta"):
        model = _bench_llama()
    total = sum(p.numel() for p in model.parameters())
    root = total - sum(p.numel() for p in model.model.layers.parameters())
    assert (total, root) == (22_284_800, 16_384_512)
    plan = shardwise.plan_wrap(model, ParallelConfig(mixed_precision="bf16"))
    got = {e.strategy: e for e in estimate_memory(plan, 8, compute_dtype_bytes=2)}
    full, hybrid, no_shard = got["full_shard"], got["hybrid_shard"], got["no_shard"]
    assert full.root_gather == 2 * root  # its bf16 all-gather beside its bf16 parameters
    # unsharded bf16 gradients and their fp32 copy, less its 1/8 fp32 shard not yet there
    assert full.root_reduce == root * (2 + 4) - 4 * root // 8
    assert (hybrid.dp_shard, hybrid.root_reduce) == (4, root * (2 + 4) - 4 * root // 4)
    assert (no_shard.gathered, no_shard.root_gather, no_shard.root_reduce) == (2 * total, 0, 0)
    assert got["shard_grad_op"].root_gather == 0 and got["ddp"].gathered == 0
    # the update's temporaries: two gradients' worth over DDP's tensors, one over FSDP's
    trace = ActivationTrace(batch=1, seq_len=8, dtype="bfloat16", saved=0, largest=0)
    phases = {s: estimate_peak(e, trace, 0).phases for s, e in got.items()}
    assert phases["ddp"]["optimizer_step"] == 4 * total * (1 + 2 + 1 + 3)  # + buckets
    assert phases["no_shard"]["optimizer_step"] == 4 * total * (1 + 2 + 2)
    held = full.params + full.optimizer
    assert phases["full_shard"]["root_reduce"] == held + full.grads + full.root_reduce
    assert phases["full_shard"]["root_gather"] == held + full.gathered + 2 * root


def test_a_row_whose_estimate_is_off_the_simulation_says_which_to_trust() -> None:
    rows = [
        Candidate("full_shard", "none", 111 * MiB, simulated=100 * MiB, fits=True),
        Candidate("no_shard", "none", 89 * MiB, simulated=100 * MiB, fits=True),
        Candidate("ddp", "none", 110 * MiB, simulated=100 * MiB, fits=True),  # at the edge
        Candidate("shard_grad_op", "none", 150 * MiB, fits=False),  # not simulated: no gap
    ]
    lines = format_rows(rows).splitlines()
    assert lines[1].endswith("yes  (estimate +11% off the simulation: trust the simulated)")
    assert lines[2].endswith("yes  (estimate -11% off the simulation: trust the simulated)")
    assert lines[3].endswith("yes") and lines[4].endswith("no")


@pytest.mark.heavy
def test_without_the_simulation_no_row_says_it_was_not_simulated() -> None:
    # Before: "(estimate over 1.25x budget: not simulated)" though none was asked for.
    config = ParallelConfig(strategy="auto", memory_budget="1MiB")
    with pytest.raises(NoPlanFitsError) as caught:
        choose_plan(MODEL, config, world=4, batch=2, seq_len=256, simulate=False)
    rows = caught.value.plan.rows
    assert rows and all(r.note == "" and r.fits is False and r.simulated is None for r in rows)
    assert "not simulated" not in str(caught.value)
    with pytest.raises(NoPlanFitsError) as simulated:  # with it, the skip is said
        choose_plan(MODEL, config, world=4, batch=2, seq_len=256)
    assert {r.note for r in simulated.value.plan.rows} == {
        "estimate over 1.25x budget: not simulated"
    }


def test_trace_without_a_sequence_length_says_what_to_give() -> None:
    from shardwise.memory import trace_activations

    with torch.device("meta"):
        model = MODEL()
    with pytest.raises(ValueError, match="seq_len=None and no example_input"):
        trace_activations(model, batch=1, seq_len=None)


def test_a_gpu_budget_leaves_the_context_and_nccl_out(monkeypatch):
    # Before: 90% of the GPU's total memory against an allocated peak, with the CUDA
    # context, cuBLAS workspaces and NCCL buffers not counted anywhere.
    from types import SimpleNamespace

    import torch

    from shardwise.memory.auto import GPU_RESERVE, device_memory, resolve_budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(total_memory=80 * 2**30, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    total, source = device_memory("cuda")
    assert total == 80 * 2**30 - GPU_RESERVE == 78 * 2**30
    assert "less 2.00 GiB for the CUDA context, cuBLAS workspaces and NCCL buffers" in source
    budget, _ = resolve_budget(None, "cuda")
    assert budget == int(0.9 * 78 * 2**30)


def test_without_a_gpu_the_budget_says_it_judges_a_cpu_run():
    from shardwise.memory.auto import device_memory

    _, source = device_memory("cpu")
    assert "no GPU is visible, so this judges a CPU run; for a GPU job pass its memory" in source


def _llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.heavy
def test_tp_auto_comes_after_every_layout_without_tp_and_resolves_to_a_real_config() -> None:
    """A budget between the best layout without tp and tp 2 with sequence parallel: the
    planner walks every layout without tp first, then picks tp 2 (tp 4 would need 4 KV
    heads), and the resolved config wraps as it was simulated."""
    pytest.importorskip("transformers")
    shape = dict(world=4, batch=8, seq_len=256)
    plain = simulate_step(_llama, ParallelConfig(strategy="full_shard"), **shape).peak
    tp2 = ParallelConfig(strategy="full_shard", tp=2, sequence_parallel=True)
    split = simulate_step(_llama, tp2, **shape).peak
    assert split < plain
    config = ParallelConfig(strategy="auto", tp="auto", activation_checkpointing="none")
    auto = choose_plan(_llama, config, budget=(plain + split) // 2, **shape)
    layouts = [(r.strategy, r.tp) for r in auto.rows]
    assert layouts[:4] == [("ddp", 1), ("shard_grad_op", 1), ("hybrid_shard", 1), ("full_shard", 1)]
    assert all(not r.fits for r in auto.rows[:4])
    assert auto.chosen is not None and auto.chosen.tp == 2 and auto.chosen.sequence_parallel
    assert (
        "tp 4 not considered: ParallelConfig.tp=4: LlamaForCausalLM's config.num_key_value_heads=2"
        in str(auto)
    )
    resolved = auto.config
    assert (resolved.tp, resolved.sequence_parallel) == (2, True)
    assert "tp=2, sequence_parallel=True" in auto.reason
    with pytest.raises(NoPlanFitsError) as nothing:  # model states alone exceed it
        choose_plan(_llama, config, budget=64 * 1024, **shape)
    notes = {r.note for r in nothing.value.plan.rows if r.tp == 2}
    assert notes == {"model states alone over budget: not simulated"}
    with pytest.raises(
        ValueError, match=r"tp='auto', strategy='full_shard'\): the planner chooses"
    ):
        ParallelConfig(strategy="full_shard", tp="auto")
    with pytest.raises(ValueError, match=r"tp='auto' is chosen by simulating the model"):
        ParallelConfig(strategy="auto", tp="auto").tp_size  # noqa: B018
