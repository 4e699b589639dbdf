"""A transformers causal LM in one process, plain PyTorch: the script every port starts from.

python examples/port/train_plain.py OUT_DIR
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
tokens = torch.randint(0, 128, (4, 8, 32), generator=torch.Generator().manual_seed(1))

for batch in tokens:  # 4 steps of 8 sequences
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"loss {loss.item():.7e}")
model.save_pretrained(sys.argv[1])
