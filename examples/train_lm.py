"""Train a byte-level GPT on Python's standard library source, configured by YAML.

    python examples/train_lm.py                                   # 1 process
    shardwise run --nproc 2 examples/train_lm.py                  # 2 processes, FSDP
    shardwise run --nproc 4 examples/train_lm.py parallel.strategy=hybrid_shard
    python examples/train_lm.py --config my.yaml runner.max_steps=20 optimizer.lr=1e-3
    shardwise run --nproc 2 examples/train_lm.py --init-from runs/train_lm/export \
        --rank0-reads runner.run_dir=runs/finetune           # continue from exported weights
    shardwise run --nproc 2 examples/train_lm.py --config lora.yaml --init-from runs/base/export
                                        # LoRA: a config file with an `adapter` section

The same job as `shardwise demo`, written out as the script you would copy: config ->
data -> engine (wraps the model, builds the optimizer after wrapping) -> runner -> export.
Rerunning after an interruption resumes from the latest checkpoint (runner.resume).
With --init-from, the model is built on the meta device and wrapped with the exported
weights, the path for models too big to build on one device: each rank allocates and fills
only its shards (with --rank0-reads, only rank 0 reads the files and scatters them).
A config with an `adapter` section trains LoRA adapters on a frozen model instead (the
Engine adds them with peft before wrapping); peft adds them to a model holding its
weights, so with --init-from that model is built whole and filled first.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import shardwise
from shardwise import Preempted
from shardwise.cli.demo import ByteWindows
from shardwise.config.run_file import Config, load_config
from shardwise.testing.models import GPT, GPTConfig

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE / "train_lm.yaml"))
    parser.add_argument("--init-from", help="safetensors weights to start from (an export/)")
    parser.add_argument(
        "--rank0-reads", action="store_true", help="with --init-from: only rank 0 reads them"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides, cls=Config)  # strict: typos are errors

    info = shardwise.init_distributed()
    stdlib = Path(os.__file__).parent
    text = b"".join(
        (stdlib / f).read_bytes() for f in ("argparse.py", "dataclasses.py", "typing.py")
    )
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(data) * 0.95)
    model_cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4)
    train = ByteWindows(data[:split], model_cfg.seq_len)
    val = ByteWindows(data[split:], model_cfg.seq_len)

    # Seed before building: the initial weights are drawn here, and the Runner seeds again
    # only at fit() (same seed and world size, same losses from step 1).
    shardwise.seed_everything(cfg.runner.seed)
    if args.init_from and cfg.adapter is not None:
        model = GPT(model_cfg)  # adapters start as "no change" only on the real weights
        shardwise.load_weights(model, args.init_from, broadcast_from_rank0=args.rank0_reads)
    elif args.init_from:
        with shardwise.init_empty():  # nothing allocated until wrap() has sharded it
            model = GPT(model_cfg)
        model = shardwise.wrap(
            model, cfg.parallel, weights=args.init_from, broadcast_from_rank0=args.rank0_reads
        )
    else:
        model = GPT(model_cfg)
    total = cfg.runner.max_steps or 1000
    engine = shardwise.Engine(
        model,
        cfg.optimizer.build,  # a factory: the optimizer is built from the wrapped parameters
        cfg.parallel,
        scheduler=lambda opt: cfg.scheduler.build(opt, total),
        train=cfg.train,
        adapter=cfg.adapter,  # None unless the config has an `adapter` section
    )
    if info.is_main:
        print(shardwise.wrap_info(engine.model))
    runner = shardwise.Runner(engine, train, val, config=cfg.runner)
    if args.init_from:
        start = runner.validate().get("loss", float("nan"))
        if info.is_main:
            print(f"val loss of the weights in {args.init_from}: {start:.4f}")
    try:
        summary = runner.fit()
    except Preempted:  # SIGTERM: a checkpoint was saved; exit 75, rerun resumes
        shardwise.shutdown()
        raise
    out = Path(cfg.runner.run_dir) / "export"
    wrapped = shardwise.wrap_info(engine.model)
    final = None
    if wrapped is None or wrapped.stages is None:
        shardwise.export_weights(engine.model, out)
    else:  # each rank holds one pipeline stage: a checkpoint holds them all
        final = shardwise.save_checkpoint(Path(cfg.runner.run_dir) / "final", engine)
    if info.is_main:  # no figure for a validation that never ran (val_every above max_steps)
        val = summary["val"].get("loss")
        shown = "no validation ran" if val is None else f"val loss {val:.4f}"
        print(
            f"done: step {summary['steps']} ({summary['ended_by']} reached), {shown}, "
            f"files in {cfg.runner.run_dir}"
        )
    shardwise.shutdown()
    if final is not None and info.is_main:  # one process reads every stage's tensors
        shardwise.export_weights(final, out)


if __name__ == "__main__":
    main()
