"""Simulate one training step's per-rank peak memory on the CPU, with fake tensors.

Owns: `simulate_step`, which builds the user's model on the meta device inside torch's
`FakeTensorMode`, wraps it with `shardwise.wrap` over a fake process group of the requested
world size, runs a training step (forward, backward, optimizer step) under torch's memory
tracker (`FSDPMemTracker` for FSDP2 strategies, `MemTracker` for DDP), and returns rank 0's
peak by category as a `SimReport`. Fake tensors carry shapes and dtypes but no storage, so
the simulation uses the same few hundred MB of host memory whatever the model's size.

Rank 0 stands for every rank: FSDP2 pads each parameter to a multiple of the shard size, so
every rank holds equal shards, and DDP ranks hold identical replicas.

The fake process group allocates nothing, so the buffers a real backend's collectives add
are modelled for the backend named (`backend=`, fake.py's `backend_collectives`). The
default is nccl, what a GPU job runs (the simulation answers for GPUs): its collectives
allocate nothing the tracker sees (read from torch's source; not yet measured on a GPU).
A CPU job runs gloo, whose reduce-scatter clones its
whole input: under FSDP2 a unit's flat gradients are held twice while it reduces, which for
a root unit holding a large embedding and an untied head is the step's peak (a Llama with
vocabulary 32000 and hidden size 256 at world 2: 291.3 MiB on gloo, 231.5 MiB without the
clone). The checks against real runs, which run on gloo here, simulate gloo.

Must not: touch the caller's process group (a simulation that finds one runs itself in a
spawned subprocess), or allocate real parameter memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.parallel import ActivationCheckpointing, ParallelConfig
from shardwise.distributed.mesh import resolve_mesh
from shardwise.distributed.process_group import shutdown
from shardwise.memory import stage_groups
from shardwise.memory.compose import (
    BlockRun,
    Segment,
    SegmentLabel,
    SegmentRecorder,
    composed_step,
    reuse_builds,
)
from shardwise.memory.fake import (
    Backend,
    ExampleInput,
    backend_collectives,
    check_backend,
    clear_sharding_caches,
    default_input,
    default_seq_len,
    fake_world_patches,
    local_comm_hook,
    shaped_grouped_mm,
    unpacked_rows,
    untracked_shape_inference,
)
from shardwise.memory.model_states import format_bytes
from shardwise.memory.stages import StageSim, simulate_stages, tracked_stage
from shardwise.memory.tracking import (
    CATEGORIES,
    tracked_step,
)
from shardwise.memory.workers import Job, check_workers, drive, gather, run_jobs
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.experts import (
    ExpertLoad,
    StatedRouting,
    check_expert_load,
    stated_routing,
)
from shardwise.parallelize.materialize import init_empty
from shardwise.plan.quantized import quantized_params

__all__ = ["SimReport", "real_step", "simulate_step", "simulate_steps", "tracked_step"]

_OPTIMIZERS = ("adamw", "adam", "sgd", "none")
SimPath = Literal["fast", "full"]
PATHS: tuple[SimPath, ...] = ("fast", "full")
SimOptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""`optimizer=` as a function of the parameters, e.g. functools.partial(AdamW, lr=1e-4)."""


