"""The causal LM ported to Accelerate, as its guides do (not run here: Accelerate is not
installed in this project; bench/port_lines.py counts its lines).

    accelerate launch --config_file examples/port/accelerate_fsdp.yaml \
        examples/port/train_accelerate.py OUT_DIR
"""

import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

accelerator = Accelerator()
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
model, optimizer = accelerator.prepare(model, optimizer)
rank, size = accelerator.process_index, accelerator.num_processes
tokens = torch.randint(0, 128, (4, 8, 32), generator=torch.Generator().manual_seed(1))

for batch in tokens:  # 4 steps of 8 sequences
    rows = batch[rank * 8 // size : (rank + 1) * 8 // size].to(accelerator.device)
    loss = model(input_ids=rows, labels=rows).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"loss {accelerator.reduce(loss.detach(), 'mean').item():.7e}")
accelerator.unwrap_model(model).save_pretrained(
    sys.argv[1],
    state_dict=accelerator.get_state_dict(model),
    is_main_process=accelerator.is_main_process,
)
