"""The typed schema for parallelism: `ParallelConfig` and the value translations it needs.

Owns: field definitions, the accepted spellings of each field (our names, torch's
`ShardingStrategy`, FSDP1's `CPUOffload`/`BackwardPrefetch`), and validation that does
not need to know the world size. Errors are raised when the config is built, before
any process group exists.

Must not: read environment variables (`ParallelConfig.from_env` calls the reader that
parallelize/from_env.py registers in LAUNCHED, as `wrap` reads them), touch torch.distributed,
or know the world size
(that is distributed/mesh.py's job, when the config meets a running job).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

from shardwise.config.budget import parse_memory_budget
from shardwise.config.context import CPStyle, validate_cp
from shardwise.config.experts import validate_ep
from shardwise.config.names import StrategySetting, closest, normalize_strategy
from shardwise.config.pipeline import PPSchedule, PPSplit, stages_per_rank, validate_pp
from shardwise.config.precision import Precision, PrecisionSetting, resolve_precision
from shardwise.config.tensor_parallel import TPPlan, validate_tp
from shardwise.config.vocabulary import FOREIGN_WORDS, integral, policy_from_dict, translate

# The fields' types name shardwise's own words and torch's current objects. Other systems'
# spellings and FSDP1's objects (ShardingStrategy, BackwardPrefetch, CPUOffload,
# MixedPrecision, 'FULL_SHARD', 'bf16-mixed', ...) are translated at run time (see
# vocabulary.py) but not typed: typed code is steered to the one spelling the checker knows.
# The str arms come first: run_file.py tries them in order when it reads a file, and the
# field's own validation parses strings.
WrapPolicy = (
    str | Iterable[type[nn.Module] | str] | Callable[..., bool] | Mapping[str, object] | None
)
"""`auto_wrap_policy`: a registered policy's name or 're:<regex>', module classes or class
names, a callable, or mmengine's `dict(type=..., ...)` form (the form config files use)."""
BackwardPrefetchName = Literal["pre", "post"]
"""`backward_prefetch` by name: FSDP2 prefetches before each unit's gradients ('post' warns)."""
FrozenPolicy = Literal["split", "warn", "error"]
"""What `frozen_policy` does with a unit mixing frozen and trainable parameters."""
ActivationCheckpointing = str | bool | int | None
"""'none', 'full', 'every_<k>' or 'auto'; an int k (every k-th block); True (every block),
False or None (none)."""
MemoryBudget = str | int | float | None
"""Bytes (int), a size ('70GiB'), a percentage ('85%'), a fraction in (0, 1], or None."""
UserMesh = DeviceMesh | ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None
"""`device_mesh`: your own mesh, one process group, or (shard group, replicate group)."""


def resolve_cpu_offload(value: object) -> CPUOffloadPolicy | None:
    """FSDP2 offload policy for `cpu_offload`: bool, CPUOffloadPolicy or FSDP1 CPUOffload."""
    if value is None or value is False:
        return None
    if value is True:
        return CPUOffloadPolicy()
    if isinstance(value, CPUOffloadPolicy):
        return value
    if isinstance(value, OffloadPolicy):  # torch's "no offload" base policy
        return None
    if isinstance(value, CPUOffload):
        return CPUOffloadPolicy() if value.offload_params else None
    raise TypeError(
        f"ParallelConfig.cpu_offload got {type(value).__name__} ({value!r}); expected a bool, "
        "torch's CPUOffloadPolicy, or FSDP1's CPUOffload."
    )


