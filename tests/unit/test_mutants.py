"""The mutation list stays applicable: each mutant's text is found once in its file, and
each names tests that exist. (Running the mutants is on demand: tests/mutants.py.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutants", ROOT / "tests" / "mutants.py")
assert _spec is not None and _spec.loader is not None
mutants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutants", mutants)  # dataclasses look their module up
_spec.loader.exec_module(mutants)


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_still_applies(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: update its text in tests/mutants.py"
    assert mutant.new != mutant.old
    for test in mutant.tests:
        file, _, name = test.partition("::")
        source = (ROOT / file).read_text()
        assert f"def {name.split('[')[0]}(" in source, f"{mutant.name}: {test} not found"


def test_the_list_covers_the_audited_behaviours():
    # The seven gaps of the mutation audit (issue 27), each with at least one mutant.
    names = {m.name for m in mutants.MUTANTS}
    assert {
        "wrap_skips_a_unit",
        "bf16_reduces_in_bf16",
        "resume_drops_param_groups",
        "latest_before_rename",
        "mmengine_parse_losses_ignored",
        "validation_not_all_reduced",
        "clip_scales_up",
        "clip_applied_twice",
    } <= names
    assert len(names) == len(mutants.MUTANTS)  # names are unique


@pytest.mark.heavy  # a pytest collection in a subprocess
def test_a_test_id_that_collects_nothing_is_reported_not_passed():
    """Issue 48: a mutant whose tests collect nothing would pass as a survivor or, worse,
    a deselected id would look like tests that ran. The script names each id that collects
    nothing under its marker: a missing test and a slow one alike."""
    present = "tests/unit/test_mutants.py::test_the_list_covers_the_audited_behaviours"
    missing = "tests/unit/test_mutants.py::test_no_such_test"
    slow = "tests/e2e/test_launch_robust.py::test_a_stalled_rank_is_named_and_the_job_ends"
    got = mutants._uncollected(ROOT, (present, missing, slow))
    assert got == [missing, slow]
