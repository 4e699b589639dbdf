"""Step time through the host integrations against the host's own DDP and `shardwise.wrap`.

The same GPT (the model of bench/overhead.py) is trained several ways in the same run, world
2 on CPU (gloo), and the step-time ratios are reported. Target (issue 12): the integration
adds at most 1% per step.

mmengine (ranks spawned by `shardwise.testing.run_distributed`): the GPT sits inside an
mmengine `BaseModel` (default `BaseDataPreprocessor`, `forward(inputs, labels, mode)`), one
copy per variant, all from the same seed:

- a `sw_ddp`: `ShardwiseDataParallel(module, strategy='ddp').train_step(data, OptimWrapper)`;
- b `mm_ddp`: mmengine's `MMDistributedDataParallel(module, device_ids=None).train_step(...)`;
- c `wrap_ddp`: `shardwise.wrap(module, ParallelConfig(strategy='ddp'))`, then a plain
  zero_grad / forward(mode='loss') / backward / optimizer.step;
- d `sw_full_shard`: `ShardwiseDataParallel(module, strategy='full_shard').train_step(...)`;
- e `wrap_full_shard`: `shardwise.wrap(module, ParallelConfig(strategy='full_shard'))`, plain.

a, b, c are stepped alternately step by step (a seeded random order per step, the same on
every rank), then d and e likewise; each step starts after a barrier and a step's time is
the slowest rank's. Ratios a/b, a/c, d/e: ratio of medians, and the median of the per-step
(paired) ratios.

Lightning (ranks started by Lightning's own launcher: this script re-runs itself as a
worker, as tests/integrations/_lt_worker.py does): `Trainer.fit` of a LightningModule holding
the same GPT, timed per optimizer step by a callback (barrier in on_train_batch_start, then
perf_counter until on_train_batch_end), the first steps of each fit excluded:

- `lt_sw_ddp`: `ShardwiseStrategy(strategy='ddp')`; `lt_ddp`: Lightning's `strategy='ddp'`;
- `lt_sw_full_shard`: `ShardwiseStrategy(strategy='full_shard')`, training_step calling
  `self.net(x, y)`; `lt_sw_full_shard_self`: the same with training_step calling `self(x, y)`,
  which re-enters the FSDP2 root's forward inside the redirected step;
- `hand_full_shard`: `shardwise.wrap(module, full_shard)` stepped by hand over the same
  DataLoader (barrier, then zero_grad / forward / backward / step);
- `hand_ddp`: the same with `shardwise.wrap(module, ddp)`, for context: lt_ddp/hand_ddp is
  what Lightning's own loop adds to a hand-written step.

Runs alternate: several rounds, each running every variant once in a seeded random order.
Ratios lt_sw_ddp/lt_ddp and lt_sw_full_shard(_self)/hand_full_shard; paired ratios are taken
between the same step of the same round.

    python bench/integrations.py              # both hosts (a few minutes on 2 CPU cores)
    python bench/integrations.py --smoke      # tiny model, a few steps
    python bench/integrations.py --hosts mmengine --steps 60 --out integrations.json

Prints one JSON object on stdout (and writes it to --out), a summary line per ratio on
stderr. Run it directly, not under a launcher.
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

HOSTS = ("mmengine", "lightning")
TARGET = 1.01
MM_GROUPS = (("sw_ddp", "mm_ddp", "wrap_ddp"), ("sw_full_shard", "wrap_full_shard"))
MM_RATIOS = (("sw_ddp", "mm_ddp"), ("sw_ddp", "wrap_ddp"), ("sw_full_shard", "wrap_full_shard"))
LT_VARIANTS = (
    "lt_sw_ddp",
    "lt_ddp",
    "hand_ddp",
    "lt_sw_full_shard",
    "lt_sw_full_shard_self",
    "hand_full_shard",
)
LT_RATIOS = (
    ("lt_sw_ddp", "lt_ddp"),
    ("lt_sw_full_shard", "hand_full_shard"),
    ("lt_sw_full_shard_self", "hand_full_shard"),  # training_step calls self(x, y)
    ("lt_ddp", "hand_ddp"),  # context: what Lightning's own loop adds to a hand-written step
)
WORLD = 2


@dataclass(frozen=True, kw_only=True)
class Config:
    hosts: tuple[str, ...]
    steps: int
    """mmengine: timed steps per variant. Lightning: timed steps per fit."""
    warmup: int
    """Untimed steps (per variant; per fit for Lightning)."""
    rounds: int
    """Lightning: fits per variant, alternating."""
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab: int
    seed: int
    timeout_s: float

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
        )


def _tokens(cfg: Config, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + rank)
    tokens = torch.randint(0, cfg.vocab, (n, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _orders(seed: int, variants: Sequence[str], n: int) -> list[list[str]]:
    """A seeded random order of the variants for each step (or round): every rank agrees."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        order = list(variants)
        rng.shuffle(order)
        out.append(order)
    return out


