"""Targeted mutation check: does the suite catch a plausible bug in each behaviour it claims?

Each mutant below is one small edit (a line, or two adjacent lines) that a real change could
make by mistake. For each, this script copies the repository's tracked files into a
temporary directory, applies the edit there, and runs the narrow tests that claim the
behaviour against the copy (`PYTHONPATH` points at the copy's `src/`; the checkout is never
touched). A mutant is *killed* when those tests fail and *survives* when they pass.

Run on demand, not in CI (each mutant costs a test run, minutes in all):

    .venv/bin/python tests/mutants.py              # every mutant; exit 1 if any survives
    .venv/bin/python tests/mutants.py --list       # names, files and tests
    .venv/bin/python tests/mutants.py --only clip_scales_up --only wrap_skips_a_unit
    .venv/bin/python tests/mutants.py --baseline   # the same tests unmutated first (must pass)

When a module moves or a line changes, update its entry here in the same commit: a mutant
whose text is no longer found is reported as `stale`, which also fails the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    """What goes wrong, in a few words."""
    path: str
    """File to edit, relative to the repository root."""
    old: str
    """Text that must occur exactly once in the file."""
    new: str
    tests: tuple[str, ...]
    """pytest node ids (or files) that must catch it."""


MUTANTS: tuple[Mutant, ...] = (
    # 1. One planned block silently not sharded (numbers stay identical).
    Mutant(
        "wrap_skips_a_unit",
        "src/shardwise/parallelize/fsdp.py",
        "    for unit in plan.units:\n        targets = ",
        "    for unit in plan.units[1:]:\n        targets = ",
        ("tests/distributed/test_wrap_models.py::test_applied_units_and_policies_equal_the_plan",),
    ),
    Mutant(
        "keep_fp32_policy_not_applied",
        "src/shardwise/parallelize/fsdp.py",
        'mp_policy=fp32_policy if unit.compute_dtype == "float32" and mixed else mp_policy,',
        "mp_policy=mp_policy,",
        ("tests/distributed/test_wrap_models.py::test_applied_units_and_policies_equal_the_plan",),
    ),
    # 2. Gradients reduced in bf16 under mixed_precision="bf16".
    Mutant(
        "bf16_reduces_in_bf16",
        "src/shardwise/config/precision.py",
        '"bf16": Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),',
        '"bf16": Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),',
        (
            "tests/distributed/test_wrap_models.py::test_applied_units_and_policies_equal_the_plan",
            "tests/distributed/test_wrap_models.py::test_ddp_compresses_gradients_only_when_asked",
        ),
    ),
    # 3. The optimizer's param_groups (lr, weight decay) not restored on resume.
    Mutant(
        "resume_drops_param_groups",
        "src/shardwise/checkpoint/load.py",
        '"param_groups": manifest["optimizer"]["param_groups"],',
        '"param_groups": optim_sd["param_groups"],',
        ("tests/distributed/test_checkpoint.py::test_resume_restores_the_learning_rate_schedule",),
    ),
    # 4. `latest` updated before the manifest and the rename.
    Mutant(
        "latest_before_rename",
        "src/shardwise/checkpoint/commit.py",
        "    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))\n",
        "    _write_atomic(root / LATEST, final.name + '\\n')\n"
        "    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))\n",
        ("tests/distributed/test_checkpoint_safety.py::test_a_fault_inside_finalisation",),
    ),
    # 5. An mmengine model's own parse_losses ignored by ShardwiseDataParallel.
    Mutant(
        "mmengine_parse_losses_ignored",
        "src/shardwise/integrations/mmengine.py",
        "parsed_loss, log_vars = model_parse_losses(self.module, losses)",
        "parsed_loss, log_vars = model_parse_losses(nn.Module(), losses)",
        ("tests/integrations/test_mmengine.py::test_models_own_parse_losses_equals_mmddp",),
    ),
    # 6. Validation metrics left per rank instead of averaged over all ranks' samples.
    Mutant(
        "validation_not_all_reduced",
        "src/shardwise/train/runner.py",
        "        dist.all_reduce(moved)\n        totals = moved.cpu()",
        "        totals = moved.cpu()",
        ("tests/distributed/test_runner_dist.py::test_validation_equals_one_process",),
    ),
    # 7. Clipping that scales small gradients up, and clipping applied twice.
    Mutant(
        "clip_scales_up",
        "src/shardwise/train/engine.py",
        "    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)\n",
        "    coef = max_norm / (norm + 1e-6)\n",
        ("tests/distributed/test_engine.py::test_clipping_above_the_norm_changes_nothing",),
    ),
    Mutant(
        "clip_applied_twice",
        "src/shardwise/train/engine.py",
        "            scale_grads_(params, clip_coefficient(norm, tc.max_grad_norm))\n",
        "            scale_grads_(params, clip_coefficient(norm, tc.max_grad_norm))\n"
        "            clip_grad_norm_(params, tc.max_grad_norm)\n",
        ("tests/distributed/test_engine.py::test_clipped_update_equals_one_process",),
    ),
    # 8. Issue 32: losses from statistics of the whole batch.
    Mutant(
        "batch_statistic_not_summed",
        "src/shardwise/parallelize/global_batch.py",
        "    batch.used += 1\n    return _sum_over(tensor, batch.groups)\n",
        "    batch.used += 1\n    return tensor\n",
        (
            "tests/distributed/test_batch_statistics.py::test_the_load_balancing_loss_trains_as_one_process",
            "tests/distributed/test_batch_statistics.py::test_global_batch_sum_makes_a_models_own_statistics_whole",
        ),
    ),
    Mutant(
        "family_loss_left_per_rank",
        "src/shardwise/parallelize/router_loss.py",
        "        if current() is None:\n",
        "        if True:\n",
        (
            "tests/distributed/test_batch_statistics.py::test_the_load_balancing_loss_trains_as_one_process",
        ),
    ),
    Mutant(
        "recompute_not_summed",
        "src/shardwise/parallelize/global_batch.py",
        "    if active is None and torch._C._current_graph_task_id() != -1:\n",
        "    if False:\n",
        (
            "tests/distributed/test_batch_statistics.py::test_global_batch_sum_makes_a_models_own_statistics_whole",
        ),
    ),
    # Issue 47: on CUDA the recompute runs on autograd's device thread, which sees none of
    # the caller's context variables or thread-locals.
    Mutant(
        "recompute_groups_per_thread",
        "src/shardwise/parallelize/global_batch.py",
        "        return _LAST[0]  # inside backward: a checkpointed block recomputing\n",
        "        return _LAST[0] if __import__('threading').current_thread() is "
        "__import__('threading').main_thread() else None\n",
        (
            "tests/unit/parallelize/test_batch_stats.py::test_a_recomputed_block_sums_over_the_batch_as_its_forward_did",
            "tests/distributed/test_batch_statistics.py::test_global_batch_sum_makes_a_models_own_statistics_whole",
        ),
    ),
    Mutant(
        "experts_fp16_divided_twice",
        "src/shardwise/parallelize/fsdp.py",
        "    if ranks > 1 or (policy.reduce_dtype or grads) in (torch.float32, torch.bfloat16):\n",
        "    if True:\n",
        (
            "tests/distributed/test_expert_parallel.py::test_fp16_gradients_with_one_expert_shard_rank_equal_one_process",
        ),
    ),
    Mutant(
        "expert_counts_by_bincount",
        "src/shardwise/parallelize/experts.py",
        "    return torch.diff(torch.searchsorted(owner, ranks))\n",
        "    return torch.bincount(owner, minlength=ep)\n",
        (
            "tests/distributed/test_expert_parallel.py::test_expert_dispatch_waits_for_the_device_once_per_layer_and_forward",
        ),
    ),
    Mutant(
        "sync_counter_blind_in_backward",
        "src/shardwise/testing/syncs.py",
        "            if not depth and not counts.paused and (when is None or when(args, kwargs)):\n",
        "            if not depth and not counts.paused and (when is None or when(args, kwargs)) "
        "and torch._C._current_graph_task_id() == -1:\n",
        ("tests/unit/testing/test_host_syncs.py::test_a_recompute_in_backward_is_counted",),
    ),
    Mutant(
        "pipeline_token_count_on_the_host",
        "src/shardwise/parallelize/pipeline.py",
        "    return (labels[..., 1:] != -100).sum().clamp_min(1)\n",
        "    return max(int((labels[..., 1:] != -100).sum()), 1)\n",
        (
            "tests/distributed/test_pipeline.py::test_a_micro_step_waits_for_nothing_and_an_update_once",
        ),
    ),
    Mutant(
        "pipeline_reduces_every_step_of_a_window",
        "src/shardwise/parallelize/pipeline.py",
        "    if sync:\n        yield\n",
        "    if True:\n        yield\n",
        ("tests/distributed/test_pipeline.py::test_an_accumulation_window_reduce_scatters_once",),
    ),
    Mutant(
        "pipeline_given_items_divided_by_micro_batches",
        "src/shardwise/parallelize/pipeline.py",
        '        return kwargs.pop("num_items_in_batch")\n',
        "        return None\n",
        (
            "tests/distributed/test_pipeline.py::test_the_batchs_own_num_items_in_batch_weighs_each_micro_batch_as_one_process",
        ),
    ),
    Mutant(
        "stage_training_nothing_gets_no_optimizer",
        "src/shardwise/train/optim.py",
        '            built = optimizer([{"params": []}])\n',
        "            built = optimizer([])\n",
        (
            "tests/distributed/test_pipeline.py::test_a_stage_that_trains_nothing_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "stage_norm_reduced_from_the_cpu",
        "src/shardwise/parallelize/pipeline.py",
        "    squared = norm_of(mine).float().to(state.device) ** 2\n",
        "    squared = norm_of(mine).float() ** 2\n",
        (
            "tests/unit/parallelize/test_pipeline_devices.py::test_the_norm_of_a_stage_that_trains_nothing_is_reduced_on_the_stages_device",
        ),
    ),
    Mutant(
        "stage_loss_on_the_current_device",
        "src/shardwise/parallelize/pipeline.py",
        "        value = torch.zeros((), device=state.device)\n",
        "        value = torch.zeros(())\n",
        (
            "tests/unit/parallelize/test_pipeline_devices.py::test_every_stage_receives_the_loss_on_its_device",
        ),
    ),
    Mutant(
        "host_device_from_local_rank",
        "src/shardwise/distributed/process_group.py",
        '    if bound is not None and bound.type == "cuda":\n',
        "    if False:\n",
        (
            "tests/unit/distributed/test_device_choice.py::test_a_group_bound_to_a_gpu_puts_the_rank_there",
            "tests/unit/distributed/test_device_choice.py::test_get_dist_info_reads_the_device_the_world_group_is_bound_to",
        ),
    ),
    Mutant(
        "init_distributed_moves_a_hosts_rank",
        "src/shardwise/distributed/process_group.py",
        "    if device is None and adopted:\n",
        "    if False:\n",
        (
            "tests/unit/distributed/test_device_choice.py::test_init_distributed_adopts_the_gpu_a_host_bound_its_group_to",
        ),
    ),
    # A ratio of sums (the load-balancing loss, a masked mean) is the same summed over the
    # tp replicas too, so the numbers cannot see this one: the count of ranks summed over does.
    Mutant(
        "statistics_summed_over_tp",
        "src/shardwise/parallelize/apply.py",
        "    groups = groups_of(data_parallel)\n",
        "    groups = groups_of(mesh)\n",
        (
            "tests/distributed/test_batch_statistics.py::test_the_load_balancing_loss_trains_as_one_process",
        ),
    ),
    Mutant(
        "family_replaced_without_the_probe",
        "src/shardwise/parallelize/router_loss.py",
        "        elif _agrees(original):\n",
        "        elif True:\n",
        (
            "tests/unit/parallelize/test_router_loss.py::test_install_leaves_a_family_whose_function_is_another_loss",
        ),
    ),
    Mutant(
        "statistics_summed_in_eval",
        "src/shardwise/parallelize/global_batch.py",
        "        current = batch if module.training else None\n",
        "        current = batch\n",
        (
            "tests/unit/parallelize/test_batch_stats.py::test_eval_forwards_leave_statistics_per_rank",
        ),
    ),
    Mutant(
        "statement_on_every_rank",
        "src/shardwise/parallelize/batch_stats.py",
        "            if unseen_moe and batch.used == 0 and dist.get_rank() == 0:\n",
        "            if unseen_moe and batch.used == 0:\n",
        ("tests/unit/parallelize/test_batch_stats.py::test_a_statement_is_made_on_rank_0_only",),
    ),
    Mutant(
        "batchnorm_in_eval_stated",
        "src/shardwise/parallelize/batch_stats.py",
        "        if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm) and m.training\n",
        "        if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm)\n",
        (
            "tests/unit/parallelize/test_batch_stats.py::test_batchnorm_in_eval_mode_or_synced_is_not_stated",
        ),
    ),
    Mutant(
        "sweep_router_gradients_not_compared",
        "tests/models/_hf_sweep.py",
        '            _compare_router_grads(run["router_grads"], got["router_grads"], label)\n',
        "            pass\n",
        ("tests/models/test_hf_models.py::test_parity_check_fails_on_a_router_gradient_off",),
    ),
    # 9. Issue 33: the launcher's report holds on a busy machine; a refused layout is one line.
    Mutant(
        "no_grace_after_a_failure",
        "src/shardwise/cli/grace.py",
        "            if running and now - self._since < self.grace_s:\n",
        "            if running and now - self._since < 0:\n",
        (
            "tests/unit/cli/test_grace.py::test_the_others_run_on_while_the_grace_lasts",
            "tests/e2e/test_launch_robust.py::test_an_error_a_rank_reaches_after_another_ended_is_still_every_ranks",
        ),
    ),
    Mutant(
        "lost_peer_reported_as_a_cause",
        "src/shardwise/cli/report.py",
        "    causes = [f for f in failures if not by_launcher(f) and not _lost_peer(f)]\n",
        "    causes = [f for f in failures if not by_launcher(f)]\n",
        (
            "tests/unit/cli/test_report.py::test_a_survivors_lost_peer_and_a_launcher_stop_read_alike",
            "tests/e2e/test_launch_robust.py::test_a_dead_peer_reads_the_same_whether_the_survivor_noticed_or_was_stopped",
        ),
    ),
    Mutant(
        "launcher_stop_read_from_the_exit_code",
        "src/shardwise/cli/report.py",
        "            return f.rank in stopped_set\n",
        "            return not f.message and f.exitcode == -signal.SIGTERM\n",
        (
            "tests/unit/cli/test_report.py::test_a_rank_the_launcher_stopped_is_no_cause_whatever_its_exit",
        ),
    ),
    Mutant(
        "worker_prints_a_lost_peer",
        "src/shardwise/distributed/worker_errors.py",
        '_LAUNCHER_REPORTS = {"PeerExitedError"}\n',
        "_LAUNCHER_REPORTS: set[str] = set()\n",
        (
            "tests/unit/distributed/test_worker_errors.py::"
            "test_the_hook_records_every_error_and_prints_on_local_rank_0_only",
            "tests/e2e/test_launch_robust.py::test_a_dead_peer_reads_the_same_whether_the_survivor_noticed_or_was_stopped",
        ),
    ),
    Mutant(
        "torch_closing_lines_shown",
        "src/shardwise/cli/report.py",
        '        if msg.startswith("Sending process") and "closing signal" in msg:\n',
        '        if msg.startswith("Sending process") and "closing signal" in msg and False:\n',
        (
            "tests/unit/cli/test_report.py::test_a_restart_is_announced_with_the_report_of_the_attempt",
            "tests/e2e/test_launch_robust.py::test_a_dead_peer_reads_the_same_whether_the_survivor_noticed_or_was_stopped",
        ),
    ),
    Mutant(
        "layout_refusal_with_a_traceback",
        "src/shardwise/distributed/worker_errors.py",
        "    if getattr(exc, _REFUSED, False) or raised_by_shardwise(exc):\n",
        "    if raised_by_shardwise(exc):\n",
        (
            "tests/unit/distributed/test_worker_errors.py::"
            "test_the_hook_records_every_error_and_prints_on_local_rank_0_only",
            "tests/e2e/test_launch_robust.py::test_a_layout_refused_in_every_rank_is_one_line_and_the_summary",
        ),
    ),
    Mutant(
        "mesh_refusal_not_marked",
        "src/shardwise/distributed/mesh.py",
        "            raise _refused(\n"
        '                f"ParallelConfig.dp_shard={dp_shard} with strategy={strategy!r}: this strategy "\n'
        '                f"shards over all',
        "            raise ValueError(\n"
        '                f"ParallelConfig.dp_shard={dp_shard} with strategy={strategy!r}: this strategy "\n'
        '                f"shards over all',
        (
            "tests/unit/distributed/test_mesh.py::test_full_shard_with_partial_dp_shard_points_to_hybrid",
            "tests/e2e/test_launch_robust.py::test_a_layout_refused_in_every_rank_is_one_line_and_the_summary",
        ),
    ),
    Mutant(
        "refusal_mark_not_written_for_the_launcher",
        "src/shardwise/distributed/worker_errors.py",
        '                "one_line": short_error(exc),  # read by cli/report.py; torch ignores it\n',
        "",
        (
            "tests/unit/cli/test_report.py::test_a_refused_setting_only_other_ranks_raised_is_one_line",
        ),
    ),
    Mutant(
        "spawn_timeout_counts_start_up",
        "src/shardwise/testing/spawn.py",
        "    deadline, timing_fn = time.monotonic() + STARTUP_S, False\n",
        "    deadline, timing_fn = time.monotonic() + timeout_s, True\n",
        (
            "tests/unit/testing/test_spawn_clock.py::"
            "test_a_slow_start_does_not_spend_the_functions_timeout",
        ),
    ),
    # 9. Issue 35: adapters under tensor parallelism.
    Mutant(
        "tp_thaws_frozen_norms",
        "src/shardwise/parallelize/tensor.py",
        "        if name in frozen and p.requires_grad:\n            p.requires_grad_(False)\n",
        "        if name in frozen and p.requires_grad:\n            pass\n",
        (
            "tests/distributed/test_adapters.py::test_tensor_parallel_keeps_frozen_parameters_frozen",
            "tests/distributed/test_adapters.py::test_adapters_train_as_one_process_and_the_base_stays_put",
        ),
    ),
    Mutant(
        "lora_b_split_under_a_row_split_base",
        "src/shardwise/parallelize/adapters.py",
        '                out[f"{name}.lora_A.{adapter}"] = lora_a_style(style)\n',
        '                out[f"{name}.lora_A.{adapter}"] = lora_a_style(style)\n'
        '                out[f"{name}.lora_B.{adapter}"] = lora_b_style(ColwiseParallel())\n',
        (
            "tests/unit/parallelize/test_adapter_plan.py::test_the_base_models_plan_reaches_through_peft_and_each_half_follows_its_base",
        ),
    ),
    # 10. Issue 35: adapter checkpoints and exports.
    Mutant(
        "adapter_checkpoint_keeps_a_tied_frozen_head",
        "src/shardwise/checkpoint/adapters.py",
        "    return {k: v for k, v in state.items() if k not in frozen}\n",
        "    return state\n",
        (
            "tests/unit/checkpoint/test_adapter_checkpoint.py::"
            "test_a_tied_frozen_head_stays_out_of_an_adapters_only_checkpoint",
        ),
    ),
    Mutant(
        "adapter_save_drops_the_optimizer_state",
        "src/shardwise/checkpoint/save.py",
        "        model_sd = without_frozen(model, model_sd)\n",
        "        model_sd = without_frozen(model, model_sd)\n"
        '        optim_sd = {**optim_sd, "state": {}}\n',
        (
            "tests/unit/checkpoint/test_adapter_checkpoint.py::"
            "test_an_adapters_only_checkpoint_holds_the_trainable_tensors_and_their_state",
        ),
    ),
    Mutant(
        "adapter_base_fingerprint_ignores_shapes",
        "src/shardwise/checkpoint/adapters.py",
        "        (_base_key(found, n), list(p.shape)) for n, p in model.named_parameters()\n",
        "        (_base_key(found, n), []) for n, p in model.named_parameters()\n",
        (
            "tests/unit/checkpoint/test_adapter_checkpoint.py::"
            "test_loading_into_another_model_is_refused_naming_the_field",
        ),
    ),
    Mutant(
        "adapter_lora_scale_not_checked_on_load",
        "src/shardwise/checkpoint/adapters.py",
        '    for layer, scales in (saved.get("lora_scaling") or {}).items():\n',
        "    for layer, scales in {}.items():\n",
        (
            "tests/unit/checkpoint/test_adapter_checkpoint.py::"
            "test_loading_into_another_model_is_refused_naming_the_field",
        ),
    ),
    Mutant(
        "peft_key_keeps_the_adapter_name",
        "src/shardwise/checkpoint/adapters.py",
        "    key = f\"{head.removesuffix(f'.{adapter}')}.{suffix}\"\n",
        '    key = f"{head}.{suffix}"\n',
        (
            "tests/unit/checkpoint/test_adapter_export.py::test_adapter_keys_are_the_ones_peft_writes",
        ),
    ),
    Mutant(
        "lora_merged_without_its_scale",
        "src/shardwise/checkpoint/adapters.py",
        "    delta = (delta * scale).to(b.dtype)\n",
        "    delta = delta.to(b.dtype)\n",
        (
            "tests/unit/checkpoint/test_adapter_export.py::"
            "test_the_merged_export_equals_peft_merge_and_opens_in_transformers",
        ),
    ),
    Mutant(
        "lora_merged_ignoring_fan_in_fan_out",
        "src/shardwise/checkpoint/adapters.py",
        "    if transpose:\n        delta = delta.T\n",
        "    if False:\n        delta = delta.T\n",
        (
            "tests/unit/checkpoint/test_adapter_export.py::"
            "test_the_merged_export_equals_peft_merge_and_opens_in_transformers",
        ),
    ),
    Mutant(
        "adapter_model_exported_whole_by_default",
        "src/shardwise/checkpoint/export.py",
        '        return "adapter" if record is not None else "full"\n',
        '        return "full"\n',
        (
            "tests/unit/checkpoint/test_adapter_export.py::"
            "test_the_adapter_export_is_peft_own_and_opens_in_peft",
        ),
    ),
    # Rank 0 writes its own shard of each adapter as if it were the whole (accelerate PR #4206).
    Mutant(
        "adapter_export_writes_rank0s_shard",
        "src/shardwise/checkpoint/adapter_export.py",
        "        value = _full(state[name])\n",
        "        value = state[name].to_local() if isinstance(state[name], DTensor) else state[name]\n",
        (
            "tests/distributed/test_adapter_checkpoints.py::"
            "test_the_peft_export_opens_in_peft_with_the_trained_logits",
        ),
    ),
    Mutant(
        "frozen_units_resharded_every_micro_batch",
        "src/shardwise/parallelize/fsdp.py",
        "        module.set_reshard_after_backward(not keep, recurse=False)\n",
        "        module.set_reshard_after_backward(True, recurse=False)\n",
        (
            "tests/distributed/test_adapters.py::test_keeping_the_frozen_base_gathered_saves_all_gathers_and_changes_nothing",
        ),
    ),
    # 11. Issue 35: quantized bases (QLoRA): the refusals, the storage dtype, wrap's preparation.
    Mutant(
        "quantized_requires_grad_checked_for_8bit_only",
        "src/shardwise/plan/quantized.py",
        "    trainable = [q for q in found if q.requires_grad]\n",
        "    trainable = [q for q in found if q.requires_grad and q.bits == 8]\n",
        (
            "tests/unit/plan/test_quantized.py::test_a_quantized_weight_that_requires_grad_is_refused",
            "tests/unit/plan/test_quantized.py::test_wrap_refuses_and_prepares_a_quantized_base_at_world_1",
        ),
    ),
    Mutant(
        "tp_over_a_quantized_base_refused_only_for_auto",
        "src/shardwise/plan/quantized.py",
        "    if config.tp != 1:\n",
        '    if config.tp == "auto":\n',
        (
            "tests/unit/plan/test_quantized.py::test_tensor_parallel_over_a_quantized_base_is_refused",
        ),
    ),
    Mutant(
        "8bit_refused_under_ddp_not_fully_shard",
        "src/shardwise/plan/quantized.py",
        '    if sharded and eight and config.strategy != "ddp":\n',
        '    if sharded and eight and config.strategy == "ddp":\n',
        (
            "tests/unit/plan/test_quantized.py::test_an_8bit_base_is_refused_by_fully_shard_and_taken_by_ddp",
        ),
    ),
    Mutant(
        "quant_state_bytes_without_the_code_book",
        "src/shardwise/plan/quantized.py",
        "    for t in quant_state_tensors(p):\n",
        "    for t in quant_state_tensors(p)[:1]:\n",
        (
            "tests/unit/plan/test_quantized.py::test_a_4bit_weight_weighs_its_packed_codes_and_its_quant_state",
            "tests/unit/plan/test_quantized.py::test_an_8bit_weight_weighs_its_codes_and_row_scales",
        ),
    ),
    Mutant(
        "bitsandbytes_cpu_repacking_left_on",
        "src/shardwise/parallelize/quantized.py",
        "                setattr(module, _CPU_REPACK, False)\n",
        "                setattr(module, _CPU_REPACK, True)\n",
        (
            "tests/unit/plan/test_quantized.py::test_after_wrap_an_eval_forward_leaves_the_codes_trainable",
            "tests/distributed/test_qlora.py::test_an_eval_forward_between_steps_changes_nothing",
        ),
    ),
    Mutant(
        "layer_quant_state_not_kept",
        "src/shardwise/parallelize/quantized.py",
        "                module.quant_state = state\n",
        "                pass\n",
        (
            "tests/unit/plan/test_quantized.py::test_wrap_refuses_and_prepares_a_quantized_base_at_world_1",
        ),
    ),
    Mutant(
        "quant_scales_not_synced_before_sharding",
        "src/shardwise/parallelize/apply.py",
        "            prepare_quantized(model, quantized, device=info.device, sync=sync)\n    prepare =",
        "            prepare_quantized(model, quantized, device=info.device)\n    prepare =",
        ("tests/distributed/test_qlora.py::test_every_rank_takes_rank_0s_codes_and_scales",),
    ),
    # Issue 47: QLoRA on GPUs.
    Mutant(
        "codes_gathered_as_numbers",
        "src/shardwise/parallelize/quantized.py",
        "            if q.quantized and q.floating_storage:\n",
        "            if q.quantized and q.floating_storage and q.storage != 'bfloat16':\n",
        (
            "tests/unit/plan/test_quantized.py::test_wrap_holds_4bit_codes_as_the_bytes_they_are",
            "tests/distributed/test_qlora.py::test_4bit_codes_are_gathered_as_bytes",
        ),
    ),
    Mutant(
        "quant_state_left_on_the_host_under_offload",
        "src/shardwise/parallelize/apply.py",
        "            prepare_quantized(model, quantized, device=info.device, sync=sync)\n    prepare =",
        "            prepare_quantized(model, quantized, device=info.device if move else None, "
        "sync=sync)\n    prepare =",
        (
            "tests/distributed/test_qlora.py::test_the_quant_state_goes_where_the_layer_computes_under_cpu_offload",
        ),
    ),
    Mutant(
        "quantized_base_unprepared_under_ep",
        "src/shardwise/parallelize/apply.py",
        "        if quantized:  # before the codes are synced: as bytes, their scales on the device\n",
        "        if False:\n",
        (
            "tests/distributed/test_qlora.py::test_qlora_under_expert_parallel_trains_as_one_process",
        ),
    ),
    Mutant(
        "simulation_builds_a_4bit_base_into_a_crash",
        "src/shardwise/memory/simulate.py",
        '        if any(name in str(exc) for name in ("Params4bit", "Int8Params")):\n',
        '        if any(name in str(exc) for name in ("Int8Params",)):\n',
        ("tests/unit/plan/test_quantized.py::test_the_simulation_refuses_a_quantized_base",),
    ),
    # 12. The memory simulation under gloo: reduce-scatter's clone of its input.
    Mutant(
        "gloo_reduce_scatter_without_its_clone",
        "src/shardwise/memory/fake.py",
        "        clone = input.clone()\n",
        "        clone = input\n",
        (
            "tests/distributed/test_simulate_real.py::test_untied_large_vocabulary_llama_is_within_5_percent_of_the_real_run",
            "tests/unit/memory/test_simulate.py::test_gloo_reduce_scatter_holds_a_copy_of_its_input",
        ),
    ),
    # 13. Issue 35: training paths for adapter models (the run file's section, the Engine's
    # optimizer and clipping, the Runner's adapters-only checkpoints).
    Mutant(
        "adapter_section_read_but_never_applied",
        "src/shardwise/train/engine.py",
        "        model = _with_adapter(model, adapter)  # before wrapping: peft adds layers to wrap\n",
        "",
        (
            "tests/unit/train/test_adapter_engine.py::test_the_engine_applies_the_section_and_optimizes_the_adapters_only",
        ),
    ),
    Mutant(
        "adapter_alpha_not_passed_to_peft",
        "src/shardwise/config/adapters.py",
        "            lora_alpha=alpha,\n",
        "            lora_alpha=self.r,\n",
        ("tests/unit/config/test_adapter_section.py::test_apply_adds_lora_and_freezes_the_base",),
    ),
    Mutant(
        "adapter_target_typo_left_to_peft",
        "src/shardwise/config/adapters.py",
        '    _check_targets(model, config.target_modules, "target_modules")\n',
        "",
        (
            "tests/unit/config/test_adapter_section.py::test_a_mistyped_target_is_refused_with_the_closest_layer",
        ),
    ),
    Mutant(
        "adapter_section_takes_a_scalar",
        "src/shardwise/config/run_file.py",
        "        if optional is not None and value is not None and not isinstance(value, Mapping):\n",
        "        if False:\n",
        ("tests/unit/config/test_adapter_section.py::test_bad_values_are_refused_at_load",),
    ),
    Mutant(
        "frozen_parameters_left_in_an_optimizer_object",
        "src/shardwise/train/optim.py",
        "    _drop_frozen(optimizer)\n",
        "",
        (
            "tests/unit/train/test_adapter_engine.py::test_an_optimizer_holding_the_frozen_base_steps_and_clips_the_adapters_only",
        ),
    ),
    Mutant(
        "clip_and_step_over_parameters_frozen_since",
        "src/shardwise/train/engine.py",
        "            if p.requires_grad:\n                params.append(p)\n",
        "            if True:\n                params.append(p)\n",
        (
            "tests/unit/train/test_adapter_engine.py::test_a_parameter_frozen_after_the_engine_was_built_is_not_stepped_or_clipped",
        ),
    ),
    Mutant(
        "runner_saves_adapter_models_whole",
        "src/shardwise/train/resume.py",
        "    return frozen\n",
        "    return False\n",
        (
            "tests/unit/train/test_adapter_engine.py::test_adapters_only_is_the_default_for_an_adapter_model_and_resumes_exactly",
            "tests/distributed/test_adapter_training.py::test_checkpoints_of_the_lora_run_hold_the_adapters_only",
        ),
    ),
    Mutant(
        "runner_save_drops_adapters_only",
        "src/shardwise/train/runner.py",
        "            where, self.engine, keep_last=keep, runner_state=state, adapters_only=only\n",
        "            where, self.engine, keep_last=keep, runner_state=state, adapters_only=False\n",
        (
            "tests/unit/train/test_adapter_engine.py::test_adapters_only_is_the_default_for_an_adapter_model_and_resumes_exactly",
            "tests/distributed/test_adapter_training.py::test_checkpoints_of_the_lora_run_hold_the_adapters_only",
        ),
    ),
    Mutant(
        "gradients_estimated_from_a_units_average_bytes",
        "src/shardwise/memory/model_states.py",
        "    trainable_bytes = sum(round(u.trainable_bytes * share[u.fqn]) for u in plan.units)\n",
        "    trainable_bytes = sum(\n"
        "        round(sum(u.bytes_by_dtype.values()) * u.trainable_params / u.num_params * share[u.fqn])\n"
        "        for u in plan.units\n"
        "        if u.num_params\n"
        "    )\n",
        (
            "tests/unit/memory/test_frozen_estimate.py::test_gradients_and_optimizer_state_count_the_trainable_parameters_in_their_dtype",
        ),
    ),
    # 14. Issue 34: every refusal for each class of bad input, each bound measured as it
    # runs, the metadata read back.
    Mutant(
        "tp_plan_value_checked_only_when_a_string",
        "src/shardwise/config/tensor_parallel.py",
        "            if not isinstance(style, ParallelStyle) and style not in TP_STYLE_NAMES:\n",
        "            if isinstance(style, str) and style not in TP_STYLE_NAMES:\n",
        (
            "tests/unit/parallelize/test_tensor_plan.py::test_a_plan_value_of_every_wrong_kind_is_refused",
        ),
    ),
    Mutant(
        "tp_plan_of_another_type_refused_only_when_a_number",
        "src/shardwise/config/tensor_parallel.py",
        "    elif not callable(plan):\n",
        "    elif isinstance(plan, int | float):\n",
        (
            "tests/unit/parallelize/test_tensor_plan.py::test_a_plan_that_is_no_word_dict_or_callable_is_refused",
        ),
    ),
    Mutant(
        "moe_plan_naming_a_parameter_the_experts_lack_taken",
        "src/shardwise/parallelize/moe.py",
        "        if missing or unknown or inner:\n",
        "        if missing or inner:\n",
        (
            "tests/unit/parallelize/test_tensor_plan.py::test_a_moe_plan_naming_parameters_the_experts_lack_is_refused",
        ),
    ),
    Mutant(
        "moe_inner_parameters_left_whole",
        "src/shardwise/parallelize/moe.py",
        "        if missing or unknown or inner:\n",
        "        if missing or unknown:\n",
        (
            "tests/unit/parallelize/test_tensor_plan.py::test_experts_holding_parameters_in_inner_modules_are_refused",
        ),
    ),
    Mutant(
        "unpickler_takes_any_torch_attribute",
        "src/shardwise/checkpoint/trust.py",
        '                and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))\n',
        '                and (name == "Size" or hasattr(torch, name))\n',
        (
            "tests/unit/checkpoint/test_trust.py::test_the_unpickler_refuses_every_global_outside_its_list",
        ),
    ),
    Mutant(
        "unpickler_takes_all_of_torch_serialization",
        "src/shardwise/checkpoint/trust.py",
        '            or (module == "torch.serialization" and name == "_get_layout")\n',
        '            or (module == "torch.serialization")\n',
        (
            "tests/unit/checkpoint/test_trust.py::test_the_unpickler_refuses_every_global_outside_its_list",
        ),
    ),
    Mutant(
        "unpickler_takes_all_of_dcp_filesystem",
        "src/shardwise/checkpoint/trust.py",
        '            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")\n',
        '            or (module == "torch.distributed.checkpoint.filesystem")\n',
        (
            "tests/unit/checkpoint/test_trust.py::test_the_unpickler_refuses_every_global_outside_its_list",
        ),
    ),
    Mutant(
        "manifest_counts_checked_for_type_not_range",
        "src/shardwise/checkpoint/trust.py",
        "    return isinstance(value, int) and not isinstance(value, bool) and value >= low\n",
        "    return isinstance(value, int) and not isinstance(value, bool)\n",
        (
            "tests/unit/checkpoint/test_trust.py::test_a_manifest_field_out_of_its_range_is_refused_by_name",
        ),
    ),
    Mutant(
        "manifest_world_size_zero_taken",
        "src/shardwise/checkpoint/trust.py",
        '    for key, low in (("step", 0), ("world_size", 1)):\n',
        '    for key, low in (("step", 0), ("world_size", 0)):\n',
        (
            "tests/unit/checkpoint/test_trust.py::test_a_manifest_field_out_of_its_range_is_refused_by_name",
        ),
    ),
    Mutant(
        "manifest_skipped_steps_unchecked",
        "src/shardwise/checkpoint/trust.py",
        '    for key in ("skipped_steps", "bytes"):\n',
        '    for key in ("bytes",):\n',
        (
            "tests/unit/checkpoint/test_trust.py::test_a_manifest_field_out_of_its_range_is_refused_by_name",
        ),
    ),
    Mutant(
        "manifest_sha256_checked_for_hex_not_length",
        "src/shardwise/checkpoint/trust.py",
        "            isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX,\n",
        "            isinstance(digest, str) and set(digest) <= _SHA256_HEX,\n",
        (
            "tests/unit/checkpoint/test_trust.py::test_a_manifest_field_out_of_its_range_is_refused_by_name",
        ),
    ),
    Mutant(
        "export_gathers_before_making_room",
        "src/shardwise/checkpoint/export.py",
        "        if keep and make_room is not None:\n            make_room(value)\n",
        "",
        (
            "tests/unit/checkpoint/test_export_bounds.py::test_rank_0_holds_at_most_one_files_worth_at_every_gather",
        ),
    ),
    Mutant(
        "export_makes_room_at_the_stored_size",
        "src/shardwise/checkpoint/export.py",
        "        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None\n",
        "        dtype = None\n",
        (
            "tests/unit/checkpoint/test_export_bounds.py::test_index_total_size_and_file_packing_are_at_the_cast_size",
        ),
    ),
    Mutant(
        "export_counts_bytes_before_the_cast",
        "src/shardwise/checkpoint/export.py",
        "            tensor = tensor.to(self.dtype)\n        nbytes = tensor.numel() * tensor.element_size()\n",
        "            pass\n        nbytes = tensor.numel() * tensor.element_size()\n"
        "        tensor = tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor\n",
        (
            "tests/unit/checkpoint/test_export_bounds.py::test_index_total_size_and_file_packing_are_at_the_cast_size",
        ),
    ),
    Mutant(
        "re_export_moves_the_old_entry_last",
        "src/shardwise/checkpoint/export.py",
        "    for p in sorted(old, key=lambda p: p.name not in (SINGLE_FILE, INDEX_FILE, ADAPTER_FILE)):\n",
        "    for p in sorted(old, key=lambda p: p.name in (SINGLE_FILE, INDEX_FILE, ADAPTER_FILE)):\n",
        (
            "tests/unit/checkpoint/test_export_bounds.py::test_every_move_of_a_re_export_leaves_one_loadable_export_or_none",
        ),
    ),
    Mutant(
        "re_export_moves_the_new_entry_first",
        "src/shardwise/checkpoint/export.py",
        "    for name in sorted(new, key=lambda n: n == written.name):\n",
        "    for name in sorted(new, key=lambda n: n != written.name):\n",
        (
            "tests/unit/checkpoint/test_export_bounds.py::test_every_move_of_a_re_export_leaves_one_loadable_export_or_none",
        ),
    ),
    # The instant estimate under tp, term by term against the simulation.
    Mutant(
        "tp_share_splits_whole_parameters_too",
        "src/shardwise/memory/model_states.py",
        "        held[fqn] = held.get(fqn, 0.0) + p.numel() / (tp if id(p) in split else 1)\n",
        "        held[fqn] = held.get(fqn, 0.0) + p.numel() / tp\n",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    Mutant(
        "tp_share_by_the_shallowest_unit",
        "src/shardwise/memory/model_states.py",
        "key=lambda x: -len(x[0]))",
        "key=lambda x: len(x[0]))",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    Mutant(
        "row_split_bias_counted_as_split",
        "src/shardwise/parallelize/tensor.py",
        '        elif isinstance(style, RowwiseParallel) and "weight" in own:\n'
        '            out.add(id(own["weight"]))\n',
        "        elif isinstance(style, RowwiseParallel):\n"
        "            out.update(id(p) for p in own.values())\n",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    Mutant(
        "gathered_without_the_tp_share",
        "src/shardwise/memory/model_states.py",
        "    units = [round(compute_bytes(u.bytes_by_dtype) * share[u.fqn]) for u in plan.units]\n",
        "    units = [compute_bytes(u.bytes_by_dtype) for u in plan.units]\n",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    Mutant(
        "gathered_root_counted_as_a_block",
        "src/shardwise/memory/model_states.py",
        "    largest = max(units[:-1], default=0)\n",
        "    largest = max(units, default=0)\n",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    Mutant(
        "unit_gradients_without_the_tp_share",
        "src/shardwise/memory/model_states.py",
        "        (round(u.trainable_params * share[u.fqn]) for u in plan.units[:-1]), default=0\n",
        "        (u.trainable_params for u in plan.units[:-1]), default=0\n",
        (
            "tests/unit/memory/test_tp_estimate.py::test_each_term_of_the_tp_estimate_equals_the_simulation",
        ),
    ),
    # Edges: clipping a non-finite norm, the second node's report, the tp check under sp.
    Mutant(
        "clip_scales_by_a_nonfinite_norm",
        "src/shardwise/train/engine.py",
        "    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))\n",
        "    return coef\n",
        ("tests/unit/train/test_clip_nonfinite.py::test_a_nonfinite_norm_scales_no_gradient",),
    ),
    Mutant(
        "clip_guards_an_infinite_norm_not_a_nan",
        "src/shardwise/train/engine.py",
        "    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))\n",
        "    return torch.where(~torch.isinf(norm), coef, torch.ones_like(coef))\n",
        ("tests/unit/train/test_clip_nonfinite.py::test_a_nonfinite_norm_scales_no_gradient",),
    ),
    Mutant(
        "mmengine_nonfinite_refusal_misses_nan",
        "src/shardwise/integrations/mmengine.py",
        "    if error_if_nonfinite and not torch.isfinite(total):",
        "    if error_if_nonfinite and torch.isinf(total):",
        (
            "tests/unit/train/test_clip_nonfinite.py::test_mmengine_global_clip_of_a_nonfinite_norm_scales_nothing_and_refuses_if_asked",
        ),
    ),
    Mutant(
        "report_reads_the_global_rank_as_local",
        "src/shardwise/cli/report.py",
        "        elif any(f.local_rank == 0 for f in group) and _shown_live(first.message):\n",
        "        elif any(f.rank == 0 for f in group) and _shown_live(first.message):\n",
        (
            "tests/unit/cli/test_report.py::"
            "test_the_second_node_of_a_two_node_job_reads_its_local_rank_0_by_local_rank",
        ),
    ),
    Mutant(
        "tp_gradient_check_reads_the_first_mesh_dim",
        "src/shardwise/parallelize/tensor.py",
        "            if TP_DIM in dims and not isinstance(g.placements[dims.index(TP_DIM)], Replicate):\n",
        "            if TP_DIM in dims and not isinstance(g.placements[0], Replicate):\n",
        (
            "tests/distributed/test_tp_gradient_check.py::"
            "test_a_whole_parameters_gradient_that_differs_over_tp_is_refused",
        ),
    ),
    Mutant(
        "tp_gradient_check_skips_the_tp_mesh",
        "src/shardwise/parallelize/tensor.py",
        "            if TP_DIM in dims and not isinstance(g.placements[dims.index(TP_DIM)], Replicate):\n",
        "            if TP_DIM in dims:\n",
        (
            "tests/distributed/test_tp_gradient_check.py::"
            "test_a_whole_parameters_gradient_that_differs_over_tp_is_refused",
        ),
    ),
    # Issue 34's own audit: ten planted bugs in config, plan, the memory simulation, the
    # Runner and the integrations (3 of 10 were caught before these tests).
    Mutant(
        "warm_up_starts_at_zero",
        "src/shardwise/config/run_file.py",
        "                return (step + 1) / warmup\n",
        "                return step / warmup\n",
        (
            "tests/unit/config/test_optimizer_section.py::"
            "test_warm_up_starts_at_one_warmup_th_of_the_peak_and_reaches_it",
        ),
    ),
    Mutant(
        "adam_betas_not_passed",
        "src/shardwise/config/optimizer.py",
        'return cls(params, lr=lr, betas=s["betas"], eps=s["eps"], weight_decay=s["weight_decay"])',
        'return cls(params, lr=lr, eps=s["eps"], weight_decay=s["weight_decay"])',
        ("tests/unit/config/test_optimizer_section.py::test_adams_fields_reach_the_optimizer",),
    ),
    Mutant(
        "regex_policy_prefix_match",
        "src/shardwise/plan/policies.py",
        "lambda fqn, m, n: compiled.fullmatch(fqn) is not None,",
        "lambda fqn, m, n: compiled.match(fqn) is not None,",
        ("tests/unit/plan/test_plan.py::test_regex_policy_fullmatches_fqns",),
    ),
    Mutant(
        "fsdp1_callable_asked_with_recurse",
        "src/shardwise/plan/policies.py",
        "return Policy(lambda fqn, m, n: fn(m, False, n),",
        "return Policy(lambda fqn, m, n: fn(m, True, n),",
        (
            "tests/unit/plan/test_policy_forms.py::"
            "test_an_fsdp1_style_callable_is_asked_whether_to_wrap_the_module_itself",
        ),
    ),
    Mutant(
        "ddp_buckets_count_frozen_parameters",
        "src/shardwise/memory/tracking.py",
        "for p in model.parameters() if p.requires_grad)",
        "for p in model.parameters())",
        ("tests/unit/memory/test_simulate.py::test_ddp_buckets_hold_the_trainable_gradients_only",),
    ),
    Mutant(
        "category_peak_is_the_last_value",
        "src/shardwise/memory/tracking.py",
        "                if name and value > peaks.get(name, -1):\n",
        "                if name:\n",
        ("tests/unit/memory/test_simulate.py::test_model_states_match_the_analytic_plan",),
    ),
    Mutant(
        "val_batches_one_too_many",
        "src/shardwise/train/runner.py",
        "if limit is not None and i >= limit:",
        "if limit is not None and i > limit:",
        (
            "tests/unit/train/test_runner.py::"
            "test_validation_reads_val_batches_batches_and_weights_each_by_its_samples",
        ),
    ),
    Mutant(
        "val_mean_of_batch_means",
        "src/shardwise/train/runner.py",
        "        samples = count_batch(batch)[0] or 1\n",
        "        samples = 1\n",
        (
            "tests/unit/train/test_runner.py::"
            "test_validation_reads_val_batches_batches_and_weights_each_by_its_samples",
        ),
    ),
    Mutant(
        "mmengine_sync_back_on_before_backward",
        "src/shardwise/integrations/mmengine.py",
        "                if not self._in_train_step:\n                    self._set_gradient_sync(True)\n",
        "                self._set_gradient_sync(True)\n",
        (
            "tests/unit/integrations/test_mmengine_contract.py::"
            "test_sharded_wrapper_keeps_sync_off_through_an_accumulating_backward_and_clips_globally",
        ),
    ),
    Mutant(
        "mmengine_clip_by_torchs_norm",
        "src/shardwise/integrations/mmengine.py",
        "            wrapper.clip_func = _global_norm_clip\n",
        "            pass\n",
        (
            "tests/unit/integrations/test_mmengine_contract.py::"
            "test_sharded_wrapper_keeps_sync_off_through_an_accumulating_backward_and_clips_globally",
        ),
    ),
    Mutant(
        "frozen_parameters_hooked_by_the_ddp_tracker",
        "src/shardwise/memory/tracking.py",
        "    _skip_frozen_grad_hooks(tracker, model)\n",
        "",
        (
            "tests/unit/memory/test_simulate.py::"
            "test_a_model_with_frozen_parameters_simulates_under_ddp",
        ),
    ),
    # Issue 36: pipeline stages.
    Mutant(
        "stage_never_takes_the_received_hidden_states",
        "src/shardwise/parallelize/stages.py",
        "        if index != 0:\n            first_block.register_forward_pre_hook(",
        "        if False:\n            first_block.register_forward_pre_hook(",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_two_stages_chained_give_the_whole_models_loss",
        ),
    ),
    Mutant(
        "stage_keeps_the_blocks_of_other_stages",
        "src/shardwise/parallelize/stages.py",
        "    out: dict[str, nn.Module] = {fqn: _Skip() for fqn in blocks if fqn not in held}\n",
        "    out: dict[str, nn.Module] = {}\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_a_stage_keeps_the_whole_models_names_and_only_its_own_parameters",
        ),
    ),
    Mutant(
        "each_stage_of_a_rank_gets_its_own_parameters",
        "src/shardwise/parallelize/stages.py",
        "        if name not in path:\n            return module\n",
        "        if name not in path:\n            return copy.deepcopy(module)\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_a_rank_holding_two_stages_runs_each_through_its_own_module",
        ),
    ),
    Mutant(
        "a_rank_holds_adjacent_stages",
        "src/shardwise/plan/stages.py",
        "        return list(range(pp_rank, len(self.stages), self.degree))\n",
        "        return list(range(pp_rank * self.per_rank, (pp_rank + 1) * self.per_rank))\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_interleaving_cuts_pp_times_stages_per_rank_and_places_them_in_a_loop",
        ),
    ),
    Mutant(
        "interleaved_micro_batches_not_checked_against_its_rounds",
        "src/shardwise/config/pipeline.py",
        '    if schedule == "interleaved_1f1b" and microbatches % rounds != 0:\n',
        "    if False:\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_micro_batch_rules_of_the_schedules",
        ),
    ),
    Mutant(
        "tied_ends_split_differently_by_tp_accepted",
        "src/shardwise/parallelize/tensor.py",
        '        if len(set(splits.values())) != 1 or "unknown" in splits[first]:\n',
        "        if False:\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_tied_ends_on_two_stages_must_be_split_alike_by_the_tp_plan",
        ),
    ),
    Mutant(
        "routing_weights_not_in_the_order_of_the_copies",
        "src/shardwise/parallelize/experts.py",
        "        weight = weights.reshape(-1)[order].to(back.dtype)\n",
        "        weight = weights.reshape(-1).to(back.dtype)\n",
        (
            "tests/distributed/test_expert_parallel.py::test_expert_parallel_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "pp_or_ep_taken_with_a_device_mesh_of_ones_own",
        "src/shardwise/parallelize/apply.py",
        "            if getattr(config, name) > 1:\n",
        "            if False:\n",
        (
            "tests/unit/config/test_vocabulary.py::test_pp_or_ep_with_a_mesh_of_ones_own_is_refused_with_the_fix",
        ),
    ),
    Mutant(
        "a_rank_without_tokens_skips_the_backward_all_to_all",
        "src/shardwise/parallelize/experts.py",
        "                zero = received.sum() * 0\n",
        "                zero = out.new_zeros(())\n",
        (
            "tests/distributed/test_expert_parallel.py::test_experts_that_receive_no_token_still_step_as_in_one_process",
        ),
    ),
    Mutant(
        "experts_without_tokens_left_without_a_gradient",
        "src/shardwise/parallelize/experts.py",
        "                    zero = zero + param.sum() * 0\n",
        "                    pass\n",
        (
            "tests/distributed/test_expert_parallel.py::test_experts_that_receive_no_token_still_step_as_in_one_process",
        ),
    ),
    Mutant(
        "experts_gradient_divided_by_the_ranks_that_shard_them",
        "src/shardwise/parallelize/fsdp.py",
        "        unit.set_gradient_divide_factor(float(spec.dp_size * spec.cp))\n",
        "        unit.set_gradient_divide_factor(float(spec.dp_size // spec.ep * spec.cp))\n",
        (
            "tests/distributed/test_expert_parallel.py::test_expert_parallel_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "sums_forced_over_a_shard_group_of_one",
        "src/shardwise/parallelize/fsdp.py",
        '        if backend == "gloo" and ranks > 1:\n',
        '        if backend == "gloo":\n',
        (
            "tests/distributed/test_expert_parallel.py::test_expert_parallel_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "tp_plan_keeps_splitting_the_experts_under_ep",
        "src/shardwise/parallelize/experts.py",
        "    kept = {k: v for k, v in plan.apply.items() if not isinstance(v, ExpertsParallel)}\n",
        "    kept = dict(plan.apply)\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_under_ep_the_tp_plan_leaves_the_experts_whole",
        ),
    ),
    Mutant(
        "ep_accepted_when_it_does_not_divide_dp_shard",
        "src/shardwise/distributed/mesh.py",
        "    if spec.dp_shard % ep == 0:\n",
        "    if True:\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_ep_borrows_its_ranks_from_dp_shard_or_whole_tp_groups",
        ),
    ),
    Mutant(
        "auto_split_gives_the_remainder_to_the_last_stages",
        "src/shardwise/plan/stages.py",
        "(1 if s < extra else 0)",
        "(1 if s >= pp - extra else 0)",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_auto_split_balances_blocks_and_sends_the_rest_to_the_ends",
        ),
    ),
    Mutant(
        "one_f_one_b_takes_fewer_micro_batches_than_stages",
        "src/shardwise/config/pipeline.py",
        'if schedule == "1f1b" and microbatches < pp:',
        'if schedule == "1f1b" and microbatches < 1:',
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_micro_batch_rules_of_the_schedules",
        ),
    ),
    Mutant(
        "pp_taken_at_world_one",
        "src/shardwise/parallelize/apply.py",
        "    if info.world_size == 1 and not config.force_wrap:\n        if config.pp > 1:\n",
        "    if info.world_size == 1 and not config.force_wrap:\n        if False:\n",
        ("tests/unit/parallelize/test_pipeline_stages.py::test_wrap_at_world_one_refuses_stages",),
    ),
    Mutant(
        "hosts_take_ep",
        "src/shardwise/integrations/layouts.py",
        "    if config.ep != 1:\n",
        "    if False:\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_hosts_refuse_expert_parallel_with_the_reason",
        ),
    ),
    Mutant(
        "hosts_take_pp",
        "src/shardwise/integrations/layouts.py",
        "    if config.pp != 1:\n",
        "    if False:\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_hosts_refuse_pipeline_stages_with_the_reason",
        ),
    ),
    Mutant(
        "run_spawns_a_pp_the_world_cannot_hold",
        "src/shardwise/cli/launch.py",
        "            pp=parallel.pp,\n            ep=parallel.ep,\n",
        "            ep=parallel.ep,\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_run_refuses_a_pp_the_world_cannot_hold_before_spawning",
        ),
    ),
    Mutant(
        "micro_batches_weighted_by_their_own_token_means",
        "src/shardwise/parallelize/pipeline.py",
        'if labels is None or getattr(model, "loss_type", None) != "ForCausalLM":',
        "if True:",
        ("tests/distributed/test_pipeline.py::test_pp2_dp2_trains_equal_to_one_process",),
    ),
    Mutant(
        "tied_gradients_kept_per_stage",
        "src/shardwise/parallelize/pipeline.py",
        "        dist.all_reduce(_local(p.grad), group=state.tie_group)\n",
        "        pass\n",
        ("tests/distributed/test_pipeline.py::test_pp2_dp2_trains_equal_to_one_process",),
    ),
    Mutant(
        "clipping_norm_of_one_stage",
        "src/shardwise/parallelize/pipeline.py",
        "    dist.all_reduce(squared, group=state.group)\n",
        "",
        ("tests/distributed/test_pipeline.py::test_pp2_dp2_trains_equal_to_one_process",),
    ),
    Mutant(
        "stage_refuses_the_other_stages_checkpoint_keys",
        "src/shardwise/checkpoint/load.py",
        "unexpected = [] if stage else sorted(",
        "unexpected = [] if False else sorted(",
        (
            "tests/distributed/test_pipeline.py::test_a_pp2_checkpoint_loads_at_world_2_and_1_exactly_and_steps_on",
        ),
    ),
    Mutant(
        "tied_optimizer_state_read_under_the_last_stages_name",
        "src/shardwise/checkpoint/load.py",
        "aliases = tied_aliases(unwrap(engine.model)) if load_optimizer else {}",
        "aliases: dict[str, str] = {}",
        (
            "tests/distributed/test_pipeline.py::test_a_pp1_checkpoint_loads_into_two_stages_with_the_ties_optimizer_state",
        ),
    ),
    Mutant(
        "runner_splits_data_over_every_rank_under_pp",
        "src/shardwise/train/runner.py",
        "(spec.tp > 1 or spec.pp > 1 or spec.cp > 1)",
        "(spec.tp > 1 or spec.cp > 1)",
        (
            "tests/distributed/test_pipeline.py::"
            "test_the_runner_gives_both_stages_of_a_pipeline_the_same_rows",
        ),
    ),
    Mutant(
        "runner_takes_a_short_last_batch_under_pp",
        "src/shardwise/train/runner.py",
        "        if per_rank % loader.batch_size:\n",
        "        if False:\n",
        (
            "tests/distributed/test_pipeline.py::"
            "test_the_runner_gives_both_stages_of_a_pipeline_the_same_rows",
        ),
    ),
    Mutant(
        "pipeline_sends_a_batch_of_another_shape",
        "src/shardwise/parallelize/pipeline.py",
        "    elif shapes != state.shapes:\n",
        "    elif False:\n",
        (
            "tests/distributed/test_pipeline.py::"
            "test_a_batch_of_another_shape_is_refused_before_the_schedule_sends",
        ),
    ),
    Mutant(
        "tp_applied_to_another_stages_shims",
        "src/shardwise/parallelize/tensor.py",
        "            if not is_shim(model.get_submodule(n))\n",
        "            if True\n",
        (
            "tests/distributed/test_pipeline.py::test_pp2_dp2_tp2_at_world_8_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "stated_routing_sends_more_to_one_rank_than_can_reach_it",
        "src/shardwise/parallelize/experts.py",
        "else min(math.ceil(self.load * tokens * k), bound)",
        "else math.ceil(self.load * tokens * k)",
        (
            "tests/unit/memory/test_expert_memory.py::test_the_stated_routing_sends_evenly_and_loads_the_busiest_rank_as_stated",
        ),
    ),
    Mutant(
        "simulated_rank_receives_only_what_it_sends",
        "src/shardwise/parallelize/experts.py",
        "            sent, got = _STATED[-1].splits(flat.numel() // k, k, ep, local)\n",
        "            got, sent = _STATED[-1].splits(flat.numel() // k, k, ep, local)\n",
        (
            "tests/unit/memory/test_expert_memory.py::test_a_simulated_step_under_ep_states_its_routing_and_keeps_the_model_states",
        ),
    ),
    Mutant(
        "simulation_ignores_the_expert_load_given",
        "src/shardwise/memory/simulate.py",
        "_routing(spec.ep, expert_load) as routing,",
        "_routing(spec.ep, DEFAULT_EXPERT_LOAD) as routing,",
        (
            "tests/unit/memory/test_expert_memory.py::test_a_simulated_step_under_ep_states_its_routing_and_keeps_the_model_states",
            "tests/distributed/test_expert_parallel.py::test_the_simulated_peak_is_within_10_percent_of_the_busiest_real_rank",
        ),
    ),
    Mutant(
        "simulation_counts_dtensor_shape_inference_as_memory",
        "src/shardwise/memory/simulate.py",
        "                untracked_shape_inference(fake_mode),\n",
        "",
        (
            "tests/unit/memory/test_expert_memory.py::test_no_rank_is_charged_a_whole_experts_parameter_it_never_holds",
        ),
    ),
    Mutant(
        "experts_of_other_stages_spread_too",
        "src/shardwise/parallelize/apply.py",
        "        experts = {name: m for name, m in experts.items() if id(m) in kept}\n",
        "",
        (
            "tests/distributed/test_expert_parallel.py::test_ep_inside_pipeline_stages_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "router_weights_split_over_tp_without_gathering_their_gradient",
        "src/shardwise/parallelize/experts.py",
        "        out = forward(shard(hidden), mine, shard(weights))\n",
        "        out = forward(shard(hidden), mine, weights.chunk(tp)[tp_mesh.get_local_rank()])\n",
        (
            "tests/distributed/test_expert_parallel.py::test_expert_parallel_trains_equal_to_one_process",
        ),
    ),
    Mutant(
        "padding_rows_kept_and_last_tokens_cut",
        "src/shardwise/parallelize/experts.py",
        "        return gathered.redistribute(tp_mesh, [Replicate()]).to_local()[:rows]\n",
        "        return gathered.redistribute(tp_mesh, [Replicate()]).to_local()[-rows:]\n",
        (
            "tests/distributed/test_expert_parallel.py::test_tokens_that_do_not_split_evenly_over_tp_still_train_equal",
        ),
    ),
    Mutant(
        "experts_padded_to_one_per_rank_on_their_first_dimension",
        "src/shardwise/parallelize/fsdp.py",
        "    return Shard(0) if local.shape[0] % ranks == 0 else Shard(1)\n",
        "    return Shard(0)\n",
        (
            "tests/distributed/test_expert_parallel.py::test_one_expert_per_rank_is_split_on_its_second_dimension",
        ),
    ),
    Mutant(
        "value_dependent_forward_blamed_on_the_input",
        "src/shardwise/memory/fake.py",
        '        if "DynamicOutputShape" in type(exc).__name__ or "DataDependent" in type(exc).__name__:\n',
        "        if False:\n",
        (
            "tests/unit/memory/test_expert_memory.py::test_a_forward_with_value_dependent_shapes_is_refused_with_the_reason",
        ),
    ),
    Mutant(
        "zero1_called_exact",
        "src/shardwise/config/deepspeed.py",
        '                "shard_grad_op",\n                "differs",',
        '                "shard_grad_op",\n                "exact",',
        ("tests/unit/config/test_deepspeed.py::test_each_row_says_how_faithful_it_is",),
    ),
    Mutant(
        "deepspeed_adam_read_as_torch_adam",
        "src/shardwise/config/deepspeed.py",
        'name = "adamw" if params.get("adam_w_mode", True) else "adam"',
        'name = "adamw" if params.get("adam_w_mode", False) else "adam"',
        ("tests/unit/config/test_deepspeed.py::test_each_row_says_how_faithful_it_is",),
    ),
    Mutant(
        "schedule_one_step_early",
        "src/shardwise/config/deepspeed_schedules.py",
        "    def warmup(step: int, base: float) -> float:\n        high = base if top is None else float(top)  # None: 'auto', the optimizer's lr\n        i = step - 1\n",
        "    def warmup(step: int, base: float) -> float:\n        high = base if top is None else float(top)  # None: 'auto', the optimizer's lr\n        i = step\n",
        ("tests/unit/config/test_deepspeed.py::test_schedulers_give_each_step_deepspeeds_lr",),
    ),
    Mutant(
        "train_batch_size_mismatch_accepted",
        "src/shardwise/config/deepspeed.py",
        "    ok = size is not None and steps is not None and total == size * steps * world\n",
        "    ok = size is not None and steps is not None\n",
        ("tests/unit/config/test_deepspeed.py::test_what_cannot_mean_the_same_is_refused_by_key",),
    ),
    Mutant(
        "fsdp2_reshard_false_read_as_full_shard",
        "src/shardwise/config/accelerate.py",
        'strategy = "full_shard" if truth in _TRUE else "shard_grad_op"',
        'strategy = "full_shard"',
        ("tests/unit/config/test_accelerate.py::test_a_yaml_translates_to_its_documented_layout",),
    ),
    Mutant(
        "flat_parameters_asked_for_and_accepted",
        "src/shardwise/config/accelerate.py",
        'verdict: Verdict = "no effect" if value else "refused"',
        'verdict: Verdict = "no effect"',
        ("tests/unit/config/test_accelerate.py::test_what_cannot_mean_the_same_is_refused_by_key",),
    ),
    Mutant(
        "torchtitan_sequence_parallel_default_off",
        "src/shardwise/config/torchtitan.py",
        'sp = bool(p.pop("enable_sequence_parallel", True))',
        'sp = bool(p.pop("enable_sequence_parallel", False))',
        ("tests/unit/config/test_torchtitan.py::test_a_toml_translates_to_its_documented_layout",),
    ),
    Mutant(
        "torchtitan_default_resharding_ignores_pp",
        "src/shardwise/config/torchtitan.py",
        'reshard == "never" or (reshard == "default" and pp > 1)',
        'reshard == "never"',
        ("tests/unit/config/test_torchtitan.py::test_a_toml_translates_to_its_documented_layout",),
    ),
    Mutant(
        "engine_ignores_the_launched_file",
        "src/shardwise/parallelize/from_env.py",
        "    launched = translation_from_env()\n    if launched is None:\n        if optimizer",
        "    launched = None\n    if launched is None:\n        if optimizer",
        (
            "tests/e2e/test_foreign_configs.py::test_the_unchanged_script_on_two_processes_equals_one",
        ),
    ),
    Mutant(
        "runner_ignores_the_launched_file",
        "src/shardwise/train/runner.py",
        "    return launched.config.runner if launched is not None else RunnerConfig()\n",
        "    return RunnerConfig()\n",
        (
            "tests/unit/config/test_deepspeed.py::test_the_engine_and_the_runner_take_a_launched_files_values",
        ),
    ),
    Mutant(
        "launch_starts_despite_refused_keys",
        "src/shardwise/cli/launch.py",
        "        translation.config  # noqa: B018  (a ConfigError naming every refused key)\n",
        "        pass\n",
        (
            "tests/e2e/test_foreign_configs.py::test_a_refused_key_stops_the_launch_before_anything_starts",
        ),
    ),
    Mutant(
        "schedule_read_against_the_first_groups_lr",
        "src/shardwise/config/translation.py",
        '        factors = [factor(group["lr"]) for group in optimizer.param_groups]\n',
        '        factors = [factor(optimizer.param_groups[0]["lr"]) for _ in optimizer.param_groups]\n',
        ("tests/unit/config/test_deepspeed.py::test_every_param_group_gets_deepspeeds_lr",),
    ),
    Mutant(
        "grouped_product_of_any_shape_simulated",
        "src/shardwise/memory/fake.py",
        '    if mat_a.dim() != 2 or mat_b.dim() != 3 or args or kwargs.get("bias") is not None:\n',
        "    if False:\n",
        (
            "tests/unit/memory/test_expert_memory.py::test_a_grouped_product_of_another_shape_is_refused_by_the_simulation",
        ),
    ),
    # Issue 38, part 2 and 3: Lightning Fabric and tensor parallel inside the hosts.
    Mutant(
        "fabric_joint_setup_keeps_the_replaced_parameters",
        "src/shardwise/integrations/fabric.py",
        'group["params"] = [after.get(names.get(id(p), ""), p) for p in group["params"]]',
        'group["params"] = [p for p in group["params"]]',
        (
            "tests/unit/integrations/test_fabric_contract.py::"
            "test_a_joint_setup_points_the_optimizer_at_the_new_parameters_by_name",
        ),
    ),
    Mutant(
        "fabric_no_sync_never_turns_sync_back_on",
        "src/shardwise/integrations/fabric.py",
        "        finally:\n            module.set_requires_gradient_sync(True)",
        "        finally:\n            pass",
        ("tests/integrations/test_fabric.py::test_world_2_matches_fabric_ddp",),
    ),
    Mutant(
        "fabric_sampler_splits_a_tp_group",
        "src/shardwise/integrations/fabric.py",
        "        if self.config.tp_size == 1:  # every rank reads its own rows",
        "        if True:  # every rank reads its own rows",
        ("tests/integrations/test_fabric.py::test_tensor_parallel_matches_fabric_ddp",),
    ),
    Mutant(
        "fabric_load_leaves_the_optimizer",
        "src/shardwise/integrations/fabric.py",
        "            load_optimizer=parts.optimizer is not None,",
        "            load_optimizer=False,",
        ("tests/integrations/test_fabric.py::test_fabric_save_and_load_resume_exactly",),
    ),
    Mutant(
        "fabric_clip_counts_one_rank",
        "src/shardwise/integrations/fabric.py",
        "        norm = clip_grad_norm_(trainable_params(optimizer), float(max_norm))",
        "        norm = torch.nn.utils.clip_grad_norm_(trainable_params(optimizer), float(max_norm))",
        ("tests/integrations/test_fabric.py::test_world_2_matches_fabric_ddp",),
    ),
    Mutant(
        "lightning_sampler_splits_a_tp_group",
        "src/shardwise/integrations/lightning.py",
        "        if info is not None and self.config.tp_size > 1:",
        "        if info is not None and self.config.tp_size > 99:",
        ("tests/integrations/test_lightning.py::test_tensor_parallel_matches_lightning_ddp",),
    ),
    Mutant(
        "a_held_models_plan_not_found",
        "src/shardwise/parallelize/tensor.py",
        "    for prefix, inner in planned_submodules(model):\n        plan.update(",
        "    for prefix, inner in planned_submodules(model)[:0]:\n        plan.update(",
        (
            "tests/unit/parallelize/test_tensor_plan.py::"
            "test_a_module_holding_a_hugging_face_model_takes_its_plan_under_its_name",
        ),
    ),
    Mutant(
        "engine_builds_a_default_optimizer_not_the_files",
        "src/shardwise/parallelize/from_env.py",
        "        optimizer if optimizer is not None else given.optimizer.build,",
        "        optimizer if optimizer is not None else type(given.optimizer)().build,",
        (
            "tests/unit/config/test_deepspeed.py::"
            "test_the_engine_builds_the_files_optimizer_when_the_script_passes_none",
        ),
    ),
    # Issue 39: a resume at another data-parallel world keeps the global batch.
    Mutant(
        "world_change_halves_the_global_batch",
        "src/shardwise/train/resume.py",
        "    set_accumulation(engine, steps)\n",
        "    pass\n",
        (
            "tests/unit/train/test_keep_global_batch.py::test_the_accumulation_keeps_the_global_batch",
            "tests/distributed/test_runner_dist.py::"
            "test_resume_at_another_world_size_trains_each_sample_of_the_epoch_once",
        ),
    ),
    Mutant(
        "sigusr1_left_to_its_default",
        "src/shardwise/train/resume.py",
        "STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)",
        "STOP_SIGNALS = (signal.SIGTERM,)",
        ("tests/unit/train/test_runner.py::test_slurms_sigusr1_saves_and_exits_75_like_sigterm",),
    ),
    Mutant(
        "launcher_dies_on_sigusr1",
        "src/shardwise/cli/launch.py",
        '"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",',
        '"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",',
        (
            "tests/distributed/test_preemption.py::test_sigterm_to_shardwise_run_ends_with_75_and_no_traceback",
        ),
    ),
    Mutant(
        "a_refused_setting_is_restarted",
        "src/shardwise/cli/grace.py",
        "                agent._remaining_restarts = 0\n",
        "                pass\n",
        ("tests/e2e/test_launch_robust.py::test_a_refused_layout_is_not_restarted",),
    ),
    Mutant(
        "the_minutes_timer_never_fires",
        "src/shardwise/train/runner.py",
        "    return minutes is not None and time.monotonic() - since >= 60 * minutes\n",
        "    return minutes is not None and time.monotonic() - since >= 3600 * minutes\n",
        ("tests/unit/train/test_runner.py::test_a_checkpoint_interval_in_minutes",),
    ),
    Mutant(
        "save_request_not_carried_by_the_update",
        "src/shardwise/train/reduce.py",
        "            torch.full((), float(save), device=device),\n",
        "            torch.zeros((), device=device),\n",
        ("tests/unit/train/test_runner.py::test_a_checkpoint_interval_in_minutes",),
    ),
    Mutant(
        "minutes_timer_all_reduced_each_update",
        "src/shardwise/train/runner.py",
        "                        if _timer_due(cfg, last_save):\n",
        "                        if cfg.save_every_minutes is not None and any_rank(\n"
        "                            _timer_due(cfg, last_save), self.world, engine.device):\n",
        (
            "tests/distributed/test_runner_dist.py::test_the_minutes_timer_costs_no_sync_and_saves_every_rank_together",
        ),
    ),
    Mutant(
        "fabric_save_keeps_what_json_changes",
        "src/shardwise/integrations/fabric.py",
        "        same = json.loads(json.dumps(value)) == value\n",
        "        same = True\n",
        (
            "tests/unit/integrations/test_fabric_contract.py::"
            "test_a_state_a_checkpoint_cannot_hold_is_refused_by_key",
        ),
    ),
    Mutant(
        "world_change_trains_a_global_batch_it_cannot_keep",
        "src/shardwise/train/resume.py",
        "    if rest or steps < 1:\n",
        "    if False:\n",
        (
            "tests/unit/train/test_keep_global_batch.py::"
            "test_a_global_batch_no_whole_accumulation_makes_up_is_refused_in_one_line",
        ),
    ),
    Mutant(
        "dp_world_rewritten_as_a_float",
        "src/shardwise/train/metrics.py",
        '_INTEGERS = ("step", "epoch", "dp_world")',
        '_INTEGERS = ("step", "epoch")',
        (
            "tests/unit/train/test_keep_global_batch.py::"
            "test_metrics_rows_keep_the_data_parallel_ranks_an_integer_through_a_rewrite",
        ),
    ),
    # Workers that all exited 75 (stopped and saved, the launcher not signalled) reported
    # as a failure: the launcher exits 1, which no scheduler requeues.
    Mutant(
        "preempted_workers_exit_the_launcher_with_1",
        "src/shardwise/cli/launch.py",
        "            if preempted(failures):",
        "            if False:",
        (
            "tests/e2e/test_launch_robust.py::"
            "test_workers_stopped_by_a_signal_the_launcher_missed[0-75]",
        ),
    ),
    Mutant(
        "preempted_ranks_reported_as_failed",
        "src/shardwise/cli/report.py",
        '    ended = "stopped and saved" if preempted(failures) else "failed"',
        '    ended = "failed"',
        (
            "tests/unit/cli/test_report.py::"
            "test_ranks_that_all_exited_75_read_as_stopped_and_saved_not_failed",
        ),
    ),
    Mutant(
        "a_75_with_an_error_of_its_own_read_as_preempted",
        "src/shardwise/cli/report.py",
        "        f.exitcode == PREEMPTED_EXIT_CODE and not f.message for f in failures",
        "        f.exitcode == PREEMPTED_EXIT_CODE for f in failures",
        (
            "tests/unit/cli/test_report.py::"
            "test_ranks_that_all_exited_75_read_as_stopped_and_saved_not_failed",
        ),
    ),
    # A host's loop computing in fp16 with no loss scale: small gradients round to zero.
    Mutant(
        "lightning_strategies_take_fp16_with_no_loss_scale",
        "src/shardwise/integrations/layouts.py",
        "    if computes_in_fp16(config):",
        "    if False:",
        (
            "tests/unit/integrations/test_fabric_contract.py::"
            "test_fp16_compute_is_refused_by_both_lightning_strategies",
        ),
    ),
    Mutant(
        "mmengine_checks_the_loss_scaler_only_when_sharded",
        "src/shardwise/integrations/mmengine.py",
        '        if computes_in_fp16(model.config) and getattr(wrapper, "loss_scaler", None) is None:',
        "        if model.sharded and computes_in_fp16(model.config)"
        ' and getattr(wrapper, "loss_scaler", None) is None:',
        (
            "tests/unit/integrations/test_mmengine_contract.py::"
            "test_fp16_compute_with_no_loss_scaler_is_refused_and_an_amp_wrapper_taken",
        ),
    ),
    # Two SLURM jobs sharing a rendezvous store both named 'none': they join one job.
    Mutant(
        "rdzv_id_not_taken_from_slurm",
        "src/shardwise/cli/launch.py",
        '        rdzv_id = getattr(args, "rdzv_id", None) or os.environ.get("SLURM_JOB_ID")',
        '        rdzv_id = getattr(args, "rdzv_id", None)',
        (
            "tests/unit/config/test_run_file.py::"
            "test_a_multi_node_job_is_named_at_the_rendezvous_by_its_id_or_slurms",
        ),
    ),
    # A trajectory that went NaN passes parity: NaN fails no `>` and Python's max skips it.
    Mutant(
        "parity_passes_a_loss_that_is_not_finite",
        "src/shardwise/testing/parity.py",
        "        if not (math.isfinite(a) and math.isfinite(b)):",
        "        if not (math.isfinite(a) or math.isfinite(b)):",
        (
            "tests/unit/testing/test_compare_trajectories.py::"
            "test_a_loss_that_is_not_finite_after_the_first_step_is_refused",
        ),
    ),
    Mutant(
        "parity_passes_a_parameter_that_is_not_finite",
        "src/shardwise/testing/parity.py",
        "                if not bool(torch.isfinite(tensor).all()):",
        "                if not bool(torch.isfinite(tensor).any()):",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_a_parameter_that_is_not_finite_is_refused_by_name",
        ),
    ),
    Mutant(
        "worst_of_skips_a_nan_as_max_does",
        "src/shardwise/testing/parity.py",
        "    bad = [v for v in values if not math.isfinite(v)]",
        "    bad = [v for v in values if math.isinf(v)]",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_worst_of_is_max_over_finite_differences_and_refuses_a_late_nan",
        ),
    ),
    Mutant(
        "same_distribution_passes_an_uninitialised_nan",
        "src/shardwise/testing/spawn.py",
        "        g_finite, w_finite = g[torch.isfinite(g)].float(), w[torch.isfinite(w)].float()",
        "        g_finite, w_finite = g[~torch.isinf(g)].float(), w[torch.isfinite(w)].float()",
        (
            "tests/unit/testing/test_compare_trajectories.py::"
            "test_a_draw_holding_a_nan_its_namesake_lacks_is_not_the_same_distribution",
        ),
    ),
    # Issue 48: the outside audit's survivors (bugs chosen from the code and docs before the
    # tests were read; 18 of 43 survived the tests each module's change would run).
    Mutant(
        "ep_router_indices_alias_dropped",
        "src/shardwise/parallelize/experts.py",
        '    return len(names) == 3 and names[1] in ("top_k_index", "router_indices", "topk_indices")\n',
        '    return len(names) == 3 and names[1] in ("top_k_index", "topk_indices")\n',
        (
            "tests/unit/parallelize/test_expert_plan.py::test_each_spelling_of_the_routing_argument_is_found",
        ),
    ),
    Mutant(
        "ep_packed_divisibility_ignores_stride",
        "src/shardwise/parallelize/moe.py",
        "            parts = tp * int(strided)\n",
        "            parts = tp\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_a_packed_gate_and_up_split_needs_tp_parts_of_each_half",
        ),
    ),
    Mutant(
        "ep_check_covers_unknown_ignored",
        "src/shardwise/parallelize/moe.py",
        "        if missing or unknown or inner:\n",
        "        if missing or inner:\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_a_plan_entry_for_a_parameter_the_experts_lack_is_refused",
        ),
    ),
    Mutant(
        "rb_probe_skips_gradient",
        "src/shardwise/parallelize/router_loss.py",
        "            if not close(want, got) or not all(map(close, want_grad, got_grad)):\n",
        "            if not close(want, got):\n",
        (
            "tests/unit/parallelize/test_router_loss.py::test_the_probe_refuses_a_function_with_the_same_value_and_another_gradient",
        ),
    ),
    Mutant(
        "rb_current_outside_backward",
        "src/shardwise/parallelize/global_batch.py",
        "    if active is None and torch._C._current_graph_task_id() != -1:\n",
        "    if active is None:\n",
        (
            "tests/unit/parallelize/test_batch_stats.py::test_outside_any_forward_or_backward_a_statistic_is_left_alone",
        ),
    ),
    Mutant(
        "ad_plan_first_adapter_only",
        "src/shardwise/parallelize/adapters.py",
        "        for adapter in wrapper.lora_A:  # type: ignore[union-attr]\n",
        "        for adapter in list(wrapper.lora_A)[:1]:  # type: ignore[union-attr]\n",
        (
            "tests/unit/parallelize/test_adapter_plan.py::test_every_adapter_loaded_on_a_layer_follows_its_base",
        ),
    ),
    Mutant(
        "fr_ds_batch_unchecked_without_world",
        "src/shardwise/config/deepspeed.py",
        "        if micro and accum:\n",
        "        if micro or accum:\n",
        (
            "tests/unit/config/test_deepspeed.py::test_without_a_world_size_a_total_batch_missing_a_factor_is_refused",
        ),
    ),
    Mutant(
        "fr_acc_distributed_type_overrides_strategy",
        "src/shardwise/config/accelerate.py",
        '        out.parallel.setdefault("strategy", "full_shard")\n',
        '        out.parallel["strategy"] = "full_shard"\n',
        (
            "tests/unit/config/test_accelerate.py::test_the_named_sharding_strategy_wins_whatever_the_key_order",
        ),
    ),
    Mutant(
        "fr_acc_replicate_one_is_hybrid",
        "src/shardwise/config/accelerate.py",
        "            if int(value) > 1:\n",
        "            if int(value) >= 1:\n",
        ("tests/unit/config/test_accelerate.py::test_replicas_of_one_are_no_replication",),
    ),
    Mutant(
        "fr_tt_hsdp_pp_loses_replication",
        "src/shardwise/config/torchtitan.py",
        '        strategy = "shard_grad_op" if strategy == "full_shard" else "hybrid_shard_zero2"\n',
        '        strategy = "shard_grad_op"\n',
        (
            "tests/unit/config/test_torchtitan.py::test_each_data_parallel_layout_and_reshard_setting_maps_to_its_strategy",
        ),
    ),
    Mutant(
        "le_grace_inf_accepted",
        "src/shardwise/cli/launch.py",
        '    if not 0 <= s < float("inf"):\n',
        "    if not 0 <= s:\n",
        (
            "tests/unit/cli/test_small_edges.py::test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused",
        ),
    ),
    Mutant(
        "le_elastic_min_one_standalone",
        "src/shardwise/cli/launch.py",
        '    return int(str(nnodes).rpartition(":")[2])\n',
        '    return int(str(nnodes).partition(":")[0])\n',
        (
            "tests/unit/cli/test_small_edges.py::test_only_a_job_that_can_never_span_nodes_runs_standalone",
        ),
    ),
    Mutant(
        "le_grace_not_reset_between_attempts",
        "src/shardwise/cli/grace.py",
        "            self._since = None\n",
        "",
        ("tests/unit/cli/test_grace.py::test_each_attempt_gets_its_own_grace",),
    ),
    Mutant(
        "le_sigterm_with_error_counted_stopped",
        "src/shardwise/cli/report.py",
        "        return not f.message and f.exitcode == -signal.SIGTERM\n",
        "        return f.exitcode == -signal.SIGTERM\n",
        (
            "tests/unit/cli/test_report.py::test_a_rank_that_wrote_its_error_before_sigterm_ended_it_is_a_cause",
        ),
    ),
    Mutant(
        "le_resume_second_world_change",
        "src/shardwise/train/resume.py",
        '    configured = position.get("accumulate_configured", saved_steps)\n',
        "    configured = saved_steps\n",
        (
            "tests/unit/train/test_keep_global_batch.py::test_the_accumulation_keeps_the_global_batch",
        ),
    ),
    Mutant(
        "le_data_parallel_ignores_pp",
        "src/shardwise/train/runner.py",
        "    if info is not None and spec is not None and (spec.tp > 1 or spec.pp > 1 or spec.cp > 1):\n",
        "    if info is not None and spec is not None and (spec.tp > 1 or spec.pp > 1):\n",
        (
            "tests/unit/train/test_runner.py::test_the_ranks_of_a_tp_group_or_a_pipeline_read_the_same_rows",
        ),
    ),
    Mutant(
        "pa_extra_params_ignored",
        "src/shardwise/testing/parity.py",
        "        if set(reference.params) != set(candidate.params):\n",
        "        if set(reference.params) - set(candidate.params):\n",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_parameter_names_must_match_both_ways",
        ),
    ),
    Mutant(
        "ck_merge_lora_bf16_rounding",
        "src/shardwise/checkpoint/adapters.py",
        "    delta = (delta * scale).to(b.dtype)\n",
        "    delta = (delta * scale).to(weight.dtype)\n",
        (
            "tests/unit/checkpoint/test_adapter_export.py::test_the_merged_export_equals_peft_merge_and_opens_in_transformers",
        ),
    ),
    Mutant(
        "merged_bf16_adapters_rounded_once",
        "src/shardwise/checkpoint/adapters.py",
        "    delta = (delta * scale).to(b.dtype)\n",
        "    delta = delta * scale\n",
        (
            "tests/unit/checkpoint/test_adapter_export.py::test_the_merged_export_equals_peft_merge_and_opens_in_transformers",
        ),
    ),
    # Found on an H200 (2026-12-04): what CUDA's sync debug mode and torch 2.11 showed.
    Mutant(
        "update_picks_losses_by_a_list",
        "src/shardwise/train/reduce.py",
        "        bad = ~torch.isfinite(torch.stack(losses)).all()\n",
        "        bad = ~torch.isfinite(means[[i for i, k in enumerate(keys) if 'loss' in k]]).all()\n",
        (
            "tests/unit/train/test_engine_unit.py::test_the_update_reduction_waits_once_and_flags_only_its_losses",
        ),
    ),
    Mutant(
        "update_flags_a_nonfinite_statistic",
        "src/shardwise/train/reduce.py",
        'losses = [means[i] for i, k in enumerate(keys) if "loss" in k]',
        "losses = [means[i] for i, k in enumerate(keys)]",
        (
            "tests/unit/train/test_engine_unit.py::test_the_update_reduction_waits_once_and_flags_only_its_losses",
        ),
    ),
    Mutant(
        "sync_counter_misses_a_list_index",
        "src/shardwise/testing/syncs.py",
        "        if isinstance(part, list):\n            return True\n",
        "        if isinstance(part, list):\n            return False\n",
        (
            "tests/unit/testing/test_host_syncs.py::test_an_index_that_waits_is_counted_and_a_view_is_not",
        ),
    ),
    Mutant(
        "sync_counter_misses_a_mask",
        "src/shardwise/testing/syncs.py",
        "            if part.dtype == torch.bool and part.dim() > 0:",
        "            if part.dtype == torch.bool and part.dim() > 1:",
        (
            "tests/unit/testing/test_host_syncs.py::test_an_index_that_waits_is_counted_and_a_view_is_not",
        ),
    ),
    Mutant(
        "simulation_steps_tensor_by_tensor_for_a_gpu_job",
        "src/shardwise/memory/simulate.py",
        'opt = _make_optimizer(optimizer, model.parameters(), foreach=backend == "nccl")',
        "opt = _make_optimizer(optimizer, model.parameters())",
        (
            "tests/unit/memory/test_simulate.py::test_a_named_optimizer_is_simulated_as_torch_builds_it_for_the_jobs_device",
        ),
    ),
    Mutant(
        "fake_reads_only_the_new_param_groups",
        "src/shardwise/memory/fake.py",
        '    group = getattr(state, "_fsdp_param_group", None)\n    return [] if group is None else [group]\n',
        "    return []\n",
        (
            "tests/unit/memory/test_simulate.py::test_fsdp_param_groups_are_read_from_every_torch_release",
        ),
    ),
    Mutant(
        "qlora_on_torch_2_11_not_refused",
        "src/shardwise/plan/quantized.py",
        "for x in release) >= (2, 12)",
        "for x in release) >= (2, 11)",
        ("tests/unit/plan/test_quantized.py::test_a_4bit_base_under_fully_shard_needs_torch_2_12",),
    ),
    Mutant(
        "qlora_old_torch_refused_under_ddp",
        "src/shardwise/plan/quantized.py",
        'if sharded and four and (config.strategy != "ddp" or config.ep > 1)',
        "if sharded and four",
        ("tests/unit/plan/test_quantized.py::test_a_4bit_base_under_fully_shard_needs_torch_2_12",),
    ),
    # Context parallel, Ulysses (issue 49).
    Mutant(
        "cp_every_rank_keeps_the_first_chunk",
        "src/shardwise/parallelize/context.py",
        "return t.narrow(1, index * chunk, chunk).contiguous()",
        "return t.narrow(1, 0, chunk).contiguous()",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_transformers_batch_is_cut_with_global_positions_and_shifted_labels",
        ),
    ),
    Mutant(
        "cp_labels_cut_unshifted",
        "src/shardwise/parallelize/context.py",
        "shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)",
        "shifted = labels",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_transformers_batch_is_cut_with_global_positions_and_shifted_labels",
            "tests/distributed/test_context_parallel.py::test_context_parallel_equals_one_process[llama_cp2_full_shard]",
        ),
    ),
    Mutant(
        "cp_loss_not_times_cp",
        "src/shardwise/parallelize/context.py",
        'extra["num_items_in_batch"] = count / cp',
        'extra["num_items_in_batch"] = count',
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_transformers_batch_is_cut_with_global_positions_and_shifted_labels",
        ),
    ),
    Mutant(
        "cp_own_model_count_not_over_cp",
        "src/shardwise/parallelize/context.py",
        'arguments["num_items_in_batch"] = count / cp',
        'arguments["num_items_in_batch"] = count',
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_model_of_your_own_gets_its_targets_cut_and_counted_as_they_are",
        ),
    ),
    Mutant(
        "cp_documents_found_despite_a_mask",
        "src/shardwise/parallelize/context.py",
        'elif self.transformers and arguments.get("attention_mask") is None:',
        "elif self.transformers:",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_transformers_batch_is_cut_with_global_positions_and_shifted_labels",
        ),
    ),
    Mutant(
        "cp_documents_found_beside_a_cache",
        "src/shardwise/parallelize/context.py",
        "documents = None if cached else _documents(positions.expand(rows, seq_len))",
        "documents = _documents(positions.expand(rows, seq_len))",
        (
            "tests/unit/parallelize/test_context_unit.py::test_documents_are_found_only_where_transformers_finds_them",
        ),
    ),
    Mutant(
        "cp_attention_check_never_fires",
        "src/shardwise/parallelize/context.py",
        "if layout.attention_calls == 0:",
        "if layout.attention_calls < 0:",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_forward_whose_attention_ignores_shardwise_is_refused_once",
        ),
    ),
    Mutant(
        "cp_window_one_key_too_many",
        "src/shardwise/parallelize/ulysses.py",
        "allowed = allowed & (distance < window if causal else distance.abs() < window)",
        "allowed = allowed & (distance <= window if causal else distance.abs() <= window)",
        (
            "tests/unit/parallelize/test_context_unit.py::test_the_mask_is_the_models_at_sizes_where_the_wrong_ones_differ",
        ),
    ),
    Mutant(
        "cp_documents_not_masked",
        "src/shardwise/parallelize/ulysses.py",
        "allowed = allowed & (documents[:, :, None] == documents[:, None, :])",
        "allowed = allowed",
        (
            "tests/unit/parallelize/test_context_unit.py::test_the_mask_is_the_models_at_sizes_where_the_wrong_ones_differ",
        ),
    ),
    Mutant(
        "cp_padding_not_masked",
        "src/shardwise/parallelize/ulysses.py",
        "allowed = allowed & keep[:, None, :].bool()",
        "allowed = allowed",
        (
            "tests/unit/parallelize/test_context_unit.py::test_the_mask_is_the_models_at_sizes_where_the_wrong_ones_differ",
        ),
    ),
    Mutant(
        "cp_empty_rows_left_empty",
        "src/shardwise/parallelize/ulysses.py",
        "allowed = allowed | torch.eye(n, dtype=torch.bool, device=device)  # no empty row",
        "allowed = allowed  # no empty row",
        (
            "tests/unit/parallelize/test_context_unit.py::test_the_mask_is_the_models_at_sizes_where_the_wrong_ones_differ",
        ),
    ),
    Mutant(
        "cp_kv_heads_tiled_not_grouped",
        "src/shardwise/parallelize/ulysses.py",
        "return x.repeat_interleave(times, dim=1)",
        "return x.repeat(1, times, 1, 1)",
        (
            "tests/unit/parallelize/test_context_unit.py::test_kv_heads_are_repeated_within_their_query_groups",
        ),
    ),
    Mutant(
        "cp_heads_back_in_the_wrong_order",
        "src/shardwise/parallelize/ulysses.py",
        "return got.transpose(0, 1).reshape(b, cp * hl, n // cp, d)",
        "return got.permute(1, 2, 0, 3, 4).reshape(b, cp * hl, n // cp, d)",
        (
            "tests/distributed/test_context_parallel.py::test_context_parallel_equals_one_process[llama_cp2_full_shard]",
        ),
    ),
    Mutant(
        "cp_pipeline_hooked_instead_of_cut_whole",
        "src/shardwise/parallelize/apply.py",
        "        if state is not None:  # the stages are never called whole: the step cuts the batch",
        "        if state is not None and False:",
        (
            "tests/distributed/test_context_parallel.py::test_pp_x_cp_x_dp_at_world_8_equals_one_process",
        ),
    ),
    Mutant(
        "cp_mesh_drops_the_stages",
        "src/shardwise/distributed/mesh.py",
        "        spec.engine, spec.tp, spec.pp, ep, cp=cp,",
        "        spec.engine, spec.tp, 1, ep, cp=cp,",
        (
            "tests/unit/parallelize/test_context_unit.py::test_cp_ranks_sit_between_the_shard_ranks_and_tp",
        ),
    ),
    Mutant(
        "cp_layout_outlives_its_forward",
        "src/shardwise/parallelize/context.py",
        "        layout, _ACTIVE[0] = _ACTIVE[0], None\n",
        "        layout = _ACTIVE[0]\n",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_layout_is_current_during_its_forward_and_its_recompute_only",
        ),
    ),
    Mutant(
        "cp_recompute_reads_no_layout",
        "src/shardwise/parallelize/context.py",
        "    if torch._C._current_graph_task_id() != -1:\n        return _LAST[0]\n",
        "",
        (
            "tests/unit/parallelize/test_context_unit.py::test_a_layout_is_current_during_its_forward_and_its_recompute_only",
            "tests/distributed/test_context_parallel.py::test_context_parallel_equals_one_process[llama_cp2_recompute]",
        ),
    ),
    Mutant(
        "simulation_takes_every_row_as_packed",
        "src/shardwise/memory/fake.py",
        "        return None if isinstance(position_ids, FakeTensor) else original(position_ids)",
        "        return original(position_ids)",
        (
            "tests/unit/memory/test_simulate.py::test_a_transformers_models_attention_is_simulated_as_it_runs",
        ),
    ),
    Mutant(
        "cp_experts_divided_by_dp_only",
        "src/shardwise/parallelize/fsdp.py",
        "        unit.set_gradient_divide_factor(float(spec.dp_size * spec.cp))",
        "        unit.set_gradient_divide_factor(float(spec.dp_size))",
        (
            "tests/distributed/test_context_parallel.py::test_context_parallel_equals_one_process[moe_cp2_ep2]",
        ),
    ),
    Mutant(
        "cp_ep_group_without_its_cp_ranks",
        "src/shardwise/distributed/mesh.py",
        "        return self.dp_shard // (taken // self.cp if self.cp > 1 else taken)",
        "        return self.dp_shard // taken",
        (
            "tests/unit/parallelize/test_context_unit.py::test_cp_ranks_sit_between_the_shard_ranks_and_tp",
        ),
    ),
    Mutant(
        "cp_heads_checked_without_tp",
        "src/shardwise/parallelize/ulysses.py",
        "if isinstance(heads, int) and heads % (cp * tp):",
        "if isinstance(heads, int) and heads % cp:",
        (
            "tests/unit/parallelize/test_context_unit.py::test_what_ulysses_cannot_hold_is_refused_before_any_group",
        ),
    ),
    Mutant(
        "cp_heads_not_checked",
        "src/shardwise/parallelize/ulysses.py",
        "if isinstance(heads, int) and heads % (cp * tp):",
        "if isinstance(heads, int) and heads % (cp * tp) and cp > 8:",
        (
            "tests/unit/parallelize/test_context_unit.py::test_what_ulysses_cannot_hold_is_refused_before_any_group",
        ),
    ),
    Mutant(
        "cp_shard_mesh_is_hsdp",
        "src/shardwise/distributed/mesh.py",
        "return mesh[(REPLICATE_DIM, SHARD_CP_DIM)] if spec.is_2d else mesh[SHARD_CP_DIM]",
        "return mesh[(REPLICATE_DIM, SHARD_CP_DIM)] if spec.is_2d else mesh[(SHARD_DIM, CP_DIM)]",
        (
            "tests/distributed/test_context_parallel.py::test_the_layout_is_real[llama_cp2_full_shard]",
        ),
    ),
    Mutant(
        "cp_ranks_read_different_rows",
        "src/shardwise/parallelize/wrapped.py",
        "if spec is None or (spec.tp == 1 and spec.pp == 1 and spec.cp == 1) or mesh is None:",
        "if spec is None or (spec.tp == 1 and spec.pp == 1) or mesh is None:",
        (
            "tests/distributed/test_context_parallel.py::test_context_parallel_equals_one_process[llama_cp2_full_shard]",
        ),
    ),
    Mutant(
        "cp_hybrid_with_dp_shard_one_refused",
        "src/shardwise/distributed/mesh.py",
        "dp_shard == 1 or (dp_shard == -1 and not _has_2d_split(data, dp_shard))",
        "dp_shard == -1 and not _has_2d_split(data, dp_shard)",
        (
            "tests/unit/parallelize/test_context_unit.py::test_cp_ranks_sit_between_the_shard_ranks_and_tp",
        ),
    ),
    Mutant(
        "cp_load_balance_taken_by_ulysses",
        "src/shardwise/config/context.py",
        "    if balance:\n",
        "    if balance and cfg.cp_style == 'ring':\n",
        (
            "tests/unit/parallelize/test_context_unit.py::test_every_cp_field_is_checked_and_what_is_not_built_is_refused",
        ),
    ),
    Mutant(
        "cp_simulated_without_it",
        "src/shardwise/memory/simulate.py",
        "            cp=config.cp,\n",
        "",
        (
            "tests/unit/parallelize/test_context_unit.py::test_the_simulation_holds_each_ranks_part_of_the_sequence",
        ),
    ),
    Mutant(
        "global_batch_sum_model_eval_reduces",
        "src/shardwise/parallelize/global_batch.py",
        "        batch = attached(model)\n        if batch is not None and not model.training:\n            batch = None\n",
        "        batch = attached(model)\n",
        (
            "tests/unit/parallelize/test_batch_stats.py::test_a_statistic_summed_with_model_is_left_alone_in_eval_mode",
        ),
    ),
    Mutant(
        "merge_shape_check_ignores_fan_in_fan_out",
        "src/shardwise/checkpoint/adapters.py",
        'want = (b[0], a[1]) if not config.get("fan_in_fan_out") else (a[1], b[0])',
        "want = (b[0], a[1])",
        (
            "tests/unit/checkpoint/test_adapter_export.py::test_the_merged_export_equals_peft_merge_and_opens_in_transformers",
        ),
    ),
    Mutant(
        "torchtitan_beta2_default",
        "src/shardwise/config/torchtitan.py",
        'betas = (float(o.pop("beta1", 0.9)), float(o.pop("beta2", 0.95)))',
        'betas = (float(o.pop("beta1", 0.9)), float(o.pop("beta2", 0.999)))',
        (
            "tests/unit/config/test_torchtitan.py::test_the_optimizer_is_torchtitans_whatever_the_file_leaves_out",
        ),
    ),
    Mutant(
        "torchtitan_weight_decay_shardwises",
        "src/shardwise/config/torchtitan.py",
        '    ("weight_decay", 0.1),\n',
        '    ("weight_decay", 0.0),\n',
        (
            "tests/unit/config/test_torchtitan.py::test_the_optimizer_is_torchtitans_whatever_the_file_leaves_out",
        ),
    ),
    Mutant(
        "torchtitan_lr_shardwises",
        "src/shardwise/config/torchtitan.py",
        '    ("lr", 8e-4),\n',
        '    ("lr", 3e-4),\n',
        (
            "tests/unit/config/test_torchtitan.py::test_the_optimizer_is_torchtitans_whatever_the_file_leaves_out",
        ),
    ),
    Mutant(
        "split_batch_remainder_dropped",
        "src/shardwise/testing/parity.py",
        "    if n % world_size:\n",
        "    if n < world_size:\n",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_a_batch_that_does_not_divide_over_the_ranks_is_refused",
        ),
    ),
    # The third outside audit's survivors (issue 48).
    Mutant(
        "pp_zero_embedding_always_fp32",
        "src/shardwise/parallelize/stages.py",
        "_ZeroEmbedding(module.embedding_dim, module.weight.dtype)",
        "_ZeroEmbedding(module.embedding_dim, torch.float32)",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_two_stages_of_a_bf16_model_give_its_loss",
        ),
    ),
    Mutant(
        "pp_split_duplicate_start_accepted",
        "src/shardwise/plan/stages.py",
        "    if starts != sorted(set(starts)):\n",
        "    if starts != sorted(starts):\n",
        (
            "tests/unit/parallelize/test_pipeline_stages.py::test_a_given_split_is_followed_and_a_wrong_one_refused_by_name",
        ),
    ),
    Mutant(
        "ep_experts_need_3d_params",
        "src/shardwise/parallelize/experts.py",
        "    if any(p.dim() < 2 or p.shape[0] != n for p in params):\n",
        "    if any(p.dim() < 3 or p.shape[0] != n for p in params):\n",
        (
            "tests/unit/parallelize/test_expert_plan.py::test_experts_with_per_expert_biases_are_found_and_checked",
        ),
    ),
    Mutant(
        "qlora_absmax_blocks_floor",
        "src/shardwise/plan/quantized.py",
        '        blocks = math.ceil(p.numel() / int(getattr(p, "blocksize", 64) or 64))\n',
        '        blocks = p.numel() // int(getattr(p, "blocksize", 64) or 64)\n',
        (
            "tests/unit/plan/test_quantized.py::test_a_weight_whose_values_are_no_whole_number_of_blocks_is_counted_as_it_will_be",
        ),
    ),
    Mutant(
        "deepspeed_bfloat16_alias_is_fp16",
        "src/shardwise/config/deepspeed.py",
        '    preset = "fp16" if key == "fp16" else "bf16"\n',
        '    preset = "bf16" if key == "bf16" else "fp16"\n',
        (
            "tests/unit/config/test_deepspeed.py::test_every_spelling_of_a_precision_block_means_its_dtype",
        ),
    ),
    Mutant(
        "runner_total_steps_floor",
        "src/shardwise/train/runner.py",
        "        by_epochs = math.ceil(batches_per_epoch / accumulate_steps) * config.max_epochs\n",
        "        by_epochs = batches_per_epoch // accumulate_steps * config.max_epochs\n",
        (
            "tests/unit/train/test_runner.py::test_the_last_step_of_epochs_with_partial_windows_is_always_logged",
        ),
    ),
    Mutant(
        "parity_loss_rel_divides_by_candidate",
        "src/shardwise/testing/parity.py",
        "    loss_rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in pairs]\n",
        "    loss_rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in pairs]\n",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_a_loss_difference_is_measured_against_the_reference",
        ),
    ),
    Mutant(
        "ulysses_repeat_kv_cp_over_kv",
        "src/shardwise/parallelize/ulysses.py",
        "    times = cp // math.gcd(kv, cp)  # divides heads // kv, since cp divides heads\n",
        "    times = cp // kv  # divides heads // kv, since cp divides heads\n",
        (
            "tests/unit/parallelize/test_context_unit.py::test_kv_heads_are_repeated_within_their_groups_at_sizes_that_are_not_powers_of_two",
        ),
    ),
    Mutant(
        "cp_mesh_local_world_not_divided",
        "src/shardwise/distributed/mesh.py",
        "            local_world_size=max(1, local // cp) if local % cp == 0 else None,\n",
        "            local_world_size=local,\n",
        (
            "tests/unit/parallelize/test_context_unit.py::test_cp_ranks_sit_between_the_shard_ranks_and_tp",
        ),
    ),
    Mutant(
        "cp_pp_micro_batch_ignores_its_rows_of_the_mask",
        "src/shardwise/parallelize/ulysses.py",
        "        rows=(kwargs.get(ROW_NAMES[0]), kwargs.get(ROW_NAMES[1])),\n",
        "        rows=(None, None),\n",
        (
            "tests/distributed/test_context_parallel.py::test_pp_x_cp_x_dp_at_world_8_equals_one_process",
        ),
    ),
    Mutant(
        "cp_pp_layout_keeps_the_whole_batchs_mask",
        "src/shardwise/parallelize/context.py",
        "        if self.pipelined and (layout.documents is not None or layout.keep is not None):\n",
        "        if False:\n",
        (
            "tests/unit/parallelize/test_context_unit.py::test_under_pp_each_micro_batch_carries_its_rows_of_the_mask_whole",
            "tests/distributed/test_context_parallel.py::test_pp_x_cp_x_dp_at_world_8_equals_one_process",
        ),
    ),
    Mutant(
        "plan_target_path_not_imported_as_a_file",
        "src/shardwise/cli/plan.py",
        '    if not name.endswith(".py"):\n        return importlib.import_module(name)\n',
        "    if True:\n        return importlib.import_module(name)\n",
        (
            "tests/unit/cli/test_plan_targets.py::test_a_path_to_a_py_file_is_imported_with_its_neighbours",
        ),
    ),
    Mutant(
        "plan_target_neighbours_not_importable",
        "src/shardwise/cli/plan.py",
        "    if folder not in sys.path:\n        sys.path.insert(0, folder)\n",
        "    if False:\n        sys.path.insert(0, folder)\n",
        (
            "tests/unit/cli/test_plan_targets.py::test_a_path_to_a_py_file_is_imported_with_its_neighbours",
        ),
    ),
    Mutant(
        "plan_path_hint_only_for_py_names",
        "src/shardwise/cli/plan.py",
        '    if "/" not in name and "\\\\" not in name and not name.endswith(".py"):\n',
        '    if not name.endswith(".py"):\n',
        (
            "tests/unit/cli/test_plan_targets.py::test_a_target_that_reads_as_a_path_gets_both_forms",
        ),
    ),
    Mutant(
        "scripts_optimizer_said_by_every_rank",
        "src/shardwise/parallelize/from_env.py",
        ' and os.environ.get("RANK", "0") == "0":\n',
        ":\n",
        (
            "tests/unit/train/test_rank_zero_lines.py::test_the_scripts_optimizer_over_the_files_is_said_by_rank_0_only",
        ),
    ),
    # Issue 50 (a newcomer's first foreign file): did-you-mean at every level, every key named.
    Mutant(
        "foreign_unknown_key_without_guess",
        "src/shardwise/config/foreign_checks.py",
        '    return f"not {what} {noun} shardwise reads" + (f".{hint}" if hint else "")\n',
        '    return f"not {what} {noun} shardwise reads"\n',
        (
            "tests/unit/config/test_deepspeed.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
            "tests/unit/config/test_accelerate.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
            "tests/unit/config/test_torchtitan.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
        ),
    ),
    Mutant(
        "deepspeed_misspelt_enabled_passes_as_no_effect",
        "src/shardwise/config/deepspeed.py",
        "            if sub in _PRECISION_KEYS:\n",
        "            if True:\n",
        (
            "tests/unit/config/test_deepspeed.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
        ),
    ),
    Mutant(
        "deepspeed_schedule_params_unnamed",
        "src/shardwise/config/deepspeed.py",
        '        out.rows.append(Row(where, raw, f"{kind}\'s {param}={got[param]}", "exact", why))\n',
        "        pass\n",
        ("tests/unit/config/test_deepspeed.py::test_every_key_read_is_named_in_the_table",),
    ),
    Mutant(
        "torchtitan_misspelt_checkpoint_key_passes",
        "src/shardwise/config/torchtitan.py",
        '        if key not in _KNOWN["activation_checkpoint"]:\n',
        "        if False:\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
        ),
    ),
    Mutant(
        "accelerate_inline_deepspeed_keys_unnamed",
        "src/shardwise/config/accelerate.py",
        "        out.rows.append(_inline_row(sub, value, given))\n",
        "        pass\n",
        (
            "tests/unit/config/test_accelerate.py::test_every_key_read_is_named_in_the_table",
            "tests/unit/config/test_accelerate.py::test_the_inline_deepspeed_keys_are_named_and_refused_beside_a_file",
        ),
    ),
    Mutant(
        "accelerate_guess_drops_the_prefix",
        "src/shardwise/config/accelerate.py",
        '            prefix = "parallelism_config_" if key.startswith("parallelism_config_") else ""\n',
        '            prefix = ""\n',
        (
            "tests/unit/config/test_accelerate.py::test_a_misspelt_key_names_the_closest_key_of_its_level",
        ),
    ),
    Mutant(
        "refusal_prints_the_whole_value",
        "src/shardwise/config/translation.py",
        '    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."\n',
        "    return text\n",
        (
            "tests/unit/config/test_deepspeed.py::test_a_refusal_shows_the_key_and_the_reason_not_the_whole_block",
        ),
    ),
    Mutant(
        "refusal_cuts_a_value_of_exactly_the_limit",
        "src/shardwise/config/translation.py",
        '    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."\n',
        '    return text if len(text) < _SHOWN else text[: _SHOWN - 3] + "..."\n',
        (
            "tests/unit/config/test_deepspeed.py::test_a_refusal_shows_the_key_and_the_reason_not_the_whole_block",
        ),
    ),
    Mutant(
        "foreign_file_of_another_kind_read_anyway",
        "src/shardwise/config/foreign_checks.py",
        "        if kind == tool or not found:\n",
        "        if True:\n",
        (
            "tests/unit/config/test_deepspeed.py::test_a_file_of_another_kind_is_named_in_one_line",
            "tests/unit/config/test_accelerate.py::test_a_file_of_another_kind_is_named_in_one_line",
            "tests/unit/config/test_torchtitan.py::test_a_file_of_another_kind_is_named_in_one_line",
        ),
    ),
    Mutant(
        "foreign_kind_ignores_the_tools_own_keys",
        "src/shardwise/config/foreign_checks.py",
        "    if keys & set(_SIGNS[tool]):\n        return\n",
        "",
        (
            "tests/unit/config/test_deepspeed.py::test_a_deepspeed_file_with_a_stray_key_of_another_kind_is_read_as_deepspeeds",
        ),
    ),
    Mutant(
        "foreign_suffix_of_another_tool_parsed_anyway",
        "src/shardwise/config/foreign_checks.py",
        "    if other is None or suffix in _TAKES[tool]:\n",
        "    if True:\n",
        (
            "tests/unit/config/test_deepspeed.py::test_a_file_of_another_kind_is_named_in_one_line",
            "tests/unit/config/test_torchtitan.py::test_a_file_of_another_kind_is_named_in_one_line",
        ),
    ),
    Mutant(
        "accelerate_json_config_refused",
        "src/shardwise/config/foreign_checks.py",
        '    "Accelerate": (".yaml", ".yml", ".json"),  # Accelerate reads a JSON config too\n',
        '    "Accelerate": (".yaml", ".yml"),\n',
        ("tests/unit/config/test_accelerate.py::test_a_file_of_another_kind_is_named_in_one_line",),
    ),
    Mutant(
        "foreign_flag_ignored_for_deepspeed",
        "src/shardwise/config/foreign.py",
        '    named = {"--deepspeed": "DeepSpeed", "--accelerate-config": "Accelerate"}.get(flag)\n',
        '    named = {"--accelerate-config": "Accelerate"}.get(flag)\n',
        (
            "tests/unit/config/test_deepspeed.py::test_a_flag_and_a_suffix_that_disagree_stop_the_launch",
        ),
    ),
    Mutant(
        "cli_flag_never_checked",
        "src/shardwise/cli/main.py",
        "            check_flag(args.source_flag, args.source)\n",
        "            pass\n",
        (
            "tests/unit/config/test_deepspeed.py::test_a_flag_and_a_suffix_that_disagree_stop_the_launch",
        ),
    ),
    Mutant(
        "parallel_config_from_env_none_without_a_file",
        "src/shardwise/config/parallel.py",
        "        return launched if launched is not None else cls()\n",
        "        return launched  # type: ignore[return-value]\n",
        (
            "tests/unit/config/test_deepspeed.py::test_parallel_config_from_env_is_the_launched_files_layout",
        ),
    ),
    Mutant(
        "parallel_config_from_env_ignores_the_file",
        "src/shardwise/config/parallel.py",
        "        return launched if launched is not None else cls()\n",
        "        return cls()\n",
        (
            "tests/unit/config/test_deepspeed.py::test_parallel_config_from_env_is_the_launched_files_layout",
        ),
    ),
    Mutant(
        "torchtitan_microbatch_size_taken_as_the_count",
        "src/shardwise/config/torchtitan_batches.py",
        "    count = local // int(size)\n",
        "    count = int(size)\n",
        (
            "tests/unit/config/test_torchtitan.py::test_the_micro_batch_size_becomes_the_count_of_micro_batches",
        ),
    ),
    Mutant(
        "torchtitan_microbatch_remainder_unchecked",
        "src/shardwise/config/torchtitan_batches.py",
        "    if int(size) < 1 or local % int(size) != 0:\n",
        "    if int(size) < 1:\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_micro_batch_size_that_does_not_divide_the_batch_is_refused",
        ),
    ),
    Mutant(
        "torchtitan_local_batch_default_not_torchtitans",
        "src/shardwise/config/torchtitan_batches.py",
        "_LOCAL_BATCH = 8\n",
        "_LOCAL_BATCH = 16\n",
        (
            "tests/unit/config/test_torchtitan.py::test_the_micro_batch_size_becomes_the_count_of_micro_batches",
        ),
    ),
    Mutant(
        "torchtitan_microbatch_count_disagreement_passes",
        "src/shardwise/config/torchtitan_batches.py",
        '    if "num_pp_microbatches" in p and int(p["num_pp_microbatches"]) != count:\n',
        "    if False:\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_micro_batch_size_that_does_not_divide_the_batch_is_refused",
        ),
    ),
    Mutant(
        "torchtitan_silent_micro_batches_take_shardwises_default",
        "src/shardwise/config/torchtitan_batches.py",
        '    elif pp > 1 and "num_pp_microbatches" not in p:\n',
        "    elif False:\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_file_silent_on_micro_batches_takes_torchtitans_micro_batches_of_one_row",
        ),
    ),
    Mutant(
        "estimate_no_shard_holds_no_unsharded_copies",
        "src/shardwise/memory/model_states.py",
        '        if strategy == "ddp" or world_size == 1:\n',
        '        if strategy == "ddp" or shard == 1:\n',
        (
            "tests/unit/memory/test_autoplan.py::test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ",
            "tests/unit/memory/test_autoplan.py::test_instant_estimate_within_ten_percent_of_the_simulation",
        ),
    ),
    Mutant(
        "estimate_fsdp_update_as_ddps",
        "src/shardwise/memory/model_states.py",
        "        step = (2 if ddp else 1) * s.grads if s.step_temporaries is None",
        "        step = 2 * s.grads if s.step_temporaries is None",
        (
            "tests/unit/memory/test_autoplan.py::test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ",
            "tests/unit/memory/test_autoplan.py::test_instant_estimate_within_ten_percent_of_the_simulation",
        ),
    ),
    Mutant(
        "estimate_fsdp_update_without_temporaries",
        "src/shardwise/memory/model_states.py",
        "        step = (2 if ddp else 1) * s.grads if s.step_temporaries is None",
        "        step = (2 if ddp else 0) * s.grads if s.step_temporaries is None",
        (
            "tests/unit/memory/test_autoplan.py::test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ",
            "tests/unit/memory/test_autoplan.py::test_instant_estimate_within_ten_percent_of_the_simulation",
        ),
    ),
    Mutant(
        "estimate_root_gathered_once",
        "src/shardwise/memory/model_states.py",
        "                root_gather=root if sharded and spec.reshard_after_forward else 0,\n",
        "                root_gather=0,\n",
        (
            "tests/unit/memory/test_autoplan.py::test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ",
            "tests/unit/memory/test_autoplan.py::test_instant_estimate_within_ten_percent_of_the_simulation",
        ),
    ),
    Mutant(
        "estimate_root_reduce_counts_its_shard_twice",
        "src/shardwise/memory/model_states.py",
        "round(root_numel * (root_width + 4)) - -(-root_grads // shard) if sharded else 0",
        "round(root_numel * (root_width + 4)) if sharded else 0",
        (
            "tests/unit/memory/test_autoplan.py::test_the_moments_of_a_step_at_sizes_where_the_wrong_ones_differ",
        ),
    ),
    Mutant(
        "estimate_gap_marked_only_above",
        "src/shardwise/memory/auto.py",
        "            if abs(r.estimate - r.simulated) > ESTIMATE_TOLERANCE * r.simulated:\n",
        "            if r.estimate - r.simulated > ESTIMATE_TOLERANCE * r.simulated:\n",
        (
            "tests/unit/memory/test_autoplan.py::test_a_row_whose_estimate_is_off_the_simulation_says_which_to_trust",
        ),
    ),
    Mutant(
        "auto_says_not_simulated_without_the_simulation",
        "src/shardwise/memory/auto.py",
        "            if simulate and estimate is not None and estimate > _SKIP_ABOVE * limit:\n",
        "            if estimate is not None and estimate > _SKIP_ABOVE * limit:\n",
        (
            "tests/unit/memory/test_autoplan.py::test_without_the_simulation_no_row_says_it_was_not_simulated",
        ),
    ),
    # Issue 50: one line for every refusal, wherever it is raised.
    Mutant(
        "refusal_by_shardwise_not_one_line",
        "src/shardwise/distributed/worker_errors.py",
        "    if getattr(exc, _REFUSED, False) or raised_by_shardwise(exc):\n",
        "    if getattr(exc, _REFUSED, False):\n",
        (
            "tests/unit/distributed/test_worker_errors.py::test_an_error_raised_by_shardwise_is_one_line_and_others_keep_their_traceback",
            "tests/e2e/test_launch_robust.py::test_a_refusal_raised_by_shardwise_without_a_mark_is_one_line",
        ),
    ),
    Mutant(
        "a_bug_inside_shardwise_read_as_a_refusal",
        "src/shardwise/distributed/worker_errors.py",
        '        ins.offset == tb.tb_lasti and ins.opname == "RAISE_VARARGS"\n',
        "        ins.offset == tb.tb_lasti\n",
        (
            "tests/unit/distributed/test_worker_errors.py::test_an_error_raised_by_shardwise_is_one_line_and_others_keep_their_traceback",
        ),
    ),
    Mutant(
        "plain_python_keeps_pythons_hook",
        "src/shardwise/distributed/worker_errors.py",
        "        sys.excepthook = _hook if launched else _plain_hook\n",
        "        sys.excepthook = _hook if launched else sys.__excepthook__\n",
        (
            "tests/unit/distributed/test_worker_errors.py::test_outside_shardwise_run_the_plain_hook_is_installed",
            "tests/e2e/test_cli.py::test_a_refusal_in_a_plain_python_run_is_one_line",
        ),
    ),
    Mutant(
        "shardwise_traceback_ignored",
        "src/shardwise/distributed/worker_errors.py",
        '    if short_error(exc) and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):\n',
        "    if short_error(exc):\n",
        (
            "tests/unit/distributed/test_worker_errors.py::test_shardwise_traceback_shows_the_traceback_of_a_refusal",
        ),
    ),
    # Issue 50: overrides checked before anything spawns, with or without --config.
    Mutant(
        "overrides_not_checked_before_spawning",
        "src/shardwise/cli/launch.py",
        "    check_overrides(args.script_args)  # a misspelt key: one line, and nothing starts\n",
        "",
        (
            "tests/unit/cli/test_small_edges.py::test_run_refuses_a_misspelt_override_before_spawning_without_a_config",
            "tests/e2e/test_cli.py::test_run_checks_overrides_before_spawning_without_a_config",
        ),
    ),
    Mutant(
        "overrides_checked_for_parallel_only",
        "src/shardwise/cli/launch.py",
        'key.partition(".")[0] in sections and',
        'key.partition(".")[0] == "parallel" and',
        (
            "tests/unit/cli/test_small_edges.py::test_run_refuses_a_misspelt_override_before_spawning_without_a_config",
        ),
    ),
    Mutant(
        "override_check_stops_at_the_section",
        "src/shardwise/config/overrides.py",
        "        cls = section\n",
        "        return\n",
        (
            "tests/unit/cli/test_small_edges.py::test_run_refuses_a_misspelt_override_before_spawning_without_a_config",
        ),
    ),
    Mutant(
        "override_value_type_not_checked",
        "src/shardwise/config/overrides.py",
        '                _coerce(value, tp, ".".join(parts), translates=cls is ParallelConfig)\n',
        "                pass\n",
        (
            "tests/unit/cli/test_small_edges.py::test_run_refuses_a_misspelt_override_before_spawning_without_a_config",
        ),
    ),
    # Issue 50: Ctrl-C saves after the step; a second stops at once, each in one line.
    Mutant(
        "ctrl_c_not_handled_by_the_runner",
        "src/shardwise/train/resume.py",
        "    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)\n",
        "",
        (
            "tests/unit/train/test_runner.py::test_a_first_ctrl_c_finishes_the_step_and_saves_like_sigterm",
        ),
    ),
    Mutant(
        "first_ctrl_c_stops_at_once",
        "src/shardwise/train/resume.py",
        "        if not state.interrupted:  # the first Ctrl-C: as SIGTERM\n",
        "        if state.interrupted:  # the first Ctrl-C: as SIGTERM\n",
        (
            "tests/unit/train/test_runner.py::test_a_first_ctrl_c_finishes_the_step_and_saves_like_sigterm",
        ),
    ),
    Mutant(
        "a_third_ctrl_c_not_ignored",
        "src/shardwise/train/resume.py",
        "        signal.signal(signal.SIGINT, signal.SIG_IGN)\n        raise Interrupted",
        "        raise Interrupted",
        (
            "tests/unit/train/test_runner.py::test_a_second_ctrl_c_stops_at_once_naming_the_last_good_checkpoint",
        ),
    ),
    Mutant(
        "second_ctrl_c_names_no_checkpoint",
        "src/shardwise/train/resume.py",
        "            stopped.checkpoint = last_good_checkpoint(config)  # where a resume would start\n",
        "",
        (
            "tests/unit/train/test_runner.py::test_a_second_ctrl_c_stops_at_once_naming_the_last_good_checkpoint",
        ),
    ),
    Mutant(
        "launcher_sends_sigterm_on_the_second_ctrl_c",
        "src/shardwise/cli/interrupt.py",
        "            self._original(agent, signal.SIGINT, timeout)\n",
        "            self._original(agent, signal.SIGTERM, timeout)\n",
        (
            "tests/e2e/test_launch_robust.py::test_ctrl_c_saves_after_the_step_and_twice_stops_at_once[2-shardwise_run]",
        ),
    ),
    Mutant(
        "ctrl_c_traceback_per_worker",
        "src/shardwise/distributed/worker_errors.py",
        "        return  # Ctrl-C: the launcher says it once, not a traceback per rank\n",
        "        sys.__excepthook__(exc_type, exc, tb)\n        return\n",
        (
            "tests/unit/distributed/test_worker_errors.py::test_ctrl_c_in_a_worker_prints_nothing",
            "tests/e2e/test_launch_robust.py::test_ctrl_c_without_a_runner_is_one_line",
        ),
    ),
    Mutant(
        "torchs_ctrl_c_warning_shown",
        "src/shardwise/cli/report.py",
        "            return record.args[0] != signal.SIGINT\n",
        "            return True\n",
        (
            "tests/unit/cli/test_report.py::test_a_restart_is_announced_with_the_report_of_the_attempt",
        ),
    ),
    Mutant(
        "launcher_repeats_the_runners_ctrl_c_line",
        "src/shardwise/cli/launch.py",
        "    if codes and codes <= {PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE}:\n",
        "    if codes and codes <= {INTERRUPTED_EXIT_CODE}:\n",
        (
            "tests/unit/cli/test_small_edges.py::test_after_ctrl_c_the_launcher_speaks_only_when_no_runner_did",
        ),
    ),
    # Issue 50: honest summaries: the limit that ended training, no figure never computed.
    Mutant(
        "readme_runner_ends_by_epochs_at_two_ranks",
        "README.md",
        "    max_steps=8, max_epochs=None, val_every=4,",
        "    max_steps=8, val_every=4,",
        (
            "tests/e2e/test_quickstart.py::test_the_readmes_runner_takes_its_max_steps_at_two_processes",
        ),
    ),
    Mutant(
        "max_steps_named_though_epochs_ended_it",
        "src/shardwise/train/runner.py",
        "    if config.max_steps is not None and done >= config.max_steps:\n",
        "    if config.max_steps is not None:\n",
        (
            "tests/unit/train/test_runner.py::test_the_last_line_names_the_limit_that_ended_training",
        ),
    ),
    Mutant(
        "steps_per_epoch_counts_micro_batches",
        "src/shardwise/train/runner.py",
        "    per_epoch = math.ceil(batches_per_epoch / engine.train_config.accumulate_steps)\n",
        "    per_epoch = batches_per_epoch\n",
        (
            "tests/unit/train/test_runner.py::test_the_last_line_names_the_limit_that_ended_training",
        ),
    ),
    Mutant(
        "done_line_shows_nan_for_no_validation",
        "examples/train_lm.py",
        '        shown = "no validation ran" if val is None else f"val loss {val:.4f}"\n',
        "        shown = f\"val loss {float('nan') if val is None else val:.4f}\"\n",
        (
            "tests/e2e/test_example_lm.py::test_the_done_line_shows_no_figure_for_a_validation_that_never_ran",
        ),
    ),
    # Issue 50: every docs snippet runs alone, as a reader who copies it runs it.
    Mutant(
        "docs_blocks_share_a_namespace",
        "tests/docs/_doc_driver.py",
        'exec(compile(step["text"], step["origin"], "exec"), {"__name__": "__main__"})',
        'exec(compile(step["text"], step["origin"], "exec"), page.setdefault("ns", {}))',
        ("tests/docs/test_snippets.py::test_a_block_that_needs_an_earlier_blocks_names_fails",),
    ),
    # The fourth outside audit's survivors (issue 48): 11 bugs chosen from the code alone.
    Mutant(
        "moe_below_the_top_level_not_stated",
        "src/shardwise/parallelize/batch_stats.py",
        'fqn.rsplit(".", 1)[-1] == "experts"',
        'fqn.rsplit(".", 1)[0] == "experts"',
        (
            "tests/unit/parallelize/test_batch_stats.py::test_a_child_named_experts_below_the_top_level_is_a_mixture_of_experts",
        ),
    ),
    Mutant(
        "fractional_lora_alpha_cut_to_an_int",
        "src/shardwise/config/adapters.py",
        "        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha",
        "        alpha = int(self.alpha)",
        (
            "tests/unit/config/test_adapter_section.py::test_alpha_reaches_peft_as_given_fractions_and_all",
        ),
    ),
    Mutant(
        "odd_4bit_weight_counted_a_byte_short",
        "src/shardwise/plan/quantized.py",
        '        _add(out, getattr(p, "quant_storage", torch.uint8), math.ceil(p.numel() / 2))',
        '        _add(out, getattr(p, "quant_storage", torch.uint8), p.numel() // 2)',
        (
            "tests/unit/plan/test_quantized.py::test_an_odd_number_of_values_is_counted_with_its_half_filled_byte",
        ),
    ),
    Mutant(
        "adapter_target_matching_a_names_tail_taken",
        "src/shardwise/config/adapters.py",
        '        if not any(p == name or p.endswith(f".{name}") for p in paths):',
        "        if not any(p == name or p.endswith(name) for p in paths):",
        (
            "tests/unit/config/test_adapter_section.py::test_a_name_that_is_only_the_tail_of_a_layers_name_is_refused",
        ),
    ),
    Mutant(
        "deepspeed_auto_eps_not_the_trainers",
        "src/shardwise/config/deepspeed.py",
        '    "eps": 1e-8,',
        '    "eps": 1e-6,',
        ("tests/unit/config/test_deepspeed.py::test_every_auto_takes_the_trainers_default",),
    ),
    Mutant(
        "deepspeed_offload_to_none_refused",
        "src/shardwise/config/deepspeed.py",
        '    if device in (None, "none"):\n        out.rows.append(Row(key, value, "-", "exact", "no offload"))',
        '    if device is None:\n        out.rows.append(Row(key, value, "-", "exact", "no offload"))',
        (
            "tests/unit/config/test_deepspeed.py::test_an_offload_to_none_is_no_offload",
            "tests/unit/config/test_accelerate.py::test_a_deepspeed_file_offloading_to_none_is_no_offload",
        ),
    ),
    Mutant(
        "accelerate_strategy_5_reshards_after_forward",
        "src/shardwise/config/accelerate.py",
        '               "5": "hybrid_shard_zero2"}  # fmt: skip',
        '               "5": "hybrid_shard"}  # fmt: skip',
        (
            "tests/unit/config/test_accelerate.py::test_every_fsdp_sharding_strategy_number_and_name_maps_to_its_strategy",
        ),
    ),
    Mutant(
        "torchtitan_replicas_of_the_rest_become_ddp",
        "src/shardwise/config/torchtitan.py",
        "    if replicate > 1 and shard == -1:\n        assert world is not None",
        "    if False:\n        assert world is not None",
        (
            "tests/unit/config/test_torchtitan.py::test_a_shard_degree_of_the_rest_of_the_ranks_shards",
        ),
    ),
    Mutant(
        "torchtitan_degree_below_one_taken",
        "src/shardwise/config/torchtitan.py",
        "    if min(replicate, tp, pp) < 1 or shard == 0 or shard < -1:\n",
        "    if min(replicate, tp, pp) < 1:\n",
        ("tests/unit/config/test_torchtitan.py::test_a_degree_below_one_is_refused",),
    ),
    Mutant(
        "nnodes_min_above_max_taken",
        "src/shardwise/cli/launch.py",
        "    if low < 1 or high < low:",
        "    if low < 1:",
        (
            "tests/unit/cli/test_small_edges.py::test_an_nnodes_that_is_no_count_or_range_of_nodes_is_refused",
        ),
    ),
    Mutant(
        "resume_at_an_epochs_end_stays_in_it",
        "src/shardwise/train/data.py",
        "    if done >= total:\n        return epoch + 1, 0",
        "    if done > total:\n        return epoch + 1, 0",
        (
            "tests/unit/train/test_keep_global_batch.py::test_a_resume_continues_after_the_samples_its_epoch_consumed",
        ),
    ),
    Mutant(
        "parity_takes_a_parameter_of_another_shape",
        "src/shardwise/testing/parity.py",
        "            if got.shape != ref.shape:",
        "            if got.numel() != ref.numel():",
        (
            "tests/unit/testing/test_compare_trajectories.py::test_a_parameter_of_another_shape_is_refused_even_at_the_same_size",
        ),
    ),
    Mutant(
        "torchtitan_rest_of_the_ranks_left_to_shardwises_minus_one",
        "src/shardwise/config/torchtitan.py",
        '        shard = world // (replicate * tp * pp * int(given.get("context_parallel_degree", 1)))\n',
        "        pass\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_shard_degree_of_the_rest_of_the_ranks_shards",
            "tests/unit/config/test_torchtitan.py::test_a_shard_degree_of_the_rest_beside_replicas_needs_the_world",
        ),
    ),
    Mutant(
        "torchtitan_rest_of_the_ranks_without_a_world_guessed",
        "src/shardwise/config/torchtitan.py",
        "    if world is None:\n        why = (",
        "    if False:\n        why = (",
        (
            "tests/unit/config/test_torchtitan.py::test_a_shard_degree_of_the_rest_beside_replicas_needs_the_world",
        ),
    ),
    # Entries of the foreign readers' tables no test asserted before test_reader_tables.py.
    Mutant(
        "deepspeed_memory_breakdown_unlisted",
        "src/shardwise/config/deepspeed.py",
        '    "memory_breakdown": "a DeepSpeed memory print (shardwise plan --simulate shows it)",\n',
        "",
        (
            "tests/unit/config/test_reader_tables.py::test_deepspeed_every_listed_top_level_key_has_its_verdict",
        ),
    ),
    Mutant(
        "deepspeed_consecutive_hysteresis_not_a_scaler_key",
        "src/shardwise/config/deepspeed.py",
        '_SCALER = ("loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")',
        '_SCALER = ("loss_scale_window", "hysteresis", "min_loss_scale")',
        ("tests/unit/config/test_reader_tables.py::test_deepspeed_every_fp16_key",),
    ),
    Mutant(
        "deepspeed_check_grad_overflow_refused",
        "src/shardwise/config/deepspeed.py",
        '_NO_EFFECT_PRECISION = ("auto_cast", "immediate_grad_update", "check_grad_overflow")',
        '_NO_EFFECT_PRECISION = ("auto_cast", "immediate_grad_update")',
        ("tests/unit/config/test_reader_tables.py::test_deepspeed_every_fp16_key",),
    ),
    Mutant(
        "deepspeed_muadam_called_not_torchs",
        "src/shardwise/config/deepspeed.py",
        '"lamb", "lion", "muadam")',
        '"lamb", "lion")',
        (
            "tests/unit/config/test_reader_tables.py::test_deepspeed_every_deepspeed_only_optimizer_is_refused_as_such",
        ),
    ),
    Mutant(
        "deepspeed_float32_communication_refused",
        "src/shardwise/config/deepspeed.py",
        '    if value in ("fp32", "float32"):',
        '    if value in ("fp32",):',
        ("tests/unit/config/test_reader_tables.py::test_deepspeed_every_communication_data_type",),
    ),
    Mutant(
        "accelerate_no_prefetch_prefetches",
        "src/shardwise/config/accelerate.py",
        '"NO_PREFETCH": None}',
        '"NO_PREFETCH": "pre"}',
        ("tests/unit/config/test_reader_tables.py::test_accelerate_every_backward_prefetch",),
    ),
    Mutant(
        "accelerate_multi_cpu_refused",
        "src/shardwise/config/accelerate.py",
        '    if kind in ("MULTI_GPU", "MULTI_CPU", "NO"):',
        '    if kind in ("MULTI_GPU", "NO"):',
        ("tests/unit/config/test_reader_tables.py::test_accelerate_every_distributed_type",),
    ),
    Mutant(
        "accelerate_regional_compilation_refused",
        "src/shardwise/config/accelerate.py",
        '                     "dynamo_use_regional_compilation")',
        ")",
        ("tests/unit/config/test_reader_tables.py::test_accelerate_every_dynamo_no_effect_key",),
    ),
    Mutant(
        "accelerate_sp_backend_refused",
        "src/shardwise/config/accelerate.py",
        '        elif name in ("cp_backend", "cp_comm_strategy", "sp_backend"):',
        '        elif name in ("cp_backend", "cp_comm_strategy"):',
        (
            "tests/unit/config/test_reader_tables.py::test_accelerate_every_sequence_backend_is_no_effect",
        ),
    ),
    Mutant(
        "torchtitan_memory_estimation_section_unlisted",
        "src/shardwise/config/torchtitan.py",
        '    "memory_estimation": "torchtitan\'s estimator; shardwise plan --simulate is shardwise\'s",\n',
        "",
        ("tests/unit/config/test_reader_tables.py::test_torchtitan_every_listed_section",),
    ),
    Mutant(
        "torchtitan_mixed_precision_output_refused",
        "src/shardwise/config/torchtitan.py",
        '            "mixed_precision_output",\n        ):',
        "        ):",
        ("tests/unit/config/test_reader_tables.py::test_torchtitan_every_training_key",),
    ),
    Mutant(
        "torchtitan_silent_decay_ratio_read_as_no_decay",
        "src/shardwise/config/torchtitan.py",
        "    if warmup == 0 and decay is not None and float(decay) == 0:",
        "    if warmup == 0 and (decay is None or float(decay) == 0):",
        (
            "tests/unit/config/test_reader_tables.py::test_torchtitan_only_a_constant_lr_schedule_is_built",
        ),
    ),
    Mutant(
        "torchtitan_silent_warmup_read_as_none",
        "src/shardwise/config/torchtitan.py",
        '    warmup = int(s.get("warmup_steps", _WARMUP_STEPS))',
        '    warmup = int(s.get("warmup_steps", 0))',
        (
            "tests/unit/config/test_reader_tables.py::test_torchtitan_only_a_constant_lr_schedule_is_built",
        ),
    ),
    Mutant(
        "adapter_rslora_hint_names_dora",
        "src/shardwise/config/adapters.py",
        '"rslora": "use_rslora",',
        '"rslora": "use_dora",',
        (
            "tests/unit/config/test_adapter_section.py::test_every_other_tools_name_points_to_its_key",
        ),
    ),
    Mutant(
        "adapter_lora_r_hint_names_alpha",
        "src/shardwise/config/adapters.py",
        '"lora_r": "r",',
        '"lora_r": "alpha",',
        (
            "tests/unit/config/test_adapter_section.py::test_every_other_tools_name_points_to_its_key",
        ),
    ),
    Mutant(
        "adapter_rslora_not_passed_to_peft",
        "src/shardwise/config/adapters.py",
        "use_rslora=self.use_rslora,",
        "use_rslora=False,",
        ("tests/unit/config/test_adapter_section.py::test_every_field_reaches_its_peft_name",),
    ),
    Mutant(
        "accelerate_fsdp1_reshard_string_read_as_a_truth_value",
        "src/shardwise/config/accelerate.py",
        "            if isinstance(value, bool) or version != 1:",
        "            if True:",
        ("tests/unit/config/test_reader_tables.py::test_accelerate_every_reshard_after_forward",),
    ),
    Mutant(
        "accelerate_fsdp2_false_string_reshards",
        "src/shardwise/config/accelerate.py",
        '_FALSE = ("n", "no", "f", "false", "off", "0")',
        '_FALSE = ("n", "no", "f", "off", "0")',
        ("tests/unit/config/test_reader_tables.py::test_accelerate_every_reshard_after_forward",),
    ),
    Mutant(
        "deepspeed_offload_param_below_stage_3_offloads",
        "src/shardwise/config/deepspeed.py",
        '    if sub == "offload_param" and stage != 3:',
        '    if sub == "offload_param" and stage < 1:',
        ("tests/unit/config/test_reader_tables.py::test_deepspeed_every_offload",),
    ),
    Mutant(
        "torchtitan_rest_of_the_ranks_that_does_not_divide_taken",
        "src/shardwise/config/torchtitan.py",
        "    elif world % others:\n",
        "    elif False:\n",
        (
            "tests/unit/config/test_torchtitan.py::test_a_shard_degree_of_the_rest_beside_replicas_needs_the_world",
        ),
    ),
    Mutant(
        "from_env_without_its_reader_returns_the_default",
        "src/shardwise/config/parallel.py",
        "        if not LAUNCHED:",
        "        if not LAUNCHED:\n            return cls()\n        if False:",
        (
            "tests/unit/config/test_deepspeed.py::test_parallel_config_from_env_without_its_reader_is_a_bug_not_a_default",
        ),
    ),
    Mutant(
        "packed_labels_predict_across_documents",
        "src/shardwise/train/packing.py",
        "labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)",
        "labels = input_ids.clone()",
        (
            "tests/unit/train/test_stream.py::test_rows_cut_documents_with_labels_and_positions_that_restart",
            "tests/unit/train/test_stream.py::test_a_packed_row_of_two_documents_trains_as_the_two_apart",
        ),
    ),
    Mutant(
        "packed_positions_run_on_across_documents",
        "src/shardwise/train/packing.py",
        "            positions += range(start, start + take)",
        "            positions += range(len(positions), len(positions) + take)",
        (
            "tests/unit/train/test_stream.py::test_rows_cut_documents_with_labels_and_positions_that_restart",
        ),
    ),
    Mutant(
        "packer_next_row_after_a_whole_document_restarts_it",
        "src/shardwise/train/packing.py",
        "        end = self.pending[0][:2] if self.pending else (self.next_document, 0)",
        "        end = self.pending[0][:2] if self.pending else (self.next_document - 1, 0)",
        ("tests/unit/train/test_stream.py::test_packer_reports_where_the_next_row_starts",),
    ),
    Mutant(
        "label_tokens_count_each_rows_first",
        "src/shardwise/train/packing.py",
        "    return int((labels[..., 1:] != IGNORE_INDEX).sum())",
        "    return int((labels != IGNORE_INDEX).sum())",
        (
            "tests/unit/train/test_stream.py::test_count_label_tokens_skips_ignored_labels_and_each_rows_first",
        ),
    ),
    Mutant(
        "packed_notice_leaves_the_cache_on",
        "src/shardwise/train/packing.py",
        "            m.config.use_cache = False  # type: ignore[union-attr]",
        "            pass",
        (
            "tests/unit/train/test_stream.py::test_packed_rows_turn_off_a_transformers_cache_and_name_other_models",
        ),
    ),
    Mutant(
        "stream_workers_dealt_without_the_turn",
        "src/shardwise/train/stream.py",
        "        dealt = [turn[w :: self.num_workers] for w in range(self.num_workers)]",
        "        dealt = [mine[w :: self.num_workers] for w in range(self.num_workers)]",
        (
            "tests/unit/train/test_stream.py::test_a_resume_mid_cycle_of_a_ranks_parts_keeps_the_order",
        ),
    ),
    Mutant(
        "stream_dealt_items_before_the_resume_kept",
        "src/shardwise/train/stream.py",
        "            if p in self.queues and n >= self.begin[p]:",
        "            if p in self.queues:",
        (
            "tests/unit/train/test_stream.py::test_a_resume_takes_every_remaining_row_once",
            "tests/unit/train/test_stream.py::test_a_resume_of_samples_not_packed_continues_each_part",
        ),
    ),
    Mutant(
        "stream_resume_offset_dropped",
        "src/shardwise/train/stream.py",
        "            packers[p].feed(got[0], packing.token_ids(got[1]), s.offset)  # a row ended inside it",
        "            packers[p].feed(got[0], packing.token_ids(got[1]), 0)  # a row ended inside it",
        ("tests/unit/train/test_stream.py::test_a_resume_takes_every_remaining_row_once",),
    ),
    Mutant(
        "stream_fingerprint_not_checked",
        "src/shardwise/train/stream.py",
        "        if seen != s.check:",
        "        if seen is None:",
        (
            "tests/unit/train/test_stream.py::test_a_stream_whose_order_changed_is_refused_before_training",
        ),
    ),
    Mutant(
        "stream_parts_split_check_dropped",
        "src/shardwise/train/stream.py",
        "        if P % W:",
        "        if P < W:",
        (
            "tests/unit/train/test_stream.py::test_parts_that_do_not_split_over_the_world_are_refused",
        ),
    ),
    Mutant(
        "stream_workers_checked_against_all_parts",
        "src/shardwise/train/stream.py",
        "        if workers and (P // W) % workers:",
        "        if workers and P % workers:",
        (
            "tests/unit/train/test_stream.py::test_workers_that_do_not_share_a_ranks_parts_evenly_are_refused",
        ),
    ),
    Mutant(
        "stream_epoch_end_keeps_positions",
        "src/shardwise/train/stream.py",
        "                    self.restart()  # the next epoch starts every part afresh",
        "                    pass",
        ("tests/unit/train/test_stream.py::test_every_epoch_reads_the_stream_from_its_start",),
    ),
    Mutant(
        "stream_window_agreed_by_any_rank",
        "src/shardwise/train/stream.py",
        "        dist.all_reduce(flag, op=dist.ReduceOp.MIN)",
        "        dist.all_reduce(flag, op=dist.ReduceOp.MAX)",
        (
            "tests/e2e/test_streams.py::test_a_resume_at_the_same_world_trains_the_same_batches_bit_for_bit",
            "tests/e2e/test_streams.py::test_a_resume_at_another_world_trains_each_document_as_often",
        ),
    ),
    Mutant(
        "stream_state_saves_own_parts_only",
        "src/shardwise/train/stream.py",
        "            dist.all_gather_object(found, mine)",
        "            found = [mine]",
        (
            "tests/e2e/test_streams.py::test_a_resume_at_the_same_world_trains_the_same_batches_bit_for_bit",
            "tests/e2e/test_streams.py::test_a_resume_at_another_world_trains_each_document_as_often",
        ),
    ),
    Mutant(
        "tokens_weight_ignores_data_parallel_ranks",
        "src/shardwise/train/stream.py",
        "                yield data, last, c * dp_world * steps / max(total, 1)",
        "                yield data, last, c * steps / max(total, 1)",
        (
            "tests/e2e/test_streams.py::test_a_resume_at_the_same_world_trains_the_same_batches_bit_for_bit",
            "tests/e2e/test_streams.py::test_a_resume_at_another_world_trains_each_document_as_often",
        ),
    ),
    Mutant(
        "tokens_weight_ignores_accumulation",
        "src/shardwise/train/stream.py",
        "                yield data, last, c * dp_world * steps / max(total, 1)",
        "                yield data, last, c * dp_world / max(total, 1)",
        (
            "tests/unit/train/test_stream.py::test_tokens_weigh_each_micro_batch_by_its_share_of_the_step",
        ),
    ),
    Mutant(
        "engine_weight_not_on_logs",
        "src/shardwise/train/engine.py",
        "    return loss * weight, {k: v * weight for k, v in logs.items()}",
        "    return loss * weight, logs",
        ("tests/unit/train/test_stream.py::test_the_engine_weighs_the_loss_and_what_it_logs",),
    ),
    Mutant(
        "loss_over_tokens_under_cp_allowed",
        "src/shardwise/train/engine.py",
        '    for name, degree in (("pp", config.pp), ("cp", config.cp)):',
        '    for name, degree in (("pp", config.pp),):',
        (
            "tests/unit/train/test_stream.py::test_loss_over_refuses_other_values_and_where_it_is_not_built",
        ),
    ),
    Mutant(
        "resume_kind_checked_one_way",
        "src/shardwise/train/resume.py",
        '    if streamed != ("stream" in position):',
        '    if streamed and "stream" not in position:',
        ("tests/unit/train/test_stream.py::test_a_resume_across_kinds_of_data_is_refused",),
    ),
    Mutant(
        "stream_validation_continues_where_it_stopped",
        "src/shardwise/train/runner.py",
        "    if isinstance(loader, StreamLoader):\n        loader.restart()",
        "    if False:\n        loader.restart()",
        (
            "tests/unit/train/test_stream.py::test_runner_trains_a_packed_stream_and_validates_on_all_of_another",
        ),
    ),
    # The wholesale five-habits pass over the pipeline's tables (test_pipeline_tables.py).
    Mutant(
        "pp_zbv_runs_one_stage_per_rank",
        "src/shardwise/config/pipeline.py",
        'MULTI_STAGE: tuple[str, ...] = ("interleaved_1f1b", "zbv")',
        'MULTI_STAGE: tuple[str, ...] = ("interleaved_1f1b",)',
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_every_schedule_picks_its_stages_per_rank_when_none_is_given",
        ),
    ),
    Mutant(
        "pp_interleaved_takes_exactly_two_stages_per_rank",
        "src/shardwise/config/pipeline.py",
        '("2 or more", per_rank >= 2)',
        '("2 or more", per_rank == 2)',
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_every_schedule_takes_its_stages_per_rank_and_refuses_the_others",
        ),
    ),
    Mutant(
        "pp_split_takes_an_empty_name",
        "src/shardwise/config/pipeline.py",
        "if not all(isinstance(n, str) and n for n in names):",
        "if not all(isinstance(n, str) for n in names):",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_an_empty_or_missing_name_in_pp_split_is_refused",
        ),
    ),
    Mutant(
        "pp_default_micro_batches_two_more_than_the_stages",
        "src/shardwise/config/pipeline.py",
        "    return 2 * pp\n",
        "    return pp + 2\n",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_the_default_micro_batches_are_twice_the_stages",
        ),
    ),
    Mutant(
        "pp_split_gives_the_whole_remainder_to_the_first_stage",
        "src/shardwise/plan/stages.py",
        "return [base + (1 if s < extra else 0) for s in range(pp)]",
        "return [base + (extra if s == 0 else 0) for s in range(pp)]",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_the_auto_split_is_as_even_as_possible_with_the_remainder_first",
        ),
    ),
    Mutant(
        "pp_parameters_below_the_root_on_the_path_taken",
        "src/shardwise/plan/stages.py",
        "if any(True for _ in model.parameters(recurse=False)) or _holds_own_params(model, parts):",
        "if any(True for _ in model.parameters(recurse=False)):",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_a_module_below_the_root_holding_its_own_parameters_is_refused",
        ),
    ),
    Mutant(
        "pp_rank_steps_by_its_stages_per_rank",
        "src/shardwise/plan/stages.py",
        "return list(range(pp_rank, len(self.stages), self.degree))",
        "return list(range(pp_rank, len(self.stages), self.per_rank))",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_three_ranks_of_two_stages_each_hold_every_third_stage",
        ),
    ),
    Mutant(
        "pp_is_last_reads_the_first_stage_of_a_rank",
        "src/shardwise/parallelize/stages.py",
        "return self.chunks[-1].index == self.plan.pp - 1",
        "return self.chunks[0].index == self.plan.pp - 1",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_three_ranks_of_two_stages_each_hold_every_third_stage",
        ),
    ),
    Mutant(
        "pp_loss_of_a_mapping_not_read",
        "src/shardwise/parallelize/stages.py",
        'loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)',
        'loss = getattr(out, "loss", out)',
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_each_form_of_the_last_stages_output_gives_its_loss",
        ),
    ),
    Mutant(
        "pp_loss_of_a_tuple_is_its_last",
        "src/shardwise/parallelize/stages.py",
        "        loss = loss[0]\n",
        "        loss = loss[-1]\n",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_each_form_of_the_last_stages_output_gives_its_loss",
        ),
    ),
    Mutant(
        "pp_target_keyword_reaches_the_first_stage",
        "src/shardwise/parallelize/stages.py",
        'TARGET_NAMES = ("labels", "targets", "target")',
        'TARGET_NAMES = ("labels", "targets")',
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_every_target_keyword_reaches_the_last_stage_only",
        ),
    ),
    Mutant(
        "pp_keyword_block_receives_under_its_last_argument",
        "src/shardwise/parallelize/stages.py",
        'return params[0].name if params else "hidden_states"',
        'return params[-1].name if params else "hidden_states"',
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_a_block_called_by_keyword_receives_the_hidden_states_under_its_first_argument",
        ),
    ),
    Mutant(
        "pp_tied_aliases_map_first_to_last",
        "src/shardwise/parallelize/pipeline.py",
        "return {last: first for first, last in state.plan.tied}",
        "return {first: last for first, last in state.plan.tied}",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_the_last_stage_names_each_tied_parameter_by_its_first_stage_name",
        ),
    ),
    Mutant(
        "pp_tokens_counted_without_the_shift",
        "src/shardwise/parallelize/pipeline.py",
        "return (labels[..., 1:] != -100).sum().clamp_min(1)",
        "return (labels != -100).sum().clamp_min(1)",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_a_causal_lm_counts_the_labels_it_predicts_after_the_shift",
        ),
    ),
    Mutant(
        "pp_list_batch_taken_as_one_argument",
        "src/shardwise/parallelize/pipeline.py",
        "args = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)",
        "args = tuple(batch) if isinstance(batch, tuple) else (batch,)",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_each_form_of_a_batch_becomes_the_forwards_keywords",
        ),
    ),
    Mutant(
        "pp_a_bare_list_of_blocks_split",
        "src/shardwise/plan/stages.py",
        "    if not container:\n        raise _refuse(",
        "    if False:\n        raise _refuse(",
        (
            "tests/unit/parallelize/test_pipeline_tables.py::test_a_model_that_is_its_own_list_of_blocks_is_refused_by_the_reason",
        ),
    ),
    # The wholesale five-habits pass over expert parallel (test_expert_tables.py).
    Mutant(
        "ep_with_cpu_offload_taken",
        "src/shardwise/config/experts.py",
        '"cpu_offload": cfg.cpu_offload not in (None, False),',
        '"cpu_offload": False,',
        (
            "tests/unit/parallelize/test_expert_tables.py::test_ep_with_cpu_offload_is_refused_and_without_ep_it_is_taken",
        ),
    ),
    Mutant(
        "ep_experts_of_another_first_dimension_found",
        "src/shardwise/parallelize/experts.py",
        "if any(p.dim() < 2 or p.shape[0] != n for p in params):",
        "if any(p.dim() < 2 for p in params):",
        ("tests/unit/parallelize/test_expert_tables.py::test_each_condition_of_an_experts_module",),
    ),
    Mutant(
        "ep_experts_without_parameters_found",
        "src/shardwise/parallelize/experts.py",
        "if not isinstance(n, int) or n < 1 or not params:",
        "if not isinstance(n, int) or n < 1:",
        ("tests/unit/parallelize/test_expert_tables.py::test_each_condition_of_an_experts_module",),
    ),
    Mutant(
        "ep_divisors_offered_without_the_count_itself",
        "src/shardwise/parallelize/experts.py",
        "fits = [d for d in range(1, n + 1) if n % d == 0]",
        "fits = [d for d in range(1, n) if n % d == 0]",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_an_ep_that_does_not_divide_the_experts_offers_every_divisor",
        ),
    ),
    Mutant(
        "moe_unknown_word_taken_until_applied",
        "src/shardwise/parallelize/moe.py",
        "placement_for(how, 3)  # an unknown word is refused at plan time",
        "pass  # an unknown word is refused at plan time",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_an_unknown_word_for_an_experts_parameter_is_refused_when_the_style_is_made",
        ),
    ),
    Mutant(
        "moe_transposed_experts_split",
        "src/shardwise/parallelize/moe.py",
        'if getattr(module, "is_transposed", False):',
        "if False:",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_experts_stored_transposed_are_refused",
        ),
    ),
    Mutant(
        "moe_experts_parameter_of_two_dims_split",
        "src/shardwise/parallelize/moe.py",
        "if param.ndim != 3:",
        "if param.ndim < 2:",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_an_experts_parameter_that_is_not_3d_is_refused_by_its_shape",
        ),
    ),
    Mutant(
        "ep_plan_still_describes_the_experts",
        "src/shardwise/parallelize/experts.py",
        "said = {k: v for k, v in plan.described.items() if k in kept}",
        "said = dict(plan.described)",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_under_ep_the_plan_describes_only_what_it_still_splits",
        ),
    ),
    Mutant(
        "ep_counts_per_rank_shifted",
        "src/shardwise/parallelize/experts.py",
        "return torch.diff(torch.searchsorted(owner, ranks))",
        "return torch.diff(torch.searchsorted(owner, ranks, right=True))",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_each_rank_is_sent_the_copies_of_its_experts",
        ),
    ),
    Mutant(
        "expert_load_inf_taken",
        "src/shardwise/parallelize/experts.py",
        "and math.isfinite(load) and load >= 1",
        "and load >= 1",
        (
            "tests/unit/parallelize/test_expert_tables.py::test_an_expert_load_that_is_not_finite_is_refused",
        ),
    ),
    # The wholesale five-habits pass over the router loss and the batch statements
    # (test_batch_stat_tables.py).
    Mutant(
        "rb_loss_without_num_experts_not_refused",
        "src/shardwise/parallelize/router_loss.py",
        "    if num_experts is None:\n        raise",
        "    if False:\n        raise",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_the_loss_without_the_number_of_experts_is_refused",
        ),
    ),
    Mutant(
        "rb_probe_without_a_mask_only",
        "src/shardwise/parallelize/router_loss.py",
        "for m in (None, mask):",
        "for m in (None,):",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_the_probe_rejects_each_function_that_is_not_the_loss",
        ),
    ),
    Mutant(
        "rb_probe_takes_a_number",
        "src/shardwise/parallelize/router_loss.py",
        "if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):",
        "if not isinstance(got, torch.Tensor):",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_the_probe_rejects_each_function_that_is_not_the_loss",
        ),
    ),
    Mutant(
        "bs_router_class_not_a_mixture",
        "src/shardwise/parallelize/batch_stats.py",
        '_MOE_CLASS = re.compile(r"moe|expert|router", re.IGNORECASE)',
        '_MOE_CLASS = re.compile(r"moe|expert", re.IGNORECASE)',
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_each_word_in_a_class_name_marks_a_mixture_of_experts",
        ),
    ),
    Mutant(
        "bs_model_itself_named_first",
        "src/shardwise/parallelize/batch_stats.py",
        "for fqn, module in named[1:] + named[:1]:",
        "for fqn, module in named:",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_the_model_itself_is_named_only_when_no_submodule_is_a_mixture_of_experts",
        ),
    ),
    Mutant(
        "bs_partly_replaced_family_not_stated",
        "src/shardwise/parallelize/batch_stats.py",
        "unseen_moe = moe is not None and not (replaced and not differ)",
        "unseen_moe = moe is not None and not replaced",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_each_outcome_of_replacing_the_familys_loss",
        ),
    ),
    Mutant(
        "bs_three_norms_and_0_more",
        "src/shardwise/parallelize/batch_stats.py",
        'f" and {len(norms) - 3} more" if len(norms) > 3 else ""',
        'f" and {len(norms) - 3} more" if len(norms) >= 3 else ""',
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_the_batchnorm_statement_names_up_to_three_layers",
        ),
    ),
    Mutant(
        "bs_sharded_model_named_by_fsdps_class",
        "src/shardwise/parallelize/batch_stats.py",
        "return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))",
        "return type(module)",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_a_sharded_model_is_named_by_its_own_class",
        ),
    ),
    # The wholesale five-habits pass over adapters and QLoRA (test_adapter_plan_tables.py,
    # test_quantized_tables.py, checkpoint/test_adapter_tables.py).
    Mutant(
        "ad_lora_b_output_always_whole",
        "src/shardwise/parallelize/adapters.py",
        "output_layouts=base.output_layouts[0],",
        "output_layouts=Replicate(),",
        (
            "tests/unit/parallelize/test_adapter_plan_tables.py::test_lora_b_gives_its_output_the_layout_of_its_column_split_base",
        ),
    ),
    Mutant(
        "ad_lora_a_input_always_split",
        "src/shardwise/parallelize/adapters.py",
        "input_layouts=base.input_layouts[0], output_layouts=Replicate()",
        "input_layouts=None, output_layouts=Replicate()",
        (
            "tests/unit/parallelize/test_adapter_plan_tables.py::test_lora_a_takes_its_input_in_the_layout_of_its_row_split_base",
        ),
    ),
    Mutant(
        "ad_adapted_conv1d_split",
        "src/shardwise/parallelize/adapters.py",
        "if not isinstance(wrapper.base_layer, nn.Linear):",
        "if False:",
        (
            "tests/unit/parallelize/test_adapter_plan_tables.py::test_an_adapted_layer_that_is_not_a_linear_is_refused",
        ),
    ),
    Mutant(
        "ad_adapted_layer_of_another_style_split",
        "src/shardwise/parallelize/adapters.py",
        "if not isinstance(style, ColwiseParallel | RowwiseParallel):",
        "if False:",
        (
            "tests/unit/parallelize/test_adapter_plan_tables.py::test_an_adapted_layer_planned_with_another_style_is_refused",
        ),
    ),
    Mutant(
        "qlora_nested_absmax_one_entry",
        "src/shardwise/plan/quantized.py",
        "4 + 4 * math.ceil(blocks / _NESTED_BLOCK) + 256 * 4",
        "4 + 4 + 256 * 4",
        (
            "tests/unit/plan/test_quantized_tables.py::test_a_quant_state_is_counted_ahead_as_bitsandbytes_holds_it",
        ),
    ),
    Mutant(
        "qlora_blocks_of_64_always",
        "src/shardwise/plan/quantized.py",
        'blocks = math.ceil(p.numel() / int(getattr(p, "blocksize", 64) or 64))',
        "blocks = math.ceil(p.numel() / 64)",
        (
            "tests/unit/plan/test_quantized_tables.py::test_a_quant_state_is_counted_ahead_as_bitsandbytes_holds_it",
        ),
    ),
    Mutant(
        "qlora_refusal_counts_the_named_weight_too",
        "src/shardwise/plan/quantized.py",
        'more = f" and {len(found) - 1} more" if len(found) > 1 else ""',
        'more = f" and {len(found)} more" if len(found) > 1 else ""',
        (
            "tests/unit/plan/test_quantized_tables.py::test_a_refusal_names_the_first_weight_and_counts_the_others",
        ),
    ),
    Mutant(
        "qlora_tp_refusal_names_the_first_weight_of_any_kind",
        "src/shardwise/plan/quantized.py",
        "four = [q for q in found if q.bits == 4] or found",
        "four = found",
        (
            "tests/unit/plan/test_quantized_tables.py::test_tp_over_a_base_of_both_kinds_names_a_4bit_weight",
        ),
    ),
    Mutant(
        "qlora_unquantized_refused_at_world_one",
        "src/shardwise/plan/quantized.py",
        'if sharded and unquantized and config.strategy != "ddp":',
        'if unquantized and config.strategy != "ddp":',
        (
            "tests/unit/plan/test_quantized_tables.py::test_a_4bit_weight_not_quantized_yet_is_taken_where_nothing_is_sharded",
        ),
    ),
    Mutant(
        "ck_prompt_learning_cpt_exported",
        "src/shardwise/checkpoint/adapters.py",
        '"MULTITASK_PROMPT_TUNING", "CPT"}',
        '"MULTITASK_PROMPT_TUNING"}',
        (
            "tests/unit/checkpoint/test_adapter_tables.py::test_every_prompt_learning_method_is_refused_by_an_export",
        ),
    ),
    Mutant(
        "ck_export_of_two_active_adapters_writes_the_first",
        "src/shardwise/checkpoint/adapters.py",
        'if len(record["names"]) != 1:',
        'if not record["names"]:',
        ("tests/unit/checkpoint/test_adapter_tables.py::test_an_export_writes_one_active_adapter",),
    ),
    Mutant(
        "ck_merge_with_a_lora_bias",
        "src/shardwise/checkpoint/adapters.py",
        'for flag in ("use_dora", "lora_bias"):',
        'for flag in ("use_dora",):',
        (
            "tests/unit/checkpoint/test_adapter_tables.py::test_each_lora_flag_a_merge_does_not_implement_is_refused",
        ),
    ),
    Mutant(
        "ck_auto_mapping_beside_a_task_type",
        "src/shardwise/checkpoint/adapters.py",
        'if config.get("task_type") is None:',
        "if True:",
        (
            "tests/unit/checkpoint/test_adapter_tables.py::test_adapter_config_with_a_task_type_is_the_one_peft_writes",
        ),
    ),
    Mutant(
        "ck_merge_keeps_the_other_adapters_copy",
        "src/shardwise/checkpoint/adapters.py",
        "return any(name != adapter and name in parts for name in configs)",
        "return False",
        (
            "tests/unit/checkpoint/test_adapter_tables.py::test_a_merge_with_a_second_adapter_loaded_merges_the_active_one_only",
        ),
    ),
    Mutant(
        "ck_unfilled_adapter_loaded",
        "src/shardwise/checkpoint/adapters.py",
        "unfilled = sorted(k for k in missing if k in trainable)",
        "unfilled: list[str] = []",
        (
            "tests/unit/checkpoint/test_adapter_tables.py::test_a_load_that_left_a_trainable_tensor_unfilled_is_refused",
        ),
    ),
    Mutant(
        "le_timeout_inf_taken",
        "src/shardwise/cli/launch.py",
        'if not 0 < s < float("inf"):  # an infinite timeout',
        "if not s > 0:  # an infinite timeout",
        (
            "tests/unit/cli/test_launch_tables.py::test_a_collective_timeout_that_is_not_a_finite_number_of_seconds_is_refused",
        ),
    ),
    Mutant(
        "le_timeout_env_inf_taken",
        "src/shardwise/distributed/process_group.py",
        'if not 0 < value < float("inf"):',
        "if not value > 0:",
        (
            "tests/unit/cli/test_launch_tables.py::test_a_collective_timeout_that_is_not_a_finite_number_of_seconds_is_refused",
        ),
    ),
    Mutant(
        "le_init_timeout_inf_taken",
        "src/shardwise/distributed/process_group.py",
        'if not 0 < timeout_s < float("inf"):',
        "if timeout_s <= 0:",
        (
            "tests/unit/cli/test_launch_tables.py::test_a_collective_timeout_that_is_not_a_finite_number_of_seconds_is_refused",
        ),
    ),
    # The wholesale five-habits pass over the launcher and resume (test_launch_tables.py,
    # test_resume_tables.py).
    Mutant(
        "le_nproc_of_zero_taken",
        "src/shardwise/cli/launch.py",
        '    if n < 1:\n        raise argparse.ArgumentTypeError(f"--nproc=',
        '    if n < 0:\n        raise argparse.ArgumentTypeError(f"--nproc=',
        (
            "tests/unit/cli/test_launch_tables.py::test_an_nproc_that_is_no_positive_count_is_refused",
        ),
    ),
    Mutant(
        "le_node_rank_equal_to_the_nodes_taken",
        "src/shardwise/cli/launch.py",
        "not 0 <= args.node_rank < int(nnodes)",
        "not 0 <= args.node_rank <= int(nnodes)",
        ("tests/unit/cli/test_launch_tables.py::test_a_node_rank_is_below_the_number_of_nodes",),
    ),
    Mutant(
        "le_config_given_with_equals_unread",
        "src/shardwise/cli/launch.py",
        '        if arg.startswith("--config="):\n            return arg.partition("=")[2]\n',
        "",
        (
            "tests/unit/cli/test_launch_tables.py::test_each_spelling_of_the_config_argument_is_checked",
        ),
    ),
    Mutant(
        "le_layout_checked_without_tp",
        "src/shardwise/cli/launch.py",
        "            tp=parallel.tp_size,\n",
        "",
        (
            "tests/unit/cli/test_launch_tables.py::test_the_tensor_parallel_degree_is_checked_before_spawning",
        ),
    ),
    Mutant(
        "data_sampler_skips_every_epoch",
        "src/shardwise/train/data.py",
        "        self.skip = 0\n",
        "",
        (
            "tests/unit/train/test_resume_tables.py::test_the_sampler_skips_once_then_gives_whole_epochs",
        ),
    ),
    Mutant(
        "data_older_position_counted_at_the_new_batch",
        "src/shardwise/train/data.py",
        'consumed = int(position.get("samples_done", done * saved_batch * saved))',
        'consumed = int(position.get("samples_done", done * batch * saved))',
        (
            "tests/unit/train/test_resume_tables.py::test_an_older_checkpoint_without_its_sample_count_resumes_at_a_new_batch_size",
        ),
    ),
    Mutant(
        "data_skip_of_a_whole_epoch_stays_in_it",
        "src/shardwise/train/data.py",
        "return (epoch + 1, 0) if skip >= per_rank else (epoch, skip)",
        "return (epoch + 1, 0) if skip > per_rank else (epoch, skip)",
        ("tests/unit/train/test_resume_tables.py::test_a_skip_of_a_whole_epoch_starts_the_next",),
    ),
    Mutant(
        "data_stream_inside_a_dataloader_not_a_stream",
        "src/shardwise/train/data.py",
        'if isinstance(getattr(data, "dataset", data), IterableDataset):',
        "if isinstance(data, IterableDataset):",
        (
            "tests/unit/train/test_resume_tables.py::test_a_stream_is_taken_bare_or_inside_a_dataloader",
        ),
    ),
    Mutant(
        "resume_seed_change_unnamed",
        "src/shardwise/train/resume.py",
        '_RUNNER_FIELDS = ("max_steps", "max_epochs", "batch_size", "seed")',
        '_RUNNER_FIELDS = ("max_steps", "max_epochs", "batch_size")',
        (
            "tests/unit/train/test_resume_tables.py::test_every_runner_field_a_resume_compares_is_named_alone",
        ),
    ),
    Mutant(
        "resume_momentum_change_unnamed",
        "src/shardwise/train/resume.py",
        '_HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps", "momentum")',
        '_HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")',
        (
            "tests/unit/train/test_resume_tables.py::test_every_hyperparameter_a_resume_compares_is_named_alone",
        ),
    ),
    Mutant(
        "resume_saved_betas_list_named_a_change",
        "src/shardwise/train/resume.py",
        "if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):",
        "if isinstance(a, list) and isinstance(b, list):",
        (
            "tests/unit/train/test_resume_tables.py::test_values_that_only_look_different_are_not_named",
        ),
    ),
    Mutant(
        "resume_numbers_compared_exactly",
        "src/shardwise/train/resume.py",
        "return not math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)",
        "return float(a) != float(b)",
        (
            "tests/unit/train/test_resume_tables.py::test_values_that_only_look_different_are_not_named",
        ),
    ),
    Mutant(
        "resume_scheduled_lr_compared_as_it_ended",
        "src/shardwise/train/resume.py",
        'name = "initial_lr" if key == "lr" and "initial_lr" in saved else key',
        "name = key",
        (
            "tests/unit/train/test_resume_tables.py::test_the_learning_rate_a_scheduler_moved_is_compared_by_its_start",
        ),
    ),
    Mutant(
        "resume_empty_tensorboard_dir_is_a_run",
        "src/shardwise/train/resume.py",
        'if board.is_dir() and any(board.rglob("events.out.tfevents*")):',
        "if board.is_dir():",
        ("tests/unit/train/test_resume_tables.py::test_each_trace_of_an_earlier_run_is_named",),
    ),
    # The wholesale five-habits pass over testing/parity.py (test_parity_tables.py).
    Mutant(
        "pa_parameter_inf_passes",
        "src/shardwise/testing/parity.py",
        "if not bool(torch.isfinite(tensor).all()):",
        "if bool(torch.isnan(tensor).any()):",
        (
            "tests/unit/testing/test_parity_tables.py::test_a_parameter_with_any_value_that_is_not_finite_is_refused",
        ),
    ),
    Mutant(
        "pa_worst_of_minus_inf_passes",
        "src/shardwise/testing/parity.py",
        "bad = [v for v in values if not math.isfinite(v)]",
        "bad = [v for v in values if math.isnan(v) or v == math.inf]",
        (
            "tests/unit/testing/test_parity_tables.py::test_worst_of_refuses_every_value_that_is_not_finite",
        ),
    ),
    Mutant(
        "pa_lengths_not_compared",
        "src/shardwise/testing/parity.py",
        "if len(reference.losses) != len(candidate.losses):",
        "if False:",
        (
            "tests/unit/testing/test_parity_tables.py::test_trajectories_of_different_lengths_are_refused",
        ),
    ),
    Mutant(
        "pa_first_parameter_named_the_worst",
        "src/shardwise/testing/parity.py",
        "            if r > worst_rel:\n",
        "            if not worst:\n",
        (
            "tests/unit/testing/test_parity_tables.py::test_the_worst_parameter_is_named_wherever_it_comes",
        ),
    ),
    Mutant(
        "pa_loss_at_the_bound_refused",
        "src/shardwise/testing/parity.py",
        "        if r > rtol:\n",
        "        if r >= rtol:\n",
        ("tests/unit/testing/test_parity_tables.py::test_a_difference_at_the_bound_passes",),
    ),
    Mutant(
        "pa_parameters_compared_when_asked_not_to",
        "src/shardwise/testing/parity.py",
        "    if check_params:\n",
        "    if True:\n",
        (
            "tests/unit/testing/test_parity_tables.py::test_parameters_are_not_compared_when_asked_not_to",
        ),
    ),
    Mutant(
        "pa_parameters_kept_in_their_dtype",
        "src/shardwise/testing/parity.py",
        "out[name] = t.detach().float().cpu().clone()",
        "out[name] = t.detach().cpu().clone()",
        (
            "tests/unit/testing/test_parity_tables.py::test_a_bf16_models_parameters_come_back_whole_in_fp32",
        ),
    ),
    # Fifth outside audit (bugs chosen from the code alone): its two survivors.
    Mutant(
        "audit5_stated_rows_rounded_down",
        "src/shardwise/parallelize/experts.py",
        'rows = bound if self.load == "worst" else min(math.ceil(self.load * tokens * k), bound)',
        'rows = bound if self.load == "worst" else min(int(self.load * tokens * k), bound)',
        (
            "tests/unit/parallelize/test_expert_tables.py::test_a_stated_load_sends_the_busiest_rank_its_rows_rounded_up",
        ),
    ),
    Mutant(
        "audit5_groups_stay_current_after_a_raising_forward",
        "src/shardwise/parallelize/global_batch.py",
        "model.register_forward_hook(leave, with_kwargs=True, always_call=True)",
        "model.register_forward_hook(leave, with_kwargs=True)",
        (
            "tests/unit/parallelize/test_batch_stat_tables.py::test_a_training_forward_leaves_its_groups_however_it_ends",
        ),
    ),
    # Issue 52: shardwise.Muon (each matrix whole, once in the job).
    Mutant(
        "muon_normalises_momentum_in_place",
        "src/shardwise/train/muon.py",
        "    y = x.to(dtype, copy=True)\n",
        "    y = x.to(dtype)\n",
        ("tests/unit/train/test_muon_optimizer.py::test_momentum_buffer_is_not_normalised",),
    ),
    Mutant(
        "muon_nesterov_ignored",
        "src/shardwise/train/muon.py",
        '        update = grad.lerp(buf, m) if group["nesterov"] else buf\n',
        "        update = grad.lerp(buf, m)\n",
        ("tests/unit/train/test_muon_optimizer.py::test_one_process_equals_torch_muon",),
    ),
    Mutant(
        "muon_lr_ratio_upside_down",
        "src/shardwise/train/muon.py",
        "        return lr * math.sqrt(max(1, rows / cols))",
        "        return lr * math.sqrt(max(1, cols / rows))",
        ("tests/unit/train/test_muon_optimizer.py::test_one_process_equals_torch_muon",),
    ),
    Mutant(
        "muon_rms_ratio_of_the_smaller_side",
        "src/shardwise/train/muon.py",
        "    return lr * 0.2 * math.sqrt(max(rows, cols))",
        "    return lr * 0.2 * math.sqrt(min(rows, cols))",
        ("tests/unit/train/test_muon_optimizer.py::test_one_process_equals_torch_muon",),
    ),
    Mutant(
        "muon_weight_decay_dropped",
        "src/shardwise/train/muon.py",
        '            local.mul_(1 - lr * group["weight_decay"])',
        "            local.mul_(1.0)",
        ("tests/unit/train/test_muon_optimizer.py::test_one_process_equals_torch_muon",),
    ),
    Mutant(
        "muon_router_on_muon",
        "src/shardwise/config/matrices.py",
        '    r"(^|\\.)(gate|router)\\.weight$",',
        '    r"(^|\\.)(router)\\.weight$",',
        ("tests/unit/train/test_muon_optimizer.py::test_split_by_name_and_shape",),
    ),
    Mutant(
        "muon_gate_proj_to_fallback",
        "src/shardwise/config/matrices.py",
        '    r"(^|\\.)(gate|router)\\.weight$",',
        '    r"(gate|router)",',
        ("tests/unit/train/test_muon_optimizer.py::test_hidden_matrices_stay_on_muon",),
    ),
    Mutant(
        "muon_matrix_names_ignored",
        "src/shardwise/config/matrices.py",
        "        forced = name is not None and any(re.search(r, name) for r in matrix_names)",
        "        forced = False",
        ("tests/unit/train/test_muon_optimizer.py::test_split_by_name_and_shape",),
    ),
    Mutant(
        "muon_unnamed_split_by_shape_silently",
        "src/shardwise/config/matrices.py",
        "        if name is None and fallback_names:",
        "        if False:",
        (
            "tests/unit/train/test_muon_optimizer.py::test_unnamed_parameters_refused_unless_split_by_shape",
        ),
    ),
    Mutant(
        "muon_owners_not_balanced",
        "src/shardwise/train/muon_comm.py",
        "        owner = min(layouts[i].candidates, key=lambda r: (load.get(r, 0), r))",
        "        owner = layouts[i].candidates[0]",
        (
            "tests/unit/train/test_muon_optimizer.py::test_owners_balanced_by_size",
            "tests/distributed/test_muon.py::test_newton_schulz_once_per_matrix_in_the_job",
        ),
    ),
    Mutant(
        "muon_owners_smallest_first",
        "src/shardwise/train/muon_comm.py",
        "    for i in sorted(range(len(layouts)), key=lambda i: (-sizes[i], i)):",
        "    for i in sorted(range(len(layouts)), key=lambda i: (sizes[i], i)):",
        ("tests/unit/train/test_muon_optimizer.py::test_owners_balanced_by_size",),
    ),
    Mutant(
        "muon_tp_copies_not_replicas",
        "src/shardwise/train/muon_comm.py",
        "    if root is mesh or root.mesh.shape == mesh.mesh.shape:",
        "    if True:",
        ("tests/distributed/test_muon.py::test_newton_schulz_once_per_matrix_in_the_job",),
    ),
    Mutant(
        "muon_strided_shard_read_as_plain",
        "src/shardwise/train/muon_comm.py",
        "            offsets.get(dim),\n",
        "            None,\n",
        ("tests/distributed/test_muon.py::test_equals_one_process",),
    ),
    Mutant(
        "muon_pieces_padded_to_the_smallest",
        "src/shardwise/train/muon_comm.py",
        "    return max(_numel(piece_index(it.shape, it.layout, c)) for c in coords)",
        "    return min(_numel(piece_index(it.shape, it.layout, c)) for c in coords)",
        ("tests/distributed/test_muon.py::test_equals_one_process",),
    ),
    Mutant(
        "muon_engine_hands_no_names",
        "src/shardwise/train/optim.py",
        "            with muon_context(model):",
        "            if True:",
        ("tests/unit/train/test_muon_optimizer.py::test_engine_names_the_parameters",),
    ),
    Mutant(
        "torch_muon_over_dtensors_allowed",
        "src/shardwise/train/optim.py",
        "    if type(optimizer) is not torch.optim.Muon:\n        return",
        "    if True:\n        return",
        ("tests/distributed/test_muon.py::test_engine_takes_muon_and_refuses_torch_muon",),
    ),
    Mutant(
        "muon_under_cp_allowed",
        "src/shardwise/train/muon.py",
        '        for field, what in (("cp", "cp"),):',
        "        for field, what in ():",
        (
            "tests/unit/train/test_muon_optimizer.py::test_layouts_not_built_are_refused_at_construction",
        ),
    ),
    Mutant(
        "muon_fallback_state_lost_on_load",
        "src/shardwise/train/muon.py",
        '            self.fallback.param_groups = [g for g in self.param_groups if not g["use_muon"]]\n            self.fallback.state = self.state\n',
        '            self.fallback.param_groups = [g for g in self.param_groups if not g["use_muon"]]\n',
        (
            "tests/unit/train/test_muon_optimizer.py::test_fallback_is_stepped_and_shares_groups_and_state",
        ),
    ),
    Mutant(
        "muon_momentum_kept_as_local_shards",
        "src/shardwise/train/muon.py",
        'state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor like the grad',
        'state["momentum_buffer"] = torch.zeros_like(_local(p.grad))',
        ("tests/distributed/test_muon.py::test_checkpoint_moves_from_world_4_to_2_and_1",),
    ),
    Mutant(
        "muon_owners_take_turns",
        "src/shardwise/train/muon_comm.py",
        "        run.gather()\n    for run in runs:\n        run.compute()\n    for run in runs:\n",
        "        run.gather()\n        run.compute()\n",
        ("tests/distributed/test_muon.py::test_owners_run_newton_schulz_at_the_same_time",),
    ),
    Mutant(
        "muon_infinite_lr_allowed",
        "src/shardwise/train/muon.py",
        "        if not (math.isfinite(float(value)) and float(value) >= 0):",
        "        if not float(value) >= 0:",
        ("tests/unit/train/test_muon_optimizer.py::test_settings_refused",),
    ),
    Mutant(
        "muon_plain_tensors_without_group_allowed",
        "src/shardwise/train/muon.py",
        "        if not isinstance(p, DTensor) and group is None and world > 1:",
        "        if False:",
        (
            "tests/unit/train/test_muon_optimizer.py::test_plain_tensors_across_ranks_need_their_group",
        ),
    ),
    Mutant(
        "muon_other_stage_read_as_copies",
        "src/shardwise/train/muon_comm.py",
        "    if PP_DIM in root_names and PP_DIM not in names:",
        "    if False:",
        ("tests/distributed/test_muon.py::test_pipeline_stages_equal_one_process",),
    ),
    Mutant(
        "muon_expert_stack_as_one_matrix",
        "src/shardwise/train/muon.py",
        "                return torch.stack([newton_schulz(m, *settings) for m in whole])",
        "                return newton_schulz(whole.flatten(0, 1), *settings).view_as(whole)",
        ("tests/unit/train/test_muon_optimizer.py::test_each_expert_is_a_matrix_of_its_own",),
    ),
    Mutant(
        "muon_expert_lr_from_the_stack",
        "src/shardwise/train/muon.py",
        "p.shape[-2:])  # one expert's matrix",
        "p.shape)  # one expert's matrix",
        ("tests/unit/train/test_muon_optimizer.py::test_each_expert_is_a_matrix_of_its_own",),
    ),
    Mutant(
        "muon_ns_dtype_string_from_a_checkpoint",
        "src/shardwise/train/muon.py",
        '                _dtype(group["ns_dtype"]),  # a checkpoint gives it back as a string',
        '                group["ns_dtype"],  # a checkpoint gives it back as a string',
        (
            "tests/unit/train/test_muon_optimizer.py::test_a_checkpoint_gives_ns_dtype_back_as_a_string",
            "tests/distributed/test_muon.py::test_checkpoint_moves_between_layouts",
        ),
    ),
    # Issue 53: torchrun's PET_* variables (Kubeflow Trainer) and shardwise under Ray Train.
    Mutant(
        "pet_variable_beats_its_flag",
        "src/shardwise/cli/launch.py",
        "        if getattr(args, attr, None) is not None:\n            continue",
        "        if getattr(args, attr, None) is not None and var not in env:\n            continue",
        (
            "tests/unit/cli/test_launch_pet.py::test_a_flag_beats_its_variable",
            "tests/e2e/test_launch_robust.py::test_kubeflow_two_nodes_and_a_flag_beats_its_variable",
        ),
    ),
    Mutant(
        "pet_one_node_stays_standalone",
        "src/shardwise/cli/launch.py",
        "    if _max_nodes(nnodes) == 1 and not args.rdzv_endpoint:",
        "    if _max_nodes(nnodes) == 1:",
        (
            "tests/unit/cli/test_launch_pet.py::test_node_rank_zero_hosts_the_store_and_one_node_still_listens_on_the_port",
            "tests/e2e/test_launch_robust.py::test_kubeflow_variables_start_their_ranks_on_their_port",
        ),
    ),
    Mutant(
        "pet_every_node_hosts_the_store",
        "src/shardwise/cli/launch.py",
        "        args.rdzv_host = args.node_rank == 0",
        "        args.rdzv_host = True",
        ("tests/unit/cli/test_launch_pet.py::test_every_variable_is_read_as_torchrun_reads_it",),
    ),
    Mutant(
        "pet_master_addr_default_localhost",
        "src/shardwise/cli/launch.py",
        'addr = env.get("PET_MASTER_ADDR") or "127.0.0.1"',
        'addr = env.get("PET_MASTER_ADDR") or "localhost"',
        (
            "tests/unit/cli/test_launch_pet.py::test_node_rank_zero_hosts_the_store_and_one_node_still_listens_on_the_port",
        ),
    ),
    Mutant(
        "pet_master_port_zero_taken",
        "src/shardwise/cli/launch.py",
        "    if not 0 < port < 65536:",
        "    if not 0 <= port < 65536:",
        ("tests/unit/cli/test_launch_pet.py::test_a_malformed_variable_is_one_line_naming_it",),
    ),
    Mutant(
        "pet_master_addr_without_port_ignored",
        "src/shardwise/cli/launch.py",
        'elif getattr(args, "rdzv_endpoint", None) is None and env.get("PET_MASTER_ADDR"):',
        'elif getattr(args, "rdzv_endpoint", None) is None and env.get("PET_MASTER_HOST"):',
        ("tests/unit/cli/test_launch_pet.py::test_an_address_without_a_port_is_refused",),
    ),
    Mutant(
        "ray_reports_no_checkpoint",
        "src/shardwise/integrations/ray.py",
        "checkpoint = ray.train.Checkpoint.from_directory(str(path)) if rank0 else None",
        "checkpoint = None",
        (
            "tests/integrations/test_ray.py::test_a_killed_worker_resumes_from_the_reported_checkpoint",
        ),
    ),
    Mutant(
        "ray_restart_ignores_rays_checkpoint",
        "src/shardwise/integrations/ray.py",
        "self.config = dataclasses.replace(self.config, resume=reported)",
        "self.config = dataclasses.replace(self.config, resume=self.config.resume)",
        (
            "tests/integrations/test_ray.py::test_a_killed_worker_resumes_from_the_reported_checkpoint",
            "tests/integrations/test_ray.py::test_a_new_trainer_of_the_run_resumes_at_another_number_of_workers",
        ),
    ),
    Mutant(
        "ray_async_save_allowed",
        "src/shardwise/integrations/ray.py",
        "        if self.config.async_save:",
        "        if self.config.async_save is None:",
        ("tests/integrations/test_ray.py::test_an_asynchronous_save_is_refused",),
    ),
    Mutant(
        "container_without_forward_made_a_unit",
        "src/shardwise/plan/planner.py",
        "        if has_no_forward(module):",
        "        if False:",
        (
            "tests/unit/plan/test_plan.py::test_a_size_policy_passes_a_container_up",
            "tests/unit/plan/test_plan.py::test_a_policy_naming_only_containers_says_so",
        ),
    ),
    Mutant(
        "detection_stops_at_a_container",
        "src/shardwise/plan/detect.py",
        "        out.extend(_blocks_of(child) if has_no_forward(child) else [child])",
        "        out.append(child)",
        ("tests/unit/plan/test_plan.py::test_a_container_without_forward_is_never_a_unit",),
    ),
    # Issue 53, item 1: the Hugging Face Trainer and TRL on shardwise (ShardwiseTrainer).
    Mutant(
        "trainer_clips_nothing",
        "src/shardwise/integrations/transformers.py",
        "return clip_grad_norm_(_trainable(self.model_wrapped), self.args.max_grad_norm)",
        "return clip_grad_norm_(_trainable(self.model_wrapped), None)",
        (
            "tests/integrations/test_transformers_trainer.py::test_world2_equals_the_trainers_own_ddp",
        ),
    ),
    Mutant(
        "trainer_syncs_every_micro_batch",
        "src/shardwise/integrations/transformers.py",
        'sync = bool(self.accelerator.sync_gradients or plugin.get("sync_each_batch", False))',
        "sync = True",
        (
            "tests/integrations/test_transformers_trainer.py::test_accumulation_skips_the_gradient_sync",
        ),
    ),
    Mutant(
        "trainer_tp_ranks_read_by_process",
        "src/shardwise/integrations/transformers.py",
        "sampler.process_index = info.dp_rank",
        "sampler.process_index = info.dist.rank % info.dp_size",
        (
            "tests/integrations/test_transformers_trainer.py::test_world4_equals_the_trainers_own_ddp",
        ),
    ),
    Mutant(
        "trainer_stream_under_tp_not_refused",
        "src/shardwise/integrations/transformers.py",
        '        if type(sampler).__name__ != "BatchSamplerShard":',
        "        if False:",
        ("tests/integrations/test_transformers_trainer.py::test_a_stream_under_tp_is_refused",),
    ),
    Mutant(
        "trainer_resume_loads_nothing",
        "src/shardwise/integrations/transformers.py",
        "        if resume_from_checkpoint is not None:\n            load_checkpoint(",
        "        if False:\n            load_checkpoint(",
        (
            "tests/integrations/test_transformers_trainer.py::test_resume_at_world1_equals_the_uninterrupted_run",
        ),
    ),
    Mutant(
        "trainer_bf16_not_translated",
        "src/shardwise/integrations/transformers.py",
        '        changes["mixed_precision"] = "bf16"',
        "        pass",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_bf16_is_shardwise_bf16_policy",
        ),
    ),
    Mutant(
        "trainer_checkpointing_not_translated",
        "src/shardwise/integrations/transformers.py",
        '            changes["activation_checkpointing"] = "full"',
        "            pass",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_activation_checkpointing_is_shardwise_checkpointing",
        ),
    ),
    Mutant(
        "trainer_ddp_arguments_dropped",
        "src/shardwise/integrations/transformers.py",
        "            changes[name] = value  # DDP's keyword",
        "            pass  # DDP's keyword",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_ddp_arguments_are_ddp_keywords",
        ),
    ),
    Mutant(
        "trainer_fp16_via_mixed_precision_kept",
        "src/shardwise/integrations/transformers.py",
        'if args.fp16 or args.mixed_precision == "fp16":',
        "if args.fp16:",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_arguments_shardwise_would_change_are_refused",
        ),
    ),
    Mutant(
        "trainer_torch_compile_kept",
        "src/shardwise/integrations/transformers.py",
        "    if args.torch_compile:",
        "    if False:",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_arguments_shardwise_would_change_are_refused",
        ),
    ),
    Mutant(
        "trainer_fsdp_kept",
        "src/shardwise/integrations/transformers.py",
        "    if args.fsdp:",
        "    if False:",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_arguments_shardwise_would_change_are_refused",
        ),
    ),
    Mutant(
        "trainer_deepspeed_kept",
        "src/shardwise/integrations/transformers.py",
        "    if args.deepspeed:",
        "    if False:",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_arguments_shardwise_would_change_are_refused",
        ),
    ),
    Mutant(
        "trainer_user_arguments_changed",
        "src/shardwise/integrations/transformers.py",
        "        own = copy.copy(training_args)",
        "        own = training_args",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_the_user_arguments_are_left_as_given",
        ),
    ),
    Mutant(
        "trainer_dpo_subclass_not_refused",
        "src/shardwise/integrations/transformers.py",
        "    for base in cls.__mro__:",
        "    for base in (cls,):",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_shardwise_trainer_builds_from_any_trainer_and_refuses_dpo_and_grpo",
        ),
    ),
    # issue 52: optimizer: {name: muon} in run files.
    Mutant(
        "muon_run_file_takes_other_optimizers_keys",
        "src/shardwise/config/optimizer.py",
        "        if key not in KEYS[name]:",
        '        if key not in KEYS[name] and name != "muon":',
        (
            "tests/unit/config/test_optimizer_muon.py::test_bad_muon_sections_are_refused_at_load_time_in_one_line",
        ),
    ),
    Mutant(
        "muon_run_file_nesterov_dropped",
        "src/shardwise/config/optimizer.py",
        '                "nesterov",\n                "eps",',
        '                "eps",',
        (
            "tests/unit/config/test_optimizer_muon.py::test_a_run_file_with_muon_trains_as_muon_built_by_hand",
        ),
    ),
    Mutant(
        "muon_run_file_weight_decay_default_adamws",
        "src/shardwise/config/optimizer.py",
        '    "muon": {\n        "weight_decay": 0.1,',
        '    "muon": {\n        "weight_decay": 0.0,',
        (
            "tests/unit/config/test_optimizer_muon.py::test_muon_keys_not_given_are_torchs_defaults_and_the_fallback_is_the_run_files_adamw",
        ),
    ),
    Mutant(
        "muon_run_file_fallback_lr_ignored",
        "src/shardwise/config/optimizer.py",
        "self.name, list(params), self.lr if self.lr is not None else lr, given",
        "self.name, list(params), lr, given",
        (
            "tests/unit/config/test_optimizer_muon.py::test_a_run_file_with_muon_trains_as_muon_built_by_hand",
        ),
    ),
    Mutant(
        "muon_run_file_momentum_one_accepted",
        "src/shardwise/config/optimizer.py",
        '    if name == "muon" and given.get("momentum") is not None and given["momentum"] >= 1:',
        '    if name == "muon" and given.get("momentum") is not None and given["momentum"] > 1:',
        (
            "tests/unit/config/test_optimizer_muon.py::test_bad_muon_sections_are_refused_at_load_time_in_one_line",
        ),
    ),
    # issue 52: the memory plan counts Muon.
    Mutant(
        "muon_memory_two_buffers",
        "src/shardwise/memory/muon_states.py",
        "MUON_STATES = 1",
        "MUON_STATES = 2",
        (
            "tests/unit/memory/test_muon_memory.py::test_muon_keeps_one_state_per_matrix_element_and_the_fallback_two_for_the_rest",
            "tests/unit/memory/test_muon_memory.py::test_the_one_process_state_is_what_shardwise_muon_holds_after_a_step",
        ),
    ),
    Mutant(
        "muon_memory_every_rank_assembles_every_matrix",
        "src/shardwise/memory/muon_states.py",
        "    for owned in _owners(sizes, world):\n        if not owned:",
        "    for owned in [list(range(len(sizes)))]:\n        if not owned:",
        (
            "tests/unit/memory/test_muon_memory.py::test_sharded_step_temporaries_count_the_busiest_owner_and_padded_pieces",
            "tests/distributed/test_muon_fused.py::test_the_memory_plans_step_temporaries_against_a_real_step",
        ),
    ),
    Mutant(
        "muon_memory_pieces_unpadded",
        "src/shardwise/memory/muon_states.py",
        "    pads = [-(-s[0] // shard) * (n // s[0])",
        "    pads = [(s[0] // shard) * (n // s[0])",
        (
            "tests/unit/memory/test_muon_memory.py::test_sharded_step_temporaries_count_the_busiest_owner_and_padded_pieces",
        ),
    ),
    Mutant(
        "muon_memory_owner_whole_matrix_not_counted",
        "src/shardwise/memory/muon_states.py",
        "        worst = max(worst, message + 2 * shard * message + whole)",
        "        worst = max(worst, message + 2 * shard * message)",
        (
            "tests/unit/memory/test_muon_memory.py::test_sharded_step_temporaries_count_the_busiest_owner_and_padded_pieces",
            "tests/distributed/test_muon_fused.py::test_the_memory_plans_step_temporaries_against_a_real_step",
        ),
    ),
    Mutant(
        "muon_memory_one_process_results_not_kept",
        "src/shardwise/memory/muon_states.py",
        "            kept += shares.ns_bytes * n",
        "            kept += 0",
        (
            "tests/unit/memory/test_muon_memory.py::test_the_one_process_step_temporaries_are_what_a_real_step_allocates",
        ),
    ),
    # issue 52: fused projections per block.
    Mutant(
        "muon_split_q_rows_are_kvs",
        "src/shardwise/train/muon_fused.py",
        "    return heads * head_dim, kv * head_dim, kv * head_dim",
        "    return kv * head_dim, heads * head_dim, kv * head_dim",
        (
            "tests/unit/train/test_muon_blocks.py::test_the_split_is_read_from_a_transformers_config",
            "tests/unit/train/test_muon_blocks.py::test_per_block_equals_each_block_as_its_own_matrix_and_off_differs",
            "tests/distributed/test_muon_fused.py::test_split_fused_equals_one_process",
        ),
    ),
    Mutant(
        "muon_split_block_lr_not_adjusted",
        "src/shardwise/train/muon_fused.py",
        "    out = [orthogonalise(b) * scale(b.shape, whole.shape) for b in blocks]",
        "    out = [orthogonalise(b) for b in blocks]",
        (
            "tests/unit/train/test_muon_blocks.py::test_per_block_equals_each_block_as_its_own_matrix_and_off_differs",
        ),
    ),
    Mutant(
        "muon_split_stack_halves_across_experts",
        "src/shardwise/train/muon_fused.py",
        '        dim = -1 if layout == "transposed" else -2',
        '        dim = -1 if layout == "transposed" else 0',
        (
            "tests/unit/train/test_muon_blocks.py::test_an_expert_stack_is_split_per_expert_then_per_half",
        ),
    ),
    Mutant(
        "muon_split_fused_on_by_default",
        "src/shardwise/train/muon.py",
        "        split_fused: SplitSetting = False,",
        "        split_fused: SplitSetting = True,",
        (
            "tests/unit/train/test_muon_blocks.py::test_the_split_is_read_from_a_transformers_config",
            "tests/unit/train/test_muon_blocks.py::test_per_block_equals_each_block_as_its_own_matrix_and_off_differs",
        ),
    ),
    Mutant(
        "muon_split_sizes_not_checked",
        "src/shardwise/train/muon_fused.py",
        "    if sum(split.sizes) != rows or min(split.sizes) <= 0:",
        "    if min(split.sizes) <= 0:",
        (
            "tests/unit/train/test_muon_blocks.py::test_a_split_that_cannot_be_read_is_refused_in_one_line",
        ),
    ),
    # Issue 54: the fast simulation (memory/compose.py) groups same blocks and composes.
    Mutant(
        "fast_key_ignores_dtype",
        "src/shardwise/memory/compose.py",
        "(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()",
        "(n, tuple(p.shape), p.requires_grad) for n, p in block.named_parameters()",
        (
            "tests/unit/memory/test_fast_simulation.py::test_blocks_differing_in_dtype_or_checkpointing_are_not_the_same",
        ),
    ),
    Mutant(
        "fast_key_ignores_checkpointing",
        "src/shardwise/memory/compose.py",
        "                u.activation_checkpointing,\n",
        "",
        (
            "tests/unit/memory/test_fast_simulation.py::test_blocks_differing_in_dtype_or_checkpointing_are_not_the_same",
            "tests/unit/memory/test_fast_simulation.py::test_full_shard_with_every_second_block_checkpointed_groups_by_the_choice",
        ),
    ),
    Mutant(
        "fast_first_and_last_blocks_not_traced_apart",
        "src/shardwise/memory/compose.py",
        "EDGE_PERIODS = 2\n",
        "EDGE_PERIODS = 1\n",
        ("tests/unit/memory/test_fast_simulation.py::test_tp_ep_and_adapters_compose_exactly",),
    ),
    Mutant(
        "fast_index_dependent_block_composed_with_its_neighbours",
        "src/shardwise/memory/compose.py",
        "while j + period < n and keys[j] == keys[j + period]:",
        "while j + period < n and keys[j][0] == keys[j + period][0]:",
        (
            "tests/unit/memory/test_fast_simulation.py::test_an_index_dependent_block_is_traced_whole_and_said",
        ),
    ),
    Mutant(
        "fast_composition_takes_the_longer_trace",
        "src/shardwise/memory/compose.py",
        "        return a + steps * (b - a)\n",
        "        return b\n",
        (
            "tests/unit/memory/test_fast_simulation.py::test_full_shard_with_every_second_block_checkpointed_groups_by_the_choice",
        ),
    ),
    Mutant(
        "fast_path_label_says_full",
        "src/shardwise/memory/compose.py",
        '                path="fast",\n',
        '                path="full",\n',
        (
            "tests/unit/memory/test_fast_simulation.py::test_full_shard_with_every_second_block_checkpointed_groups_by_the_choice",
        ),
    ),
    Mutant(
        "simulation_keeps_dtensor_decisions_of_an_earlier_one",
        "src/shardwise/memory/fake.py",
        "        clear_native()\n",
        "        pass\n",
        (
            "tests/unit/memory/test_fast_simulation.py::test_simulations_under_tp_in_one_process_each_use_their_own_groups",
        ),
    ),
    Mutant(
        "fast_composes_a_run_too_short_to_save",
        "src/shardwise/memory/compose.py",
        "ONLY_IF_SHORTER and sum(run.lengths()) >= run.run:",
        "ONLY_IF_SHORTER and sum(run.lengths()) >= 10 * run.run:",
        (
            "tests/unit/memory/test_fast_simulation.py::test_a_run_too_short_to_save_is_traced_whole",
        ),
    ),
    Mutant(
        "plan_table_hides_the_path",
        "src/shardwise/memory/auto.py",
        '            sim += " " + r.simulation\n',
        '            sim += ""\n',
        (
            "tests/unit/memory/test_fast_simulation.py::test_the_plan_says_which_simulation_made_each_figure",
        ),
    ),
    Mutant(
        "simulate_full_flag_runs_the_fast_path",
        "src/shardwise/cli/plan.py",
        "            simulate=args.simulate or False,\n",
        "            simulate=bool(args.simulate),\n",
        (
            "tests/unit/memory/test_fast_simulation.py::test_the_plan_says_which_simulation_made_each_figure",
        ),
    ),
    Mutant(
        "bare_simulate_takes_the_next_word",
        "src/shardwise/cli/main.py",
        '            out[i] = "--simulate=fast"',
        "            pass",
        ("tests/unit/memory/test_fast_simulation.py::test_a_bare_simulate_never_takes_the_model",),
    ),
    Mutant(
        "bare_simulate_rewrites_a_scripts_flag",
        "src/shardwise/cli/main.py",
        '    if next((a for a in out if not a.startswith("-")), None) != "plan":',
        "    if False:",
        ("tests/unit/memory/test_fast_simulation.py::test_a_bare_simulate_never_takes_the_model",),
    ),
    # Issue 54: pipeline stages holding the same blocks (memory/stage_groups.py).
    Mutant(
        "stage_groups_interpolate_from_one_end",
        "src/shardwise/memory/stage_groups.py",
        "    return x + -((x - y) * at // span)\n",
        "    return x\n",
        (
            "tests/unit/memory/test_fast_simulation.py::test_pipeline_stages_holding_the_same_blocks_are_derived_exactly[1f1b-5-5-derived2]",
        ),
    ),
    Mutant(
        "stage_groups_key_ignores_the_blocks",
        "src/shardwise/memory/stage_groups.py",
        "(st.index == 0, st.index == last, st.modules, tuple(keys[b] for b in st.blocks))",
        "(st.index == 0, st.index == last, st.modules)",
        (
            "tests/unit/memory/test_fast_simulation.py::test_stages_holding_different_blocks_are_each_traced",
        ),
    ),
    Mutant(
        "stage_groups_gpipe_stages_not_copied",
        "src/shardwise/memory/stage_groups.py",
        "            if k in by_count:\n",
        "            if False:\n",
        (
            "tests/unit/memory/test_fast_simulation.py::test_pipeline_stages_holding_the_same_blocks_are_derived_exactly[gpipe-4-4-derived1]",
        ),
    ),
    Mutant(
        "adam_warm_up_makes_no_state",
        "src/shardwise/memory/tracking.py",
        "            optimizer._init_group(group, [], [], [], [], [], [])\n",
        "",
        (
            "tests/unit/memory/test_fast_simulation.py::test_adams_state_made_without_a_step_is_the_steps",
        ),
    ),
    Mutant(
        "trainer_save_model_barrier_unguarded",
        "src/shardwise/integrations/transformers.py",
        "        with guard(what):\n            dist.barrier()\n",
        "        if what:\n            dist.barrier()\n",
        (
            "tests/unit/integrations/test_transformers_contract.py::test_save_models_barriers_are_guarded_and_say_what_they_wait_for",
        ),
    ),
    # Issue 54: a plan's traces side by side in forked workers (memory/workers.py).
    Mutant(
        "workers_gather_answers_swapped",
        "src/shardwise/memory/workers.py",
        "zip(order, reports, strict=True)",
        "zip(order, reports[::-1], strict=True)",
        (
            "tests/unit/memory/test_workers.py::test_gather_asks_every_jobs_traces_together_and_answers_each_its_own",
            "tests/unit/memory/test_fast_simulation.py::test_traces_side_by_side_give_the_reports_of_traces_one_after_another",
        ),
    ),
    Mutant(
        "workers_child_keeps_the_parents_thread_pool",
        "src/shardwise/memory/workers.py",
        "    torch.set_num_threads(1)\n",
        "",
        (
            "tests/unit/memory/test_workers.py::test_a_child_runs_real_ops_after_the_parent_used_its_thread_pool",
        ),
    ),
    Mutant(
        "workers_child_exception_loses_its_type",
        "src/shardwise/memory/workers.py",
        "        raise payload from ChildTraceback(text)",
        "        raise RuntimeError(str(payload)) from ChildTraceback(text)",
        (
            "tests/unit/memory/test_workers.py::test_a_childs_exception_is_raised_here_with_its_type_and_traceback",
        ),
    ),
    Mutant(
        "workers_child_forks_again",
        "src/shardwise/memory/workers.py",
        'return sys.platform.startswith("linux") and not _IN_CHILD',
        'return sys.platform.startswith("linux")',
        ("tests/unit/memory/test_workers.py::test_a_forked_child_does_not_fork_again",),
    ),
    Mutant(
        "workers_timeout_never_fires",
        "src/shardwise/memory/workers.py",
        "            if not ready and left <= 0:\n",
        "            if not ready and left < -1e9:\n",
        (
            "tests/unit/memory/test_workers.py::test_a_trace_over_the_timeout_is_named_and_every_child_killed",
        ),
    ),
    Mutant(
        "workers_first_trace_not_run_here",
        "src/shardwise/memory/workers.py",
        "    if len(jobs) > workers:\n",
        "    if False:\n",
        ("tests/unit/memory/test_workers.py::test_answers_in_order_whatever_the_workers",),
    ),
    Mutant(
        "workers_background_runs_in_this_process",
        "src/shardwise/memory/workers.py",
        "    if not can_fork():\n        return fn\n",
        "    return fn\n",
        (
            "tests/unit/memory/test_workers.py::test_in_background_runs_beside_this_process_and_answers_later",
        ),
    ),
    Mutant(
        "workers_default_not_capped",
        "src/shardwise/memory/workers.py",
        "    return min(cpus, MAX_DEFAULT_WORKERS)\n",
        "    return cpus\n",
        (
            "tests/unit/memory/test_workers.py::test_workers_default_to_this_process_cpus_at_most_four",
        ),
    ),
    Mutant(
        "workers_children_start_after_the_warm_up_trace",
        "src/shardwise/memory/workers.py",
        "            for _ in range(workers):\n                start(*waiting.pop(0))\n            results[first[0]] = run(first[1])\n",
        "            results[first[0]] = run(first[1])\n            for _ in range(workers):\n                start(*waiting.pop(0))\n",
        (
            "tests/unit/memory/test_workers.py::test_the_first_children_start_beside_the_parents_trace_and_the_rest_after_it",
        ),
    ),
    Mutant(
        "workers_a_dead_child_is_not_named",
        "src/shardwise/memory/workers.py",
        "        raise RuntimeError(died.format(code=proc.exitcode)) from None",
        "        raise EOFError(died.format(code=proc.exitcode)) from None",
        (
            "tests/unit/memory/test_workers.py::test_a_child_that_dies_is_named",
            "tests/unit/memory/test_workers.py::test_in_background_raises_the_childs_error_and_names_a_death_or_a_timeout",
        ),
    ),
)


def _copy_tree(dest: Path) -> None:
    """The tracked files as they are in the working tree (uncommitted edits included)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    venv = ROOT / ".venv"
    if venv.exists():
        (dest / ".venv").symlink_to(venv)


