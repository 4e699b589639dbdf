"""The launcher's flags and arguments, value by value (the five habits of docs/testing.md):
non-finite seconds, the counts each flag refuses at its edge, each spelling of the config
argument, each dimension of the layout checked before spawning, and the torchrun arguments
of a job over several nodes, every one."""

from __future__ import annotations

import argparse

import pytest

from shardwise.cli.launch import seconds_arg
from shardwise.distributed.process_group import _timeout_from_env, init_distributed


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_a_collective_timeout_that_is_not_a_finite_number_of_seconds_is_refused(value: str) -> None:
    """--timeout inf passed `> 0` and started every worker, each then failing in
    timedelta(seconds=inf) with OverflowError; so did SHARDWISE_TIMEOUT_S=inf and
    init_distributed(timeout_s=inf). NaN was refused by the flag and the variable, not by
    init_distributed."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"use a positive number of seconds"):
        seconds_arg(value)
    with pytest.raises(ValueError, match=r"SHARDWISE_TIMEOUT_S=.* must be a positive number"):
        _timeout_from_env({"SHARDWISE_TIMEOUT_S": value})
    with pytest.raises(ValueError, match=r"must be > 0 seconds, and finite"):
        init_distributed(timeout_s=float(value))
    assert seconds_arg("1e6") == 1e6 and _timeout_from_env({"SHARDWISE_TIMEOUT_S": "0.5"}) == 0.5
