"""Memory under expert parallel, before any real group: the stated routing's counts, the
simulated step at ep 2, and `shardwise plan --ep`. (The simulation against a real run at
world 4 is in tests/distributed/test_expert_parallel.py.)"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.cli.main import main
from shardwise.parallelize.experts import StatedRouting, stated_routing

TOKENS, TOP_K = 8, 2


def qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, use_cache=False,
        head_dim=4, num_experts=4, num_experts_per_tok=TOP_K, moe_intermediate_size=64,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def test_the_stated_routing_sends_evenly_and_loads_the_busiest_rank_as_stated() -> None:
    n = TOKENS * TOP_K
    sent, got = StatedRouting(1.0).splits(TOKENS, TOP_K, ep=4, local=1)
    assert sent == [4, 4, 4, 4] and got == [4, 4, 4, 4]  # balanced: it receives what it sends
    assert sum(StatedRouting(1.5).splits(TOKENS, TOP_K, ep=4, local=1)[1]) == 1.5 * n
    # Never more than can reach one rank: each token sends it at most min(k, local) copies.
    for load in ("worst", 100.0):
        routing = StatedRouting(load)
        sent, got = routing.splits(TOKENS, TOP_K, ep=4, local=1)
        assert sum(got) == 4 * TOKENS * 1 and max(got) - min(got) <= 1
        assert routing.seen == [(TOKENS, TOP_K, 4 * TOKENS)]
    assert sum(StatedRouting("worst").splits(TOKENS, TOP_K, ep=2, local=4)[1]) == 2 * n
    assert StatedRouting(1.0).splits(7, 1, ep=3, local=2)[0] == [3, 2, 2]
    for bad in (0.5, "most", None):
        with pytest.raises(
            ValueError, match=r"a number >= 1 \(1: perfectly balanced\), or 'worst'"
        ):
            with stated_routing(bad):  # type: ignore[arg-type]
                pass


def _simulate(ep: int, load: float | str = 2.0) -> shardwise.SimReport:
    return shardwise.simulate_step(
        qwen3_moe, shardwise.ParallelConfig(strategy="full_shard", ep=ep), world=4, batch=1,
        seq_len=TOKENS, backend="gloo", expert_load=load,
    )  # fmt: skip


@pytest.mark.heavy
def test_a_simulated_step_under_ep_states_its_routing_and_keeps_the_model_states() -> None:
    balanced, worst = _simulate(2, 1.0), _simulate(2, "worst")
    assert (balanced.ep, str(balanced).split(" at ")[0]) == (2, "full_shard x ep 2")
    rows = [
        int(re.search(r"receiving (\d+) rows", r.notes[-1]).group(1)) for r in (balanced, worst)
    ]  # type: ignore[union-attr]
    assert rows == [TOKENS * TOP_K, 2 * TOKENS * TOP_K]  # worst at ep 2, 2 local: every copy
    assert "expert_load='worst'" in worst.notes[-1]
    assert worst.peak > balanced.peak  # the busiest rank holds the extra rows' activations
    # Each expert is split over the 4 shard ranks with or without ep: the same model states.
    without = _simulate(1)
    assert without.ep == 1 and not any("routing" in n for n in without.notes)
    for category in ("params", "optimizer"):
        assert balanced.category_peaks[category] == without.category_peaks[category]
    # ep gathers 2 of 4 experts per layer, not all 4
    assert balanced.category_peaks["gathered_params"] < without.category_peaks["gathered_params"]


@pytest.fixture
def moe_factory(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """This file's qwen3_moe as MODULE:FACTORY for `shardwise plan`."""
    (tmp_path / "moe_factory.py").write_text(
        f"from importlib.util import spec_from_file_location, module_from_spec\n"
        f"spec = spec_from_file_location('expert_memory', {__file__!r})\n"
        "module = module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "build = module.qwen3_moe\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "moe_factory:build"


@pytest.mark.heavy
def test_plan_with_ep_shows_where_the_experts_go_and_simulates_the_busiest_rank(
    moe_factory, capsys
) -> None:  # type: ignore[no-untyped-def]
    argv = ["plan", moe_factory, "--world", "4", "parallel.strategy=full_shard", "--ep", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "experts: ep 2 x 2 shard rank(s)" in out
    assert "2 experts module(s) (model.layers.0.mlp.experts, ...), each rank holding 2 of 4" in out
    assert "as without ep" in out and "need --simulate" in out
    argv += ["--simulate", "--seq-len", str(TOKENS), "--expert-load", "worst"]
    assert main(argv) == 0
    assert f"receiving {2 * TOKENS * TOP_K} rows per experts layer" in capsys.readouterr().out
    assert main([*argv[:-1], "most"]) == 2
    assert "--expert-load most: give the busiest rank's received rows" in capsys.readouterr().err
    dense = ["plan", "shardwise.testing.models:GPT", "--world", "4", "--ep", "2"]
    assert main(dense) == 2
    assert "GPT has no experts module to spread over ranks" in capsys.readouterr().err


@pytest.mark.heavy
def test_a_mixture_of_experts_is_traced_and_simulated_in_fp32(moe_factory, capsys) -> None:  # type: ignore[no-untyped-def]
    # torch's meta kernel for the grouped matrix product takes bf16 only; the CPU and CUDA
    # kernels take fp32 too, and so do the activation trace and the simulation.
    report = _simulate(1)
    assert report.category_peaks["activations"] > 0 and report.peak > report.model_states
    assert main(["plan", moe_factory, "--world", "4", "--seq-len", str(TOKENS)]) == 0
    # the instant estimate of the peak with activations traces the forward
    assert re.search(r"\n  full_shard +none +[\d.]+ KiB +- +yes", capsys.readouterr().out)


@pytest.mark.heavy
def test_no_rank_is_charged_a_whole_experts_parameter_it_never_holds() -> None:
    # DTensor learns an op's global output shape by running it on global-shaped fake
    # arguments. A real run's tracker never sees them; the simulation's must not either:
    # under ep 8 a rank gathers 8 of 64 experts, and at every forward (bf16 gathers make
    # FSDP rebuild its unsharded DTensor) it used to be charged all 64 for a moment.
    def wide() -> nn.Module:
        config = transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, use_cache=False,
            head_dim=16, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=256,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(config)

    report = shardwise.simulate_step(
        wide, shardwise.ParallelConfig(strategy="full_shard", ep=8, mixed_precision="bf16"),
        world=8, batch=1, seq_len=TOKENS, expert_load=1.0,
    )  # fmt: skip
    whole_gate_up = 64 * 2 * 256 * 64 * 2  # experts x (gate, up) x width x hidden, bf16
    assert report.category_peaks["activations"] < whole_gate_up / 2, report


def test_a_forward_with_value_dependent_shapes_is_refused_with_the_reason() -> None:
    from shardwise.testing.models import TinyMoE

    with pytest.raises(Exception, match=r"A shape there depends on tensor values \(torch.where"):
        shardwise.simulate_step(
            TinyMoE, shardwise.ParallelConfig(ep=2), world=4, batch=1, seq_len=TOKENS
        )


def test_a_grouped_product_of_another_shape_is_refused_by_the_simulation() -> None:
    from shardwise.memory.fake import shaped_grouped_mm

    with shaped_grouped_mm():
        a, b = torch.zeros(4, 8), torch.zeros(2, 8, 3)
        assert torch.nn.functional.grouped_mm(a, b, offs=None).shape == (4, 3)
        with pytest.raises(NotImplementedError, match=r"simulated for \(rows, in\) x"):
            torch.nn.functional.grouped_mm(torch.zeros(2, 4, 8), b)