def resolve_backward_prefetch(value: object) -> tuple[int, str | None]:
    """Backward prefetch depth for FSDP2, and a warning where FSDP1's meaning has no twin.

    FSDP2 always prefetches the next unit in backward (depth 1, issued before the
    current unit's gradient computation — FSDP1's BACKWARD_PRE); deeper explicit
    prefetch is available, turning it off is not.
    """
    name = getattr(value, "name", value)  # FSDP1 BackwardPrefetch members
    if isinstance(name, bool):
        raise TypeError(
            f"ParallelConfig.backward_prefetch={value!r}: use 'pre', 'post', None or a depth >= 1."
        )
    if isinstance(name, int):
        if name < 1:
            raise ValueError(
                f"ParallelConfig.backward_prefetch={name} must be a depth >= 1 "
                "(or 'pre', 'post', None). FSDP2 cannot disable backward prefetch."
            )
        return name, None
    if name is None:
        return 1, (
            "ParallelConfig.backward_prefetch=None has no FSDP2 equivalent: FSDP2 always "
            "prefetches one unit ahead in backward. Using depth 1."
        )
    if isinstance(name, str):
        key = name.lower().removeprefix("backward_")
        if key == "pre":
            return 1, None
        if key == "post":
            return 1, (
                "ParallelConfig.backward_prefetch='post' (FSDP1 BACKWARD_POST) has no exact "
                "FSDP2 equivalent; using FSDP2's pre-gradient prefetch of depth 1."
            )
    raise ValueError(
        f"ParallelConfig.backward_prefetch={value!r} is not valid. Use 'pre', 'post', None, "
        "a depth >= 1, or FSDP1's BackwardPrefetch."
    )


