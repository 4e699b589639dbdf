"""The launcher's flags and arguments, value by value (the five habits of docs/testing.md):
non-finite seconds, the counts each flag refuses at its edge, each spelling of the config
argument, each dimension of the layout checked before spawning, and the torchrun arguments
of a job over several nodes, every one."""

from __future__ import annotations

import argparse

import pytest
import torch

from shardwise.cli.launch import check_layout, launcher_args, nproc_arg, seconds_arg
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


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", ""])
def test_an_nproc_that_is_no_positive_count_is_refused(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"use a positive integer or 'auto'"):
        nproc_arg(value)


def test_an_nproc_of_one_or_more_or_auto_is_taken() -> None:
    assert [nproc_arg(v) for v in ("1", "8")] == [1, 8]
    assert nproc_arg("auto") == (torch.cuda.device_count() or 2)


def _nodes(nnodes: str, node_rank: int) -> argparse.Namespace:
    return argparse.Namespace(nproc=2, nnodes=nnodes, rdzv_endpoint="head:29400",
                              node_rank=node_rank, max_restarts=0, rdzv_id=None)  # fmt: skip


@pytest.mark.parametrize("node_rank", [0, 1, 2])
def test_a_node_rank_is_below_the_number_of_nodes(node_rank: int) -> None:
    args = _nodes("2", node_rank)
    if node_rank < 2:
        got = launcher_args(args)
        assert got[got.index("--node_rank") + 1] == str(node_rank)
        return
    with pytest.raises(ValueError, match=r"--node-rank=2 must be in \[0, --nnodes=2\)"):
        launcher_args(args)


def test_an_elastic_job_leaves_the_node_rank_to_the_rendezvous() -> None:
    got = launcher_args(_nodes("1:2", 5))
    assert got[got.index("--nnodes") + 1] == "1:2"


@pytest.mark.parametrize("spelling", ["separate", "equals"])
def test_each_spelling_of_the_config_argument_is_checked(tmp_path, spelling: str) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  strategy: full_shard\n")
    given = ["--config", str(config)] if spelling == "separate" else [f"--config={config}"]
    with pytest.raises(ValueError, match=r"at world size 3: ParallelConfig\.pp=2 does not divide"):
        check_layout([*given, "parallel.pp=2"], 3)
    check_layout([*given, "parallel.pp=2"], 4)
    check_layout(["parallel.pp=2", "--config"], 3)  # no file given: the script's own default


def test_the_tensor_parallel_degree_is_checked_before_spawning(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  strategy: full_shard\n  tp: 4\n")
    with pytest.raises(ValueError, match=r"at world size 6: ParallelConfig\.tp=4 does not divide "
                       r"the 6 ranks"):  # fmt: skip
        check_layout(["--config", str(config)], 6)
    check_layout(["--config", str(config)], 8)
