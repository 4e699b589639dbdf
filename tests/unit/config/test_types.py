"""The config dataclasses type their closed sets as `Literal`s, and validate them too.

A closed set typed `str` lets mypy pass `strategy="ful_shard"` and the reference call it any
string. Every field typed as a plain string is either a closed set (listed in CLOSED_SETS,
typed `Literal`) or open for a reason (listed in OPEN_STRINGS); a new field that is neither
fails here until someone decides which it is.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from typing import Literal, Union, get_args, get_origin

import pytest

import shardwise.config as config_package
from shardwise.config import (
    FallbackConfig,
    OptimizerConfig,
    ParallelConfig,
    Precision,
    RunnerConfig,
    SchedulerConfig,
    TrainConfig,
)
from shardwise.config.run_file import ConfigError
from shardwise.config.translation import Translation

CLOSED_SETS: dict[tuple[type, str], tuple[str, ...]] = {
    (ParallelConfig, "strategy"): (
        "ddp",
        "no_shard",
        "shard_grad_op",
        "full_shard",
        "hybrid_shard",
        "hybrid_shard_zero2",
        "auto",
    ),
    (ParallelConfig, "mixed_precision"): ("fp32", "bf16", "fp16"),
    (ParallelConfig, "backward_prefetch"): ("pre", "post"),
    (ParallelConfig, "frozen_policy"): ("split", "warn", "error"),
    (TrainConfig, "on_nonfinite"): ("stop", "skip"),
    (Translation, "source"): ("DeepSpeed", "Accelerate", "torchtitan"),
    (OptimizerConfig, "name"): ("adamw", "adam", "sgd", "muon"),
    (OptimizerConfig, "adjust_lr_fn"): ("original", "match_rms_adamw"),
    (OptimizerConfig, "ns_dtype"): ("bfloat16", "float32", "float64", "float16"),
    (FallbackConfig, "name"): ("adamw", "adam", "sgd"),
    (SchedulerConfig, "name"): ("none", "constant", "cosine", "linear"),
}
"""Each closed-set field and the strings it takes (besides other systems' spellings of them,
which ParallelConfig translates at run time)."""

ALONGSIDE: dict[tuple[type, str], dict[str, object]] = {
    (OptimizerConfig, "adjust_lr_fn"): {"name": "muon"},
    (OptimizerConfig, "ns_dtype"): {"name": "muon"},
}
"""Closed sets that only some values of another field read (muon's keys), with that value."""

OPEN_STRINGS: dict[tuple[type, str], str] = {
    (ParallelConfig, "auto_wrap_policy"): "register_wrap_policy adds names; 're:<regex>' on FQNs",
    (ParallelConfig, "activation_checkpointing"): "'every_<k>' for any k",
    (ParallelConfig, "memory_budget"): "sizes ('70GiB') and percentages ('85%')",
    (ParallelConfig, "compile"): "any torch.compile backend name",
    (RunnerConfig, "run_dir"): "a path",
    (RunnerConfig, "checkpoint_dir"): "a path",
    (RunnerConfig, "resume"): "'latest' or a checkpoint's path",
}
"""Fields typed `str` (or with a `str` arm) on purpose, and why the set is open."""


def _config_classes() -> list[type]:
    found = [getattr(config_package, n) for n in config_package.__all__]
    return [c for c in found if isinstance(c, type) and dataclasses.is_dataclass(c)]


def _arms(tp: object) -> tuple[object, ...]:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def _fields(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def test_the_config_classes_are_found():
    classes = set(_config_classes())
    assert {ParallelConfig, Precision, RunnerConfig, TrainConfig, OptimizerConfig} <= classes
    assert {cls for cls, _ in CLOSED_SETS} <= classes


@pytest.mark.parametrize(("where", "values"), CLOSED_SETS.items(), ids=lambda x: str(x))
def test_closed_sets_are_literals_of_their_values(where, values):
    cls, name = where
    arms = _arms(_fields(cls)[name])
    assert str not in arms, f"{cls.__name__}.{name} is a closed set typed with a plain str arm"
    literals = [v for a in arms if get_origin(a) is Literal for v in get_args(a)]
    assert tuple(literals) == values, f"{cls.__name__}.{name}: {literals} != {values}"


def test_every_plain_string_field_is_open_for_a_reason():
    plain = {
        (cls, name)
        for cls in _config_classes()
        for name, tp in _fields(cls).items()
        if str in _arms(tp)
    }
    undecided = sorted(f"{cls.__name__}.{name}" for cls, name in plain - set(OPEN_STRINGS))
    assert not undecided, (
        f"{undecided} typed str: a closed set becomes a Literal (and goes in CLOSED_SETS); an "
        "open one goes in OPEN_STRINGS with the reason"
    )
    stale = sorted(f"{cls.__name__}.{name}" for cls, name in set(OPEN_STRINGS) - plain)
    assert not stale, f"{stale} are no longer typed str: remove them from OPEN_STRINGS"


@pytest.mark.parametrize(("where", "values"), CLOSED_SETS.items(), ids=lambda x: str(x))
def test_closed_sets_take_each_value_and_refuse_others_when_built_in_python(where, values):
    cls, name = where
    base = ALONGSIDE.get(where, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backward_prefetch='post' warns that FSDP2 differs
        for value in values:
            assert getattr(cls(**base, **{name: value}), name) == value
    with pytest.raises((ValueError, ConfigError), match=r"not-a-choice"):
        cls(**base, **{name: "not-a-choice"})


def test_other_systems_words_stay_accepted_at_run_time():
    # Not typed (a typed caller gets a mypy error steering it to the canonical word), but
    # translated at run time as before: FSDP1's objects and names, Lightning's presets.
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

    assert ParallelConfig(strategy="FULL_SHARD").strategy == "full_shard"
    hybrid = ParallelConfig(strategy=ShardingStrategy.HYBRID_SHARD, dp_shard=2)
    assert hybrid.strategy == "hybrid_shard"
    assert (
        ParallelConfig(backward_prefetch=BackwardPrefetch.BACKWARD_PRE).backward_prefetch_depth == 1
    )
    assert ParallelConfig(mixed_precision="bf16-mixed").precision.is_mixed
    assert ParallelConfig(mixed_precision=MixedPrecision()).precision == Precision()
