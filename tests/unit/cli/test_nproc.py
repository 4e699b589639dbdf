"""Processes per node against the visible GPUs, decided before anything spawns."""

from __future__ import annotations

import pytest

from shardwise.cli.launch import fit_nproc


def test_two_ranks_on_one_gpu_is_an_error_naming_nproc():
    with pytest.raises(
        ValueError,
        match=r"shardwise run: --nproc 2 but this machine has 1 GPU\(s\) visible.*Use --nproc 1",
    ):
        fit_nproc(2, 1, default=2, command="run")
    assert fit_nproc(2, 8, default=2, command="run") == (2, "")
    assert fit_nproc(4, 0, default=2, command="run") == (4, "")  # CPU: gloo ranks


def test_the_demo_runs_one_process_on_a_one_gpu_machine_and_says_so():
    nproc, note = fit_nproc(None, 1, default=2, command="demo")
    assert nproc == 1
    assert "1 GPU(s) visible, so 1 process(es) instead of 2" in note
    assert fit_nproc(None, 0, default=2, command="demo") == (2, "")
    assert fit_nproc(None, 4, default=2, command="demo") == (2, "")
