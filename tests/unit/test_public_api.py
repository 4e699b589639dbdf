"""The public API: every name `shardwise` exported before the package was laid out in
subpackages is still there, of the same kind, and every old deep import path a user may have
written still gives its names (forwarded, with a DeprecationWarning naming the new path).

The lists below are a snapshot of main before the move (65ab3b1 + issue 27): a name may be
added, never removed without a decision recorded here.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import warnings

import pytest

import shardwise

PUBLIC: dict[str, str] = {
    "PREEMPTED_EXIT_CODE": "int",
    "PRESETS": "dict",
    "STRATEGIES": "tuple",
    "AutoPlan": "class",
    "CheckpointError": "exception",
    "DistInfo": "class",
    "Engine": "class",
    "InitializationError": "exception",
    "MeshSpec": "class",
    "NoPlanFitsError": "exception",
    "NonFiniteError": "exception",
    "ParallelConfig": "class",
    "PendingCheckpoint": "class",
    "PlanNotice": "exception",
    "Precision": "class",
    "Preempted": "exception",
    "Runner": "class",
    "RunnerConfig": "class",
    "SimReport": "class",
    "StallError": "exception",
    "TrainConfig": "class",
    "WeightsError": "exception",
    "WrapInfo": "class",
    "WrapPlan": "class",
    "WrapUnit": "class",
    "__version__": "str",
    "choose_plan": "function",
    "export_weights": "function",
    "get_dist_info": "function",
    "init_distributed": "function",
    "init_empty": "function",
    "load_checkpoint": "function",
    "load_weights": "function",
    "pack": "function",
    "parse_losses": "function",
    "plan_wrap": "function",
    "register_wrap_policy": "function",
    "resolve_mesh": "function",
    "save_checkpoint": "function",
    "seed_everything": "function",
    "set_aside_newer": "function",
    "shutdown": "function",
    "simulate_step": "function",
    "translate_accelerate": "function",
    "translate_deepspeed": "function",
    "translation_from_env": "function",
    "translate_torchtitan": "function",
    "sync_module_states": "function",
    "unwrap": "function",
    "wait_for_checkpoint": "function",
    "wrap": "function",
    "wrap_info": "function",
    # added since the snapshot (issue 22: a plain training loop's helpers)
    "guard": "function",
    "mean_across_ranks": "function",
    "print0": "function",
    # issue 24: one process's gradient norm over mixed meshes
    "clip_grad_norm_": "function",
    # issue 32: losses from statistics of the whole batch
    "global_batch_sum": "function",
    "BatchStatisticNotice": "exception",
    # issue 36: a step of a pipelined model
    "pipeline_step": "function",
    "pipeline_eval": "function",
    "plan_stages": "function",
    "StagePlan": "class",
    # issue 49: attention for a model of your own under context parallel
    "context_attention": "function",
    # issue 52: Muon on whole matrices under every layout
    "Muon": "class",
}

OLD_PATHS: dict[str, list[str]] = {
    "shardwise.activation": ["apply_activation_checkpointing", "is_checkpointed"],
    "shardwise.activations": ["ActivationTrace", "BlockTrace", "meta_copy", "trace_activations"],
    "shardwise.autoplan": [
        "AC_ORDER",
        "AutoPlan",
        "COMM_ORDER",
        "Candidate",
        "DEFAULT_FRACTION",
        "InstantPeak",
        "NoPlanFitsError",
        "choose_plan",
        "device_memory",
        "format_rows",
        "resolve_budget",
    ],
    "shardwise.checkpoint": [
        "CheckpointInfo",
        "DELETING_PREFIX",
        "FORMAT",
        "FORMAT_VERSION",
        "LATEST",
        "MANIFEST",
        "PendingCheckpoint",
        "RNG_DIR",
        "STATE_DIR",
        "SUPERSEDED",
        "TMP_PREFIX",
        "checkpoint_name",
        "list_checkpoints",
        "load_checkpoint",
        "read_manifest",
        "resolve_checkpoint",
        "save_checkpoint",
        "set_aside_newer",
        "single_process_ok",
        "verify_checkpoint",
        "wait_for_checkpoint",
    ],
    "shardwise.cli": ["build_parser", "launcher_args", "main"],
    "shardwise.config": [
        "FROZEN_POLICIES",
        "ParallelConfig",
        "STRATEGIES",
        "StrategyName",
        "WrapPolicy",
        "closest",
        "normalize_strategy",
        "parse_memory_budget",
        "resolve_activation_checkpointing",
        "resolve_backward_prefetch",
        "resolve_cpu_offload",
        "resolve_forward_prefetch",
        "validate_parallel_config",
    ],
    "shardwise.dcp_safe": [
        "CheckpointError",
        "SafeReader",
        "TensorOnlyLoadPlanner",
        "read_dcp_metadata",
        "root_cause",
    ],
    "shardwise.demo": [
        "ByteWindows",
        "DataConfig",
        "DemoConfig",
        "STDLIB_FILES",
        "SampleConfig",
        "generate",
        "load_text",
        "main",
        "run",
    ],
    "shardwise.distributed": [
        "DEFAULT_TIMEOUT_S",
        "DistInfo",
        "JobEnv",
        "LAUNCHER_PID_ENV",
        "SLURM_DEFAULT_PORT_BASE",
        "TIMEOUT_ENV",
        "env_world_size",
        "expand_hostlist",
        "get_dist_info",
        "init_distributed",
        "rank_and_world",
        "shutdown",
    ],
    "shardwise.engine": [
        "Engine",
        "MODES",
        "NonFiniteError",
        "SchedulerFactory",
        "TrainConfig",
        "clip_grad_norm_",
        "total_grad_norm",
    ],
    "shardwise.losses": ["VIS_KEYS", "model_parse_losses", "parse_losses", "split_outputs"],
    "shardwise.materialize": ["InitializationError", "has_meta", "init_empty", "materialize"],
    "shardwise.memory": [
        "MemoryEstimate",
        "OPTIMIZER_STATES",
        "PeakEstimate",
        "dtype_bytes",
        "estimate_memory",
        "estimate_peak",
        "format_bytes",
        "format_memory",
        "memory_json",
    ],
    "shardwise.mesh": [
        "MeshSpec",
        "REPLICATE_DIM",
        "SHARD_DIM",
        "divisors",
        "from_user_mesh",
        "resolve_mesh",
        "strategy_reshards",
    ],
    "shardwise.metrics": ["METRICS_FILE", "MetricsLogger", "read_metrics"],
    "shardwise.models": [
        "Attention",
        "Block",
        "ConvNet",
        "CrossTied",
        "Embeddings",
        "GPT",
        "GPTConfig",
        "Head",
        "LoRABlock",
        "LoRALM",
        "LoRALinear",
        "MLP",
        "random_lm_batches",
    ],
    "shardwise.optim": [
        "OptimizerFactory",
        "WrapperSettings",
        "build_optimizer",
        "build_scheduler",
        "check_hyperparameters",
        "is_optim_wrapper",
        "mark_replaced",
        "read_optim_wrapper",
        "stale_parameters",
    ],
    "shardwise.parity": [
        "Batch",
        "ModelFactory",
        "OptimizerFactory",
        "ParityError",
        "ParityReport",
        "Trajectory",
        "compare_trajectories",
        "default_optimizer",
        "full_parameters",
        "split_batch",
        "train_distributed",
        "train_reference",
    ],
    "shardwise.plot": ["plot_run"],
    "shardwise.precision": [
        "PRESETS",
        "Precision",
        "apply_autocast",
        "parse_dtype",
        "resolve_precision",
    ],
    "shardwise.runner": [
        "EvaluateFn",
        "PREEMPTED_EXIT_CODE",
        "Preempted",
        "Runner",
        "RunnerConfig",
        "seed_everything",
    ],
    "shardwise.schema": [
        "Config",
        "ConfigError",
        "OptimizerConfig",
        "REFERENCE_BEGIN",
        "REFERENCE_END",
        "SchedulerConfig",
        "apply_overrides",
        "dump_config",
        "field_docs",
        "from_dict",
        "load_config",
        "parse_override",
        "reference_markdown",
        "to_dict",
        "update_reference",
    ],
    "shardwise.simulate": [
        "CATEGORIES",
        "SimReport",
        "call_model",
        "default_input",
        "default_seq_len",
        "fake_materialize",
        "loss_of",
        "real_step",
        "simulate_step",
        "tracked_step",
    ],
    "shardwise.strategies": [
        "WrapInfo",
        "check_not_wrapped",
        "sync_module_states",
        "unwrap",
        "wrap",
        "wrap_info",
    ],
    "shardwise.testing": [
        "COUNTED_COLLECTIVES",
        "RankError",
        "assert_same_distribution",
        "count_collectives",
        "free_port",
        "run_distributed",
    ],
    "shardwise.vocabulary": [
        "FIELD",
        "FOREIGN_WORDS",
        "PLACEMENT_WORDS",
        "integral",
        "policy_from_dict",
        "translate",
    ],
    "shardwise.watchdog": ["MAX_CHECK_S", "StallError", "guard"],
    "shardwise.weights": [
        "DEFAULT_MAX_SHARD_BYTES",
        "INDEX_FILE",
        "SINGLE_FILE",
        "STAGING_PREFIX",
        "WeightsError",
        "export_weights",
        "load_weights",
    ],
}


def _kind(value: object) -> str:
    if inspect.isclass(value):
        return "exception" if issubclass(value, BaseException) else "class"
    if callable(value):
        return "function"
    return type(value).__name__


def test_every_public_name_is_still_exported_with_its_kind():
    assert sorted(shardwise.__all__) == sorted(PUBLIC)
    for name, kind in PUBLIC.items():
        assert _kind(getattr(shardwise, name)) == kind, name


def test_wrap_is_the_function_and_the_planning_package_is_plan():
    import shardwise.plan

    assert callable(shardwise.wrap) and inspect.isfunction(shardwise.wrap)
    assert shardwise.plan.plan_wrap is shardwise.plan_wrap
    for old in ("shardwise.wrap.plan", "shardwise.wrap.policies"):
        with pytest.raises(
            ImportError,
            match=r"shardwise\.wrap is the function wrap\(model, config\).*shardwise\.plan",
        ):
            importlib.import_module(old)
    assert callable(shardwise.wrap)  # a failed import did not replace it


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_module_paths_still_give_their_names(old):
    module = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        missing = [n for n in OLD_PATHS[old] if not hasattr(module, n)]
    assert missing == [], f"{old} lost {missing}"


@pytest.mark.heavy
def test_an_old_path_warns_once_naming_the_new_one():
    code = (
        "import warnings; warnings.simplefilter('always');"
        "from shardwise.models import GPT, GPTConfig;"
        "import shardwise.strategies as s; s.unwrap"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(lines) == 2, out.stderr
    assert "shardwise.models moved to shardwise.testing.models" in lines[0]
    assert "shardwise.strategies moved to shardwise.parallelize" in lines[1]


@pytest.mark.heavy
def test_the_console_script_and_module_entry_points():
    from shardwise.cli import build_parser, launcher_args, main

    assert callable(main) and callable(build_parser) and callable(launcher_args)
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "plan" in out.stdout
