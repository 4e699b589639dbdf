"""Clipping when the gradient norm is not finite scales nothing (issue 34).

`clip_coefficient` is 1 for an infinite and for a NaN norm: multiplying by
max_norm / inf = 0 would zero every finite gradient (and turn the inf ones into NaN), and a
NaN coefficient would make every gradient NaN. The step itself is the loss scaler's or the
non-finite policy's to skip; clipping must leave the gradients as they came. mmengine's
global-norm clip (integrations/mmengine.py) goes through the same function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.train.engine import clip_coefficient


def _params(bad: float) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    grads = [torch.tensor([3.0, -4.0, 0.5]), torch.tensor([[1.0, bad], [2.0, -1.0]])]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params, grads


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    # Bit for bit, NaN where NaN was: a coefficient of 1 changes nothing.
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_nonfinite_norm_scales_no_gradient(bad):
    params, grads = _params(bad)
    norm = shardwise.clip_grad_norm_(params, max_norm=0.5)
    assert not torch.isfinite(norm)
    for p, g in zip(params, grads, strict=True):
        _same(p.grad, g)
    assert clip_coefficient(torch.tensor(bad), 0.5).item() == 1.0


def test_a_finite_norm_above_the_bound_is_scaled_to_it():
    # The same gradients with a finite entry: the clip does act (the test above can fail).
    params, grads = _params(2.0)
    want = torch.cat([g.flatten() for g in grads]).norm()
    norm = shardwise.clip_grad_norm_(params, max_norm=0.5)
    torch.testing.assert_close(norm, want)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * (0.5 / (want + 1e-6)))
    assert clip_coefficient(torch.tensor(0.25), 0.5).item() == 1.0  # below: never scaled up


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_mmengine_global_clip_of_a_nonfinite_norm_scales_nothing_and_refuses_if_asked(bad):
    pytest.importorskip("mmengine")
    from shardwise.integrations.mmengine import _global_norm_clip

    params, grads = _params(bad)
    assert not torch.isfinite(_global_norm_clip(params, 0.5))
    for p, g in zip(params, grads, strict=True):
        _same(p.grad, g)
    with pytest.raises(
        RuntimeError,
        match=r"The total norm of gradients is (inf|nan); clip_grad\(error_if_nonfinite=True\) "
        r"refuses it",
    ):
        _global_norm_clip(params, 0.5, error_if_nonfinite=True)
    for p, g in zip(params, grads, strict=True):
        _same(p.grad, g)