def resolve_forward_prefetch(value: object) -> int:
    """Forward prefetch depth: False/0 = none (FSDP2's default), True = 1, or a depth."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        f"ParallelConfig.forward_prefetch={value!r} is not valid. Use a bool or a depth >= 0."
    )


FROZEN_POLICIES: tuple[FrozenPolicy, ...] = get_args(FrozenPolicy)


def resolve_activation_checkpointing(value: object) -> int:
    """Every how many planned blocks to checkpoint: 0 none, 1 all, k every k-th."""
    if value is None or value is False:
        return 0
    if value is True:
        return 1
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        key = value.lower()
        if key in ("none", "off", "auto"):  # 'auto' is resolved by shardwise.choose_plan
            return 0
        if key == "full":
            return 1
        if key.startswith("every_") and key[6:].isdigit() and int(key[6:]) >= 1:
            return int(key[6:])
    raise ValueError(
        f"ParallelConfig.activation_checkpointing={value!r} is not valid. Use 'none', 'full', "
        "'every_<k>' (e.g. 'every_2'), a positive int k, or 'auto'."
    )


LAUNCHED: list[Callable[[], ParallelConfig | None]] = []
"""The launched file's layout, or None (registered by parallelize/from_env.py)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How `shardwise.wrap` parallelises a model. Defaults do the right thing on one CPU."""

    strategy: StrategySetting = "full_shard"
    """One of ddp, no_shard, shard_grad_op, full_shard, hybrid_shard, hybrid_shard_zero2
    (torch's ShardingStrategy members and names are accepted and normalised), or 'auto':
    the least communication whose simulated peak fits memory_budget (resolved by
    shardwise.choose_plan or `shardwise plan`, before wrapping)."""
    dp_shard: int = -1
    """Ranks each shard group spans. -1: all ranks for full_shard/shard_grad_op; for
    hybrid strategies the ranks of one node when that gives a 2-D mesh, else the most
    balanced split. Replication across groups is world_size // dp_shard."""
    tp: int | Literal["auto"] = 1
    """Tensor-parallel degree: the layers `tp_plan` names are split over `tp` adjacent ranks
    (torch's parallelize_module, before sharding), and the strategy shards or replicates
    over the world_size // tp data-parallel ranks; the ranks of one tp group read the same
    batch. 1: none. 'auto' (with strategy='auto'): the planner may choose tp 2, 4 or 8,
    with sequence parallelism, when no layout without tp fits."""
    tp_plan: TPPlan = "auto"
    """With tp > 1: 'auto' takes the model's own plan (a Hugging Face model's `_tp_plan`);
    a dict {module name or fnmatch pattern: 'colwise' | 'rowwise' | a torch ParallelStyle}
    or a callable (model, tp_mesh) covers your own models. A model with no plan is an
    error, never silently replicated."""
    loss_parallel: bool = False
    """With tp > 1: keep the output head's logits split over the vocabulary and compute the
    cross-entropy on the split logits (torch's loss_parallel), instead of gathering whole
    logits on every rank. The Engine enters torch's loss_parallel() around each step; a
    loop of your own does it itself."""
    sequence_parallel: bool = False
    """With tp > 1: inside the decoder layers, what runs between split layers (norms,
    residual adds, dropout) holds 1/tp of the tokens on each rank instead of all of them,
    which divides that activation memory by tp. The first layer splits the sequence and the
    last gathers it; every batch's sequence length must divide by tp. Not with a callable
    tp_plan (it applies its own styles)."""
    pp: int = 1
    """Pipeline-parallel degree: the model is cut into `pp` stages, each held by its own
    ranks (the outermost mesh dimension), which send activations to the next stage and
    gradients back (torch's pipelining). Each stage shards or replicates over its
    world_size // (pp * tp) data-parallel ranks. 1: none."""
    pp_schedule: PPSchedule = "1f1b"
    """With pp > 1: the schedule of micro-batches: '1f1b' (one forward, one backward; at
    most pp micro-batches in flight), 'gpipe' (all forwards, then all backwards) or
    'interleaved_1f1b' (each rank holds `pp_stages_per_rank` stages, non-adjacent: rank r
    holds stages r, r + pp, ...; a smaller bubble for more sends). 'zbv' is named but not
    built yet (an error says so)."""
    pp_stages_per_rank: int | None = None
    """With pp > 1: stages each rank holds. None: 2 for 'interleaved_1f1b', 1 otherwise.
    '1f1b' and 'gpipe' take 1; 'interleaved_1f1b' takes 2 or more. The model is cut into
    pp * pp_stages_per_rank stages."""
    pp_microbatches: int | None = None
    """With pp > 1: micro-batches each rank's batch is cut into per step. None: 2 * pp. 1F1B
    needs at least pp; the batch's rows must divide by it."""
    pp_split: PPSplit = "auto"
    """With pp > 1: 'auto' (the repeated blocks balanced over the stages: what comes before
    them, such as the embeddings, goes to the first stage, what comes after, such as the
    final norm and the head, to the last), or the module names at which each stage after
    the first begins, e.g. ['model.layers.2'] (the names of blocks in the model's list of
    layers): pp * pp_stages_per_rank - 1 names."""
    ep: int = 1
    """Expert-parallel degree for a mixture of experts: each group of `ep` ranks holds
    num_experts / ep whole experts per rank, and tokens travel to their experts' ranks and
    back by all-to-all. ep takes its ranks from dp_shard (ep divides dp_shard), or from
    dp_shard and whole tp groups (ep a multiple of tp, ep // tp dividing dp_shard; each tp
    rank then sends 1/tp of its group's tokens). The experts are sharded by FSDP over the
    shard ranks ep leaves; the rest of the model keeps its layout. 1: none."""
    cp: int = 1
    """Context-parallel degree: each rank of a cp group holds 1/cp of every sequence (the
    ranks of one group read the same rows; wrap's hook cuts them), and attention reads the
    whole sequence through `cp_style`. Parameters are sharded over dp_shard x cp, gradients
    reduced over both; with tp, Ulysses spreads the heads tp leaves; with pp, each whole
    batch is cut before the schedule's micro-batches; with ep, an ep group takes whole cp
    groups (ep a multiple of cp). 1: none. Not yet with sequence_parallel, loss_parallel or
    compile (an error says so)."""
    cp_style: CPStyle = "auto"
    """With cp > 1: 'ulysses' (an all-to-all gives each rank every position of 1/cp of the
    attention heads, which must divide by cp), 'ring' (not built yet: an error says so), or
    'auto' (Ulysses)."""
    cp_load_balance: bool | None = None
    """With cp > 1: cut each sequence into head-and-tail chunks so that causal ring
    attention's ranks share the work. None: on for causal ring attention. Ulysses has
    nothing to balance; True with it is an error."""
    mixed_precision: PrecisionSetting = "fp32"
    """'fp32', 'bf16', 'fp16', a mapping of param/reduce/output dtypes, shardwise.Precision,
    torch's MixedPrecisionPolicy, or FSDP1's MixedPrecision."""
    cpu_offload: bool | OffloadPolicy = False
    """Keep sharded parameters, gradients and optimizer state on CPU: bool,
    CPUOffloadPolicy or FSDP1's CPUOffload. Not available with ddp."""
    sync_module_states: bool = True
    """Start every rank from rank 0's parameters and buffers (an eagerly built model; to
    load a weights file through rank 0, use wrap(..., broadcast_from_rank0=True))."""
    reshard_after_forward: bool | int | None = None
    """Override the strategy's choice for non-root units (True frees gathered parameters
    after forward; an int reshards to that many ranks). None: from the strategy."""
    backward_prefetch: BackwardPrefetchName | int | None = "pre"
    """'pre', 'post', None, a depth >= 1, or FSDP1's BackwardPrefetch."""
    forward_prefetch: bool | int = False
    """Prefetch the next unit(s) in forward: bool or a depth."""
    auto_wrap_policy: WrapPolicy = "auto"
    """Which submodules become their own shard units: 'auto' (the model's repeated blocks),
    a registered name ('transformer_blocks', 'size', 'none', or your own), module classes
    or class names, 're:<regex>' on module FQNs, or a callable (fqn, module) -> bool
    (FSDP1-style (module, recurse, nonwrapped_numel) -> bool is recognised too)."""
    min_num_params: int | None = None
    """For the 'size' policy only (an error with any other): a module becomes a unit once
    this many parameters below it are in no unit yet. None: 100,000,000 (FSDP1's default)."""
    frozen_policy: FrozenPolicy = "warn"
    """Units mixing frozen and trainable parameters: 'split' (frozen parts get units of
    their own where the module structure allows), 'warn' (accept them and list them in the
    plan's `mixed:` line; FSDP2 makes them cost nothing, so nothing is printed at wrap), or
    'error'."""
    keep_fp32: Iterable[type[nn.Module] | str] | None = None
    """Module classes or class names computed in fp32 under a bf16/fp16 policy, each in
    its own unit. None: normalisation layers with running statistics (BatchNorm)."""
    ignored_modules: Iterable[nn.Module | type[nn.Module] | str] = ()
    """Modules (instances, classes, class names or 're:<regex>' on FQNs) left unsharded and
    unmanaged: their gradients are not synchronised by shardwise."""
    ignored_params: Iterable[str] = ()
    """Parameter FQNs left unsharded and unmanaged, like ignored_modules."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute planned blocks in backward: 'none', 'full' (every block), 'every_<k>' or
    an int k (every k-th block). Applied before sharding. 'auto': the least recompute
    whose simulated peak fits memory_budget (resolved by shardwise.choose_plan or
    `shardwise plan`, before wrapping)."""
    memory_budget: MemoryBudget = None
    """Per-rank memory strategy='auto' and activation_checkpointing='auto' must fit:
    bytes, a size ('70GiB', '80GB'), a percentage of the device's memory ('85%'), or
    None for 90% of it. `shardwise plan` marks each row as fitting it or not."""
    force_wrap: bool = False
    """Apply the strategy even at world size 1 (the model is otherwise returned unwrapped)."""
    compile: bool | str = False
    """Compile each planned block with torch.compile before sharding (the order FSDP2
    needs): True for the default backend (inductor) or a backend name such as 'aot_eager'."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """For models built on the meta device: a callable(module) run on every module to
    initialise its (sharded) parameters, instead of reset_parameters()."""
    init_seed: int = 0
    """Seed for initialising a meta-built model after sharding."""
    device_mesh: UserMesh = None
    """Your own torch DeviceMesh instead of one built from dp_shard: 1-D for ddp,
    full_shard and shard_grad_op; 2-D (replicate, shard) for the hybrid strategies and
    no_shard. FSDP1's `process_group` is accepted too: one group, or (shard group,
    replicate group) for hybrid strategies. Set it in Python; it cannot come from YAML."""
    find_unused_parameters: bool | None = None
    """ddp only (an error with FSDP strategies): tolerate parameters that get no gradient in
    a step (costs a graph walk). None: False."""
    bucket_cap_mb: float | None = None
    """ddp only (an error with FSDP strategies, which reduce per shard unit): gradient
    bucket size in MiB. None: DDP's 25."""
    broadcast_buffers: bool | None = None
    """ddp only: send rank 0's buffers to every rank at each forward. None: True (DDP's)."""
    gradient_as_bucket_view: bool | None = None
    """ddp only: gradients are views into DDP's buckets (saves a copy). None: False."""
    static_graph: bool | None = None
    """ddp only: the set of used parameters never changes between steps. None: False."""

    # Resolved forms, filled in by validation.
    _precision: Precision = field(init=False, repr=False, compare=False)
    _offload: CPUOffloadPolicy | None = field(init=False, repr=False, compare=False)
    _backward_depth: int = field(init=False, repr=False, compare=False)
    _forward_depth: int = field(init=False, repr=False, compare=False)
    _ac_every: int = field(init=False, repr=False, compare=False)
    _placement: dict[str, Any] = field(init=False, repr=False, compare=False)
    """device_ids/output_device/device_id given in other systems' words, checked by wrap."""

    def __post_init__(self) -> None:
        validate_parallel_config(self)

    @classmethod
    def from_env(cls) -> ParallelConfig:
        """The layout of the file `shardwise run --from FILE` (or `--deepspeed`,
        `--accelerate-config`) launched this script with, at the job's world size (a
        ConfigError names every refused key). Without one, `ParallelConfig()`, not None:
        what `wrap(model)` takes, so the script also runs as `python train.py`;
        `shardwise.translation_from_env()` says whether a file was given."""
        if not LAUNCHED:  # importing shardwise registers it: a bug, never a silent default
            raise RuntimeError("ParallelConfig.from_env: no reader of the launched file")
        launched = LAUNCHED[0]()
        return launched if launched is not None else cls()

    @property
    def precision(self) -> Precision:
        return self._precision

    @property
    def offload_policy(self) -> CPUOffloadPolicy | None:
        return self._offload

    @property
    def backward_prefetch_depth(self) -> int:
        return self._backward_depth

    @property
    def forward_prefetch_depth(self) -> int:
        return self._forward_depth

    @property
    def tp_size(self) -> int:
        """`tp` as a number; 'auto' is the planner's to resolve first."""
        if self.tp == "auto":
            raise ValueError(
                "ParallelConfig.tp='auto' is chosen by simulating the model, which this call "
                "does not do. Resolve it first: config = shardwise.choose_plan(make_model, "
                "config, world=..., batch=..., seq_len=...).config (or `shardwise plan --world "
                "N --simulate parallel.strategy=auto parallel.tp=auto`)."
            )
        return self.tp

    @property
    def stages_per_rank(self) -> int:
        """`pp_stages_per_rank` resolved (None: 2 for 'interleaved_1f1b', 1 otherwise)."""
        return stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)

    @property
    def checkpoint_every(self) -> int:
        """Activation-checkpoint every k-th planned block (0: none)."""
        return self._ac_every


