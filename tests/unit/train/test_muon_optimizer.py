"""shardwise.Muon in one process: torch's arithmetic, the untouched momentum, the split
between Muon and the fallback, the owners, and every refusal. The layouts are
tests/distributed/test_muon.py's (`make test-muon`)."""

from __future__ import annotations

import copy
import inspect
import math
from unittest import mock

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

import shardwise
from shardwise.train import muon as muon_module
from shardwise.train.muon import DEFAULT_NS_COEFFICIENTS, Muon, newton_schulz, split_parameters
from shardwise.train.muon_comm import MatrixLayout, choose_owners


def _torch_newton_schulz_in(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """torch's own _zeropower_via_newtonschulz with its one cast (to bf16) made `dtype`."""
    source = inspect.getsource(torch_muon._zeropower_via_newtonschulz)
    cast = {torch.float32: "grad.float()", torch.float64: "grad.double()"}[dtype]
    assert "grad.bfloat16()" in source
    namespace = {"torch": torch, "Tensor": torch.Tensor}
    exec(source.replace("grad.bfloat16()", cast), namespace)
    return namespace["_zeropower_via_newtonschulz"]


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (7, 7)])
def test_newton_schulz_is_torchs(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = torch_muon._zeropower_via_newtonschulz(g, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(newton_schulz(g), want)  # bf16, bit for bit
    before = g.clone()
    got = newton_schulz(g, dtype=torch.float32)
    assert torch.equal(g, before)  # its input untouched, though already float32
    # torch's code, cast to float32, would divide `g` itself in place: give it a copy
    fp32 = _torch_newton_schulz_in(torch.float32)(g.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    assert got.dtype == torch.float32
    assert torch.equal(got, fp32)
    assert not torch.allclose(got, want.float(), rtol=1e-3, atol=1e-3)  # bf16 is apart


def test_newton_schulz_follows_its_settings() -> None:
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    base = newton_schulz(g, dtype=torch.float32)
    for kwargs in ({"ns_steps": 4}, {"ns_coefficients": (3.0, -4.0, 2.0)}, {"eps": 1e3}):
        assert not torch.equal(newton_schulz(g, dtype=torch.float32, **kwargs), base), kwargs
    with pytest.raises(ValueError, match=r"expected a matrix, got shape \(2, 3, 4\)"):
        newton_schulz(torch.zeros(2, 3, 4))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 20, bias=False), nn.ReLU(), nn.Linear(20, 8, bias=False), nn.ReLU()
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 12, generator=g)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_one_process_equals_torch_muon(nesterov: bool, adjust_lr_fn: str | None) -> None:
    settings = dict(
        lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    a, b = _mlp(), _mlp()
    _train(a, torch.optim.Muon(a.parameters(), **settings))  # type: ignore[arg-type]
    _train(b, Muon(b.named_parameters(), **settings))  # type: ignore[arg-type]
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    c = _mlp()
    _train(c, Muon(c.named_parameters(), **{**settings, "lr": 0.03}))  # type: ignore[arg-type]
    assert not torch.equal(next(c.parameters()), next(a.parameters()))


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_momentum_buffer_is_not_normalised(ns_dtype: torch.dtype) -> None:
    """pytorch#190597: torch's Muon with bf16 parameters and nesterov=False divides the
    momentum buffer itself by its norm every step. Ours keeps the buffer (1 - m) * grad."""
    dtype = ns_dtype  # the parameters' dtype, so Newton–Schulz's cast copies nothing
    model = nn.Linear(8, 4, bias=False).to(dtype)
    theirs = copy.deepcopy(model)
    x = (0.1 * torch.randn(3, 8, generator=torch.Generator().manual_seed(0))).to(dtype)
    ours_opt = Muon(model.named_parameters(), nesterov=False, ns_dtype=ns_dtype)
    model(x).square().sum().backward()
    grad = model.weight.grad.clone()  # type: ignore[union-attr]
    ours_opt.step()
    buf = ours_opt.state[model.weight]["momentum_buffer"]
    assert torch.equal(buf, grad * (1 - 0.95)), "the buffer was changed beyond its lerp"
    if dtype == torch.bfloat16:  # the bug this guards against is real in torch 2.13
        torch_opt = torch.optim.Muon(theirs.parameters(), nesterov=False)
        theirs(x).square().sum().backward()
        torch_opt.step()
        norm = float(torch_opt.state[theirs.weight]["momentum_buffer"].float().norm())
        assert math.isclose(norm, 1.0, abs_tol=0.01)  # measured: 0.998
        assert float(buf.float().norm()) < 0.1  # measured: 6e-3


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 6)
        self.q_proj = nn.Linear(6, 6)
        self.gate_proj = nn.Linear(6, 6, bias=False)
        self.gate = nn.Linear(6, 4, bias=False)  # a router
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 10, bias=False)


