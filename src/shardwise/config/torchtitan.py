"""A torchtitan job configuration (its TOML file, or the dict of its sections, e.g.
`dataclasses.asdict` of a `Trainer.Config`), read as it is: every key becomes what it
means in shardwise, or is refused with the reason.

Owns: `translate_torchtitan`, reading the sections that describe the layout and the
step into a `Translation` (config/translation.py): `parallelism` (replicate × shard ×
tp × pp × ep, resharding, the pipeline schedule), `training` (mixed precision, clipping,
local batch, steps, CPU offload), `activation_checkpoint`, `compile` and `optimizer`. A
section about torchtitan's own job (its logging, checkpoint folder, profiler, model
registry, data) changes no training value and is listed as having no effect; a feature
shardwise does not build (float8, context parallel, torchtitan's LR schedule) is refused.

Must not: import torchtitan, or read the environment.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shardwise.config.foreign_checks import check_kind, check_suffix, unknown_key
from shardwise.config.run_file import ConfigError
from shardwise.config.torchtitan_batches import microbatches
from shardwise.config.translation import Row, Translation, Verdict

__all__ = ["translate_torchtitan"]

_OWN_SECTIONS = {
    "job": "torchtitan's job description",
    "metrics": "torchtitan's logging; shardwise logs with runner.log_every and tensorboard",
    "profiling": "torchtitan's profiler",
    "checkpoint": "torchtitan's checkpoint folder; shardwise's is runner.checkpoint_dir",
    "comm": "torchtitan's collective timeouts; shardwise's wait timeouts are its own",
    "model": "the model is the one your script builds",
    "validation": "torchtitan's validation loop",
    "memory_estimation": "torchtitan's estimator; shardwise plan --simulate is shardwise's",
    "experimental": "torchtitan's experiment registry",
    "debug": "torchtitan's debug switches (seed: runner.seed)",
    "dataloader": "the data is the one your script loads",
}
_REFUSED_SECTIONS = {
    "float8": "float8 training is not built",
    "mx": "MX formats are not built",
    "quantize": "quantized training is not built",
    "fault_tolerance": "torchft is not built (shardwise resumes from checkpoints)",
}
_SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved_1f1b"}


def translate_torchtitan(
    source: str | Path | Mapping[str, object], *, world: int | None = None
) -> Translation:
    """Read a torchtitan config (see the module docstring). `world`, the number of ranks,
    resolves a shard degree of -1 beside replicas (torchtitan gives the shard groups the
    ranks the other degrees leave)."""
    data = _load(source)
    check_kind(
        data, "torchtitan", "the config given" if isinstance(source, Mapping) else str(source)
    )
    out = Translation(source="torchtitan")
    handlers: dict[str, Callable[[Translation, dict[str, Any]], None]] = {
        "parallelism": functools.partial(_parallelism, world=world),
        "training": _training,
        "activation_checkpoint": _checkpointing,
        "compile": _compile,
        "optimizer": _optimizer,
        "lr_scheduler": _scheduler,
    }
    for section, block in data.items():
        if section in handlers:
            if not isinstance(block, Mapping):
                out.rows.append(Row(section, block, "-", "refused", "a section is a table"))
                continue
            handlers[section](out, dict(block))
        elif section in _OWN_SECTIONS:
            out.rows.append(Row(section, "...", "-", "no effect", _OWN_SECTIONS[section]))
        elif section in _REFUSED_SECTIONS:
            out.rows.append(Row(section, "...", "-", "refused", _REFUSED_SECTIONS[section]))
        else:
            known = [*handlers, *_OWN_SECTIONS, *_REFUSED_SECTIONS]
            why = unknown_key(section, known, "a torchtitan", noun="section")
            out.rows.append(Row(section, "...", "-", "refused", why))
    microbatches(out, data)
    _defaults(out)
    return out


def _rest_of_the_ranks(out: Translation, given: dict[str, Any], world: int | None) -> bool:
    """Whether the shard groups beside replicas can take the ranks the other degrees leave,
    as torchtitan's shard degree -1 does; a refused row names what is missing otherwise
    (shardwise's own dp_shard=-1 is a node's ranks: another layout)."""
    key = "parallelism.data_parallel_shard_degree"
    degrees = ("data_parallel_replicate_degree", "tensor_parallel_degree",
               "pipeline_parallel_degree", "context_parallel_degree")  # fmt: skip
    others = math.prod(int(given.get(k, 1)) for k in degrees)
    named = " x ".join(f"{k.split('_degree')[0]} {given.get(k, 1)}" for k in degrees)
    if world is None:
        why = (f"-1 beside replicas is the ranks {named} leave, and the world size is not "
               "known here: give the degree, or translate with world= (shardwise run "
               "--from passes it)")  # fmt: skip
    elif world % others:
        why = f"-1 beside replicas: world {world} does not divide by {named} = {others}"
    else:
        return True
    out.rows.append(Row(key, given.get("data_parallel_shard_degree", -1), "-", "refused", why))
    return False


_OPTIMIZER_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("name", "adamw"),
    ("lr", 8e-4),
    ("betas", (0.9, 0.95)),
    ("eps", 1e-8),
    ("weight_decay", 0.1),
)
"""torchtitan's AdamW where its [optimizer] section is silent (its 2025 releases' Optimizer
defaults); shardwise's own defaults differ in lr (3e-4) and weight_decay (0)."""