def _pair_report(times: dict[str, list[float]], a: str, b: str) -> dict[str, Any]:
    paired = common.paired_ratios(times[a], times[b])
    ma, mb = statistics.median(times[a]), statistics.median(times[b])
    ratio = common.ratio(ma, mb)
    return {
        "ratio_of_medians": ratio,
        "paired_ratio_median": statistics.median(paired),
        "paired_ratio_iqr": _quartiles(paired),
        "meets_target": ratio is not None and ratio <= TARGET,
    }


def _quartiles(xs: list[float]) -> list[float] | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


# --- mmengine ---------------------------------------------------------------------------


def _mm_model(cfg: Config) -> Any:
    from mmengine.model import BaseModel

    class MMGPT(BaseModel):
        def __init__(self) -> None:
            super().__init__()  # default BaseDataPreprocessor
            self.gpt = GPT(cfg.gpt)

        def forward(self, inputs: Any, labels: Any = None, mode: str = "tensor") -> Any:
            if mode == "loss":
                return {"loss": self.gpt(inputs, labels)}
            return self.gpt(inputs)

    model = MMGPT()
    # mmengine's init_weights (which ShardwiseDataParallel runs before sharding when it has
    # not run yet) re-draws GPT's weights: run it here, reseeded, for every variant.
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model