@dataclass(frozen=True)
class SimReport:
    """Rank 0's memory during one steady-state training step, in bytes.

    `at_peak` is each category at the moment the total peaked (they sum to `peak`);
    `category_peaks` is each category's own maximum over the step (these need not occur
    together). `ddp_buckets` is DDP's gradient buckets, which DDP allocates in C++ at
    construction where no tracker sees them: counted analytically (one copy of the
    gradients) and added to `peak`.
    """

    strategy: str
    world_size: int
    batch: int
    seq_len: int | None
    precision: str
    activation_checkpointing: str
    optimizer: str
    peak: int
    at_peak: dict[str, int]
    category_peaks: dict[str, int]
    fake: bool = True
    notes: list[str] = field(default_factory=list)
    tp: int = 1
    sequence_parallel: bool = False
    backend: str = "nccl"
    """The backend whose collective buffers were modelled (see the module docstring)."""
    pp: int = 1
    """Pipeline stages; with pp > 1 this report is the stage with the highest peak."""
    stages: list[dict[str, int]] = field(default_factory=list)
    """With pp > 1: each stage's index, peak, model states and micro-batches in flight."""
    ep: int = 1
    """Expert-parallel degree; with ep > 1 the notes state the routing simulated."""
    path: SimPath = "full"
    """Which simulation made the figures: "fast" (each distinct block traced, the step
    composed: memory/compose.py) or "full" (every block traced); the notes say why a fast
    request was answered by the full one."""
    segments: dict[SegmentLabel, Segment] = field(default_factory=dict, repr=False, compare=False)
    """A trace's figures by segment of the step, for composing (empty in answers)."""

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state held between steps (at the peak)."""
        return sum(self.at_peak.get(k, 0) for k in ("params", "grads", "optimizer"))

    def to_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "model_states": self.model_states}
        out.pop("segments")
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        tp = ""
        if self.tp > 1:
            tp = f" x tp {self.tp}{' (sequence parallel)' if self.sequence_parallel else ''}"
        if self.pp > 1:
            tp = f" x pp {self.pp}{tp}"
        if self.ep > 1:
            tp = f"{tp} x ep {self.ep}"
        head = (
            f"{self.strategy}{tp} at world {self.world_size}, batch {self.batch} x seq "
            f"{self.seq_len}, {self.precision}, AC {self.activation_checkpointing}, "
            f"{self.optimizer}, {self.backend}: per-rank peak {format_bytes(self.peak)} "
            f"({self.path} simulation)"
        )
        rows = [
            f"  {k:<16} {format_bytes(self.at_peak.get(k, 0)):>12} "
            f"{format_bytes(self.category_peaks.get(k, 0)):>12}"
            for k in CATEGORIES
            if self.at_peak.get(k, 0) or self.category_peaks.get(k, 0)
        ]
        header = f"  {'category':<16} {'at peak':>12} {'own peak':>12}"
        stages = [
            f"  stage {st['index']}: peak {format_bytes(st['peak'])}, model states "
            f"{format_bytes(st['model_states'])}, {st['in_flight']} micro-batch(es) in flight"
            f" ({st.get('path', 'full')})"
            for st in self.stages
        ]
        notes = [f"  note: {n}" for n in self.notes]
        return "\n".join([head, header, *rows, *stages, *notes])


# --------------------------------------------------------------------------- model + input


def _make_optimizer(
    optimizer: str | SimOptimizerFactory,
    params: Iterable[nn.Parameter],
    foreach: bool | None = None,
) -> torch.optim.Optimizer | None:
    """The optimizer named, with `foreach` as given (None: torch's default for the
    parameters' device). torch picks foreach for CUDA parameters, whose step holds a
    temporary the size of the parameters; the simulation's fake parameters are on the CPU,
    so it passes the job's choice (foreach for an nccl job: 0.81 of an H200's peak without
    it, 0.97 with)."""
    if callable(optimizer):
        return optimizer(params)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach)
    if optimizer == "none":
        return None
    raise ValueError(
        f"simulate_step(optimizer={optimizer!r}): use one of {list(_OPTIMIZERS)} or a "
        "callable that takes the parameters and returns a torch optimizer."
    )


# --------------------------------------------------------------------------- experts

DEFAULT_EXPERT_LOAD = 2.0
"""The stated routing's load when none is given: the busiest rank receives twice the
balanced count of rows (GShard's and Switch Transformer's evaluation capacity factor; a
run trained with a load-balancing loss sits below it, one that is not may sit above)."""


def _routing(ep: int, load: ExpertLoad) -> contextlib.AbstractContextManager[Any]:
    return stated_routing(load) if ep > 1 else contextlib.nullcontext()


def routing_note(routing: StatedRouting) -> str:
    """What the stated routing gave the simulated rank, for the report's notes."""
    tokens, k, rows = max(routing.seen, key=lambda seen: seen[2], default=(0, 0, 0))
    return (
        f"experts: routing stated, not traced (expert_load={routing.load!r}): the simulated "
        f"rank is the busiest, receiving {rows} rows per experts layer against a balanced "
        f"{tokens * k} ({tokens} tokens x top-{k})"
    )


# --------------------------------------------------------------------------- the step


