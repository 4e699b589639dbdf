"""The causal LM ported to DeepSpeed, as its tutorials do (not run here: DeepSpeed is not
installed in this project; bench/port_lines.py counts its lines).

    deepspeed --num_gpus 2 examples/port/train_deepspeed.py OUT_DIR
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

deepspeed.init_distributed()
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
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, optimizer, _, _ = deepspeed.initialize(
    model=model, optimizer=optimizer, config="examples/port/ds_zero3.json"
)
rank, size = dist.get_rank(), dist.get_world_size()
tokens = torch.randint(0, 128, (4, 8, 32), generator=torch.Generator().manual_seed(1))

for batch in tokens:  # 4 steps of 8 sequences
    rows = batch[rank * 8 // size : (rank + 1) * 8 // size].to(engine.device)
    loss = engine(input_ids=rows, labels=rows).loss
    engine.backward(loss)
    engine.step()
    dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"loss {loss.item():.7e}")
engine.save_16bit_model(sys.argv[1])