def _mm_variant(name: str, cfg: Config) -> Callable[[dict[str, torch.Tensor]], float]:
    """One copy of the model wrapped one way; returns its step function (-> loss)."""
    from mmengine.model import MMDistributedDataParallel
    from mmengine.optim import OptimWrapper

    from shardwise.integrations.mmengine import ShardwiseDataParallel

    module = _mm_model(cfg)
    if name.startswith("sw_") or name == "mm_ddp":
        if name == "mm_ddp":
            model = MMDistributedDataParallel(module=module, device_ids=None)
        else:
            model = ShardwiseDataParallel(module=module, strategy=name.removeprefix("sw_"))
        optim = OptimWrapper(optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        model.train()

        def mm_step(data: dict[str, torch.Tensor]) -> float:
            return float(model.train_step(data, optim)["loss"].detach())

        return mm_step
    wrapped = shardwise.wrap(module, shardwise.ParallelConfig(strategy=name.removeprefix("wrap_")))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped.train()

    def plain_step(data: dict[str, torch.Tensor]) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = wrapped(**data, mode="loss")["loss"]
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return plain_step


def _mm_rank(cfg: Config) -> dict[str, Any]:
    import logging

    from mmengine.logging import MMLogger

    import shardwise.integrations.mmengine  # noqa: F401  (registers the wrapper)

    MMLogger.get_current_instance().setLevel(logging.WARNING)  # init_weights' report

    x, y = _tokens(cfg, dist.get_rank(), cfg.batch)
    data = {"inputs": x, "labels": y}
    times: dict[str, list[float]] = {}
    final_loss: dict[str, float] = {}
    for g, group in enumerate(MM_GROUPS):
        steps = {name: functools.partial(_mm_variant(name, cfg), data) for name in group}
        # Each step after a barrier: every rank starts together, whichever variant ran before.
        group_times, group_loss = common.timed_rounds(
            steps,
            _orders(cfg.seed + g, group, cfg.warmup + cfg.steps),
            warmup=cfg.warmup,
            barrier=True,
        )
        times.update(group_times)
        final_loss.update(group_loss)
        del steps
    return {"step_times_s": times, "final_loss": final_loss}


def _run_mmengine(cfg: Config) -> dict[str, Any]:
    ranks = run_distributed(_mm_rank, WORLD, args=(cfg,), timeout_s=cfg.timeout_s)
    names = [n for group in MM_GROUPS for n in group]
    slowest: dict[str, list[float]] = {}
    median: dict[str, float] = {}
    for name in names:
        median[name], slowest[name] = common.median_slowest_rank(
            [r["step_times_s"][name] for r in ranks]
        )
    return {
        "median_step_ms": {n: round(1e3 * median[n], 3) for n in names},
        "ratios": {f"{a}/{b}": _pair_report(slowest, a, b) for a, b in MM_RATIOS},
        "final_loss_rank0": ranks[0]["final_loss"],
        "step_times_s": {n: [round(t, 6) for t in slowest[n]] for n in names},
    }


# --- Lightning (this script, re-run as a worker; Lightning's launcher starts rank 1) --------


def _lt_worker(cfg: Config, out: Path) -> None:
    import warnings

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from shardwise.integrations.lightning import ShardwiseStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    total = cfg.warmup + cfg.steps

    def loader(rank: int) -> DataLoader:
        # Every rank's samples come from its own seeded stream; one epoch covers the fit.
        x, y = _tokens(cfg, rank, cfg.batch * total)
        return DataLoader(TensorDataset(x, y), batch_size=cfg.batch, shuffle=False)

    class LitGPT(L.LightningModule):
        def __init__(self, call_self: bool = False) -> None:
            super().__init__()
            self.net = GPT(cfg.gpt)
            self.call_self = call_self

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.net(x, y)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            # self(x, y) re-enters the FSDP2 root's forward inside the redirected step.
            return self(x, y) if self.call_self else self.net(x, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            return loader(self.trainer.global_rank)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.loss = float("nan")
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            dist.barrier()
            self._start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            self.times.append(time.perf_counter() - self._start)
            self.loss = float(outputs["loss"])

    def fit(variant: str, steps: int) -> tuple[list[float], float]:
        strategy: Any = {
            "lt_sw_ddp": lambda: ShardwiseStrategy(strategy="ddp"),
            "lt_ddp": lambda: "ddp",
            "lt_sw_full_shard": lambda: ShardwiseStrategy(strategy="full_shard"),
            "lt_sw_full_shard_self": lambda: ShardwiseStrategy(strategy="full_shard"),
        }[variant]()
        torch.manual_seed(cfg.seed)
        lit = LitGPT(call_self=variant.endswith("_self"))
        timer = StepTimer()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=WORLD,
            max_epochs=1,
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            use_distributed_sampler=False,
            callbacks=[timer],
        )
        trainer.fit(lit)
        return timer.times, timer.loss

    def by_hand(strategy: str, steps: int) -> tuple[list[float], float]:
        torch.manual_seed(cfg.seed)
        model = shardwise.wrap(LitGPT(), shardwise.ParallelConfig(strategy=strategy))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            return loss

        times, loss = [], torch.tensor(float("nan"))
        for i, (x, y) in enumerate(loader(dist.get_rank())):
            if i >= steps:
                break
            seconds, loss = common.timed(functools.partial(step, x, y), barrier=True)
            times.append(seconds)
        return times, float(loss.detach())

    def run(variant: str, steps: int) -> tuple[list[float], float]:
        if variant.startswith("hand_"):
            return by_hand(variant.removeprefix("hand_"), steps)
        return fit(variant, steps)

    # Lightning's first fit starts rank 1 and the process group: one short untimed fit of
    # every Lightning variant first (it also warms up their code paths).
    for variant in LT_VARIANTS:
        run(variant, min(2, total))
    times: dict[str, list[list[float]]] = {v: [] for v in LT_VARIANTS}
    losses: dict[str, float] = {}
    for order in _orders(cfg.seed, LT_VARIANTS, cfg.rounds):
        for variant in order:
            mine, losses[variant] = run(variant, total)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine[cfg.warmup :])
            times[variant].append([max(s) for s in zip(*gathered, strict=True)])
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"step_times_s": times, "final_loss_rank0": losses}))
    dist.barrier()


