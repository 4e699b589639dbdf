"""shardwise.Muon(split_fused=...): fused projections orthogonalised per block, in one process.

A fused model (qkv_proj, gate_up_proj) trained with split_fused on lands where its unfused
twin (q_proj, k_proj, v_proj, gate_proj, up_proj with the same weights) lands under plain
Muon: each block is orthogonalised as the matrix it would be unfused. Off, the fused model
lands far from it (the negative control). The split is read from a transformers config
(phi3) and per expert, per half, for an MoE stack; a split that cannot be read is refused in
one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import shardwise

HEADS, KV, HEAD_DIM, HIDDEN, INTER = 3, 1, 6, 16, 20
Q, K = HEADS * HEAD_DIM, KV * HEAD_DIM  # 18 rows of q, 6 each of k and v
MUON = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
            hidden_size=HIDDEN,
        )  # fmt: skip
        self.qkv_proj = nn.Linear(HIDDEN, Q + 2 * K, bias=False)
        self.o_proj = nn.Linear(Q + 2 * K, HIDDEN, bias=False)
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(torch.tanh(self.qkv_proj(x)))
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


class Unfused(nn.Module):
    """The same function with each block a matrix of its own."""

    def __init__(self, fused: Fused) -> None:
        super().__init__()
        q, k, v = fused.qkv_proj.weight.detach().split([Q, K, K])
        gate, up = fused.gate_up_proj.weight.detach().chunk(2)
        self.q_proj, self.k_proj, self.v_proj = (_linear(w) for w in (q, k, v))
        self.gate_proj, self.up_proj = _linear(gate), _linear(up)
        self.o_proj, self.down_proj = _linear(fused.o_proj.weight), _linear(fused.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        h = x + self.o_proj(torch.tanh(qkv))
        return h + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


def _train(net: nn.Module, **kw: object) -> tuple[list[float], torch.Tensor]:
    model = net
    opt = shardwise.Muon(model.named_parameters(), **MUON, fallback_names=(), **kw)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, _qkv(model)


def _qkv(model: nn.Module) -> torch.Tensor:
    if isinstance(model, Fused):
        return torch.cat([model.qkv_proj.weight, model.gate_up_proj.weight]).detach()
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    return torch.cat([getattr(model, n).weight for n in parts]).detach()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_per_block_equals_each_block_as_its_own_matrix_and_off_differs():
    torch.manual_seed(0)
    fused = Fused()
    unfused = Unfused(fused)
    off = Fused()
    off.load_state_dict(fused.state_dict())
    want_losses, want = _train(unfused)
    losses, got = _train(fused, split_fused=True, model=fused)
    assert _rel(got, want) < 1e-5  # measured: 5.7e-7 (the lr ratio's rounding, magnified)
    assert losses == pytest.approx(want_losses, rel=1e-5)  # measured: 1.4e-7
    _, whole = _train(off)  # the negative control: the fused matrices whole
    assert _rel(whole, want) > 1e-2  # measured: 7.7e-2


@pytest.mark.heavy  # builds a transformers model: a second or two
def test_the_split_is_read_from_a_transformers_config():
    import transformers

    config = transformers.Phi3Config(
        hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Phi3ForCausalLM(config)
    opt = shardwise.Muon(model.named_parameters(), split_fused=True, model=model)
    assert opt.fused_names == [
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ]
    qkv, gate_up = (opt._splits[id(p)] for n, p in model.named_parameters() if n in opt.fused_names)
    assert (qkv.dim, qkv.sizes) == (-2, (24, 12, 12))  # 4 heads x 6, 2 kv heads x 6 each
    assert (gate_up.dim, gate_up.sizes) == (-2, (40, 40))
    assert shardwise.Muon(model.named_parameters())._splits == {}  # off by default


@pytest.mark.heavy  # builds a transformers model
def test_an_expert_stack_is_split_per_expert_then_per_half():
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, num_local_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    stack = dict(model.named_parameters())[name]
    assert stack.shape == (3, 24, 16)
    grad = torch.randn_like(stack)
    before = stack.detach().clone()
    opt = shardwise.Muon([(name, stack)], **MUON, split_fused=True, model=model)
    stack.grad = grad
    opt.step()
    # by hand: each expert's gate and up halves as six matrices of their own
    halves = [nn.Parameter(h.clone()) for e in before for h in e.chunk(2)]
    by_hand = shardwise.Muon([(f"m{i}", h) for i, h in enumerate(halves)], **MUON)
    for h, g in zip(halves, [h for e in grad for h in e.chunk(2)], strict=True):
        h.grad = g.clone()
    by_hand.step()
    want = torch.stack([torch.cat(halves[2 * e : 2 * e + 2]) for e in range(3)]).detach()
    assert _rel(stack.detach(), want) < 1e-6
    whole = shardwise.Muon([(name, p := nn.Parameter(before.clone()))], **MUON)
    p.grad = grad
    whole.step()
    assert _rel(p.detach(), want) > 1e-3  # per expert but unsplit: another update


class _Interleaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 6))
        self.experts.is_concatenated = False  # gpt_oss: gate and up alternate


@pytest.mark.parametrize(
    ("model", "setting", "match"),
    [
        (
            lambda: nn.Sequential(),
            True,
            r"qkv_proj\.weight is a fused q, k, v projection, and no model config with "
            r"num_attention_heads says where q ends\. .*split_fused=\{'qkv_proj'",
        ),
        (
            Fused,
            {"qkv_proj": [18, 6, 5]},
            r"qkv_proj\.weight has 30 rows along dim -2, but split_fused\['qkv_proj'\] gives "
            r"blocks \[18, 6, 5\] \(sum 29\)",
        ),
        (_Interleaved, True, r"experts\.gate_up_proj interleaves gate and up"),
        (Fused, "yes", r"split_fused='yes'\): use False, True"),
    ],
)
def test_a_split_that_cannot_be_read_is_refused_in_one_line(model, setting, match):
    built = model()
    named = list(Fused().named_parameters())[:1] if isinstance(built, nn.Sequential) else None
    params = named or list(built.named_parameters())
    with pytest.raises((ValueError, TypeError), match=match) as caught:
        shardwise.Muon(params, split_fused=setting, model=built, fallback_names=())
    assert "\n" not in str(caught.value)
