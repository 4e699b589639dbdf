"""Muon under full_shard: bytes moved, collectives, Newton–Schulz calls and step time per
step, shardwise.Muon against FSDP with AdamW and against torch.optim.Muon over the same
sharded parameters, at worlds 2 and 4 (CPU/gloo).

A llama-shaped MLP stack (per layer x + down(silu(gate(x)) * up(x)), bias-free: hidden
384, intermediate 1024, 4 layers, 12 matrices) trains on one global batch of 32 rows
under `full_shard`, one spawned group per world, three optimizers stepped alternately
(round r runs each once, in a rotating order):

- `adamw`: torch.optim.AdamW over the DTensor parameters (elementwise: the step sends
  nothing; the traffic is FSDP's own all-gathers and reduce-scatters);
- `torch_muon`: torch.optim.Muon over the DTensor parameters, built by hand (the Engine
  refuses it): DTensor assembles every matmul of Newton–Schulz, on every rank;
- `shardwise_muon`: shardwise.Muon (each matrix gathered on one owner rank,
  Newton–Schulz once there, the parts scattered back).

Newton–Schulz runs in float32 in both Muons (`ns_dtype`; torch's is patched to
float32), so the two compute the same numbers and the final losses can be compared.

Per optimizer, from one extra step under a counting dispatch mode (not timed): the
collectives of the whole step (forward, backward and optimizer step) by kind, and the
bytes each rank receives from other ranks, summed over the job (an all-gather's or a
reduce-scatter's (W - 1)/W of its whole tensor per rank, an all-reduce's twice that, a
broadcast's, gather's or scatter's piece per receiving rank). The torch functions FSDP2
calls and DTensor's functional collectives both go through the dispatcher, so one mode
sees both. One gradient's worth of traffic is FSDP's reduce-scatter of the gradients
(the issue's goal: at most one more per step than FSDP with AdamW). Newton–Schulz calls
are counted on every rank and summed. The step time is the median over rounds of the
slowest rank, without the counter; "in Newton–Schulz" is the time inside it on the
busiest rank (for torch's, DTensor's traffic inside it included).

    python bench/muon.py            # worlds 2 and 4, 6 rounds
    python bench/muon.py --smoke    # tiny sizes (seconds)
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise
from shardwise.testing import run_distributed
from shardwise.train import muon as muon_module

OPTIMIZERS = ("adamw", "torch_muon", "shardwise_muon")
LR = 0.02


class Block(nn.Module):
    """Llama's MLP with a residual: x + down(silu(gate(x)) * up(x)), bias-free."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Stack(nn.Module):
    """`layers` blocks and a mean-squared error; every parameter a hidden matrix."""

    def __init__(self, hidden: int, inter: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, inter) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return nn.functional.mse_loss(x, y)


# --- counting ---------------------------------------------------------------------------

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional
NOT_TRAFFIC = ("barrier", "barrier_", "wait_tensor", "_wrap_tensor_autograd")
"""c10d ops that move no tensor data (any other c10d op unknown here raises)."""


def _group_size_rank(group: Any) -> tuple[int, int]:
    if isinstance(group, str):  # a functional collective names its group
        group = dist.distributed_c10d._resolve_process_group(group)
    elif not isinstance(group, dist.ProcessGroup):  # a c10d op gets the script object
        group = dist.ProcessGroup.unbox(group)
    return group.size(), group.rank()


def _flat(tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(tensors))


