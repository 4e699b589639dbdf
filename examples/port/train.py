"""The same causal LM trained by shardwise, in the layout of the file it is launched with.

    python examples/port/train.py OUT_DIR
    shardwise run --nproc 2 --deepspeed examples/port/ds_zero3.json examples/port/train.py OUT
    shardwise run --nproc 2 --accelerate-config examples/port/accelerate_fsdp.yaml \
        examples/port/train.py OUT
    shardwise run --nproc 2 --from examples/port/torchtitan.toml examples/port/train.py OUT
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise

shardwise.init_distributed()
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
)
model = LlamaForCausalLM(config)
engine = shardwise.Engine(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
info = shardwise.wrap_info(engine.model)
rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
tokens = torch.randint(0, 128, (4, 8, 32), generator=torch.Generator().manual_seed(1))

for batch in tokens:  # 4 steps of 8 sequences, each data-parallel rank its own rows
    rows = batch[rank * 8 // size : (rank + 1) * 8 // size]
    loss = engine.train_step({"input_ids": rows, "labels": rows})["loss"]
    shardwise.print0(f"loss {shardwise.mean_across_ranks(loss):.7e}")
shardwise.export_weights(engine.model, sys.argv[1])