def test_split_by_name_and_shape() -> None:
    named = list(LM().named_parameters())
    matrices, others = split_parameters(named)
    assert [n for n, _ in matrices] == ["q_proj.weight", "gate_proj.weight"]
    assert [n for n, _ in others] == [
        "embed_tokens.weight",
        "q_proj.bias",
        "gate.weight",
        "norm.weight",
        "norm.bias",
        "lm_head.weight",
    ]
    matrices, _ = split_parameters(named, fallback_names=())  # by shape alone
    assert [n for n, _ in matrices] == [
        "embed_tokens.weight",
        "q_proj.weight",
        "gate_proj.weight",
        "gate.weight",
        "lm_head.weight",
    ]
    matrices, _ = split_parameters(named, matrix_names=[r"^gate\."])
    assert [n for n, _ in matrices] == ["q_proj.weight", "gate_proj.weight", "gate.weight"]
    matrices, _ = split_parameters(named, fallback_names=[r"q_proj"])
    assert [n for n, _ in matrices] == [
        "embed_tokens.weight",
        "gate_proj.weight",
        "gate.weight",
        "lm_head.weight",
    ]


@pytest.mark.parametrize(
    "name",
    ["wte.weight", "transformer.wpe.weight", "emb.weight", "tok_embeddings.weight",
     "head.weight", "output.weight", "classifier.weight", "score.weight",
     "model.final_norm.weight", "mlp.router.weight"],
)  # fmt: skip
def test_each_default_fallback_name(name: str) -> None:
    _, others = split_parameters([(name, nn.Parameter(torch.zeros(3, 3)))])
    assert [n for n, _ in others] == [name]


@pytest.mark.parametrize(
    "name", ["attention.output.dense.weight", "mlp.gate_proj.weight", "lora_A.default.weight"]
)
def test_hidden_matrices_stay_on_muon(name: str) -> None:
    matrices, _ = split_parameters([(name, nn.Parameter(torch.zeros(3, 3)))])
    assert [n for n, _ in matrices] == [name]


def test_fallback_is_stepped_and_shares_groups_and_state() -> None:
    model = LM()
    opt = Muon(model.named_parameters(), lr=0.01)
    assert opt.fallback is not None
    assert isinstance(opt.fallback, torch.optim.AdamW)
    assert opt.fallback.param_groups[0]["lr"] == 0.01
    assert opt.matrix_names == ["q_proj.weight", "gate_proj.weight"]
    before = model.embed_tokens.weight.detach().clone()
    (model.lm_head(model.q_proj(model.embed_tokens(torch.tensor([1, 2])))).sum()).backward()
    opt.step()
    assert not torch.equal(model.embed_tokens.weight, before)
    assert "exp_avg" in opt.state[model.embed_tokens.weight]
    assert "momentum_buffer" in opt.state[model.q_proj.weight]
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # every group, the fallback's too
    assert opt.fallback.param_groups[0]["lr"] == 0.005
    saved = copy.deepcopy(opt.state_dict())
    again = Muon(model.named_parameters(), lr=0.01)
    again.load_state_dict(saved)
    assert again.fallback is not None
    assert again.fallback.state is again.state
    exp_avg = again.fallback.state[model.embed_tokens.weight]["exp_avg"]
    assert torch.equal(exp_avg, opt.state[model.embed_tokens.weight]["exp_avg"])
    assert again.fallback.param_groups[0] is again.param_groups[1]


def test_custom_fallback() -> None:
    opt = Muon(LM().named_parameters(), fallback=lambda ps: torch.optim.SGD(ps, lr=0.3))
    assert isinstance(opt.fallback, torch.optim.SGD)
    only_matrices = Muon(_mlp().named_parameters())
    assert only_matrices.fallback is None


def test_owners_balanced_by_size() -> None:
    two = MatrixLayout(torch.tensor([0, 1]), (), (), ())
    three = MatrixLayout(torch.tensor([0, 1, 2]), (), (), ())
    # largest first, each to the least-loaded rank: 10 -> 0, 9 -> 1, 8 -> 1, 1 -> 0
    assert choose_owners([two] * 4, [8, 10, 1, 9]) == [1, 0, 0, 1]
    assert choose_owners([three] * 3, [5, 5, 5]) == [0, 1, 2]
    sub = MatrixLayout(torch.tensor([2, 3]), (), (), ())  # owners only from its own mesh
    assert choose_owners([sub, sub], [1, 1]) == [2, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, r"shardwise.Muon\(lr=-1.0\): must be a finite number >= 0"),
        ({"lr": math.inf}, r"shardwise.Muon\(lr=inf\)"),
        ({"lr": math.nan}, r"shardwise.Muon\(lr=nan\)"),
        ({"lr": -math.inf}, r"shardwise.Muon\(lr=-inf\)"),
        ({"weight_decay": -0.1}, r"shardwise.Muon\(weight_decay=-0.1\)"),
        ({"momentum": -0.5}, r"shardwise.Muon\(momentum=-0.5\)"),
        ({"adjust_lr_fn": "rms"}, r"adjust_lr_fn='rms'\): use None, 'original' or"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients=\(1.0, 2.0\)\): give three"),
        ({"ns_steps": 100}, r"ns_steps=100\): use 0 to 99"),
        ({"ns_steps": -1}, r"ns_steps=-1\): use 0 to 99"),
    ],
)
def test_settings_refused(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        Muon(_mlp().named_parameters(), **kwargs)


def test_unnamed_parameters_refused_unless_split_by_shape() -> None:
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(20, 12\)\) has no name.*"
                       r"model.named_parameters\(\), or fallback_names=\(\)"):  # fmt: skip
        Muon(_mlp().parameters())
    opt = Muon(_mlp().parameters(), fallback_names=())
    assert opt.matrix_names == ["params[0]", "params[1]"]


