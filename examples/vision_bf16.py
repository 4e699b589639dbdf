"""Vision in bf16: a CNN with BatchNorm trained by shardwise's Engine and Runner.

    python examples/vision_bf16.py                                         # 1 process
    torchrun --standalone --nproc_per_node 2 examples/vision_bf16.py --run-dir runs/vision_bf16-fsdp

Each run needs a run directory of its own (--run-dir; the Runner refuses to start afresh
where a run already wrote its metrics); --strategy ddp (or another) picks the strategy.

The images are synthetic, made here, so nothing is downloaded: each 32x32 RGB image is
noise plus a faint copy of one of 10 smooth random templates, and its class is the
template it correlates with most. Under bf16, BatchNorm's statistics would lose precision,
so shardwise gives each BatchNorm a unit of its own that computes in float32 (the plan
printed at the start lists them as keep_fp32). Metrics go to RUN_DIR/metrics.csv.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise

NUM_CLASSES = 10


def make_images(n: int, seed: int, signal: float = 0.1) -> TensorDataset:
    """`n` images and labels; every rank draws the same ones (the Runner slices them)."""
    g = torch.Generator().manual_seed(1234)  # the templates are shared by all splits
    templates = F.interpolate(
        torch.randn(NUM_CLASSES, 3, 4, 4, generator=g), size=32, mode="bilinear"
    )
    templates = templates / templates.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * 32
    g = torch.Generator().manual_seed(seed)
    drawn = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    images = torch.randn(n, 3, 32, 32, generator=g) + signal * templates[drawn]
    # The label is a rule the model can learn: the best-matching template.
    labels = torch.einsum("nchw,kchw->nk", images, templates).argmax(dim=1)
    return TensorDataset(images, labels)


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)  # BatchNorm has the bias
        self.norm = nn.BatchNorm2d(c_out)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.norm(self.conv(x))))


class SmallCNN(nn.Module):
    """Three conv blocks (32x32 -> 4x4), then a linear classifier."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        # Same-class children of a Sequential: the "auto" policy makes each block a unit.
        self.blocks = nn.Sequential(
            ConvBlock(3, width), ConvBlock(width, 2 * width), ConvBlock(2 * width, 4 * width)
        )
        self.head = nn.Linear(4 * width * 4 * 4, NUM_CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        # The engine's plain contract: keys with "loss" are summed and backpropagated,
        # every other scalar (accuracy here) is logged for train and val alike.
        logits = self.head(self.blocks(images).flatten(1)).float()
        loss = F.cross_entropy(logits, labels)
        acc = (logits.argmax(dim=1) == labels).float().mean()
        return {"loss": loss, "acc": acc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="full_shard", help="ddp, full_shard, ...")
    parser.add_argument("--precision", default="bf16", help="bf16, fp16 or fp32")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=64, help="global batch (images)")
    parser.add_argument("--run-dir", default="runs/vision_bf16")
    args = parser.parse_args()

    info = shardwise.init_distributed()  # world size 1 without torchrun
    train_data = make_images(8192, seed=1)
    val_data = make_images(1024, seed=2)

    torch.manual_seed(0)
    engine = shardwise.Engine(
        SmallCNN(),
        lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.05),  # after wrap
        shardwise.ParallelConfig(strategy=args.strategy, mixed_precision=args.precision),
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps),
        train=shardwise.TrainConfig(max_grad_norm=1.0),
    )
    if info.is_main:
        print(shardwise.wrap_info(engine.model), flush=True)

    val_every = max(1, args.steps // 5)
    runner = shardwise.Runner(
        engine,
        train_data,
        val_data,
        config=shardwise.RunnerConfig(
            max_epochs=None,
            max_steps=args.steps,
            batch_size=max(1, args.batch // info.world_size),  # per rank
            val_every=val_every,
            run_dir=args.run_dir,
            progress=True,
        ),
    )
    before = runner.validate()  # step 0: the chance-level baseline, also in metrics.csv
    if info.is_main:
        print(f"before training: val loss {before['loss']:.4f}  val acc {before['acc']:.3f}")
    summary = runner.fit()
    final = summary["val"] if engine.step % val_every == 0 else runner.validate()
    if info.is_main:
        print(
            f"done: {engine.step} steps on {info.world_size} rank(s) in "
            f"{summary['seconds']:.1f}s  val loss {final['loss']:.4f}  "
            f"val acc {final['acc']:.3f}  run dir {summary['run_dir']}",
            flush=True,
        )
    shardwise.shutdown()


if __name__ == "__main__":
    main()
