"""The command line's and the library's small edges (issue 22, "Small" and "Errors drowned")."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import shardwise
from shardwise.cli import main
from shardwise.cli.demo import validation_line


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip().startswith("shardwise ")


@pytest.mark.heavy
def test_a_closed_pipe_ends_quietly():
    # `shardwise checkpoint inspect ... | head` ended in a BrokenPipeError traceback.
    code = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from shardwise.cli import main\n"
        "sys.exit(main(['config', 'reference']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr


def test_exported_files_are_readable_by_others(tmp_path):
    # safetensors writes 0600: an export shared with a serving job was unreadable.
    path = shardwise.export_weights(torch.nn.Linear(2, 2), tmp_path / "w")
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


def test_ddp_does_not_warn_about_broadcast_buffers():
    shardwise.init_distributed(timeout_s=30)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = shardwise.wrap(
                torch.nn.Linear(2, 2), shardwise.ParallelConfig(strategy="ddp", force_wrap=True)
            )
        assert not [w for w in caught if "broadcast_buffers" in str(w.message)]
        assert model.module.weight.shape == (2, 2)
    finally:
        shardwise.shutdown()


def test_no_validation_is_said_not_printed_as_nan():
    assert (
        validation_line(float("nan"), float("nan")) == "validation loss   none: no validation ran"
    )
    assert validation_line(5.348, 2.615) == "validation loss   5.348 -> 2.615 (nats per byte)"


def test_plan_refuses_a_layout_the_world_cannot_have(capsys):
    # Before: plan exited 0 for these, and `run` then failed in every worker.
    target = "shardwise.testing.models:GPT"
    hybrid = ["plan", target, "--world", "3", "parallel.strategy=hybrid_shard"]
    assert main(hybrid) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "ParallelConfig.strategy='hybrid_shard' needs a 2-D mesh" in err
    shard = [
        "plan",
        target,
        "--world",
        "4",
        "parallel.strategy=hybrid_shard",
        "parallel.dp_shard=3",
    ]
    assert main(shard) == 2
    assert "ParallelConfig.dp_shard=3 does not divide the world size 4" in capsys.readouterr().err


def test_run_refuses_a_missing_script_before_spawning(capsys, tmp_path):
    # Before: the workers spawned first, and each failed on the missing file.
    missing = str(tmp_path / "no_such_script.py")
    assert main(["run", "--nproc", "2", missing]) == 2
    err = capsys.readouterr().err
    assert f"'{missing}' is not a file" in err and "nothing was started" in err


def test_plan_auto_without_a_known_input_names_the_flags(capsys):
    model = ["plan", "shardwise.testing.models:ConvNet", "--world", "2", "parallel.strategy=auto"]
    assert main(model) == 2
    err = capsys.readouterr().err
    assert "strategy=auto needs the batch the model trains on" in err
    assert "--input MODULE:FUNCTION" in err


def test_checkpoint_targets_are_checked(tmp_path):
    import pytest

    with pytest.raises(
        TypeError, match=r"save_checkpoint\(directory, \.\.\.\) got str; pass the model"
    ):
        shardwise.save_checkpoint(tmp_path, "model", step=1)
    with pytest.raises(
        TypeError, match=r"save_checkpoint\(optimizer=\.\.\.\) got dict; pass the torch optimizer"
    ):
        shardwise.save_checkpoint(tmp_path, torch.nn.Linear(2, 2), {"lr": 1.0}, step=1)


def test_plan_names_the_users_function_that_raised(tmp_path, monkeypatch, capsys):
    # Before: a factory that raised (or needed arguments) ended in a traceback, and a model
    # whose forward refused --input's batch printed torch's fake-tensor log, then the error.
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def needs_size(hidden):\n    return torch.nn.Linear(hidden, hidden)\n"
        "def broken():\n    raise KeyError('vocab_size')\n"
        "def small():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "def wrong_batch():\n    return torch.randn(2, 5)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["plan", "mymodels:needs_size", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise plan: error: mymodels:needs_size() raised TypeError: ")
    assert "calls it with no arguments" in err and "Traceback" not in err
    assert main(["plan", "mymodels:broken", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert f"raised KeyError: 'vocab_size' at {tmp_path / 'mymodels.py'}:5." in err
    argv = ["plan", "mymodels:small", "--world", "2", "--input", "mymodels:wrong_batch"]
    assert main([*argv, "--simulate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line: no fake-tensor log before it
    assert (
        "the model's forward raised RuntimeError on the example input tensor float32[2, 5]" in err
    )


def test_run_refuses_a_layout_the_world_cannot_hold_before_spawning(tmp_path, capsys):
    # Before: every worker raised the mesh error (30 to 74 lines) after the job started.
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  strategy: full_shard\nrunner:\n  max_steps: 2\n")
    script = os.path.join("examples", "train_lm.py")
    cases = [
        (
            ["--nproc", "3"],
            ["parallel.strategy=hybrid_shard"],
            "at world size 3: ParallelConfig.strategy='hybrid_shard' needs a 2-D mesh",
        ),
        (
            ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
            ["parallel.dp_shard=3"],
            "at world size 4: ParallelConfig.dp_shard=3",
        ),
        (
            ["--nproc", "2"],
            ["parallel.stratgy=ddp"],
            "unknown key 'parallel.stratgy'. Did you mean 'strategy'?",
        ),
        (
            ["--nproc", "3"],
            ["parallel.cp=2"],
            "at world size 3: ParallelConfig.cp=2 does not divide the job's 3 rank(s)",
        ),
    ]
    for flags, overrides, said in cases:
        assert main(["run", *flags, script, "--config", str(config), *overrides]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    # A file without a parallel section is the script's own: nothing is refused.
    from shardwise.cli.launch import check_layout

    (tmp_path / "other.yaml").write_text("lr: 3\n")
    check_layout(["--config", str(tmp_path / "other.yaml"), "parallel.strategy=hybrid_shard"], 3)


def test_run_refuses_a_misspelt_override_before_spawning_without_a_config(capsys):
    """Before: without --config the workers started and each said "Did you mean
    'strategy'?" 8 s later; with --config it was refused at once. Now both are."""
    script = os.path.join("examples", "train_lm.py")
    cases = [
        (
            ["parallel.stratgy=full_shard"],
            "unknown key 'parallel.stratgy'. Did you mean 'strategy'?",
        ),
        (["runner.max_step=8"], "unknown key 'runner.max_step'. Did you mean 'max_steps'?"),
        (["optimizer.lrr=1e-3"], "unknown key 'optimizer.lrr'. Did you mean 'lr'?"),
        (["adapter.rr=8"], "unknown key 'adapter.rr'. Did you mean 'r'?"),
        (["runner.max_steps=many"], "runner.max_steps: expected int | null, got str ('many')."),
        # The first bad one of several, after a good one and the script's own arguments.
        (["--init-from", "x", "train.max_grad_norm=1", "train.max_stepz=2"], "'train.max_stepz'"),
    ]
    for overrides, said in cases:
        assert main(["run", "--nproc", "2", script, *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardwise run: error: ") and said in err, err
        assert err.count("\n") == 1, err
    # Arguments the launcher leaves to the script: its own sections, options, foreign words
    # and placement words in parallel (translated or checked by the workers), and values
    # whose check needs the whole config (max_epochs null with max_steps from the file).
    from shardwise.cli.launch import check_overrides

    check_overrides(
        ["model.depth=3", "--lr=3", "x=1", "parallel.sharding_strategy=FULL_SHARD",
         "parallel.device_ids=[0]", "runner.max_epochs=null", "parallel.strategy=FULL_SHARD",
         "adapter.r=4", "optimizer.lr=1e-3"]
    )  # fmt: skip


@pytest.mark.heavy
def test_plan_shows_the_2d_layout_and_refuses_what_it_cannot_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "llm.py").write_text(
        "import transformers as tf\n"
        "def llama():\n"
        "    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, "
        "intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    argv = ["plan", "llm:llama", "--world", "8", "--tp", "2", "parallel.strategy=hybrid_shard"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("hybrid_shard: 2 replica group(s) x 2 shard rank(s) x tp 2 = world 8")
    assert re.search(r"model\.layers\.\*\.self_attn\.k_proj +colwise +2 module\(s\)", out)
    assert "peak with activations: the instant estimate does not model them under tensor" in out
    assert re.search(r"full_shard +1x4 ", out) and "world size 8, tp 2, optimizer adamw" in out
    assert main([*argv, "parallel.sequence_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.\*\.input_layernorm +sequence_parallel +2 module", out)
    assert re.search(r"model\.layers\.\*\.self_attn +gathers the sequence +2 module", out)
    assert main([*argv, "parallel.sequence_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.\*\.input_layernorm +sequence_parallel +2 module", out)
    assert re.search(r"model\.layers\.\*\.self_attn +gathers the sequence +2 module", out)
    assert main([*argv, "--simulate", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "hybrid_shard x tp 2 at world 8, batch 1 x seq 16, fp32, AC none, adamw" in out
    assert main(["plan", "llm:llama", "--world", "8", "parallel.tp=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.num_key_value_heads=2 does not divide by 4" in err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1", "x"])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused(value: str) -> None:
    """Issue 48: --grace inf would never stop the other workers after a failure (a stalled
    rank hangs the job), as NaN would compare false everywhere."""
    from shardwise.cli.launch import grace_arg

    with pytest.raises(argparse.ArgumentTypeError, match=r"--grace=.*use a number of seconds"):
        grace_arg(value)
    assert grace_arg("0") == 0.0 and grace_arg("2.5") == 2.5


_NNODES = (
    ": use a positive integer N, or MIN:MAX with 1 <= MIN <= MAX (an elastic job that "
    "starts with MIN nodes and admits up to MAX)"
)


@pytest.mark.parametrize("value", ["4:2", "2:1", "0:2", "0", "-1", "0:0", "two", "1:x", ":2", "2:"])
def test_an_nnodes_that_is_no_count_or_range_of_nodes_is_refused(capsys, value: str) -> None:
    """Fourth audit: both conditions of MIN:MAX, a MIN below 1 and a MIN above MAX (an
    elastic job that could never start), each refused by the flag's own line."""
    from shardwise.cli import build_parser
    from shardwise.cli.launch import nnodes_arg

    with pytest.raises(argparse.ArgumentTypeError) as caught:
        nnodes_arg(value)
    assert str(caught.value) == f"--nnodes={value!r}{_NNODES}"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["run", "--nnodes", value, "train.py"])
    assert exc.value.code == 2
    assert f"argument --nnodes: --nnodes={value!r}{_NNODES}" in capsys.readouterr().err


def test_an_nnodes_of_one_count_or_an_ordered_range_is_taken() -> None:
    from shardwise.cli.launch import nnodes_arg

    got = [nnodes_arg(v) for v in ("1", "2", "1:4", "2:2", "1:1", "02:04")]
    assert got == ["1", "2", "1:4", "2:2", "1:1", "2:4"]


@pytest.mark.parametrize(
    ("nnodes", "standalone"), [("1", True), ("1:1", True), ("2", False), ("1:4", False)]
)
def test_only_a_job_that_can_never_span_nodes_runs_standalone(
    nnodes: str, standalone: bool
) -> None:
    """Issue 48: an elastic --nnodes 1:4 starts on one node but admits four: it needs the
    rendezvous endpoint the others join, by its maximum, not its minimum."""
    from shardwise.cli.launch import launcher_args

    args = argparse.Namespace(
        nproc=2, nnodes=nnodes, rdzv_endpoint=None, node_rank=0, max_restarts=0, rdzv_id=None
    )
    if standalone:
        assert "--standalone" in launcher_args(args)
        return
    with pytest.raises(ValueError, match=rf"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT"):
        launcher_args(args)
    args.rdzv_endpoint = "h:1"
    got = launcher_args(args)
    assert "--standalone" not in got and got[got.index("--rdzv_endpoint") + 1] == "h:1"


@pytest.mark.heavy
def test_plan_shows_the_context_parallel_layout_and_simulates_its_peak(capsys):
    argv = ["plan", "shardwise.testing.models:GPT", "--world", "8", "--cp", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("full_shard: 1 replica group(s) x 4 shard rank(s) x cp 2 = world 8")
    assert "the instant estimate does not model cp=2; add --simulate" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["mesh"]["cp"], data["mesh"]["dp_shard"], data["simulated"]) == (2, 4, None)
    assert main([*argv, "parallel.cp=2"]) == 2  # the flag and the override both given
    assert "--cp and parallel.cp=... both given" in capsys.readouterr().err
    assert main(["plan", "shardwise.testing.models:GPT", "--world", "6", "--cp", "4"]) == 2
    assert "ParallelConfig.cp=4 does not divide the job's 6 rank(s)" in capsys.readouterr().err


def test_after_ctrl_c_the_launcher_speaks_only_when_no_runner_did(capsys):
    from shardwise.cli.launch import _after_ctrl_c

    line = "shardwise run: stopped by SIGINT (Ctrl-C); no Runner saved a checkpoint\n"
    cases = [
        ({0: 75, 1: 75}, 75, ""),  # saved after the step: rank 0 said where
        ({0: 130, 1: 130}, 130, ""),  # stopped at once: rank 0 named the last checkpoint
        ({0: 75, 1: 130}, 130, ""),  # one rank had saved before the second Ctrl-C
        ({0: -2, 1: -2}, 130, line),  # no Runner: ended by the SIGINT itself
        ({0: 75, 1: -2}, 130, line),
        ({0: 75, 1: None}, 130, line),  # still running (torch SIGKILLs it)
        ({}, 130, line),
    ]
    for codes, code, said in cases:
        assert _after_ctrl_c(codes) == code, codes
        assert capsys.readouterr().err == said, codes
