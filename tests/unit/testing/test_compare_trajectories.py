"""`compare_trajectories` and `worst_of`: a difference within the bound passes, one above it
is named, and a trajectory that is not finite on either side is refused, wherever its NaN
sits (Python's `max` and every `>` let a NaN through). `assert_same_distribution` refuses a
NaN its namesake lacks."""

from __future__ import annotations

import math
import re

import pytest
import torch

from shardwise.testing.parity import ParityError, Trajectory, compare_trajectories, worst_of


def trajectory(losses: list[float], weight: float = 1.0) -> Trajectory:
    return Trajectory(losses, {"w": torch.full((3,), weight), "b": torch.ones(2)})


def test_equal_trajectories_pass_and_report_zero() -> None:
    report = compare_trajectories(trajectory([2.0, 1.5, 1.0]), trajectory([2.0, 1.5, 1.0]))
    assert (report.max_loss_rel, report.max_param_rel) == (0.0, 0.0)


def test_a_loss_above_the_bound_is_named_by_step() -> None:
    with pytest.raises(ParityError, match="loss diverges at step 1"):
        compare_trajectories(trajectory([2.0, 1.5]), trajectory([2.0, 1.6]), rtol=1e-5)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("side", ["candidate", "reference", "both"])
def test_a_loss_that_is_not_finite_after_the_first_step_is_refused(bad: float, side: str) -> None:
    good, diverged = [2.0, 1.5, 1.0], [2.0, 1.5, bad]
    ref = diverged if side in ("reference", "both") else good
    got = diverged if side in ("candidate", "both") else good
    with pytest.raises(ParityError, match="loss at step 2 is not finite"):
        compare_trajectories(trajectory(ref), trajectory(got))


@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_a_parameter_that_is_not_finite_is_refused_by_name(side: str) -> None:
    ref, got = trajectory([1.0]), trajectory([1.0])
    (got if side == "candidate" else ref).params["w"][1] = math.nan
    with pytest.raises(ParityError, match=f"parameter 'w' of the {side} is not finite"):
        compare_trajectories(ref, got)


def test_worst_of_is_max_over_finite_differences_and_refuses_a_late_nan() -> None:
    assert worst_of([0.0, 3e-7, 1e-7]) == 3e-7
    assert worst_of([]) == 0.0
    assert max([0.0, math.nan]) == 0.0  # what worst_of guards against
    with pytest.raises(ParityError, match="1 of 2 differences are not finite"):
        worst_of([0.0, math.nan])
    with pytest.raises(ParityError, match="not finite"):
        worst_of(iter([1e-9, math.inf, 0.0]))


def test_a_draw_holding_a_nan_its_namesake_lacks_is_not_the_same_distribution() -> None:
    from shardwise.testing import assert_same_distribution

    torch.manual_seed(0)
    want = {"w": torch.randn(64, 64), "mask": torch.full((4, 4), -math.inf).triu(1)}
    got = {"w": torch.randn(64, 64), "mask": want["mask"].clone()}
    assert_same_distribution(got, want, label="eager")  # the mask's -inf on both sides
    got["w"][3, 5] = math.nan  # one value left uninitialised
    with pytest.raises(AssertionError, match="w holds 1 values that are not finite"):
        assert_same_distribution(got, want, label="meta")


@pytest.mark.parametrize("side", ["missing", "extra"])
def test_parameter_names_must_match_both_ways(side: str) -> None:
    """Issue 48: a candidate holding a parameter the reference lacks (an untied copy, a
    stage's leftover shim) has compared nothing for it: refused, as a missing one is."""
    ref = Trajectory([2.0], {"w": torch.ones(2)})
    other = {"w": torch.ones(2), "head.weight": torch.ones(2)}
    cand = Trajectory([2.0], other if side == "extra" else {})
    want = "missing [], extra ['head.weight']" if side == "extra" else "missing ['w'], extra []"
    with pytest.raises(ParityError, match=re.escape(f"parameter names differ: {want}")):
        compare_trajectories(ref, cand)


def test_a_batch_that_does_not_divide_over_the_ranks_is_refused():
    """Rows left over would be dropped: the distributed run would train on fewer rows
    than the reference and the layout would take the blame (fresh audit)."""
    from shardwise.testing.parity import split_batch

    for rows, world in ((5, 2), (6, 4), (3, 4)):
        with pytest.raises(ValueError, match=rf"global batch size {rows} does not divide evenly "
                           rf"over {world} ranks"):  # fmt: skip
            split_batch((torch.arange(rows),), 0, world)
    parts = [split_batch((torch.arange(8), torch.arange(8) * 2), r, 4) for r in range(4)]
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [p[1].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10], [12, 14]]


def test_a_loss_difference_is_measured_against_the_reference():
    """|candidate - reference| / |reference|, as documented: a candidate below the reference
    is judged as one above it would be (third audit: over the candidate, 1 against 2 read
    as twice off)."""
    ref = Trajectory([1.0, 2.0], {})
    report = compare_trajectories(ref, Trajectory([1.0, 1.0], {}), rtol=0.75, check_params=False)
    assert report.max_loss_rel == 0.5
    report = compare_trajectories(ref, Trajectory([1.0, 3.0], {}), rtol=0.75, check_params=False)
    assert report.max_loss_rel == 0.5
    with pytest.raises(ParityError, match=r"loss diverges at step 1: 0\.90000000 vs reference "
                       r"2\.00000000 \(rel 5\.50e-01 > rtol 5e-01\)"):  # fmt: skip
        compare_trajectories(ref, Trajectory([1.0, 0.9], {}), rtol=0.5, check_params=False)


@pytest.mark.parametrize(
    ("reference", "candidate"),
    [((3,), (1, 3)), ((1, 3), (3,)), ((3, 1), (1, 3)), ((2, 3), (3, 2)), ((3,), (4,))],
)
def test_a_parameter_of_another_shape_is_refused_even_at_the_same_size(reference, candidate):
    """Fourth audit: a final parameter laid out in another shape (a row for a column, a
    transpose) holds the same number of values, and their difference broadcasts to
    nothing; the shape itself is compared, on either side."""
    ref = Trajectory([1.0, 0.9], {"w": torch.ones(reference)})
    cand = Trajectory([1.0, 0.9], {"w": torch.ones(candidate)})
    with pytest.raises(ParityError) as caught:
        compare_trajectories(ref, cand)
    assert str(caught.value) == f"candidate: w shape {candidate} != {reference}"
