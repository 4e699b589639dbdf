"""Commands the docs show that another test runs, and where.

The doc tests run every other command themselves. These are too slow for that (a full
demo, a training run of an example, a Lightning or mmengine job) or are the test suite
itself; each names the test that runs it and the text that shows it does (found in that
test function's source, or in the file). A documented command that is neither here nor
cheap enough to run, nor marked `*Not run by the tests: ...*`, fails the doc tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunBy:
    where: str
    """`path::function` (or a path) of the test that runs the command."""
    evidence: tuple[str, ...]
    """Text in that function (or file) showing it runs this command."""
    also: tuple[tuple[str, str], ...] = ()
    """(path, text) elsewhere that ties the command to what the test runs (a Makefile recipe)."""


_HOSTS = "tests/docs/test_host_examples.py::test_host_examples_run_as_written"
_RUN_AS_WRITTEN = ("for text in commands:", "run_shell(")


def _hosts(example: str) -> RunBy:
    return RunBy(_HOSTS, _RUN_AS_WRITTEN, also=(("tests/docs/test_host_examples.py", example),))


COVERED: dict[str, RunBy] = {
    # README.md
    "make demo": RunBy(
        "tests/e2e/test_cli.py::test_demo_short",
        ('cli("demo", "--short"',),
        also=(("Makefile", "$(VENV)/bin/shardwise demo"),),
    ),
    "make test": RunBy(
        ".ci/run", ("for target in test ",), also=(("Makefile", "$(VENV)/bin/pytest -q\n"),)
    ),
    # docs/vocabulary.md: a plain script driven by another tool's file
    "shardwise run --nproc 2 --deepspeed ds_config.json train.py": RunBy(
        "tests/e2e/test_foreign_configs.py::test_the_unchanged_script_on_two_processes_equals_one",
        ('flag, strategy, source = "--deepspeed"', "_shardwise(flag, str(config))"),
    ),
    "shardwise run --nproc 2 --accelerate-config default_config.yaml train.py": RunBy(
        "tests/e2e/test_foreign_configs.py::test_the_unchanged_script_on_two_processes_equals_one",
        ('flag, strategy, source = "--accelerate-config"', "_shardwise(flag, str(config))"),
    ),
    "python train.py": RunBy(
        "tests/e2e/test_foreign_configs.py::one_process", ("_run(tmp_path_factory",)
    ),
    # docs/examples.md
    "shardwise run --nproc 2 examples/train_lm.py": RunBy(
        "tests/e2e/test_example_lm.py::"
        "test_a_resume_with_a_changed_lr_says_its_step_and_names_the_change",
        ('"run", "--nproc", "2", str(EXAMPLE)',),
    ),
    "shardwise run --nproc 2 examples/train_lm.py --init-from runs/train_lm/export --rank0-reads "
    "runner.run_dir=runs/finetune": RunBy(
        "tests/e2e/test_example_lm.py::test_train_export_then_start_from_the_export_on_meta",
        ('"--init-from", str(export), "--rank0-reads"', '"runner.run_dir='),
    ),
    "python examples/vision_bf16.py": RunBy(
        "tests/e2e/test_example_vision.py::test_plain_python_is_world_one_and_learns",
        ("[sys.executable, str(EXAMPLE)",),
    ),
    "torchrun --standalone --nproc_per_node 2 examples/vision_bf16.py --run-dir "
    "runs/vision_bf16-fsdp": RunBy(
        "tests/e2e/test_example_vision.py::test_torchrun_two_processes",
        ('"--nproc_per_node", "2"', '"--run-dir"'),
    ),
    "python examples/quickstart.py": RunBy(
        "tests/e2e/test_quickstart.py::test_plain_python_is_world_one",
        ("[sys.executable, str(EXAMPLE)",),
    ),
    "torchrun --standalone --nproc_per_node 2 examples/quickstart.py": RunBy(
        "tests/e2e/test_quickstart.py::test_torchrun_two_processes",
        ('"--nproc_per_node", "2"', "str(EXAMPLE)"),
    ),
    # docs/examples.md: the CPU SLURM job, submitted to a real SLURM by the slurm tier
    "sbatch examples/slurm/train_cpu.sbatch": RunBy(
        "tests/e2e/test_slurm.py::test_the_documented_sbatch_job_runs_as_written",
        ('"sbatch", "examples/slurm/train_cpu.sbatch"',),
    ),
    # docs/gpu.md: the two GPU checks, run by the bench tier (on the CPU, or saying so)
    "make gpu-check": RunBy(
        "tests/e2e/test_bench_smoke.py::test_gpu_check_without_a_gpu_says_so_and_checks_nothing",
        ('str(BENCH / "gpu_check.py")',),
        also=(("Makefile", "$(PY) bench/gpu_check.py\n"),),
    ),
    "make gpu-check-multi": RunBy(
        "tests/e2e/test_bench_smoke.py::test_gpu_check_multi_with_fewer_than_two_gpus_says_so",
        ('str(BENCH / "gpu_check_multi.py")',),
        also=(("Makefile", "$(PY) bench/gpu_check_multi.py\n"),),
    ),
    "python bench/gpu_check.py --device cpu --only router,adapters,dims_syncs": RunBy(
        "tests/e2e/test_bench_smoke.py::test_gpu_checks_of_the_newest_dimensions_run_on_the_cpu",
        ('"--device", "cpu"', '"--only", "router,adapters,dims_syncs"'),
    ),
    "python bench/gpu_check_multi.py --device cpu --world 4": RunBy(
        "tests/e2e/test_bench_smoke.py::test_gpu_check_multi_runs_every_check_on_cpu_ranks",
        ('"--device", "cpu", "--world", "4"',),
    ),
    # docs/gpu.md: an elastic job, run by the elastic tier
    "shardwise rendezvous --host 127.0.0.1 --port 29400": RunBy(
        "tests/e2e/test_elastic.py::test_losing_the_node_that_would_host_the_rendezvous",
        ('"rendezvous", "--host", "127.0.0.1", "--port"',),
    ),
    "shardwise run --nproc 2 --nnodes 1:2 --rdzv-endpoint 127.0.0.1:29400 --max-restarts 3 "
    "tests/e2e/_resumable_worker.py runs/elastic": RunBy(
        "tests/e2e/test_elastic.py",
        (
            'flags = ["--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--max-restarts", "3"]',
        ),
    ),
    # docs/hosts.md: mmengine and Lightning jobs, run as written under `-m integrations`
    "torchrun --standalone --nproc_per_node 2 examples/mmengine/train.py "
    "examples/mmengine/toy_config.py --work-dir work_dirs/toy": _hosts(
        '"examples/mmengine/train.py", 2'
    ),
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 torchrun --standalone --nproc_per_node 2 "
    "examples/mmengine/train.py examples/mmengine/toy_config.py --work-dir work_dirs/toy "
    "--resume": _hosts('"examples/mmengine/train.py", 2'),
    "python examples/lightning_train.py": _hosts('"examples/lightning_train.py", 2'),
    "python examples/lightning_train.py --strategy ddp --devices 1": _hosts(
        '"examples/lightning_train.py", 2'
    ),
    "python examples/fabric_train.py": _hosts('"examples/fabric_train.py", 2'),
    "python examples/fabric_train.py --resume": _hosts('"examples/fabric_train.py", 2'),
    "torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py": _hosts(
        '"examples/hf_trainer.py", 2'
    ),
    "python examples/hf_trainer.py --resume": _hosts('"examples/hf_trainer.py", 2'),
    "torchrun --standalone --nproc_per_node 2 examples/mixin_trainer.py --use-fsdp "
    "--sharding-strategy ShardingStrategy.FULL_SHARD": RunBy(
        "tests/e2e/test_quickstart.py::test_trainer_mixin_example",
        (
            '"--nproc_per_node", "2"',
            '"--use-fsdp", "--sharding-strategy", "ShardingStrategy.FULL_SHARD"',
        ),
    ),
    # docs/troubleshooting.md (it exits 1: the transcript is the test's assertion)
    "shardwise run --nproc 2 examples/train_lm.py parallel.dp_shard=3": RunBy(
        "tests/e2e/test_launch_robust.py::"
        "test_a_layout_refused_in_every_rank_is_one_line_and_the_summary",
        ('"examples/train_lm.py", "parallel.dp_shard=3"', "out.stderr.splitlines() == shown"),
    ),
    # docs/testing.md
    ".venv/bin/python tests/mutants.py --list": RunBy(
        "tests/e2e/test_docs_testing.py::test_every_command_in_the_testing_doc_runs",
        ('".venv/bin/python tests/mutants.py --list"',),
    ),
    ".venv/bin/python tests/mutants.py --only latest_before_rename": RunBy(
        "tests/e2e/test_docs_testing.py::test_every_command_in_the_testing_doc_runs",
        ('".venv/bin/python tests/mutants.py --only latest_before_rename"',),
    ),
    # The wrapper runs there with a short command in place of `make test`, which .ci/run runs.
    ".venv/bin/python -m tools.busy make test": RunBy(
        "tests/e2e/test_docs_testing.py::test_every_command_in_the_testing_doc_runs",
        ('".venv/bin/python -m tools.busy make test"', "busy[:-2]"),
        also=(("Makefile", "$(VENV)/bin/pytest -q\n"),),
    ),
}