def _defaults(out: Translation) -> None:
    """torchtitan's defaults where the file is silent and shardwise's differ: parameters
    gathered in bf16 (reduced in fp32), clipping at 1.0, its AdamW's hyperparameters, and
    its lr schedule (warm-up then linear decay), which shardwise does not build."""
    refused = any(r.key == "optimizer.name" and r.verdict == "refused" for r in out.rows)
    for key, value in _OPTIMIZER_DEFAULTS if not refused else ():
        if key not in out.optimizer:
            out.optimizer[key] = value
            shown = f"'{value}'" if isinstance(value, str) else value
            out.rows.append(Row(f"optimizer.{key}", "(not given)", f"optimizer.{key}={shown}",
                                "exact", "torchtitan's default"))  # fmt: skip
    if "mixed_precision" not in out.parallel:
        out.parallel["mixed_precision"] = "bf16"
        out.rows.append(
            Row(
                "training.mixed_precision_param",
                "(not given)",
                "parallel.mixed_precision='bf16'",
                "exact",
                "torchtitan's default, bfloat16",
            )
        )
    if not any(r.key == "lr_scheduler" for r in out.rows):
        out.rows.append(
            Row(
                "lr_scheduler",
                "(not given)",
                "a constant lr",
                "differs",
                f"torchtitan's default warms up over {_WARMUP_STEPS} steps, then decays "
                "linearly to 0 over the rest; give shardwise's scheduler section for a schedule",
            )
        )
    if "max_grad_norm" not in out.train:
        out.train["max_grad_norm"] = 1.0
        out.rows.append(
            Row(
                "training.max_norm",
                "(not given)",
                "train.max_grad_norm=1.0",
                "exact",
                "torchtitan's default",
            )
        )


