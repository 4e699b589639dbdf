"""`compare_trajectories`, `worst_of` and `full_parameters`, case by case (the five habits of
docs/testing.md): -inf and +inf beside NaN, on either side; trajectories of different
lengths either way; the worst of several parameters named, not the first; a difference
exactly at the bound; parameters not compared when asked not to; a bf16 model's parameters
returned in fp32."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardwise.testing.parity import (
    ParityError,
    Trajectory,
    compare_trajectories,
    full_parameters,
    worst_of,
)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_a_parameter_with_any_value_that_is_not_finite_is_refused(bad: float, side: str) -> None:
    ref = Trajectory([1.0], {"w": torch.ones(3), "b": torch.ones(2)})
    got = Trajectory([1.0], {"w": torch.ones(3), "b": torch.ones(2)})
    (got if side == "candidate" else ref).params["b"][0] = bad
    with pytest.raises(ParityError, match=rf"final parameter 'b' of the {side} is not finite"):
        compare_trajectories(ref, got)


@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_a_loss_of_minus_infinity_is_refused(side: str) -> None:
    good, diverged = [2.0, 1.5], [2.0, -math.inf]
    ref, got = (good, diverged) if side == "candidate" else (diverged, good)
    with pytest.raises(ParityError, match=r"loss at step 1 is not finite"):
        compare_trajectories(Trajectory(ref, {}), Trajectory(got, {}), check_params=False)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_worst_of_refuses_every_value_that_is_not_finite(bad: float) -> None:
    with pytest.raises(ParityError, match=r"1 of 3 differences are not finite"):
        worst_of([1e-7, bad, 0.0])


@pytest.mark.parametrize(("ref", "got"), [(3, 2), (2, 3)], ids=["fewer", "more"])
def test_trajectories_of_different_lengths_are_refused(ref: int, got: int) -> None:
    with pytest.raises(ParityError) as caught:
        compare_trajectories(Trajectory([1.0] * ref, {}), Trajectory([1.0] * got, {}))
    assert str(caught.value) == f"candidate: {got} steps, reference has {ref}"


def test_the_worst_parameter_is_named_wherever_it_comes() -> None:
    ref = {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}
    got = {"a": torch.full((2,), 1.1), "b": torch.full((2,), 1.3), "c": torch.full((2,), 1.2)}
    report = compare_trajectories(Trajectory([1.0], ref), Trajectory([1.0], got), rtol=0.5)
    assert report.worst_param == "b" and report.max_param_rel == pytest.approx(0.3)
    with pytest.raises(ParityError, match=r"final parameter 'b' differs from reference"):
        compare_trajectories(Trajectory([1.0], ref), Trajectory([1.0], got), rtol=0.25)


def test_a_difference_at_the_bound_passes() -> None:
    """|3 - 2| / 2 = 0.5 exactly in binary: within rtol=0.5, beyond 0.25."""
    ref, got = Trajectory([2.0], {}), Trajectory([3.0], {})
    assert compare_trajectories(ref, got, rtol=0.5, check_params=False).max_loss_rel == 0.5
    with pytest.raises(ParityError, match=r"loss diverges at step 0"):
        compare_trajectories(ref, got, rtol=0.25, check_params=False)


def test_parameters_are_not_compared_when_asked_not_to() -> None:
    ref = Trajectory([1.0], {"w": torch.ones(2)})
    other = Trajectory([1.0], {"v": torch.full((3,), math.nan)})
    report = compare_trajectories(ref, other, check_params=False)
    assert (report.max_param_rel, report.worst_param) == (0.0, "")


def test_a_bf16_models_parameters_come_back_whole_in_fp32() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    got = full_parameters(model)
    assert {k: v.dtype for k, v in got.items()} == {"weight": torch.float32, "bias": torch.float32}
    assert torch.equal(got["weight"], model.weight.detach().float())
    got["weight"].add_(1)  # a copy: the model's own values stay
    assert not torch.equal(got["weight"], model.weight.detach().float())
