"""Real transformers architectures under full_shard, each built from a tiny config.

For every model in `_hf_sweep.SPECS`: the `auto` policy finds its blocks; 2 AdamW steps
at world 2 equal single-process training on the same global batch; and the export loads
with the model's own `from_pretrained` and gives the same logits. All models run in one
spawned process group (a module fixture); the tests below read its per-model results,
so every model passes or fails on its own. `python tests/models/_hf_sweep.py` prints
the same results as a Markdown table.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

from _hf_sweep import (
    BY_NAME,
    CONTROL,
    ROUNDING_FACTOR,
    RTOL,
    failure,
    merge,
    parity,
    reload,
    sweep,
)

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import ParityError

pytestmark = pytest.mark.models  # `make test-models`, which .ci/run runs after `make test`

NAMES = list(BY_NAME)
# The reloaded model computes exactly what the distributed one does; up to 1e-7 apart
# where a kernel's summation order differs between the runs (measured: 0 to 1.3e-7).
SAME_MODEL_RTOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    shardwise.shutdown()
    out = tmp_path_factory.mktemp("hf_sweep")
    return merge(run_distributed(sweep, 2, args=(str(out), NAMES), timeout_s=240))


def _distributed_ok(record) -> None:
    error = failure(record)
    if error:
        pytest.fail(error, pytrace=False)


@pytest.mark.parametrize("name", NAMES)
def test_auto_policy_finds_blocks(results, name):
    plan = results[name]["distributed"].get("plan")
    if plan is None:
        _distributed_ok(results[name])
    if not plan["blocks"]:
        pytest.fail(f"{name}: {plan['policy']}; units {plan['units']}", pytrace=False)


@pytest.mark.parametrize("name", NAMES)
def test_full_shard_trains_like_one_process(results, name):
    _distributed_ok(results[name])
    parity(results[name])


def test_parity_check_fails_on_wrong_training(results):
    """Negative controls on one model: every rank trained on rank 0's slice; a regular
    parameter off by 2*RTOL; a rounding-set parameter pushed past its bound."""
    record = results[CONTROL]
    _distributed_ok(record)
    with pytest.raises(ParityError, match="loss diverges at step 0"):
        parity({**record, "distributed": record["control"]})

    rounding = parity(record).rounding
    assert rounding, f"{CONTROL} was picked for having rounding-set parameters"
    regular = next(n for n in record["distributed"]["params"] if n not in rounding)
    off = copy.deepcopy(record)
    off["distributed"]["params"][regular] *= 1 + 2 * RTOL
    with pytest.raises(ParityError, match=f"final parameter '{regular}'"):
        parity(off)

    name, (spread, _) = next(iter(rounding.items()))
    off = copy.deepcopy(record)
    off["distributed"]["params"][name] += 2 * ROUNDING_FACTOR * spread
    with pytest.raises(ParityError, match="set by rounding"):
        parity(off)


def test_parity_check_fails_on_a_router_gradient_off(results):
    """The mixtures of experts' first-step router gradients are compared, not only present:
    one off by 2*RTOL fails (each rank's own load-balancing statistics were off by 0.2-0.5)."""
    moe = [name for name in NAMES if BY_NAME[name].router]
    assert len(moe) >= 4, moe
    record = results["mixtral"]
    _distributed_ok(record)
    grads = record["distributed"]["router_grads"]
    assert len(grads) == 2, grads  # one router per layer
    off = copy.deepcopy(record)
    name = next(iter(grads))
    off["distributed"]["router_grads"][name] *= 1 + 2 * RTOL
    with pytest.raises(ParityError, match=f"first step's gradient of '{name}' differs"):
        parity(off)


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_with_from_pretrained(results, name):
    _distributed_ok(results[name])
    got = reload(BY_NAME[name], results[name])
    assert not got["loading_info"], got["loading_info"]
    assert got["vs_reference"] <= RTOL, got
    assert got["vs_distributed"] <= SAME_MODEL_RTOL, got