def _apply(copy: Path, mutant: Mutant) -> str | None:
    """Edit the copy; the reason it could not be applied, or None."""
    path = copy / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"the text to replace occurs {count} times in {mutant.path} (expected once)"
    path.write_text(text.replace(mutant.old, mutant.new))
    return None


def _run_tests(copy: Path, tests: tuple[str, ...], log: Path) -> int:
    env = dict(os.environ, PYTHONPATH=str(copy / "src"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider"]
    cmd += ["-m", "not slow", *tests]  # the marker lifts pyproject's exclusions
    with log.open("w") as out:
        return subprocess.run(
            cmd, cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def _uncollected(copy: Path, tests: tuple[str, ...]) -> list[str]:
    """The test ids that collect nothing under the marker the run uses (a test renamed, a
    parametrisation dropped, a tier's marker that deselects it): such a mutant is an error,
    since tests that never ran cannot have passed against it."""
    env = dict(os.environ, PYTHONPATH=str(copy / "src"), PYTHONDONTWRITEBYTECODE="1")

    def collect(ids: tuple[str, ...]) -> tuple[int, list[str]]:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        out = subprocess.run(
            [*cmd, "-m", "not slow", *ids], cwd=copy, env=env, capture_output=True, text=True
        )
        return out.returncode, [line.strip() for line in out.stdout.splitlines() if "::" in line]

    rc, collected = collect(tests)
    if rc not in (0, 5):  # an id pytest cannot find fails the whole collection: one by one
        collected = [c for t in tests for c in collect((t,))[1]]
    return [
        t for t in tests if not any(c == t or c.startswith((f"{t}[", f"{t}::")) for c in collected)
    ]


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="run this mutant (repeat)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--baseline", action="store_true", help="first run each mutant's tests unmutated"
    )
    parser.add_argument("--verbose", action="store_true", help="show each run's last lines")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    unknown = sorted(set(args.only) - names)
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; known: {sorted(names)}")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}\n    " + "\n    ".join(m.tests))
        return 0
    verdicts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="shardwise-mutants-") as tmp:
        work = Path(tmp)
        if args.baseline:
            base = work / "baseline"
            _copy_tree(base)
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            rc = _run_tests(base, tests, work / "baseline.log")
            print(f"baseline: {'pass' if rc == 0 else 'FAIL'}", flush=True)
            if rc != 0:
                print(_tail(work / "baseline.log", 40))
                return 2
        for m in chosen:
            copy = work / m.name
            _copy_tree(copy)
            start = time.monotonic()
            problem = _apply(copy, m)
            if problem is not None:
                verdicts[m.name] = "stale"
                print(f"{m.name}: stale ({problem})", flush=True)
                continue
            log = work / f"{m.name}.log"
            missing = _uncollected(copy, m.tests)
            if missing:
                log.write_text(f"collects nothing: {', '.join(missing)}\n")
                verdict = f"error (collects nothing: {', '.join(missing)})"
            else:
                rc = _run_tests(copy, m.tests, log)
                verdict = "killed" if rc == 1 else "survived" if rc == 0 else f"error (pytest {rc})"
            verdicts[m.name] = verdict
            print(f"{m.name}: {verdict} ({time.monotonic() - start:.0f} s)", flush=True)
            if args.verbose or verdict != "killed":
                print(_tail(log))
            shutil.rmtree(copy, ignore_errors=True)
    killed = sum(v == "killed" for v in verdicts.values())
    print(f"{killed} killed, {len(verdicts) - killed} not killed, of {len(verdicts)}")
    return 0 if killed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
