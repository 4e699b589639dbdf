"""The hook workers of `shardwise run` use for an uncaught error: recorded, shown once."""

from __future__ import annotations

import json
import sys

import pytest

from shardwise.config.run_file import ConfigError
from shardwise.distributed import PeerExitedError, worker_errors


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_not_installed_outside_shardwise_run(monkeypatch):
    monkeypatch.delenv("SHARDWISE_LAUNCHER_PID", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert not worker_errors.install_if_launched()
    assert sys.excepthook is sys.__excepthook__


def test_a_users_own_hook_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDWISE_LAUNCHER_PID", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    mine = lambda *a: None  # noqa: E731
    monkeypatch.setattr(sys, "excepthook", mine)
    assert worker_errors.install_if_launched() and sys.excepthook is mine


@pytest.mark.parametrize(
    ("local_rank", "exc", "shown"),
    [
        (
            "0",
            ConfigError("unknown key 'train.max_stepz'"),
            "ConfigError: unknown key 'train.max_stepz'\n",
        ),
        ("1", ConfigError("unknown key 'train.max_stepz'"), ""),  # the launcher prints it, once
        ("0", ValueError("boom"), "Traceback"),
        # A layout refused in wrap() is the user's setting too: one line, no traceback.
        ("0", worker_errors.refused(ValueError("ParallelConfig.dp_shard=3 ...")), "ValueError: Pa"),
        # A lost peer is the launcher's to report ("stopped because rank 1 ended").
        ("0", PeerExitedError("rank 0: ...", what="step 3", rank=0, missing=None), ""),
    ],
)
def test_the_hook_records_every_error_and_prints_on_local_rank_0_only(
    monkeypatch, tmp_path, capsys, local_rank, exc, shown
):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    caught = _raise(exc)
    worker_errors._hook(type(caught), caught, caught.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith(shown) if shown else err == ""
    if worker_errors.short_error(exc):
        assert "Traceback" not in err  # the user's input, not our code: one line
    data = json.loads(path.read_text())["message"]
    assert data["message"] == f"{type(exc).__name__}: {exc}"
    assert "Traceback (most recent call last)" in data["extraInfo"]["py_callstack"]
    assert data["extraInfo"]["one_line"] == worker_errors.short_error(exc)  # for the launcher