def _load(source: str | Path | Mapping[str, object]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    check_suffix(path, "torchtitan")
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the torchtitan config {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not TOML: {exc}") from None


_KNOWN = {
    "parallelism": (
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "fsdp_reshard_after_forward", "enable_sequence_parallel",
        "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size", "num_pp_microbatches",
        "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage", "module_fqns_per_model_part",
        "context_parallel_degree", "expert_tensor_parallel_degree", "expert_parallel_degree",
        "enable_async_tensor_parallel", "enable_fsdp_symm_mem", "context_parallel_load_balancer",
        "context_parallel_rotate_method", "spmd_backend", "pipeline_parallel_schedule_csv",
        "disable_loss_parallel",
    ),
    "training": (
        "mixed_precision_param", "mixed_precision_reduce", "max_norm", "local_batch_size",
        "batch_size", "steps", "enable_cpu_offload", "dtype", "seq_len", "max_context_length",
        "dataset", "dataset_path", "gc_freq", "gc_debug", "disable_cuda_graphs",
        "mixed_precision_output",
    ),
    "optimizer": ("name", "beta1", "beta2", "lr", "eps", "weight_decay", "implementation"),
    "activation_checkpoint": (
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
        "determinism_check", "debug",
    ),
    "compile": ("enable", "backend", "components"),
    "lr_scheduler": ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor", "lr_min"),
}  # fmt: skip
"""The keys of each section shardwise reads (what a misspelt key is compared with)."""


def _unknown(out: Translation, key: str, value: object) -> None:
    section, name = key.split(".", 1)
    article = "an" if section[0] in "aeio" else "a"
    why = unknown_key(name, _KNOWN[section], f"{article} [{section}]")
    out.rows.append(Row(key, value, "-", "refused", why))


def _parallelism(out: Translation, p: dict[str, Any], world: int | None = None) -> None:
    given = dict(p)
    replicate = int(p.pop("data_parallel_replicate_degree", 1))
    shard = int(p.pop("data_parallel_shard_degree", -1))
    tp = int(p.pop("tensor_parallel_degree", 1))
    pp = int(p.pop("pipeline_parallel_degree", 1))
    if min(replicate, tp, pp) < 1 or shard == 0 or shard < -1:
        why = ("each degree is a whole number >= 1, and data_parallel_shard_degree may also be "
               "-1 (the rest of the ranks), as torchtitan requires")  # fmt: skip
        named = f"replicate {replicate} x shard {shard} x tp {tp} x pp {pp}"
        out.rows.append(Row("parallelism.*_degree", named, "-", "refused", why))
        return
    if replicate > 1 and shard == -1 and not _rest_of_the_ranks(out, given, world):
        return
    if replicate > 1 and shard == -1:
        assert world is not None  # _rest_of_the_ranks refused it otherwise
        shard = world // (replicate * tp * pp * int(given.get("context_parallel_degree", 1)))
    if replicate > 1 and shard == 1:
        strategy, why = "ddp", "replication only: DDP, as torchtitan"
    elif replicate > 1:
        strategy, why = "hybrid_shard", "HSDP: replicas of shard groups, as torchtitan"
    else:
        strategy, why = "full_shard", "FSDP over the ranks, as torchtitan"
    reshard = p.pop("fsdp_reshard_after_forward", "default")
    if strategy != "ddp" and (reshard == "never" or (reshard == "default" and pp > 1)):
        strategy = "shard_grad_op" if strategy == "full_shard" else "hybrid_shard_zero2"
        why += "; parameters kept gathered after forward (torchtitan's default under pp)"
    out.parallel["strategy"] = strategy
    if shard > 1 and strategy != "ddp":
        out.parallel["dp_shard"] = shard
    degrees = f"replicate {replicate} x shard {shard}"
    out.rows.append(
        Row(
            "parallelism.data_parallel_*_degree",
            degrees,
            f"parallel.strategy='{strategy}'",
            "exact",
            why,
        )
    )
    out.rows.append(
        Row("parallelism.fsdp_reshard_after_forward", reshard, "read with the strategy", "exact")
    )
    if tp > 1:
        out.parallel["tp"] = tp
        sp = bool(p.pop("enable_sequence_parallel", True))
        out.parallel["sequence_parallel"] = sp
        out.rows.append(
            Row(
                "parallelism.tensor_parallel_degree",
                tp,
                f"parallel.tp={tp}, sequence_parallel={sp}",
                "exact",
                "torchtitan turns sequence parallel on by default",
            )
        )
        if "enable_sequence_parallel" in given:
            value = given["enable_sequence_parallel"]
            out.rows.append(Row("parallelism.enable_sequence_parallel", value,
                                f"parallel.sequence_parallel={sp}", "exact"))  # fmt: skip
    elif "tensor_parallel_degree" in given:
        out.rows.append(Row("parallelism.tensor_parallel_degree", tp, "parallel.tp=1", "exact"))
    if pp > 1 or "pipeline_parallel_degree" in given:
        if pp > 1:
            out.parallel["pp"] = pp
        out.rows.append(
            Row("parallelism.pipeline_parallel_degree", pp, f"parallel.pp={pp}", "exact")
        )
    for key, value in p.items():
        where = f"parallelism.{key}"
        if key == "enable_sequence_parallel":
            out.rows.append(Row(where, value, "-", "no effect", "tp is 1"))
        elif key == "pipeline_parallel_schedule":
            if value not in _SCHEDULES:
                out.rows.append(
                    Row(where, value, "-", "refused", f"not built; {sorted(_SCHEDULES)} are")
                )
                continue
            out.parallel["pp_schedule"] = _SCHEDULES[value]
            out.rows.append(
                Row(where, value, f"parallel.pp_schedule='{_SCHEDULES[value]}'", "exact")
            )
        elif key in ("pipeline_parallel_microbatch_size", "num_pp_microbatches"):
            pass  # read in _microbatches, once the local batch is known
        elif key in (
            "pipeline_parallel_first_stage_less_layers",
            "pipeline_parallel_last_stage_less_layers",
            "pipeline_parallel_layers_per_stage",
            "module_fqns_per_model_part",
        ):
            verdict: Verdict = "no effect" if pp == 1 else "differs"
            why = (
                "pp is 1"
                if pp == 1
                else (
                    "shardwise's automatic split balances the blocks (pp_split names its cut "
                    "points)"
                )
            )
            out.rows.append(Row(where, value, "-", verdict, why))
        elif key == "context_parallel_degree" and int(value) > 1:
            out.parallel["cp"] = int(value)
            out.rows.append(Row(where, value, f"parallel.cp={value}", "differs",
                                "Ulysses (an all-to-all of heads) in place of torch's ring: "
                                "the same attention; the heads must divide by cp"))  # fmt: skip
        elif key in ("context_parallel_degree", "expert_tensor_parallel_degree"):
            if int(value) > 1:
                out.rows.append(Row(where, value, "-", "refused", "not built"))
            else:
                out.rows.append(Row(where, value, "-", "exact", "1: none"))
        elif key == "expert_parallel_degree":
            if int(value) > 1:
                out.parallel["ep"] = int(value)
            out.rows.append(Row(where, value, f"parallel.ep={value}", "exact"))
        elif key in (
            "enable_async_tensor_parallel",
            "enable_fsdp_symm_mem",
            "context_parallel_load_balancer",
            "context_parallel_rotate_method",
            "spmd_backend",
            "pipeline_parallel_schedule_csv",
            "disable_loss_parallel",
        ):
            why = "a kernel or communication choice; the same math"
            if key == "disable_loss_parallel" and not value and tp > 1:
                out.parallel["loss_parallel"] = True
                why = "torchtitan computes the loss on tp-split logits by default"
                out.rows.append(Row(where, value, "parallel.loss_parallel=True", "exact", why))
                continue
            out.rows.append(Row(where, value, "-", "no effect", why))
        else:
            _unknown(out, where, value)


def _training(out: Translation, t: dict[str, Any]) -> None:
    for key, value in t.items():
        where = f"training.{key}"
        if key == "mixed_precision_param":
            preset = "bf16" if value == "bfloat16" else "fp32" if value == "float32" else None
            if preset is None:
                out.rows.append(Row(where, value, "-", "refused", "bfloat16 or float32"))
                continue
            out.parallel["mixed_precision"] = preset
            out.rows.append(
                Row(
                    where,
                    value,
                    f"parallel.mixed_precision='{preset}'",
                    "exact",
                    "parameters gathered in it, reduced in fp32, as torchtitan",
                )
            )
        elif key == "mixed_precision_reduce":
            reduce: Verdict = "exact" if value == "float32" else "refused"
            out.rows.append(Row(where, value, "gradients reduced in fp32", reduce))
        elif key == "max_norm":
            norm = float(value) if value else None
            out.train["max_grad_norm"] = norm
            out.rows.append(Row(where, value, f"train.max_grad_norm={norm}", "exact"))
        elif key in ("local_batch_size", "batch_size"):
            out.runner["batch_size"] = int(value)
            out.rows.append(Row(where, value, f"runner.batch_size={value}", "exact"))
        elif key == "steps":
            out.runner["max_steps"] = int(value)
            out.runner["max_epochs"] = None
            out.rows.append(Row(where, value, f"runner.max_steps={value}", "exact"))
        elif key == "enable_cpu_offload":
            out.parallel["cpu_offload"] = bool(value)
            out.rows.append(Row(where, value, f"parallel.cpu_offload={bool(value)}", "exact"))
        elif key == "dtype" and value != "float32":
            out.rows.append(
                Row(
                    where,
                    value,
                    "-",
                    "refused",
                    "parameters stored in bf16 without fp32 masters are not built",
                )
            )
        elif key in (
            "dtype",
            "seq_len",
            "max_context_length",
            "dataset",
            "dataset_path",
            "gc_freq",
            "gc_debug",
            "disable_cuda_graphs",
            "mixed_precision_output",
        ):
            out.rows.append(
                Row(
                    where,
                    value,
                    "-",
                    "no effect",
                    "data, memory housekeeping or the default fp32 storage",
                )
            )
        else:
            _unknown(out, where, value)


def _checkpointing(out: Translation, a: dict[str, Any]) -> None:
    mode = a.pop("mode", "none")
    if "selective_ac_option" in a and mode != "selective":
        value = a.pop("selective_ac_option")
        why = "read with mode 'selective' only"
        out.rows.append(Row("activation_checkpoint.selective_ac_option", value, "-", "no effect",
                            why))  # fmt: skip
    if "selective_ac_option" in a:
        value = a["selective_ac_option"]
        out.rows.append(Row("activation_checkpoint.selective_ac_option", value,
                            "read with activation_checkpoint.mode", "exact"))  # fmt: skip
    option = a.pop("selective_ac_option", "2")
    if mode in ("none", "full"):
        out.parallel["activation_checkpointing"] = mode
        out.rows.append(
            Row(
                "activation_checkpoint.mode",
                mode,
                f"parallel.activation_checkpointing='{mode}'",
                "exact",
            )
        )
    elif mode == "selective" and str(option).isdigit():
        every = f"every_{int(option)}"
        out.parallel["activation_checkpointing"] = every
        out.rows.append(
            Row(
                "activation_checkpoint.mode",
                f"selective, {option}",
                f"parallel.activation_checkpointing='{every}'",
                "exact",
                "every k-th block, as torchtitan's layer-selective option",
            )
        )
    else:
        out.rows.append(
            Row(
                "activation_checkpoint.mode",
                f"{mode}, {option}",
                "-",
                "refused",
                "per-op selective checkpointing is not built ('full' or 'every_<k>' blocks are)",
            )
        )
    for key, value in a.items():
        where = f"activation_checkpoint.{key}"
        if key not in _KNOWN["activation_checkpoint"]:
            _unknown(out, where, value)
            continue
        why = "a detail of torchtitan's own checkpointing wrapper"
        out.rows.append(Row(where, value, "-", "no effect", why))


def _compile(out: Translation, c: dict[str, Any]) -> None:
    enable = bool(c.pop("enable", False))
    if "backend" in c:
        value = c["backend"]
        became = f"parallel.compile={str(value)!r}" if enable else "-"
        verdict: Verdict = "exact" if enable else "no effect"
        out.rows.append(Row("compile.backend", value, became, verdict,
                            "" if enable else "compile is off"))  # fmt: skip
    backend = str(c.pop("backend", "inductor"))
    out.parallel["compile"] = backend if enable else False
    out.rows.append(
        Row(
            "compile.enable",
            enable,
            f"parallel.compile={out.parallel['compile']!r}",
            "exact",
            "each planned block compiled",
        )
    )
    for key, value in c.items():
        if key not in _KNOWN["compile"]:
            _unknown(out, f"compile.{key}", value)
            continue
        why = "shardwise compiles the planned blocks"
        out.rows.append(Row(f"compile.{key}", value, "-", "no effect", why))


def _optimizer(out: Translation, o: dict[str, Any]) -> None:
    name = str(o.pop("name", "AdamW"))
    if name.lower() not in ("adamw", "adam"):
        out.rows.append(Row("optimizer.name", name, "-", "refused", "Adam and AdamW are built"))
        return
    out.optimizer["name"] = name.lower()
    out.rows.append(Row("optimizer.name", name, f"optimizer.name='{name.lower()}'", "exact"))
    if "beta1" in o or "beta2" in o:  # torchtitan's defaults for the one not given
        betas = (float(o.pop("beta1", 0.9)), float(o.pop("beta2", 0.95)))
        out.optimizer["betas"] = betas
        out.rows.append(Row("optimizer.beta1, beta2", betas, f"optimizer.betas={betas}", "exact"))
    for key, value in o.items():
        where = f"optimizer.{key}"
        if key in ("lr", "eps", "weight_decay"):
            out.optimizer[key] = float(value)
            out.rows.append(Row(where, value, f"optimizer.{key}={value}", "exact"))
        elif key == "implementation":
            out.rows.append(Row(where, value, "-", "no effect", "a kernel choice; the same step"))
        else:
            _unknown(out, where, value)


_WARMUP_STEPS = 200
"""torchtitan's lr_scheduler.warmup_steps where the file is silent; its decay_ratio where
silent is None: a linear decay to 0 over all the steps after the warm-up."""


def _scheduler(out: Translation, s: dict[str, Any]) -> None:
    for key, value in s.items():
        where = f"lr_scheduler.{key}"
        if key not in _KNOWN["lr_scheduler"]:
            _unknown(out, where, value)
        else:
            out.rows.append(Row(where, value, "read with lr_scheduler (its row below)", "exact"))
    # torchtitan: warm-up of warmup_steps (200 where silent), then decay over the last
    # decay_ratio of the steps, or over all the rest where decay_ratio is silent (None):
    # the lr is constant only with no warm-up and a decay_ratio of 0.
    warmup = int(s.get("warmup_steps", _WARMUP_STEPS))
    decay = s.get("decay_ratio")
    if warmup == 0 and decay is not None and float(decay) == 0:
        out.rows.append(Row("lr_scheduler", s, "a constant lr", "exact"))
        return
    out.rows.append(
        Row(
            "lr_scheduler",
            s,
            "-",
            "refused",
            "torchtitan's warm-up, stable, "
            "decay schedule is not built; give warmup_steps = 0 and decay_ratio = 0.0 "
            "(a constant lr), or use shardwise's scheduler section",
        )
    )