def _run_lightning(cfg: Config) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-lt-") as tmp:
        out = Path(tmp) / "lightning.json"
        env = common.child_env(
            {"PYTHONWARNINGS": "ignore"}, drop=("LOCAL_RANK", "WORLD_SIZE", "RANK")
        )
        proc = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--lightning-worker",
                json.dumps(asdict(cfg)),
                str(out),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=cfg.timeout_s,
        )
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"Lightning worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        raw = json.loads(out.read_text())
    per_round: dict[str, list[list[float]]] = raw["step_times_s"]
    flat = {v: [t for r in per_round[v] for t in r] for v in LT_VARIANTS}
    return {
        "median_step_ms": {v: round(1e3 * statistics.median(flat[v]), 3) for v in LT_VARIANTS},
        "median_step_ms_per_round": {
            v: [round(1e3 * statistics.median(r), 3) for r in per_round[v]] for v in LT_VARIANTS
        },
        "ratios": {f"{a}/{b}": _pair_report(flat, a, b) for a, b in LT_RATIOS},
        "final_loss_rank0": raw["final_loss_rank0"],
        "step_times_s": {v: [round(t, 6) for t in flat[v]] for v in LT_VARIANTS},
    }


# --- command line -----------------------------------------------------------------------

_SMOKE = {**common.SMOKE_GPT, "steps": 3, "warmup": 1, "rounds": 1}


def _parse_args(argv: Sequence[str] | None) -> tuple[Config, Path | None]:
    p = common.arg_parser(__doc__)
    p.add_argument("--hosts", default=",".join(HOSTS), help="comma-separated")
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant (per fit)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (per fit)")
    p.add_argument("--rounds", type=int, default=4, help="Lightning: fits per variant")
    common.add_gpt_args(p)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per host")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes, seconds: {_SMOKE}")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = common.parse_with_smoke(p, argv, _SMOKE)
    hosts = tuple(h.strip() for h in a.hosts.split(",") if h.strip())
    if not hosts or set(hosts) - set(HOSTS):
        p.error(f"--hosts={a.hosts!r}: choose from {', '.join(HOSTS)}.")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        p.error("run bench/integrations.py directly, not under a launcher.")
    cfg = Config(
        hosts=hosts,
        steps=a.steps,
        warmup=a.warmup,
        rounds=a.rounds,
        **common.gpt_args(a),
        timeout_s=a.timeout_s,
    )
    if min(cfg.steps, cfg.rounds) < 1 or cfg.warmup < 0:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0.")
    try:
        _ = cfg.gpt
    except ValueError as exc:
        p.error(str(exc))
    return cfg, a.out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--lightning-worker"]:  # also how Lightning's launcher re-runs rank 1
        raw = json.loads(args[1])
        cfg = Config(**{**raw, "hosts": tuple(raw["hosts"])})
        _lt_worker(cfg, Path(args[2]))
        # Leave with no live process group: gloo's threads, still holding tensors while
        # Python shuts down, otherwise abort the exit now and then ("terminate called").
        shardwise.shutdown()
        return 0
    cfg, out = _parse_args(args)
    start = time.perf_counter()
    report: dict[str, Any] = {
        **common.dated_header(
            "integrations", common.command_line(argv=args), common.device_description("cpu", WORLD)
        ),
        "world_size": WORLD,
        "backend": "gloo",
        "config": asdict(cfg),
        "params": GPT(cfg.gpt).num_params(),
        "target_step_time_ratio": TARGET,
        "method": (
            "every variant its own model copy from the same seed; barrier before each step, "
            "perf_counter; a step's time is the slowest rank's; median over steps. mmengine: "
            "variants alternate step by step in seeded random order. Lightning: whole fits "
            "alternate in seeded random order, a callback times on_train_batch_start -> "
            "on_train_batch_end, the first --warmup steps of each fit excluded."
        ),
    }
    if "mmengine" in cfg.hosts:
        report["mmengine"] = _run_mmengine(cfg)
    if "lightning" in cfg.hosts:
        report["lightning"] = _run_lightning(cfg)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    common.emit_json(report, out)
    for host in HOSTS:
        if host in report:
            ms = report[host]["median_step_ms"]
            for key, r in report[host]["ratios"].items():
                a, b = key.split("/")
                print(
                    f"{host:<9} {key:<33} {ms[a]:8.1f} ms vs {ms[b]:8.1f} ms: ratio "
                    f"{r['ratio_of_medians']:.4f}, paired {r['paired_ratio_median']:.4f} "
                    f"(target <= {TARGET})",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
