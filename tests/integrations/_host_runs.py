"""What test_lightning.py and test_fabric.py (and their workers) share: launching a worker
script that Lightning starts the other ranks of, reading back its scenarios, and comparing
two of them.

A worker writes OUT/<phase>.json (each scenario's losses and facts) and OUT/<phase>-<name>.pt
(its final parameters, gathered on rank 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from shardwise.testing.parity import worst_of

TOL = 1e-5


def param_dtypes(module: torch.nn.Module) -> list[str]:
    """The dtypes a module's parameters have (a worker records them)."""
    return sorted({str(p.dtype) for p in module.parameters()})


def launch(worker: Path, out: Path, phase: str, timeout_s: float) -> dict[str, Any]:
    """Run `worker OUT PHASE` (its own launcher starts the other ranks); its results."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(worker), str(out), phase],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    result = out / f"{phase}.json"
    if proc.returncode != 0 or not result.is_file():
        raise AssertionError(f"worker {phase} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(json.loads(result.read_text()))


def params(out: Path, name: str, phases: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Scenario `name`'s final parameters, from whichever phase ran it."""
    for phase in phases:
        path = out / f"{phase}-{name}.pt"
        if path.is_file():
            return dict(torch.load(path))
    raise FileNotFoundError(name)


def rel_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return worst_of(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def rel_losses(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return worst_of(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def assert_same(
    runs: tuple[Path, dict[str, Any]], name: str, ref: str, phases: tuple[str, ...], skip: int = 0
) -> None:
    """Scenario `name` trained as `ref` did (from `ref`'s step `skip` on): losses and final
    parameters within TOL."""
    out, r = runs
    assert rel_losses(r[name]["losses"], r[ref]["losses"][skip:]) <= TOL
    assert rel_params(params(out, name, phases), params(out, ref, phases)) <= TOL


PARAM_DTYPES = {
    "bf16_mixed": "torch.float32",
    "bf16_true": "torch.bfloat16",
    "16_true": "torch.float16",
}
"""The parameters' dtype under each of Lightning's precision flags (the flag's `-` as `_`)."""


def assert_precision_same(
    runs: tuple[Path, dict[str, Any]], precision: str, host_ddp: str, phases: tuple[str, ...]
) -> None:
    """Scenario `<precision>_full_shard` trained as `<precision>_<host_ddp>` did, in the
    precision's parameter dtype, and not as the fp32 `host_ddp` run did (the precision
    ran)."""
    name = f"{precision}_full_shard"
    assert_same(runs, name, f"{precision}_{host_ddp}", phases)
    assert runs[1][name]["dtypes"] == [PARAM_DTYPES[precision]]
    assert rel_losses(runs[1][name]["losses"], runs[1][host_ddp]["losses"]) > 1e-4
