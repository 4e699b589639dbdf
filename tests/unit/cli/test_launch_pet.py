"""torchrun's PET_* variables (Kubeflow Trainer's torch runtime sets five) as `shardwise run`
reads them: each variable as a flag's default, each flag beating its variable, each
malformed value refused in one line naming it, and the torchrun arguments they give."""

from __future__ import annotations

import argparse
import os

import pytest

from shardwise.cli import build_parser
from shardwise.cli.launch import launcher_args, resolve_env_defaults

KUBEFLOW = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *flags, "train.py"])


def _torchrun(args: argparse.Namespace, monkeypatch: pytest.MonkeyPatch, env: dict) -> list[str]:
    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return launcher_args(args)


def _value(torchrun: list[str], flag: str) -> str:
    return torchrun[torchrun.index(flag) + 1]


def test_every_variable_is_read_as_torchrun_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args()
    got = _torchrun(args, monkeypatch, KUBEFLOW)
    assert (args.nproc, args.nnodes, args.node_rank) == (4, "3", 1)
    assert _value(got, "--nproc_per_node") == "4"
    assert _value(got, "--nnodes") == "3"
    assert _value(got, "--node_rank") == "1"
    assert _value(got, "--rdzv_endpoint") == "job-node-0-0.job:29400"
    assert _value(got, "--rdzv_backend") == "c10d"
    assert _value(got, "--rdzv_conf") == "is_host=0"  # node 1 joins node 0's store
    assert "--standalone" not in got


def test_node_rank_zero_hosts_the_store_and_one_node_still_listens_on_the_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**KUBEFLOW, "PET_NNODES": "1", "PET_NODE_RANK": "0"}
    got = _torchrun(_args(), monkeypatch, env)
    assert "--standalone" not in got  # standalone would listen on a port of its own
    assert _value(got, "--rdzv_conf") == "is_host=1"
    assert _value(got, "--rdzv_endpoint") == "job-node-0-0.job:29400"
    env.pop("PET_MASTER_ADDR")  # torchrun's --master-addr defaults to 127.0.0.1
    assert _value(_torchrun(_args(), monkeypatch, env), "--rdzv_endpoint") == "127.0.0.1:29400"


@pytest.mark.parametrize(
    ("flags", "attr", "want"),
    [
        (["--nproc", "2"], "nproc", 2),
        (["--nnodes", "2"], "nnodes", "2"),
        (["--node-rank", "0"], "node_rank", 0),
        (["--rdzv-endpoint", "h:5"], "rdzv_endpoint", "h:5"),
    ],
)
def test_a_flag_beats_its_variable(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], attr: str, want: object
) -> None:
    args = _args(*flags)
    got = _torchrun(args, monkeypatch, KUBEFLOW)
    assert getattr(args, attr) == want
    if attr == "rdzv_endpoint":  # a given endpoint is the user's: torch guesses its host
        assert _value(got, "--rdzv_endpoint") == "h:5" and "--rdzv_conf" not in got


def test_no_variable_keeps_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args()
    got = _torchrun(args, monkeypatch, {})
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("1", 0, None)
    assert "--standalone" in got and "--rdzv_conf" not in got
    assert resolve_env_defaults(args, {}) is args and args.nnodes == "1"  # twice: no change


@pytest.mark.parametrize(
    ("var", "value", "match"),
    [
        ("PET_NPROC_PER_NODE", "three", r"PET_NPROC_PER_NODE='three' \(the default of --nproc"),
        ("PET_NPROC_PER_NODE", "0", r"PET_NPROC_PER_NODE='0' .*positive integer or 'auto'"),
        ("PET_NPROC_PER_NODE", "", r"PET_NPROC_PER_NODE='' "),
        ("PET_NNODES", "0", r"PET_NNODES='0' \(the default of --nnodes"),
        ("PET_NNODES", "2:1", r"PET_NNODES='2:1' .*MIN:MAX"),
        ("PET_NODE_RANK", "-1", r"PET_NODE_RANK='-1' \(the default of --node-rank"),
        ("PET_MASTER_PORT", "http", r"PET_MASTER_PORT='http' .*port number in \[1, 65535\]"),
        ("PET_MASTER_PORT", "0", r"PET_MASTER_PORT='0' "),
        ("PET_MASTER_PORT", "65536", r"PET_MASTER_PORT='65536' "),
    ],
)
def test_a_malformed_variable_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, match: str
) -> None:
    env = {**KUBEFLOW, "PET_NODE_RANK": "0", var: value}
    with pytest.raises(ValueError, match=match) as err:
        _torchrun(_args(), monkeypatch, env)
    assert "\n" not in str(err.value) and "nothing was started" in str(err.value)


def test_an_address_without_a_port_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PET_MASTER_ADDR": "job-node-0-0.job"}
    with pytest.raises(
        ValueError, match=r"PET_MASTER_ADDR='job-node-0-0.job' without PET_MASTER_PORT"
    ):
        _torchrun(_args(), monkeypatch, env)
    got = _torchrun(_args("--rdzv-endpoint", "h:5", "--nnodes", "2"), monkeypatch, env)
    assert _value(got, "--rdzv_endpoint") == "h:5"  # the flag: the variable is not read


def test_a_node_rank_outside_the_nodes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"--node-rank=3 must be in \[0, --nnodes=3\)"):
        _torchrun(_args(), monkeypatch, {**KUBEFLOW, "PET_NODE_RANK": "3"})