def real_step(
    model_factory: Callable[[], nn.Module],
    config: ParallelConfig,
    *,
    batch: int,
    seq_len: int,
    optimizer: str | SimOptimizerFactory = "adamw",
) -> dict[str, Any]:
    """The real counterpart of `simulate_step`, on real tensors in the caller's process group:
    build, `wrap`, then `tracked_step` with the same default input. What a simulation is
    checked against."""
    model = wrap(model_factory(), config)
    opt = _make_optimizer(optimizer, model.parameters())
    return tracked_step(model, opt, lambda: default_input(model, batch, seq_len))


def _resolve_config(
    config: ParallelConfig, activation_checkpointing: ActivationCheckpointing
) -> ParallelConfig:
    if not isinstance(config, ParallelConfig):
        raise TypeError(
            f"simulate_step(config=...) expects a ParallelConfig, got {type(config).__name__}."
        )
    changes: dict[str, Any] = {"sync_module_states": False}  # values are fake: nothing to sync
    if activation_checkpointing is not None:
        changes["activation_checkpointing"] = activation_checkpointing
    if config.compile:
        raise NotImplementedError(
            "simulate_step: ParallelConfig.compile is not simulated yet (compiling under "
            "fake tensors traces a different graph than the eager step). Simulate with "
            "compile=False: eager activations are an upper bound for the compiled ones."
        )
    if config.device_mesh is not None:
        raise NotImplementedError(
            "simulate_step: ParallelConfig.device_mesh is a mesh of the real job and cannot "
            "be reused in a fake world. Give the strategy and dp_shard instead."
        )
    return dataclasses.replace(config, **changes)


def _simulate_here(
    model_factory: Callable[[], nn.Module],
    config: ParallelConfig,
    world: int,
    example_input: ExampleInput | None,
    batch: int,
    seq_len: int | None,
    optimizer: str | SimOptimizerFactory,
    backend: Backend,
    stage: StageSim | None = None,
    expert_load: ExpertLoad = DEFAULT_EXPERT_LOAD,
    segments: tuple[BlockRun, int] | None = None,
) -> SimReport:
    import torch.distributed._tools.fake_collectives
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    clear_sharding_caches()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        spec = resolve_mesh(
            config.strategy,
            config.dp_shard,
            world,
            reshard_after_forward=config.reshard_after_forward,
            tp=config.tp_size,
            ep=config.ep,
            cp=config.cp,
        )
        # DeviceMesh reads its layout with .tolist(): build it before entering fake mode.
        mesh = spec.build("cpu")
        experts_mesh = spec.build_experts("cpu") if spec.ep > 1 else None
        # wrap makes the cp mesh itself (a mesh of your own is refused with cp)
        on_meta = spec.tp > 1 or spec.ep > 1 or spec.cp > 1
        if mesh is not None and not on_meta:
            config = dataclasses.replace(config, device_mesh=mesh)
        elif on_meta:  # the fake world has no nodes: fix the shard size resolved here
            config = dataclasses.replace(config, dp_shard=spec.dp_shard)
        fake_mode = FakeTensorMode()
        model = _build_fake(model_factory, fake_mode)
        if seq_len is None and example_input is None:
            seq_len = default_seq_len(model)
            if seq_len is None:
                raise ValueError(
                    "simulate_step: seq_len=None and no example_input: give the sequence "
                    "length of the default (batch, seq_len) token input, or example_input."
                )
        if on_meta:
            # fully_shard over a mesh with a tp or ep dimension fails under fake tensors; on
            # the meta device it works, and the sharded model is then materialised fake.
            with fake_world_patches(mesh, fake_mode, experts_mesh) as hooked:
                model = wrap(model, config)
        else:
            with fake_mode, fake_world_patches() as hooked:
                model = wrap(model, config)
        recorder = None
        if segments is not None:
            recorder = SegmentRecorder(*segments)
            recorder.hook(model)
        with fake_mode:
            if isinstance(model, DistributedDataParallel) and model not in hooked:
                model.register_comm_hook(None, local_comm_hook(None))
            opt = _make_optimizer(optimizer, model.parameters(), foreach=backend == "nccl")

            def make_input() -> Any:
                if example_input is not None:
                    return example_input()
                return default_input(model, batch, int(seq_len or 0))

            with (
                backend_collectives(backend),
                shaped_grouped_mm(),
                unpacked_rows(),
                untracked_shape_inference(fake_mode),
                _routing(spec.ep, expert_load) as routing,
            ):
                if stage is None:
                    result = tracked_step(model, opt, make_input, recorder)
                else:
                    dtype = config.precision.param_dtype or torch.float32
                    result = tracked_stage(
                        model, opt, stage, batch, int(seq_len or 0), dtype, recorder
                    )
    finally:
        shutdown()
    notes = [f"rank 0 of {world}; ranks are symmetric ({spec.strategy}, {spec})"]
    if routing is not None:
        notes = [f"rank 0 of {world} ({spec.strategy}, {spec})", routing_note(routing)]
    return SimReport(
        strategy=spec.strategy,
        world_size=world,
        batch=batch,
        seq_len=seq_len,
        precision=str(config.precision),
        activation_checkpointing=str(config.activation_checkpointing),
        optimizer=optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "?"),
        peak=result["peak"],
        at_peak=result["at_peak"],
        category_peaks=result["category_peaks"],
        notes=notes,
        tp=spec.tp,
        sequence_parallel=config.sequence_parallel,
        backend=backend,
        ep=spec.ep,
        segments=result.get("segments", {}),
    )


