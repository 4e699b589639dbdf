"""Train a small GPT with lightning.Trainer and ShardwiseStrategy (FSDP2 by default).

    python examples/lightning_train.py                      # 2 CPU processes, full_shard
    python examples/lightning_train.py --strategy ddp --devices 1
    python examples/lightning_train.py --accelerator gpu --devices 8 --strategy hybrid_shard

Lightning starts the other processes itself (or run it under torchrun). The model is built
in `configure_model`, so its parameters start on the meta device and each rank allocates
only its shards; the checkpoint is a DCP directory, resumable at any world size.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise.integrations.lightning import ShardwiseStrategy
from shardwise.testing.models import GPT, GPTConfig


class LitGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, lr: float = 3e-3) -> None:
        super().__init__()
        self.config, self.lr = config, lr

    def configure_model(self) -> None:
        if not hasattr(self, "gpt"):  # called again by a second fit/validate
            self.gpt = GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self.gpt(idx, targets)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)  # after wrapping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="full_shard")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--checkpoint", default="lightning_ckpt/last.ckpt")
    args = parser.parse_args()

    L.seed_everything(0)
    config = GPTConfig()
    tokens = torch.randint(0, config.vocab_size, (512, config.seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)
    trainer = L.Trainer(
        strategy=ShardwiseStrategy(strategy=args.strategy),
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.steps,
        gradient_clip_val=args.clip,  # clipped by the norm over every shard
        logger=False,
        enable_checkpointing=False,
    )
    model = LitGPT(config)
    trainer.fit(model, data)
    trainer.save_checkpoint(args.checkpoint)  # each rank writes its shards
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss']:.4f}; checkpoint {args.checkpoint}")


if __name__ == "__main__":
    main()
