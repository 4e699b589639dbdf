"""The simulation against a real run: same model, config and world size, real tensors on
gloo/CPU, measured by the same tracker over the same step (`shardwise.simulate.tracked_step`).

Guarantee tested: simulating gloo (the backend these real runs use), the simulated per-rank
peak is within 5% of the real one (full_shard and ddp, fp32, AC off; and a Hugging Face
Llama whose untied embedding and head make the root unit's reduce-scatter the peak), on
every rank of the real run.

The ranks of a real run are symmetric but not always equal to the byte: gloo's worker
thread drops its references to a collective's tensors after `wait()` has returned, and
how late depends on the scheduler. No wait in the step can order it, so the checks here
hold each rank to the simulation, and hold the ranks to each other within 1% (one CI run
on a loaded machine: 4.5 KiB apart in 15.5 MiB).
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardwise import ParallelConfig
from shardwise.memory import real_step as measure_real_step
from shardwise.memory import simulate_step
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4)
WORLD = 2
BATCH = 4


def real_step(strategy: str, ac: str, precision: str) -> dict:
    torch.manual_seed(0)
    config = ParallelConfig(
        strategy=strategy, activation_checkpointing=ac, mixed_precision=precision
    )
    return measure_real_step(functools.partial(GPT, CFG), config, batch=BATCH, seq_len=CFG.seq_len)


def simulated(strategy: str, ac: str = "none", precision: str = "fp32"):
    return simulate_step(
        functools.partial(GPT, CFG),
        ParallelConfig(strategy=strategy, mixed_precision=precision),
        world=WORLD,
        batch=BATCH,
        seq_len=CFG.seq_len,
        activation_checkpointing=ac,
        backend="gloo",
    )


@pytest.mark.parametrize("strategy", ["full_shard", "ddp"])
def test_simulated_peak_is_within_5_percent_of_the_real_run(strategy):
    real = run_distributed(real_step, WORLD, args=(strategy, "none", "fp32"), timeout_s=120)
    peaks = [rank["peak"] for rank in real]
    assert max(peaks) - min(peaks) <= 0.01 * max(peaks), peaks  # symmetric ranks
    sim = simulated(strategy)
    for rank in real:
        assert sim.peak == pytest.approx(rank["peak"], rel=0.05), (sim, rank)


def untied_llama() -> torch.nn.Module:
    """A large vocabulary against a small body, embedding and head untied: both sit in the
    root unit, whose reduce-scatter input (both gradients) is the largest buffer of the
    step, and gloo's reduce-scatter clones it."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def real_llama_step() -> dict:
    torch.manual_seed(0)
    return measure_real_step(
        untied_llama, ParallelConfig(strategy="full_shard"), batch=1, seq_len=128
    )


def test_untied_large_vocabulary_llama_is_within_5_percent_of_the_real_run():
    pytest.importorskip("transformers")
    real = run_distributed(real_llama_step, WORLD, timeout_s=180)
    sim = simulate_step(
        untied_llama,
        ParallelConfig(strategy="full_shard"),
        world=WORLD,
        batch=1,
        seq_len=128,
        backend="gloo",
    )
    # gloo may free a reduce-scatter's clone late, from its worker thread (fake.py): a rank
    # can then peak one layer's gradients higher, well inside 5% here.
    for rank in real:
        assert sim.peak == pytest.approx(rank["peak"], rel=0.05), (sim, rank)