_QUANTIZED = (
    "simulate_step: the model's base is quantized by bitsandbytes ({what}), which the "
    "simulation cannot build: it builds the model on the meta device under fake tensors, "
    "and a quantized weight can neither be made from a fake tensor nor quantized without "
    "values. Measure one real step of the loaded model instead "
    "(shardwise.memory.real_step, on real tensors in your process group)."
)


def _build_fake(model_factory: Callable[[], nn.Module], fake_mode: Any) -> nn.Module:
    """The user's model, built on meta under fake tensors; a quantized base is refused."""
    try:
        with fake_mode, init_empty():
            model = model_factory()
    except RuntimeError as exc:
        if any(name in str(exc) for name in ("Params4bit", "Int8Params")):
            raise NotImplementedError(_QUANTIZED.format(what=str(exc)[:200])) from exc
        raise
    found = quantized_params(model)
    if found:
        what = f"{found[0].name}, {found[0].bits}-bit, and {len(found) - 1} more"
        raise NotImplementedError(_QUANTIZED.format(what=what))
    return model


def _child(conn: Any, kwargs: dict[str, Any]) -> None:
    try:
        conn.send(("ok", _simulate_here(**kwargs)))
    except BaseException as exc:  # sent back and re-raised in the parent
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _simulate_in_subprocess(kwargs: dict[str, Any], timeout_s: float) -> SimReport:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"simulate_step: the simulation subprocess ran over {timeout_s}s.")
        status, payload = parent.recv()
    finally:
        if proc.is_alive():
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok" or not isinstance(payload, SimReport):
        raise RuntimeError(f"simulate_step failed in its subprocess: {payload}")
    return payload


def simulate_step(
    model_factory: Callable[[], nn.Module],
    config: ParallelConfig,
    *,
    world: int,
    example_input: ExampleInput | None = None,
    batch: int,
    seq_len: int | None,
    optimizer: str | SimOptimizerFactory = "adamw",
    activation_checkpointing: ActivationCheckpointing = None,
    backend: Backend = "nccl",
    expert_load: ExpertLoad = DEFAULT_EXPERT_LOAD,
    timeout_s: float = 600.0,
    path: SimPath = "fast",
    workers: int | None = None,
) -> SimReport:
    """Rank 0's peak memory, by category, for one training step at `world` ranks.

    `model_factory()` builds the model; it runs on the meta device under fake tensors, so
    it must not read parameter values. The input is integer tokens and labels of shape
    (batch, seq_len) unless `example_input()` returns the model's arguments (a tuple, a
    dict of keyword arguments, or one tensor); it is called under fake tensors too. The
    step is: a warm-up step (creating optimizer state), then forward, backward and
    optimizer step under torch's memory tracker — the steady-state peak.

    `backend` is the process-group backend the job will run, whose collective buffers are
    modelled: "nccl" (a GPU job, the default) or "gloo" (a CPU job; its reduce-scatter
    holds a copy of each unit's gradients while it reduces). See the module docstring.

    With expert parallelism (config.ep > 1) the tokens each rank's experts receive depend
    on router values, which fake tensors lack: the routing is stated instead. The
    simulated rank is the busiest one, receiving `expert_load` times the balanced count of
    rows in every experts layer (2.0 by default; 1: balanced; "worst": every copy that can
    reach one rank does). The report's notes say what it received.

    `path="fast"` (the default) traces each distinct block once or twice and composes the
    step from the parts (memory/compose.py: the run of same blocks traced at two short
    lengths); `path="full"` traces every block. The report's `path` says which made it;
    a model the fast path cannot compose is traced whole, and its notes say why.

    Traces that do not depend on each other (the fast path's two, each pipeline stage's)
    run side by side in forked processes on Linux, `workers` at a time (None: the CPUs
    this process may use, at most 4; 1: one after another in this process). The figures
    are the same whatever the number (memory/workers.py).

    Runs in this process with a fake process group, destroyed afterwards. If this process
    already has a process group (torch allows one default group per process), the
    simulation runs in a spawned subprocess instead: `model_factory`, `example_input`
    and `optimizer` must then be picklable (module-level functions or classes).
    """
    (report,) = simulate_steps(
        model_factory,
        [config],
        world=world,
        example_input=example_input,
        batch=batch,
        seq_len=seq_len,
        optimizer=optimizer,
        activation_checkpointing=activation_checkpointing,
        backend=backend,
        expert_load=expert_load,
        timeout_s=timeout_s,
        path=path,
        workers=workers,
    )
    return report


