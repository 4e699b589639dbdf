"""What users write: the typed configuration, with no process group and no environment.

`ParallelConfig` (parallel.py) with the foreign vocabulary it accepts (vocabulary.py) and
shardwise's own strategy names (names.py); `Precision` (precision.py); `TrainConfig` and
`RunnerConfig` (training.py); and the run file that holds them all (run_file.py).
"""

from shardwise.config.names import STRATEGIES, StrategyName, closest, normalize_strategy
from shardwise.config.parallel import (
    FROZEN_POLICIES,
    ParallelConfig,
    WrapPolicy,
    parse_memory_budget,
    resolve_activation_checkpointing,
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_forward_prefetch,
    validate_parallel_config,
)
from shardwise.config.precision import PRESETS, Precision, parse_dtype, resolve_precision
from shardwise.config.run_file import (
    Config,
    ConfigError,
    OptimizerConfig,
    SchedulerConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_override,
    reference_markdown,
    update_reference,
)
from shardwise.config.training import RunnerConfig, TrainConfig
from shardwise.config.vocabulary import FOREIGN_WORDS, PLACEMENT_WORDS, translate

__all__ = [
    "FOREIGN_WORDS",
    "FROZEN_POLICIES",
    "PLACEMENT_WORDS",
    "PRESETS",
    "STRATEGIES",
    "Config",
    "ConfigError",
    "OptimizerConfig",
    "ParallelConfig",
    "Precision",
    "RunnerConfig",
    "SchedulerConfig",
    "StrategyName",
    "TrainConfig",
    "WrapPolicy",
    "apply_overrides",
    "closest",
    "dump_config",
    "load_config",
    "normalize_strategy",
    "parse_dtype",
    "parse_memory_budget",
    "parse_override",
    "reference_markdown",
    "resolve_activation_checkpointing",
    "resolve_backward_prefetch",
    "resolve_cpu_offload",
    "resolve_forward_prefetch",
    "resolve_precision",
    "translate",
    "update_reference",
    "validate_parallel_config",
]