def validate_parallel_config(cfg: ParallelConfig) -> None:
    """Every check that does not need the world size, in one place; normalises fields."""
    cfg.strategy = normalize_strategy(cfg.strategy)
    # Lists become tuples, so a config equals itself after a round trip through YAML.
    for name in ("auto_wrap_policy", "keep_fp32", "ignored_modules", "ignored_params"):
        if isinstance(getattr(cfg, name), list):
            setattr(cfg, name, tuple(getattr(cfg, name)))
    cfg.dp_shard = integral(cfg.dp_shard, "ParallelConfig.dp_shard")
    if cfg.dp_shard == 0 or cfg.dp_shard < -1:
        raise ValueError(
            f"ParallelConfig.dp_shard={cfg.dp_shard} is not a valid group size. "
            "Use a positive number of ranks, or -1 to infer it."
        )
    validate_tp(cfg)
    validate_pp(cfg)
    validate_ep(cfg)
    validate_cp(cfg)
    cfg._precision = resolve_precision(cfg.mixed_precision)
    _keep_fp32_from_fsdp1(cfg)
    cfg._offload = resolve_cpu_offload(cfg.cpu_offload)
    if cfg._offload is not None and cfg.strategy == "ddp":
        raise ValueError(
            "ParallelConfig.cpu_offload is set with strategy='ddp', but DDP keeps a full "
            "replica on every device and cannot offload. Use a sharded strategy "
            "(full_shard, shard_grad_op, hybrid_shard) or set cpu_offload=False."
        )
    cfg._backward_depth, prefetch_warning = resolve_backward_prefetch(cfg.backward_prefetch)
    if prefetch_warning and cfg.strategy != "ddp":
        warnings.warn(prefetch_warning, stacklevel=3)
    cfg._forward_depth = resolve_forward_prefetch(cfg.forward_prefetch)
    raf = cfg.reshard_after_forward
    if raf is not None and not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 1):
        raise ValueError(
            f"ParallelConfig.reshard_after_forward={raf!r} is not valid. Use True, False, None "
            "(from the strategy) or a positive number of ranks to reshard to."
        )
    _validate_wrap_policy(cfg)
    if cfg.frozen_policy not in FROZEN_POLICIES:
        raise ValueError(
            f"ParallelConfig.frozen_policy={cfg.frozen_policy!r} is not valid."
            f"{closest(str(cfg.frozen_policy), FROZEN_POLICIES)} "
            f"Choose one of {list(FROZEN_POLICIES)}."
        )
    cfg._ac_every = resolve_activation_checkpointing(cfg.activation_checkpointing)
    parse_memory_budget(cfg.memory_budget)
    if cfg.param_init_fn is not None and not callable(cfg.param_init_fn):
        raise ValueError(
            f"ParallelConfig.param_init_fn={cfg.param_init_fn!r} is not callable. Give a function "
            "taking a module (set it in Python; it cannot come from a YAML file), or None."
        )
    if not isinstance(cfg.compile, (bool, str)) or cfg.compile == "":
        raise ValueError(
            f"ParallelConfig.compile={cfg.compile!r} is not valid. Use False, True (inductor) or a "
            "torch.compile backend name such as 'aot_eager'."
        )
    _validate_ddp_only(cfg)
    _validate_device_mesh(cfg)