def received_bytes(op: Any, args: tuple[Any, ...]) -> tuple[str, int] | None:
    """(kind, bytes this rank receives from other ranks) of a collective, or None for any
    other op. Collectives are counted by what they must deliver, not by an algorithm:
    all-gather and reduce-scatter (W - 1)/W of the whole tensor, all-reduce twice that."""
    packet = op.overloadpacket
    if packet in (_c10d._allgather_base_, _c10d.allgather_):
        w, _ = _group_size_rank(args[2])
        return "all_gather", (w - 1) * _nbytes(args[1])
    if packet in (_c10d._reduce_scatter_base_, _c10d.reduce_scatter_):
        w, _ = _group_size_rank(args[2])
        return "reduce_scatter", (w - 1) * _nbytes(args[0])
    if packet is _c10d.allreduce_:
        w, _ = _group_size_rank(args[1])
        return "all_reduce", 2 * (w - 1) * _nbytes(args[0]) // w
    if packet is _c10d.broadcast_:
        w, me = _group_size_rank(args[1])
        return "broadcast", 0 if me == args[2] else _nbytes(args[0])
    if packet is _c10d.gather_:
        w, me = _group_size_rank(args[2])
        return "gather", (w - 1) * _nbytes(args[1]) if me == args[3] else 0
    if packet is _c10d.scatter_:
        w, me = _group_size_rank(args[2])
        return "scatter", 0 if me == args[3] else _nbytes(args[0])
    if packet is _funcol.all_gather_into_tensor:
        return "all_gather", (int(args[1]) - 1) * _nbytes(args[0])
    if packet is _funcol.reduce_scatter_tensor:
        w = int(args[2])
        return "reduce_scatter", (w - 1) * _nbytes(args[0]) // w
    if packet is _funcol.all_reduce:
        w, _ = _group_size_rank(args[2])
        return "all_reduce", 2 * (w - 1) * _nbytes(args[0]) // w
    if packet is _funcol.broadcast:
        w, me = _group_size_rank(args[2])
        return "broadcast", 0 if me == args[1] else _nbytes(args[0])
    if packet is _funcol.all_to_all_single:
        w, me = _group_size_rank(args[3])
        out = args[1] or [args[0].shape[0] // w] * w
        row = args[0][0].numel() * args[0].element_size() if args[0].shape[0] else 0
        return "all_to_all", sum(n for j, n in enumerate(out) if j != me) * row
    name = str(packet)
    if "c10d" in name and not name.endswith(NOT_TRAFFIC):
        raise NotImplementedError(f"bench/muon.py: no byte count for the collective {name}")
    return None


class CountCollectives(TorchDispatchMode):
    """Every collective dispatched inside the block: calls by kind and bytes received.
    Ops on DTensors are left to DTensor (NotImplemented), so the collectives it issues to
    redistribute come through here too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        found = received_bytes(func, args)
        if found is not None:
            kind, n = found
            self.calls[kind] += 1
            self.bytes[kind] += n
        return func(*args, **(kwargs or {}))


# --- the ranks ----------------------------------------------------------------------------


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "torch_muon":
        return torch.optim.Muon(model.parameters(), lr=LR)
    return shardwise.Muon(
        model.named_parameters(), lr=LR, ns_dtype=torch.float32, fallback_names=()
    )


def _float32_torch_newton_schulz(counter: Counter[str], clock: dict[str, float]) -> Any:
    """torch's Newton–Schulz in float32 (its own is bf16), counted and timed."""
    from torch.optim import _muon

    def run(grad: torch.Tensor, coefficients: Any, steps: int, eps: float) -> torch.Tensor:
        counter["torch_muon"] += 1
        start = time.perf_counter()
        out = _float32(grad, coefficients, steps, eps)
        clock["torch_muon"] += time.perf_counter() - start
        return out

    _muon._zeropower_via_newtonschulz = run
    return _muon


def _float32(grad: torch.Tensor, coefficients: Any, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton–Schulz in float32 (on DTensors: DTensor's matmuls)."""
    a, b, c = coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _rank(size: dict[str, int], batch: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ns: Counter[str] = Counter()
    clock: dict[str, float] = {name: 0.0 for name in OPTIMIZERS}
    _float32_torch_newton_schulz(ns, clock)
    real = muon_module.newton_schulz

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        ns["shardwise_muon"] += 1
        start = time.perf_counter()
        out = real(*args, **kwargs)
        clock["shardwise_muon"] += time.perf_counter() - start
        return out

    muon_module.newton_schulz = counted
    runs = {}
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = shardwise.wrap(
            Stack(size["hidden"], size["inter"], size["layers"]),
            shardwise.ParallelConfig(strategy="full_shard"),
        )
        runs[name] = (model, _optimizer(name, model))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, size["hidden"], generator=g)
    y = torch.randn(batch, size["hidden"], generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * batch // world, (rank + 1) * batch // world)

    in_ns: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}

    def step(name: str) -> float:
        model, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        loss = model(x[rows], y[rows])
        loss.backward()
        before = clock[name]
        opt.step()
        in_ns[name].append(clock[name] - before)
        return float(loss.detach())

    counts: dict[str, Any] = {}
    for name in OPTIMIZERS:  # one counted step each (not timed), after a first one
        step(name)
        before = ns[name]
        with CountCollectives() as mode:
            step(name)
        counts[name] = {
            "calls": dict(mode.calls),
            "bytes": dict(mode.bytes),
            "newton_schulz": ns[name] - before,
        }
    n = len(OPTIMIZERS)
    orders = [OPTIMIZERS[r % n :] + OPTIMIZERS[: r % n] for r in range(rounds + 1)]
    steps = {name: functools.partial(step, name) for name in OPTIMIZERS}
    times, losses = common.timed_rounds(steps, orders, warmup=1, barrier=True)
    matrices = sum(1 for _ in runs["adamw"][0].parameters())
    ns_s = {name: in_ns[name][-rounds:] for name in OPTIMIZERS}  # the timed rounds'
    return {"counts": counts, "times": times, "ns_s": ns_s, "losses": losses, "matrices": matrices}


def run(world: int, size: dict[str, int], batch: int, rounds: int) -> dict[str, Any]:
    per_rank = run_distributed(_rank, world, args=(size, batch, rounds), timeout_s=1800)
    figures: dict[str, Any] = {"matrices": per_rank[0]["matrices"]}
    for name in OPTIMIZERS:
        calls: Counter[str] = Counter()
        moved: Counter[str] = Counter()
        for r in per_rank:
            calls.update(r["counts"][name]["calls"])
            moved.update(r["counts"][name]["bytes"])
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(rounds)]
        figures[name] = {
            "bytes_per_step": sum(moved.values()),
            "bytes_by_kind": dict(moved),
            "collectives_per_rank_step": {k: v // world for k, v in calls.items()},
            "collectives_per_step": sum(calls.values()) // world,
            "newton_schulz_per_step": sum(r["counts"][name]["newton_schulz"] for r in per_rank),
            "median_s": statistics.median(slowest),
            "newton_schulz_s": statistics.median(
                max(r["ns_s"][name][i] for r in per_rank) for i in range(rounds)
            ),
            "rounds_s": slowest,
            "final_loss_rank0": per_rank[0]["losses"][name],
        }
    ours = figures["shardwise_muon"]
    # One gradient's worth of traffic: FSDP's reduce-scatter of the gradients.
    gradient = figures["adamw"]["bytes_by_kind"]["reduce_scatter"]
    for name in ("torch_muon", "shardwise_muon"):
        extra = figures[name]["bytes_per_step"] - figures["adamw"]["bytes_per_step"]
        figures[name]["extra_over_adamw_in_gradients"] = extra / gradient
    for other in ("adamw", "torch_muon"):
        figures[f"shardwise_muon_over_{other}"] = {
            "bytes": common.ratio(ours["bytes_per_step"], figures[other]["bytes_per_step"]),
            "step_time": common.ratio(ours["median_s"], figures[other]["median_s"]),
        }
    return figures


def table(world: int, figures: dict[str, Any]) -> str:
    lines = [
        f"world {world} ({figures['matrices']} matrices)",
        f"{'optimizer':<16} {'bytes/step':>12} {'collectives/rank':>17} {'NS calls':>9} "
        f"{'step (median)':>14} {'in Newton-Schulz':>17}",
    ]
    for name in OPTIMIZERS:
        f = figures[name]
        lines.append(
            f"{name:<16} {f['bytes_per_step'] / 1024:>9.0f} KiB {f['collectives_per_step']:>17} "
            f"{f['newton_schulz_per_step']:>9} {f['median_s'] * 1000:>11.1f} ms "
            f"{f['newton_schulz_s'] * 1000:>14.1f} ms"
        )
    for other in ("adamw", "torch_muon"):
        r = figures[f"shardwise_muon_over_{other}"]
        lines.append(
            f"shardwise_muon / {other}: bytes {r['bytes']:.2f}x, step {r['step_time']:.2f}x"
        )
    for name in ("torch_muon", "shardwise_muon"):
        extra = figures[name]["extra_over_adamw_in_gradients"]
        lines.append(f"{name}: {extra:.2f} gradients' worth of traffic over AdamW's")
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    if args.smoke:
        size, batch, rounds = {"hidden": 16, "inter": 40, "layers": 1}, 8, 1
    else:
        size, batch, rounds = {"hidden": 384, "inter": 1024, "layers": 4}, 32, args.rounds
    worlds = [int(w) for w in args.worlds.split(",")]
    by_world = {}
    for world in worlds:
        by_world[f"world_{world}"] = run(world, size, batch, rounds)
        print(table(world, by_world[f"world_{world}"]))
    header = common.dated_header(
        "muon", common.command_line("python bench/muon.py"),
        common.device_description("cpu", max(worlds)),
    )  # fmt: skip
    common.emit_json({**header, "model": size, "global_batch": batch, **by_world})


if __name__ == "__main__":
    main()
