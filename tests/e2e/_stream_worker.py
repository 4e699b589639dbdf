"""One rank of the streamed-corpus test: a tiny Llama trains on 400 generated documents,
streamed from a datasets IterableDataset of 8 shards, packed into rows of 32 tokens, in 2
DataLoader workers (run by tests/e2e/test_streams.py through `shardwise run`).

Every token of document i is 1 + i, so a row's tokens name the documents it holds. Each
rank writes the rows of each micro-batch it trained, in order, and the loss of each step.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import transformers
from datasets import Dataset

import shardwise
from shardwise import Engine, ParallelConfig, Runner, RunnerConfig, TrainConfig
from shardwise.train.packing import pack

DOCUMENTS, SHARDS, SEQ = 400, 8, 32


def corpus():
    rng = random.Random(0)
    texts = ["x" * rng.randint(3, 60) for _ in range(DOCUMENTS)]
    table = Dataset.from_dict({"id": list(range(DOCUMENTS)), "text": texts})
    return table.to_iterable_dataset(num_shards=SHARDS)


def tokenize(document):
    return [1 + document["id"]] * len(document["text"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()
    info = shardwise.init_distributed()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    engine = Engine(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        ParallelConfig(strategy="full_shard"),
        train=TrainConfig(accumulate_steps=args.accumulate, loss_over="tokens"),
    )
    rows: list[list[list[int]]] = []
    train_step = engine.train_step

    def recording(batch, **kwargs):
        rows.append(batch["input_ids"].tolist())
        return train_step(batch, **kwargs)

    engine.train_step = recording  # type: ignore[method-assign]
    runner = Runner(
        engine,
        pack(corpus(), SEQ, tokenize=tokenize),
        config=RunnerConfig(
            run_dir=args.run_dir, batch_size=2, num_workers=args.workers, stream_parts=8,
            max_epochs=1, max_steps=args.max_steps, save_at_end=True, resume=args.resume,
            progress=False,
        ),
    )  # fmt: skip
    summary = runner.fit()
    out = Path(args.run_dir) / f"rows.{info.rank}.json"
    losses = [r["loss"] for r in runner.history if r.get("split") == "train"]
    steps = engine.train_config.accumulate_steps
    out.write_text(json.dumps({"rows": rows, "losses": losses, "steps": summary["steps"],
                               "accumulate_steps": steps}))  # fmt: skip


if __name__ == "__main__":
    main()