def _validate_wrap_policy(cfg: ParallelConfig) -> None:
    """mmengine's dict policies and torch's FSDP1 policy objects become shardwise's forms;
    min_num_params is refused where it would be silently ignored."""
    policy = cfg.auto_wrap_policy
    if isinstance(policy, Mapping):
        cfg.auto_wrap_policy, size = policy_from_dict(policy)
        if size is not None:
            if cfg.min_num_params is not None and cfg.min_num_params != size:
                raise ValueError(
                    f"ParallelConfig.auto_wrap_policy gives min_num_params={size} and "
                    f"ParallelConfig.min_num_params={cfg.min_num_params}. Set it in one place."
                )
            cfg.min_num_params = size
    elif type(policy).__name__ == "ModuleWrapPolicy":  # FSDP1's class policy object
        classes = getattr(policy, "_module_classes", None)
        if classes is not None:
            cfg.auto_wrap_policy = tuple(classes)
    if cfg.min_num_params is None:
        return
    cfg.min_num_params = integral(cfg.min_num_params, "ParallelConfig.min_num_params")
    if cfg.min_num_params < 1:
        raise ValueError(
            f"ParallelConfig.min_num_params={cfg.min_num_params} must be >= 1 (parameters "
            "per unit for the 'size' policy)."
        )
    if cfg.auto_wrap_policy != "size":
        raise ValueError(
            f"ParallelConfig.min_num_params={cfg.min_num_params:,} applies to the 'size' policy "
            f"only, but auto_wrap_policy={cfg.auto_wrap_policy!r}, which would ignore it. Set "
            "auto_wrap_policy='size' to make units by parameter count, or remove min_num_params."
        )


