"""Quickstart: a character-level GPT trained data-parallel with one config value.

    python examples/quickstart.py                                          # 1 process
    torchrun --standalone --nproc_per_node 2 examples/quickstart.py        # 2 processes, FSDP
    torchrun --standalone --nproc_per_node 4 examples/quickstart.py --strategy hybrid_shard

The text is Python's own standard library source, read at run time: every machine has it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
from shardwise.testing.models import GPT, Block, GPTConfig


def load_corpus(max_chars: int = 400_000) -> str:
    stdlib = Path(argparse.__file__).parent
    files = ["argparse.py", "textwrap.py", "dataclasses.py", "pathlib.py", "inspect.py"]
    text = "".join((stdlib / f).read_text(encoding="utf-8") for f in files if (stdlib / f).exists())
    if not text:  # a stripped Python install: fall back to our own source
        text = Path(shardwise.__file__).read_text(encoding="utf-8") * 20
    return text[:max_chars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", default="full_shard", help="ddp, full_shard, hybrid_shard, ..."
    )
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    args = parser.parse_args()

    info = shardwise.init_distributed()
    text = load_corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=64, d_model=128, n_heads=4, n_layers=4)

    torch.manual_seed(0)
    model = GPT(cfg)
    config = shardwise.ParallelConfig(
        strategy=args.strategy, auto_wrap_policy={Block}, mixed_precision=args.precision
    )
    model = shardwise.wrap(model, config)  # the one line that makes it distributed
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # build AFTER wrap
    if info.is_main:
        print(shardwise.wrap_info(model))

    per_rank = args.batch // info.world_size
    gen = torch.Generator().manual_seed(1234)  # same draws on every rank...
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(data) - cfg.seq_len - 1, (args.batch,), generator=gen)
        idx = idx[info.rank * per_rank : (info.rank + 1) * per_rank]  # ...each takes its slice
        x = torch.stack([data[i : i + cfg.seq_len] for i in idx]).to(info.device)
        y = torch.stack([data[i + 1 : i + 1 + cfg.seq_len] for i in idx]).to(info.device)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            dist.all_reduce(loss := loss.detach().float())
            if info.is_main:
                print(f"step {step:4d}  loss {loss.item() / info.world_size:.3f}", flush=True)
    if info.is_main:
        tokens = args.steps * args.batch * cfg.seq_len
        elapsed = time.perf_counter() - start
        rate = tokens / elapsed
        print(f"done: {args.steps} steps, {rate:,.0f} tokens/s on {info.world_size} rank(s)")
    shardwise.shutdown()


if __name__ == "__main__":
    main()
