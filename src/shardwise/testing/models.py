"""Reference models: a small GPT-style decoder used by the parity tests, bench and examples.

Owns: `GPTConfig` and `GPT` (token embedding tied to the output head, pre-LayerNorm
blocks of causal self-attention and MLP). Small enough for CPU tests, scalable to the
benchmark sizes. Also `TinyMoE`, a mixture of experts in plain PyTorch whose `Experts`
module has the shape expert parallelism finds (docs/experts.md).

Must not: depend on any other shardwise module; models stay plain PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    vocab_size: int = 64
    """Tokens in the vocabulary."""
    seq_len: int = 16
    """Longest sequence the position embedding covers."""
    d_model: int = 32
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_layers: int = 2
    """Transformer blocks."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout on the residual branches (uses the RNG: exercises exact resume)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1).")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads={self.n_heads} must divide d_model={self.d_model}."
            )


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # No qkv bias: the key bias gets an exactly-zero gradient (softmax is shift
        # invariant per query), so Adam would turn its rounding noise into updates.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only LM. `forward(idx, targets=None)` returns logits, or the mean loss."""

    _no_split_modules = ("Block",)

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def random_lm_batches(
    cfg: GPTConfig, steps: int, batch_size: int, *, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (inputs, next-token targets) drawn uniformly from the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


class ConvNet(nn.Module):
    """A small CNN with BatchNorm: the case fp32-only modules exist for under bf16."""

    def __init__(self, channels: int = 8, num_classes: int = 10, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for _ in range(depth):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
            c_in = channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.features(x).mean(dim=(2, 3)))
        return logits if y is None else F.cross_entropy(logits.float(), y)


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank adapter (PEFT's layout)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRABlock(nn.Module):
    """A residual MLP block whose weights are frozen except for LoRA adapters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = LoRALinear(d, 4 * d)
        self.proj = LoRALinear(4 * d, d)
        self.ln.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class LoRALM(nn.Module):
    """A language model with a frozen base (embedding, head, norms) and trainable adapters."""

    def __init__(self, d: int = 16, n_layers: int = 2, vocab_size: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList(LoRABlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab_size)
        self.emb.requires_grad_(False)
        self.head.requires_grad_(False)
        # Non-zero adapters, so both LoRA matrices get gradients from the first step.
        for module in self.modules():
            if isinstance(module, LoRALinear):
                nn.init.normal_(module.lora_b.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), targets.flatten())


class Embeddings(nn.Module):
    """Token embedding plus LayerNorm: a unit of its own in BERT-like plans."""

    def __init__(self, vocab_size: int, d: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(x))


class Head(nn.Module):
    """BERT's MLM head: the decoder's bias is the head's own `bias`, its weight the
    embedding's: two ties, one reaching outside the head."""

    def __init__(self, word: nn.Embedding) -> None:
        super().__init__()
        vocab_size, d = word.weight.shape
        self.transform = nn.Linear(d, d)
        self.decoder = nn.Linear(d, vocab_size)
        self.bias = self.decoder.bias
        self.decoder.weight = word.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.transform(h)))


class CrossTied(nn.Module):
    """A BERT-shaped LM whose ties cross shard-unit boundaries (tests the planner)."""

    def __init__(self, vocab_size: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embeddings = Embeddings(vocab_size, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = Head(self.embeddings.word)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(x)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class Experts(nn.Module):
    """A mixture of experts' experts, in the shape expert parallelism finds: `num_experts`,
    parameters stored experts first, and a forward that takes (hidden_states, top_k_index,
    top_k_weights) and loops over `self.num_experts` (under ep it sees its rank's own
    experts, numbered from 0)."""

    def __init__(self, num_experts: int, d_model: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.Parameter(torch.randn(num_experts, width, d_model) * d_model**-0.5)
        self.down = nn.Parameter(torch.randn(num_experts, d_model, width) * width**-0.5)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = F.gelu(hidden_states[token] @ self.up[e].T) @ self.down[e].T
            out = out.index_add(0, token, h * top_k_weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    """Pre-norm residual block: a router picks `top_k` experts per token, softmax-weighted."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, width)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(h).softmax(-1), self.top_k, dim=-1)
        return x + self.experts(h, index, weights).reshape(x.shape)


class TinyMoE(nn.Module):
    """Token embedding, `layers` MoE blocks and an untied head; `forward(input_ids,
    labels)` returns {"loss": next-token cross entropy} (with labels) or the logits."""

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 16,
        layers: int = 2,
        num_experts: int = 4,
        top_k: int = 2,
        width: int = 32,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            MoEBlock(d_model, num_experts, top_k, width) for _ in range(layers)
        )
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> object:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss}