_DDP_ONLY = {
    "find_unused_parameters": "FSDP2 reduces whatever gradients each unit has",
    "bucket_cap_mb": "FSDP2 reduces gradients per shard unit: the unit is the bucket (size "
    "units with auto_wrap_policy)",
    "broadcast_buffers": "FSDP2 does not broadcast buffers during training",
    "gradient_as_bucket_view": "FSDP2 has no buckets",
    "static_graph": "FSDP2 needs no graph hint",
}


def _validate_ddp_only(cfg: ParallelConfig) -> None:
    for name, fsdp2 in _DDP_ONLY.items():
        value = getattr(cfg, name)
        if value is not None and cfg.strategy != "ddp":
            raise ValueError(
                f"ParallelConfig.{name}={value!r} is a DistributedDataParallel setting, but "
                f"strategy={cfg.strategy!r} uses FSDP2 ({fsdp2}). Remove it, or use "
                "strategy='ddp'."
            )
    if cfg.bucket_cap_mb is not None and not cfg.bucket_cap_mb > 0:
        raise ValueError(
            f"ParallelConfig.bucket_cap_mb={cfg.bucket_cap_mb} must be > 0 (MiB per DDP bucket)."
        )


def _validate_device_mesh(cfg: ParallelConfig) -> None:
    """A user's mesh (or FSDP1 process groups) must fit the strategy's shape."""
    mesh: object = cfg.device_mesh  # FSDP1's non-member sentinel is an int, untyped here
    if mesh is None:
        return
    from torch.distributed import GroupMember

    if mesh is GroupMember.NON_GROUP_MEMBER or (
        isinstance(mesh, (list, tuple)) and GroupMember.NON_GROUP_MEMBER in mesh
    ):
        raise ValueError(
            "ParallelConfig.device_mesh/process_group: this rank is not a member of the given "
            "process group. shardwise treats every rank as a data-parallel replica: give a "
            "group (or mesh) that spans all ranks."
        )
    hybrid = cfg.strategy in ("hybrid_shard", "hybrid_shard_zero2", "no_shard")
    if isinstance(mesh, (list, tuple)) and len(mesh) == 2:
        if not all(isinstance(g, ProcessGroup) for g in mesh):
            raise TypeError(
                f"ParallelConfig.device_mesh/process_group={mesh!r}: a pair must be two "
                "ProcessGroups, (shard group, replicate group), as FSDP1's HYBRID_SHARD took."
            )
        ndim = 2
    elif isinstance(mesh, ProcessGroup):
        ndim = 1
    elif isinstance(mesh, DeviceMesh):
        ndim = mesh.ndim
    else:
        raise TypeError(
            f"ParallelConfig.device_mesh got {type(mesh).__name__}; expected a torch DeviceMesh, "
            "a ProcessGroup, or (shard group, replicate group)."
        )
    if ndim != (2 if hybrid else 1):
        raise ValueError(
            f"ParallelConfig.device_mesh is {ndim}-D but strategy={cfg.strategy!r} needs a "
            f"{2 if hybrid else 1}-D mesh: 1-D for ddp, full_shard and shard_grad_op, 2-D "
            "(replicate, shard) for hybrid_shard, hybrid_shard_zero2 and no_shard."
        )


