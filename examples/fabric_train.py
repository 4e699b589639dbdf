"""Train a small GPT with a LitGPT-style Fabric loop and ShardwiseFabricStrategy.

    python examples/fabric_train.py                          # 2 CPU processes, full_shard
    python examples/fabric_train.py --resume                 # continue from its checkpoint
    python examples/fabric_train.py --strategy hybrid_shard --devices 4
    python examples/fabric_train.py --accelerator gpu --devices 8 --tp 2

Only the `strategy=` argument is shardwise's: the loop is Fabric's (`fabric.setup`,
`fabric.backward`, `fabric.no_backward_sync`, `fabric.clip_gradients`, `fabric.save` and
`fabric.load`). Fabric starts the other processes itself (or run it under torchrun).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise.integrations.fabric import ShardwiseFabricStrategy
from shardwise.testing.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="full_shard")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--checkpoint", default="fabric_ckpt")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    strategy = ShardwiseFabricStrategy(strategy=args.strategy, tp=args.tp)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    config = GPTConfig()
    with fabric.init_module(empty_init=True):  # on meta: each rank allocates its shards
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    if args.resume:
        fabric.load(args.checkpoint, state)

    tokens = torch.randint(0, config.vocab_size, (512, config.seq_len + 1))
    data = fabric.setup_dataloaders(
        DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8, shuffle=True)
    )
    batches = iter(data)
    for _ in range(args.steps):
        for micro in range(args.accumulate):
            idx, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(idx, targets)
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm over every shard
        optimizer.step()
        optimizer.zero_grad()
        state["iter_num"] += 1
    fabric.save(args.checkpoint, state)  # every rank writes its shards
    step, last = state["iter_num"], float(loss.detach())
    fabric.print(f"step {step}: loss {last:.4f}; checkpoint {args.checkpoint}")


if __name__ == "__main__":
    main()
