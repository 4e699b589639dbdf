"""Expert parallel against the experts split over tp and against plain FSDP: step time at
world 4 on one mixture of experts and one global batch (CPU/gloo), and the all-to-all volume.

One transformers Qwen3-MoE (width 256, 4 layers, 8 experts of width 256, 2 per token,
vocabulary 1024) trains through the Engine under each layout, in one spawned group of 4,
stepped alternately (round r runs every layout once, in a rotating order):

- `full_shard`: FSDP over 4 ranks; every expert of a layer is gathered at each forward;
- `tp2`: dp 2 × tp 2; attention and every expert split over tp (the model's own plan);
- `ep2`: full_shard with ep 2; each rank holds 4 whole experts, sharded over 2 ranks;
- `ep4`: full_shard with ep 4; each rank holds 2 whole experts, not sharded further.

Reported per layout: the median over rounds of the slowest rank's step time, its ratio to
full_shard, and, for ep, the bytes each rank sends to other ranks per step through the
all-to-alls (dispatch and combine in the forward, and the same again in the backward),
counted from the split sizes of every call. What CPU timing can say: the cost of the
dispatch (sorting, the count exchange, the uneven all-to-alls) against gathering the
experts, on one host where every transfer is a memory copy. What it cannot: the trade on
GPUs across nodes, where FSDP's all-gather of every expert crosses slow links and ep's
all-to-all moves only the tokens.

    python bench/experts.py            # 16 sequences of 128, 8 rounds
    python bench/experts.py --smoke    # a tiny model (seconds)
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import common
import torch
import torch.distributed as dist

from shardwise import Engine, ParallelConfig, wrap_info
from shardwise.parallelize import experts as ep_module
from shardwise.testing import run_distributed

WORLD = 4
LAYOUTS: dict[str, dict[str, Any]] = {
    "full_shard": {"strategy": "full_shard"},
    "tp2": {"strategy": "full_shard", "tp": 2},
    "ep2": {"strategy": "full_shard", "ep": 2},
    "ep4": {"strategy": "full_shard", "ep": 4},
}


def build(size: dict[str, int]) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["hidden"] * 2,
        moe_intermediate_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=size["hidden"] // 8,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        use_cache=False,
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


_SENT = [0]


def _counting(original: Any) -> Any:
    """all_to_all_single_autograd, counting the bytes this rank sends to other ranks."""

    def call(t: torch.Tensor, out_splits: Any, in_splits: list[int], group: Any) -> Any:
        me = dist.get_rank(group)
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        _SENT[0] += sum(n for j, n in enumerate(in_splits) if j != me) * row
        return original(t, out_splits, in_splits, group)

    return call


def _rank(size: dict[str, int], batch: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ep_module.all_to_all_single_autograd = _counting(ep_module.all_to_all_single_autograd)
    engines = {
        name: Engine(
            build(size), functools.partial(torch.optim.AdamW, lr=1e-4), ParallelConfig(**fields)
        )
        for name, fields in LAYOUTS.items()
    }
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=g)
    sent: dict[str, int] = {}

    def step(name: str) -> Any:
        engine = engines[name]
        info = wrap_info(engine.model)
        assert info is not None
        per = batch // info.dp_size
        rows = ids[info.dp_rank * per : (info.dp_rank + 1) * per]
        before = _SENT[0]
        loss = engine.train_step({"input_ids": rows, "labels": rows})["loss"]
        sent[name] = _SENT[0] - before  # forward only: the backward sends as much again
        return loss

    names = tuple(LAYOUTS)
    n = len(names)
    orders = [names[r % n :] + names[: r % n] for r in range(rounds + 1)]
    steps = {name: functools.partial(step, name) for name in names}
    times, losses = common.timed_rounds(steps, orders, warmup=1, barrier=True)
    return {"times": times, "losses": losses, "sent_forward_bytes": sent}


def run(size: dict[str, int], batch: int, rounds: int) -> dict[str, Any]:
    per_rank = run_distributed(_rank, WORLD, args=(size, batch, rounds), timeout_s=1800)
    figures: dict[str, Any] = {}
    for name in LAYOUTS:
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(rounds)]
        sent = max(r["sent_forward_bytes"].get(name, 0) for r in per_rank)
        figures[name] = {
            "median_s": statistics.median(slowest),
            "rounds_s": slowest,
            "all_to_all_bytes_per_rank_step": 2 * sent,  # the backward sends as much again
            "final_loss_rank0": float(per_rank[0]["losses"][name]),
        }
    base = figures["full_shard"]["median_s"]
    for name in LAYOUTS:
        figures[name]["ratio_to_full_shard"] = common.ratio(figures[name]["median_s"], base)
    return figures


def table(figures: dict[str, Any]) -> str:
    lines = [f"{'layout':<12} {'step (median, slowest rank)':>28} {'vs full_shard':>14} "
             f"{'all-to-all sent per rank-step':>30}"]  # fmt: skip
    for name, f in figures.items():
        sent = f["all_to_all_bytes_per_rank_step"]
        lines.append(
            f"{name:<12} {f['median_s'] * 1000:>25.1f} ms {f['ratio_to_full_shard']:>13.2f}x "
            f"{sent / 1024:>26.1f} KiB"
        )
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (seconds)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if args.smoke:
        size, batch, rounds = {"hidden": 32, "layers": 2, "vocab": 64, "seq": 16}, 8, 2
    else:
        size, batch, rounds = (
            {"hidden": 256, "layers": 4, "vocab": 1024, "seq": 128},
            16,
            args.rounds,
        )
    figures = run(size, batch, rounds)
    print(table(figures))
    header = common.dated_header(
        "experts", common.command_line("python bench/experts.py"),
        common.device_description("cpu", WORLD),
    )  # fmt: skip
    common.emit_json({**header, "model": size, "global_batch": batch, **figures})


if __name__ == "__main__":
    main()