def test_groups_refused() -> None:
    with pytest.raises(TypeError, match=r"got a parameter group \(a dict\)"):
        Muon([{"params": list(_mlp().parameters())}])
    with pytest.raises(TypeError, match=r"got a str among its parameters"):
        Muon(["weight"])  # type: ignore[list-item]


def test_each_expert_is_a_matrix_of_its_own() -> None:
    """A 3-D stack of experts steps as its experts would one by one (Newton–Schulz and the
    lr ratio per expert's (3, 6) matrix, not the stack's (4, 3)), never as one matrix."""
    g = torch.Generator().manual_seed(0)
    stack = nn.Parameter(torch.randn(4, 3, 6, generator=g))
    apart = [nn.Parameter(m.detach().clone()) for m in stack]
    grads = torch.randn(2, 4, 3, 6, generator=g)
    together = Muon([("mlp.experts.down_proj", stack)], lr=0.1)
    one_by_one = Muon([(f"mlp.expert{i}.weight", p) for i, p in enumerate(apart)], lr=0.1)
    assert together.expert_names == ["mlp.experts.down_proj"]
    for grad in grads:
        stack.grad = grad.clone()
        for p, gi in zip(apart, grad, strict=True):
            p.grad = gi.clone()
        together.step()
        one_by_one.step()
    assert torch.equal(stack.detach(), torch.stack([p.detach() for p in apart]))
    _, others = split_parameters([("conv.weight", nn.Parameter(torch.zeros(4, 6, 3)))])
    assert [n for n, _ in others] == ["conv.weight"]  # 3-D and not experts: by shape
    _, others = split_parameters([("experts.w", stack)], fallback_names=[r"experts"])
    assert [n for n, _ in others] == ["experts.w"]


def test_layouts_not_built_are_refused_at_construction() -> None:
    for field, what in (("cp", "cp"),):
        info = mock.Mock()
        info.config = mock.Mock(**{"pp": 1, "ep": 1, "cp": 1, field: 2})
        model = _mlp()
        with mock.patch.object(muon_module, "wrap_info", return_value=info):
            with muon_module.muon_context(model):
                with pytest.raises(
                    NotImplementedError,
                    match=rf"shardwise.Muon under {what} \(ParallelConfig.{field}=2\) is not built",
                ):
                    Muon(model.named_parameters())


def test_plain_tensors_across_ranks_need_their_group() -> None:
    with (
        mock.patch.object(muon_module.dist, "is_initialized", return_value=True),
        mock.patch.object(muon_module.dist, "get_world_size", return_value=4),
    ):
        with pytest.raises(ValueError, match=r"0.weight is a plain tensor at world size 4 and "
                           r"no process_group.*process_group=ddp_model.process_group"):  # fmt: skip
            Muon(_mlp().named_parameters())


def test_engine_names_the_parameters() -> None:
    engine = shardwise.Engine(LM(), lambda p: Muon(p, lr=0.01))
    assert isinstance(engine.optimizer, Muon)
    assert engine.optimizer.matrix_names == ["q_proj.weight", "gate_proj.weight"]
    assert "embed_tokens.weight" in engine.optimizer.fallback_names


def test_a_checkpoint_gives_ns_dtype_back_as_a_string() -> None:
    """DCP hands a group's dtype back as 'torch.float32': the loaded dtype is used (here
    float32 over the constructor's bf16), and a name that is no dtype is refused."""
    a = _mlp()
    opt = Muon(a.named_parameters(), ns_dtype=torch.float32)
    _train(a, opt, 1)
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["ns_dtype"] = "torch.float32"
    b = copy.deepcopy(a)
    again = Muon(b.named_parameters(), ns_dtype=torch.bfloat16)
    again.load_state_dict(state)
    _train(a, opt, 1)
    _train(b, again, 1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    state["param_groups"][0]["ns_dtype"] = "torch.nonsense"
    again.load_state_dict(state)
    with pytest.raises(ValueError, match=r"ns_dtype='torch.nonsense' is not a torch dtype"):
        _train(b, again, 1)
