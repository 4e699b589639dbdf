"""The load-balancing loss on whole-batch statistics, in one process: it is each transformers
family's own loss (value and gradient), it replaces a family's function only where a probe
shows that, and the replacement runs the family's function outside a wrapped training
forward. The distributed equality is tests/distributed/test_batch_statistics.py
(`make test-batch-stats`)."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from torch import nn

import shardwise
from shardwise.parallelize import router_loss
from shardwise.parallelize.global_batch import BatchGroups

pytest.importorskip("transformers")

# nllb_moe's function is written differently (one concatenation, a [top_k, experts] mean)
# and is the same loss: the probe, not the source text, decides.
SWITCH_FORM = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "gpt_oss", "dbrx", "jamba",
               "granitemoe", "phimoe", "jetmoe", "nllb_moe"]  # fmt: skip
OTHER_FORM = ["switch_transformers", "doge"]


def _family(name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _original(name: str):  # type: ignore[no-untyped-def]
    fn = getattr(_family(name), router_loss.FUNCTION)
    return getattr(fn, "__shardwise_original__", fn)


def _logits(rows: int = 12, experts: int = 8, layers: int = 3, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, experts, generator=g, requires_grad=True) for _ in range(layers))


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("family", SWITCH_FORM)
def test_the_loss_is_each_familys_own_value_and_gradient(family, masked):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]]) if masked else None
    logits = _logits()
    want = _original(family)(logits, 8, 3, mask)
    got = router_loss.load_balancing_loss(logits, 8, 3, mask)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(
        torch.autograd.grad(got, logits), torch.autograd.grad(want, logits), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert router_loss._agrees(_original(family))


@pytest.mark.parametrize("family", OTHER_FORM)
def test_a_family_whose_function_is_another_loss_is_not_replaced(family):
    assert not router_loss._agrees(_original(family))


def test_the_probe_runs_on_real_tensors_inside_the_memory_simulations_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.device("meta"):
        assert router_loss._agrees(_original("mixtral"))


def test_no_router_logits_give_zero_as_transformers_does():
    assert router_loss.load_balancing_loss(None, 4) == 0
    assert router_loss.load_balancing_loss([torch.zeros(2, 4)], 4) == 0  # a list: not recorded


def _mixtral() -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def test_install_replaces_the_family_function_which_stays_the_familys_outside_a_forward():
    model = _mixtral()
    module = _family("mixtral")
    original = _original("mixtral")
    replaced, differ = router_loss.install(model)
    assert (replaced, differ) == (["transformers.models.mixtral.modeling_mixtral"], [])
    installed = getattr(module, router_loss.FUNCTION)
    assert installed is not original and installed.__shardwise_original__ is original
    assert router_loss.install(model) == (replaced, [])  # once: not wrapped twice
    assert getattr(module, router_loss.FUNCTION) is installed
    logits = _logits(experts=4)
    # Outside a wrapped model's training forward: the family's function itself runs.
    with mock.patch.object(router_loss, "load_balancing_loss", side_effect=AssertionError):
        assert torch.equal(installed(logits, 4, 2), original(logits, 4, 2))
    # Inside one (groups of nothing: no process group here), the arguments arrive bound
    # by name whichever way the family passed them.
    with mock.patch.object(router_loss, "current", return_value=BatchGroups((), 2)):
        by_position = installed(logits, 4, 2, None)
        by_name = installed(gate_logits=logits, num_experts=4, top_k=2)
        default_top_k = installed(logits, 4)
    want = original(logits, 4, 2)
    for got in (by_position, by_name, default_top_k):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_global_batch_sum_leaves_a_tensor_alone_outside_a_wrapped_model():
    t = torch.arange(3.0)
    assert shardwise.global_batch_sum(t) is t
    assert shardwise.global_batch_sum(t, model=nn.Linear(1, 1)) is t
    with pytest.raises(TypeError, match=r"global_batch_sum expects a tensor, got float\. Pass"):
        shardwise.global_batch_sum(3.0)  # type: ignore[arg-type]


def test_install_leaves_a_family_whose_function_is_another_loss(monkeypatch):
    import sys
    import types

    family = types.ModuleType("pretend_family")

    def other(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # type: ignore[no-untyped-def]
        return torch.stack([g.mean() for g in gate_logits]).sum()  # not the Switch loss

    family.load_balancing_loss_func = other  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pretend_family", family)
    model = type("PretendMoE", (nn.Module,), {"__module__": "pretend_family"})()
    assert router_loss.install(model) == ([], ["pretend_family"])
    assert family.load_balancing_loss_func is other  # type: ignore[attr-defined]


def test_the_probe_refuses_a_function_with_the_same_value_and_another_gradient():
    """A family's function that computes the loss's value but stops the gradient of one of
    its statistics trains another router: the probe compares gradients too (issue 48)."""

    def detached_probs(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # type: ignore[no-untyped-def]
        value = router_loss.load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)
        assert isinstance(value, torch.Tensor)
        # the same value, with half the gradient
        return value * 0.5 + value.detach() * 0.5

    assert not router_loss._agrees(detached_probs)
    assert router_loss._agrees(router_loss.load_balancing_loss)
