"""Model factories for `bench/plan_memory.py` (`shardwise plan MODULE:FACTORY` imports them
by path): the Llama-3 shapes of `bench/memory_sim.py` (untied, `use_cache=False`) and
transformers' DeepSeek-V3 at its default configuration. Built on meta by the plan."""

from __future__ import annotations

from typing import Any

LLAMA3: dict[str, dict[str, int]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8),
}  # fmt: skip


def _llama(shape: dict[str, int]) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False, use_cache=False, **shape,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def llama3_8b() -> Any:
    return _llama(LLAMA3["8b"])


def llama3_70b() -> Any:
    return _llama(LLAMA3["70b"])


def llama3_405b() -> Any:
    return _llama(LLAMA3["405b"])


def deepseek_v3() -> Any:
    import transformers

    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(use_cache=False))


def tiny_llama() -> Any:
    """For the smoke run: 6 layers, the fewest the fast path composes."""
    return _llama(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