def _keep_fp32_from_fsdp1(cfg: ParallelConfig) -> None:
    """FSDP1's MixedPrecision(_module_classes_to_ignore=...) ran those classes in fp32 in
    units of their own: exactly keep_fp32."""
    ignored = getattr(cfg.mixed_precision, "_module_classes_to_ignore", None)
    if ignored is None or not cfg.precision.is_mixed:
        return
    classes = tuple(ignored)
    if cfg.keep_fp32 is None:
        cfg.keep_fp32 = classes
    elif set(cfg.keep_fp32) != set(classes):
        raise ValueError(
            f"ParallelConfig.keep_fp32={cfg.keep_fp32!r} and FSDP1 MixedPrecision"
            f"(_module_classes_to_ignore={classes!r}) name different fp32 classes. Set only "
            "keep_fp32."
        )


def _accept_other_systems_words(init: Callable[..., None]) -> Callable[..., None]:
    """ParallelConfig(...) also takes the words of the systems it replaces: translated, or
    refused with what FSDP2 does instead (see vocabulary.py)."""

    @functools.wraps(init)
    def __init__(self: ParallelConfig, **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(ParallelConfig) if f.init}
        unknown = sorted(set(kwargs) - fields - FOREIGN_WORDS)
        if unknown:
            raise TypeError(
                f"ParallelConfig got unknown keyword(s) {unknown}.{closest(unknown[0], fields)} "
                f"Valid keywords: {sorted(fields)}."
            )
        values, placement = translate(kwargs)
        init(self, **values)
        self._placement = placement

    return __init__


setattr(ParallelConfig, "__init__", _accept_other_systems_words(ParallelConfig.__init__))  # noqa: B010
# Read by schema.from_dict, so a config file may use these words too.
ParallelConfig.FOREIGN_WORDS = FOREIGN_WORDS  # type: ignore[attr-defined]
