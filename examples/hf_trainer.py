"""Train a small Llama with transformers.Trainer on shardwise's layout (ShardwiseTrainer).

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py       # full_shard, 2 CPUs
    python examples/hf_trainer.py --resume                                 # 1 process resumes

The script is a plain Trainer script but for the class and its `parallel=` argument. The
first command trains 4 of 8 steps (a checkpoint every 2) and stops; the second resumes
the newest checkpoint in one process, with the same global batch, trains to step 8 and
writes weights that `from_pretrained` opens.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import transformers
from transformers import TrainingArguments

from shardwise import ParallelConfig
from shardwise.integrations.transformers import ShardwiseTrainer

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 128


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, rows: int = 128) -> None:
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="full_shard")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=GLOBAL_BATCH // 2 // world,  # global batch 8 at any world
        gradient_accumulation_steps=2,
        max_steps=8,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=2,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = ShardwiseTrainer(
        model=model,
        args=training_args,
        train_dataset=Tokens(),
        parallel=ParallelConfig(strategy=args.strategy),
    )
    if not args.resume:  # stop after 4 steps, as a preempted job would
        trainer.add_callback(_StopAt(4))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.resume:
        export = os.path.join(args.output_dir, "final")
        trainer.save_model(export)  # every rank calls it; rank 0 writes
        if trainer.is_world_process_zero():
            reopened = transformers.LlamaForCausalLM.from_pretrained(export)
            print(f"exported {sum(p.numel() for p in reopened.parameters())} parameters")


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


if __name__ == "__main__":
    main()
