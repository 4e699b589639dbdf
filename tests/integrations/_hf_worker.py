"""Trainer scenarios for tests/integrations/test_transformers_trainer.py, run as a script.

`torchrun --nproc_per_node W _hf_worker.py OUT PHASE` (or plain `python` for world 1):
every scenario of PHASE runs in the same process group, one after another, and rank 0
writes OUT/<PHASE>.json (each scenario's logged losses and facts) and
OUT/<PHASE>-<name>.pt (its final parameters, gathered).

Every scenario trains the same tiny Llama on the same 48 rows: 6 optimizer steps of a
global batch of 8 (4 rows a micro-batch over the data-parallel ranks, gradient
accumulation 2), max_grad_norm 0.5, the sequential sampler, dropout 0, and labels with a
different number of masked tokens per row (so the token count across ranks matters).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments

from shardwise import ParallelConfig
from shardwise.integrations.transformers import ShardwiseTrainer, shardwise_trainer
from shardwise.parallelize.recompute import is_checkpointed
from shardwise.testing.parity import full_parameters

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
OUT, PHASE = Path(sys.argv[1]), sys.argv[2]
ROWS, SEQ, VOCAB, MICRO = 48, 16, 64, 4  # MICRO rows per micro-batch over the dp ranks


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = ROWS, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        keep = torch.randint(4, SEQ + 1, (n,), generator=g)  # 4..16 scored tokens a row
        for i, k in enumerate(keep.tolist()):
            self.labels[i, k:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def llama(tied: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(config)


def lora_config() -> Any:
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def lora_llama() -> Any:
    import peft

    model = peft.get_peft_model(llama(), lora_config())
    torch.manual_seed(1)  # LoRA's B starts at zero: give it values, so A trains at step 1
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def base_args(name: str, per_device: int) -> dict[str, Any]:
    """The arguments every scenario shares, the Trainer's and TRL's SFTConfig alike."""
    return dict(
        output_dir=str(OUT / f"{PHASE}-{name}"),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_steps=6,
        max_grad_norm=0.5,
        learning_rate=5e-3,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        train_sampling_strategy="sequential",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def targs(name: str, per_device: int, **kw: Any) -> TrainingArguments:
    return TrainingArguments(**{**base_args(name, per_device), **kw})


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.unsynced: list[bool] = []

    def on_substep_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        # After the first micro-batch of a step: no gradient has reached the shards when
        # the sync waited (FSDP2 keeps the unsharded sum until the last micro-batch).
        self.unsynced.append(all(p.grad is None for p in model.parameters()))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs and "grad_norm" in logs:
            self.losses.append(float(logs["loss"]))
            self.norms.append(float(logs["grad_norm"]))


def checkpointed(model: torch.nn.Module) -> int:
    """Modules whose forward shardwise recomputes in backward."""
    return sum(is_checkpointed(m) for m in model.modules())


def layout(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's placement: 'plain' or the DTensor's mesh shape and placements."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = f"{tuple(p.device_mesh.shape)} {[str(x) for x in p.placements]}"
        else:
            out[name] = "plain"
    return out


RESULTS: dict[str, Any] = {}


def record(name: str, trainer: Any, rec: Record, **facts: Any) -> None:
    params = full_parameters(trainer.model_wrapped)  # every rank gathers
    if rank() == 0:
        torch.save(params, OUT / f"{PHASE}-{name}.pt")
        RESULTS[name] = {
            "losses": rec.losses,
            "norms": rec.norms,
            "unsynced": rec.unsynced,
            **facts,
        }
        (OUT / f"{PHASE}.json").write_text(json.dumps(RESULTS))


def train(
    name: str,
    cls: Any,
    model: Any,
    per_device: int,
    parallel: ParallelConfig | None = None,
    resume: str | None = None,
    evaluate: bool = False,
    **kw: Any,
) -> Any:
    rec = Record()
    extra = {} if parallel is None else {"parallel": parallel}
    trainer = cls(
        model=model,
        args=targs(name, per_device, **kw),
        train_dataset=Rows(),
        eval_dataset=Rows(16, seed=99) if evaluate else None,
        callbacks=[rec],
        **extra,
    )
    trainer.train(resume_from_checkpoint=resume)
    facts: dict[str, Any] = {
        "layout": layout(trainer.model),
        "checkpointed": checkpointed(trainer.model),
    }
    if evaluate:
        facts["eval_loss"] = trainer.evaluate()["eval_loss"]
    record(name, trainer, rec, **facts)
    return trainer


class LocalClip(ShardwiseTrainer):
    """Negative control: clips each rank's shards by their own norm."""

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = (self.args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm


class WorldShare(ShardwiseTrainer):
    """Negative control under tp: Accelerate's share by process, not by dp rank."""

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        return Trainer._get_dataloader(self, *args, **kwargs)


def export_check(name: str, trainer: Any, load: Any) -> None:
    """save_model on every rank, then rank 0 opens it and compares with the trained
    parameters (the largest relative difference)."""
    out = OUT / f"{PHASE}-{name}-export"
    trainer.save_model(str(out))
    if rank() == 0:
        trained = torch.load(OUT / f"{PHASE}-{name}.pt")
        opened = {k: v.float() for k, v in load(str(out)).named_parameters()}
        worst = max(
            float((opened[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in trained.items()
        )
        RESULTS[name]["export_rel"] = worst
        RESULTS[name]["export_files"] = sorted(os.listdir(out))
        (OUT / f"{PHASE}.json").write_text(json.dumps(RESULTS))
    if dist.is_initialized():
        dist.barrier()


def open_adapter(path: str) -> Any:
    import peft

    torch.manual_seed(0)
    return peft.PeftModel.from_pretrained(llama(), path)


def phase_w2() -> None:
    per = MICRO // 2
    train("hf_ddp", Trainer, llama(), per, evaluate=True)
    full = train(
        "full_shard",
        ShardwiseTrainer,
        llama(),
        per,
        ParallelConfig(strategy="full_shard"),
        evaluate=True,
        save_strategy="steps",
        save_steps=3,
    )
    export_check("full_shard", full, transformers.LlamaForCausalLM.from_pretrained)
    train("local_clip", LocalClip, llama(), per, ParallelConfig(strategy="full_shard"))
    bf16 = train("bf16_full_shard", ShardwiseTrainer, llama(), per, ParallelConfig(), bf16=True)
    if rank() == 0:
        policy = fully_shard.state(bf16.model)._mp_policy  # type: ignore[attr-defined]
        RESULTS["bf16_full_shard"]["policy"] = [str(policy.param_dtype), str(policy.reduce_dtype)]
        RESULTS["bf16_full_shard"]["dtypes"] = sorted(
            {str(p.dtype) for p in bf16.model.parameters()}
        )
        (OUT / f"{PHASE}.json").write_text(json.dumps(RESULTS))
    train("shardwise_ddp", ShardwiseTrainer, llama(), per, ParallelConfig(strategy="ddp"))
    train("tied_hf_ddp", Trainer, llama(tied=True), per)
    train(
        "tied_full_shard",
        ShardwiseTrainer,
        llama(tied=True),
        per,
        ParallelConfig(strategy="full_shard"),
    )
    train("lora_hf_ddp", Trainer, lora_llama(), per)
    lora = train(
        "lora_full_shard",
        ShardwiseTrainer,
        lora_llama(),
        per,
        ParallelConfig(strategy="full_shard"),
    )
    export_check("lora_full_shard", lora, open_adapter)
    sft(per)


def sft(per: int) -> None:
    import datasets
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(7)
    rows = [
        {"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g).tolist()}
        for n in torch.randint(5, 13, (64,), generator=g)
    ]
    data = datasets.Dataset.from_list(rows)
    for name, cls, parallel in (
        ("sft_hf_ddp", SFTTrainer, None),
        ("sft_full_shard", shardwise_trainer(SFTTrainer), ParallelConfig(strategy="full_shard")),
    ):
        rec = Record()
        args = SFTConfig(
            **base_args(name, per),
            bf16=False,  # TRL defaults to True: compare in fp32 (bf16 is its own check)
            packing=True,
            max_length=SEQ,
            dataset_num_proc=None,
        )
        extra = {} if parallel is None else {"parallel": parallel}
        trainer = cls(
            model=llama(),
            args=args,
            train_dataset=data,
            processing_class=tokenizer(),
            peft_config=lora_config(),
            callbacks=[rec],
            **extra,
        )
        trainer.train()
        record(
            name,
            trainer,
            rec,
            layout=layout(trainer.model),
            checkpointed=checkpointed(trainer.model),
        )
        if parallel is not None:
            export_check(name, trainer, open_adapter)


def tokenizer() -> Any:
    """A word-level tokenizer over the model's vocabulary, built here (no download)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="t0", pad_token="t0", eos_token="t1"
    )


def phase_w1() -> None:
    """The world-2 full_shard run resumed at world 1 from its step-3 checkpoint, and the
    first step's loss computed by hand: the mean over every scored token of its 8 rows."""
    rows = Rows()
    labels = rows.labels[:8]
    with torch.no_grad():
        logits = llama()(input_ids=rows.ids[:8]).logits
    first = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )
    RESULTS["first_step"] = {"loss": float(first)}
    source = OUT / "w2-full_shard" / "checkpoint-3"
    train(
        "resumed",
        ShardwiseTrainer,
        llama(),
        MICRO,
        ParallelConfig(strategy="full_shard"),
        resume=str(source),
    )


def phase_w4() -> None:
    train("hf_ddp", Trainer, llama(), MICRO // 4)
    train(
        "hybrid",
        ShardwiseTrainer,
        llama(),
        MICRO // 4,
        ParallelConfig(strategy="hybrid_shard", dp_shard=2),
    )
    train("tp", ShardwiseTrainer, llama(), MICRO // 2, ParallelConfig(strategy="full_shard", tp=2))
    train(
        "tp_world_share",
        WorldShare,
        llama(),
        MICRO // 2,
        ParallelConfig(strategy="full_shard", tp=2),
    )
    stream = ShardwiseTrainer(
        model=llama(),
        args=targs("tp_stream", MICRO // 2),
        train_dataset=Stream(),
        parallel=ParallelConfig(strategy="full_shard", tp=2),
    )
    try:
        stream.get_train_dataloader()
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    if rank() == 0:
        RESULTS["tp_stream"] = {"refused": refused}
        (OUT / f"{PHASE}.json").write_text(json.dumps(RESULTS))


class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """The rows as a stream: its loader cannot be told a data-parallel rank."""

    def __iter__(self) -> Any:
        rows = Rows()
        return iter([rows[i] for i in range(len(rows))])


def phase_sft() -> None:
    sft(MICRO // 2)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    {"w1": phase_w1, "w2": phase_w2, "w4": phase_w4, "sft": phase_sft}[PHASE]()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
