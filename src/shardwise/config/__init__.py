"""What users write: the typed configuration, with no process group and no environment.

`ParallelConfig` (parallel.py) with the foreign vocabulary it accepts (vocabulary.py) and
shardwise's own strategy names (names.py); `Precision` (precision.py); `TrainConfig` and
`RunnerConfig` (training.py); and the run file that holds them all (run_file.py).
The fields' types are exported too: each closed set is a `Literal` (`StrategySetting`,
`PrecisionName`, `FrozenPolicy`, `NonFinitePolicy`, `OptimizerName`, ...).
"""

from shardwise.config.accelerate import translate_accelerate
from shardwise.config.budget import parse_memory_budget
from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.names import (
    STRATEGIES,
    StrategyName,
    StrategySetting,
    closest,
    normalize_strategy,
)
from shardwise.config.optimizer import FallbackConfig
from shardwise.config.parallel import (
    FROZEN_POLICIES,
    ActivationCheckpointing,
    BackwardPrefetchName,
    FrozenPolicy,
    MemoryBudget,
    ParallelConfig,
    UserMesh,
    WrapPolicy,
    resolve_activation_checkpointing,
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_forward_prefetch,
    validate_parallel_config,
)
from shardwise.config.precision import (
    PRESETS,
    Precision,
    PrecisionName,
    PrecisionSetting,
    parse_dtype,
    resolve_precision,
)
from shardwise.config.run_file import (
    Config,
    ConfigError,
    OptimizerConfig,
    OptimizerName,
    SchedulerConfig,
    SchedulerName,
    apply_overrides,
    dump_config,
    load_config,
    parse_override,
    reference_markdown,
    update_reference,
)
from shardwise.config.torchtitan import translate_torchtitan
from shardwise.config.training import NonFinitePolicy, RunnerConfig, TrainConfig
from shardwise.config.translation import Translation
from shardwise.config.vocabulary import FOREIGN_WORDS, PLACEMENT_WORDS, translate

__all__ = [
    "FOREIGN_WORDS",
    "FROZEN_POLICIES",
    "PLACEMENT_WORDS",
    "PRESETS",
    "STRATEGIES",
    "ActivationCheckpointing",
    "BackwardPrefetchName",
    "Config",
    "ConfigError",
    "FallbackConfig",
    "FrozenPolicy",
    "MemoryBudget",
    "NonFinitePolicy",
    "OptimizerConfig",
    "OptimizerName",
    "ParallelConfig",
    "Precision",
    "PrecisionName",
    "PrecisionSetting",
    "RunnerConfig",
    "SchedulerConfig",
    "SchedulerName",
    "StrategyName",
    "StrategySetting",
    "TrainConfig",
    "Translation",
    "UserMesh",
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
    "translate_accelerate",
    "translate_deepspeed",
    "translate_torchtitan",
    "update_reference",
    "validate_parallel_config",
]
