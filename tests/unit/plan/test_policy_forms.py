"""How an auto_wrap_policy callable is asked (issue 34's planted bugs).

A callable with FSDP1's signature `(module, recurse, nonwrapped_numel)` is asked with
recurse=False, as FSDP1 did when deciding whether to wrap the module itself; FSDP1 policies
return True for recurse=True ("keep descending"), so asking with True would make every
module a unit.
"""

from __future__ import annotations

from torch import nn

from shardwise import ParallelConfig
from shardwise.plan.planner import plan_wrap
from shardwise.testing.models import GPT, Block, GPTConfig


def test_an_fsdp1_style_callable_is_asked_whether_to_wrap_the_module_itself():
    asked: list[bool] = []

    def fsdp1_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        asked.append(recurse)
        if recurse:
            return True  # FSDP1's idiom: always descend
        return isinstance(module, Block)

    plan = plan_wrap(GPT(GPTConfig()), ParallelConfig(auto_wrap_policy=fsdp1_policy))
    assert [u.fqn for u in plan.units] == ["blocks.0", "blocks.1", ""]
    assert asked and set(asked) == {False}


def test_a_two_argument_callable_is_given_the_name_and_the_module():
    seen: list[tuple[str, str]] = []

    def by_name(fqn: str, module: nn.Module) -> bool:
        seen.append((fqn, type(module).__name__))
        return fqn.startswith("blocks.") and fqn.count(".") == 1

    plan = plan_wrap(GPT(GPTConfig()), ParallelConfig(auto_wrap_policy=by_name))
    assert [u.fqn for u in plan.units] == ["blocks.0", "blocks.1", ""]
    assert ("blocks.0", "Block") in seen and ("blocks.0.attn", "Attention") in seen
