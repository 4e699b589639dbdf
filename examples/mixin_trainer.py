"""A project's own trainer with a parallel mixin, on shardwise: no integration code needed.

Trainers of the k-scale `ml` kind keep a small dataclass of parallel settings
(`use_fsdp`, `sharding_strategy`, `cpu_offload`, `sync_module_states`) and a mixin whose
`wrap_model` picks DDP or FSDP from it. With shardwise the mixin shrinks to one call: those
very words are `ParallelConfig` keywords (use_fsdp=False means DDP; use_fsdp=True means its
`sharding_strategy`, HYBRID_SHARD by default, as in that mixin), and `shardwise.wrap` does
the rest, including "no wrapping at world size 1". The settings can stay in the project's
YAML, string enums included (`sharding_strategy: ShardingStrategy.FULL_SHARD`).

    python examples/mixin_trainer.py                                         # 1 process
    torchrun --standalone --nproc_per_node 2 examples/mixin_trainer.py --use-fsdp \\
        --sharding-strategy ShardingStrategy.FULL_SHARD
    torchrun --standalone --nproc_per_node 4 examples/mixin_trainer.py --use-fsdp  # HSDP 2x2
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch
from torch import nn

import shardwise
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches


@dataclass
class ParallelSettings:
    """The project's own config section, unchanged from its FSDP1 days."""

    use_fsdp: bool = False
    sharding_strategy: str = "ShardingStrategy.HYBRID_SHARD"
    cpu_offload: bool = False
    sync_module_states: bool = True


class ParallelMixin:
    """The whole mixin: its settings become a ParallelConfig, and wrap does the work."""

    parallel: ParallelSettings

    def wrap_model(self, model: nn.Module) -> nn.Module:
        config = shardwise.ParallelConfig(**asdict(self.parallel))
        return shardwise.wrap(model, config)


class Trainer(ParallelMixin):
    def __init__(self, parallel: ParallelSettings, steps: int, batch: int) -> None:
        self.parallel, self.steps, self.batch = parallel, steps, batch

    def fit(self) -> None:
        info = shardwise.init_distributed()
        cfg = GPTConfig()
        torch.manual_seed(0)
        model = self.wrap_model(GPT(cfg))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping
        if info.is_main:
            print(shardwise.wrap_info(model))
        for step, (x, y) in enumerate(random_lm_batches(cfg, self.steps, self.batch, seed=1)):
            per_rank = self.batch // info.world_size
            mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
            loss = model(x[mine].to(info.device), y[mine].to(info.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if info.is_main:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        if info.is_main:
            print(f"done: {self.steps} steps on {info.world_size} rank(s)")
        shardwise.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--use-fsdp", action="store_true")
    parser.add_argument("--sharding-strategy", default="ShardingStrategy.HYBRID_SHARD")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    settings = ParallelSettings(use_fsdp=args.use_fsdp, sharding_strategy=args.sharding_strategy)
    Trainer(settings, args.steps, args.batch).fit()


if __name__ == "__main__":
    main()
