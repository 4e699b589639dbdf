"""The hook workers of `shardwise run` use for an uncaught error: recorded, shown once."""

from __future__ import annotations

import json
import sys
import traceback

import pytest
import torch

from shardwise.config.run_file import ConfigError
from shardwise.distributed import PeerExitedError, worker_errors


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_outside_shardwise_run_the_plain_hook_is_installed(monkeypatch):
    """Plain `python` at world 1 gets one line for a refusal too (no error file to write)."""
    monkeypatch.delenv("SHARDWISE_LAUNCHER_PID", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert not worker_errors.install_if_launched()
    assert sys.excepthook is worker_errors._plain_hook


def test_the_worker_hook_is_installed_under_shardwise_run(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDWISE_LAUNCHER_PID", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert worker_errors.install_if_launched() and sys.excepthook is worker_errors._hook


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


def _caught(call, *args):
    try:
        call(*args)
    except BaseException as caught:
        return caught
    raise AssertionError(f"{call} raised nothing")


NO_OPTIMIZER = (
    "TypeError: Engine(model) needs an optimizer: pass one, or a factory such as lambda params: "
    "torch.optim.AdamW(params, lr=3e-4). (A script launched by `shardwise run --from FILE` "
    "whose file has an optimizer block may leave it out.)\n"
)


def _shardwise_errors():
    """A TypeError, a ValueError and a NotImplementedError, each raised by a `raise` of
    shardwise's own code (none of them marked with `refused`)."""
    from shardwise.parallelize.experts import check_expert_parallel
    from shardwise.parallelize.from_env import engine_values_from_env
    from shardwise.parallelize.moe import placement_for

    return [
        _caught(engine_values_from_env, None, None, None, None),
        _caught(check_expert_parallel, torch.nn.Linear(2, 2), 2),
        _caught(placement_for, "replicate", 3),
    ]


def test_an_error_raised_by_shardwise_is_one_line_and_others_keep_their_traceback():
    from shardwise.config.training import RunnerConfig
    from shardwise.train.runner import _total_steps

    own = _shardwise_errors()
    assert [type(e).__name__ for e in own] == ["TypeError", "ValueError", "NotImplementedError"]
    assert not any(getattr(e, "shardwise_refused", False) for e in own)  # not marked
    assert all(worker_errors.raised_by_shardwise(e) and worker_errors.short_error(e) for e in own)
    # The same types raised by Python inside shardwise's code (a bug), by torch below it,
    # or by the user's own code keep their traceback.
    by_python = _caught(_total_steps, RunnerConfig(), "12", 1)  # "12" / 1 in runner.py
    by_torch = _caught(torch.optim.SGD, [], 0.1)  # "an empty parameter list", torch's raise
    by_user = _raise(ValueError("boom"))
    for exc in (by_python, by_torch, by_user):
        assert isinstance(exc, (TypeError, ValueError)), exc
        assert not worker_errors.raised_by_shardwise(exc) and not worker_errors.short_error(exc)
    assert isinstance(by_python, TypeError)
    assert "runner.py" in traceback.format_tb(by_python.__traceback__)[-1]


def test_the_plain_hook_prints_one_line_for_a_refusal(monkeypatch, capsys):
    """Plain `python` (no launcher): `Engine(model)` with no optimizer is one line."""
    monkeypatch.delenv("SHARDWISE_TRACEBACK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    exc = _shardwise_errors()[0]
    worker_errors._plain_hook(type(exc), exc, exc.__traceback__)
    assert capsys.readouterr().err == NO_OPTIMIZER
    other = _raise(ValueError("boom"))
    worker_errors._plain_hook(type(other), other, other.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("boom\n")


@pytest.mark.parametrize("hook", ["_plain_hook", "_hook"])
def test_shardwise_traceback_shows_the_traceback_of_a_refusal(monkeypatch, tmp_path, capsys, hook):
    monkeypatch.setenv("SHARDWISE_TRACEBACK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    exc = _shardwise_errors()[0]
    getattr(worker_errors, hook)(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert err.endswith(NO_OPTIMIZER) and "from_env.py" in err


def test_ctrl_c_in_a_worker_prints_nothing(monkeypatch, tmp_path, capsys):
    """Before: ~40 lines of KeyboardInterrupt traceback per rank; the launcher says it once."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    exc = _raise(KeyboardInterrupt())
    worker_errors._hook(type(exc), exc, exc.__traceback__)
    assert capsys.readouterr().err == "" and not (tmp_path / "e.json").exists()