def simulate_steps(
    model_factory: Callable[[], nn.Module],
    configs: Sequence[ParallelConfig],
    *,
    world: int,
    example_input: ExampleInput | None = None,
    batch: int,
    seq_len: int | None,
    optimizer: str | SimOptimizerFactory = "adamw",
    activation_checkpointing: ActivationCheckpointing = None,
    backend: Backend = "nccl",
    expert_load: ExpertLoad = DEFAULT_EXPERT_LOAD,
    timeout_s: float = 600.0,
    path: SimPath = "fast",
    workers: int | None = None,
) -> list[SimReport]:
    """`simulate_step` of one model under each of `configs` (a plan's strategies), in
    order: every config's traces are asked together, so they run side by side (`workers`
    at a time), and the model is built on meta once. The reports are the ones
    `simulate_step` gives for each config alone."""
    if world < 1:
        raise ValueError(f"simulate_step(world={world}): the world size must be >= 1.")
    if batch < 1:
        raise ValueError(f"simulate_step(batch={batch}): the micro-batch must be >= 1.")
    if isinstance(optimizer, str) and optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"simulate_step(optimizer={optimizer!r}): use one of {list(_OPTIMIZERS)} or a "
            "callable that takes the parameters and returns a torch optimizer."
        )
    if path not in PATHS:
        raise ValueError(
            f"simulate_step(path={path!r}): use 'fast' (each distinct block traced, the step "
            "composed) or 'full' (every block traced, to check the fast figure)."
        )
    check_backend(backend)
    check_expert_load(expert_load)
    workers = check_workers(workers)
    same = dict(
        model_factory=model_factory,
        world=world,
        example_input=example_input,
        batch=batch,
        seq_len=seq_len,
        optimizer=optimizer,
        backend=backend,
        expert_load=expert_load,
    )
    in_process = not (dist.is_available() and dist.is_initialized())

    def run_one(one: dict[str, Any]) -> SimReport:
        return _simulate_here(**one) if in_process else _simulate_in_subprocess(one, timeout_s)

    def run(one: dict[str, Any]) -> Job:
        return composed_step(one, in_process) if path == "fast" else _whole(one)

    def runs(wanted: list[dict[str, Any]]) -> list[SimReport]:
        return run_jobs(wanted, run_one, workers if in_process else 1, timeout_s)

    grouping = stage_groups if path == "fast" else None
    jobs = []
    for config in configs:
        kwargs = dict(same, config=_resolve_config(config, activation_checkpointing))
        jobs.append(simulate_stages(kwargs, run, grouping) if config.pp > 1 else run(kwargs))
    with reuse_builds():  # one build of the model for every config and stage
        return drive(gather(jobs), runs)  # type: ignore[no-any-return]


def _whole(one: dict[str, Any]) -> Job:
    """The full path's job: one trace of the whole model (or stage)."""
    (report,) = yield [one]
    return report
