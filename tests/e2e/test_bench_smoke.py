"""The benchmarks still run: each in its tiny CPU configuration (figures are not checked:
speed and memory are measured in bench/, never in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = pytest.mark.bench  # `make test-bench` (and .ci/run), not `make test`


@pytest.mark.parametrize(
    "script",
    [
        "mfu.py",
        "meta_memory.py",
        "wrap_memory.py",
        "export_memory.py",
        "checkpoint_io.py",
        "overhead.py",
        "memory_sim.py",
        "plan_memory.py",  # the fast simulation against the full one (issue 54)
        "stream_loader.py",  # needs datasets (the dev extra); torchdata if installed
        "muon.py",  # worlds 2 and 4, spawned
        # These two need transformers / mmengine and lightning: they run with the targets
        # that test those (`make test-models`, `make test-integrations`) instead.
        pytest.param("hf_storage.py", marks=pytest.mark.models),
        pytest.param("integrations.py", marks=pytest.mark.integrations),
        pytest.param("adapters.py", marks=pytest.mark.adapters),  # peft: `make test-adapters`
        pytest.param("pipeline.py", marks=pytest.mark.pipeline),  # `make test-pipeline`
        pytest.param("experts.py", marks=pytest.mark.experts),  # `make test-experts`
        pytest.param("experts_memory.py", marks=pytest.mark.experts),
        pytest.param("context.py", marks=pytest.mark.context_parallel),  # `make test-cp`
    ],
)
def test_benchmark_smoke(script):
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    start = out.stdout.index("{")
    report = json.loads(out.stdout[start:])
    assert report["benchmark"] in script.replace(".py", "") or script == "overhead.py"


@pytest.mark.pipeline  # `make test-pipeline`: tp and pp at world 2
def test_overhead_compares_tp_and_pp_with_the_same_plan_written_by_hand():
    out = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--smoke", "--strategies", "tp,pp"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{") :])
    assert set(report["strategies"]) == {"tp", "pp"}
    for name, r in report["strategies"].items():
        # The same plan both ways: rank 0 holds as many parameters under each.
        local = r["local_params_rank0"]
        assert local["shardwise"] == local["handwritten"] < r["params"], (name, local)
    tp = report["strategies"]["tp"]["final_loss_rank0"]  # the same steps on the same rows
    assert tp["shardwise"] == pytest.approx(tp["handwritten"], rel=1e-5)


def test_gpu_check_without_a_gpu_says_so_and_checks_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run `make gpu-check` itself")
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path / "g.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA GPU is visible on this machine; nothing was checked" in out.stdout
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["gpu"] is None and report["checks"] == {}


def test_gpu_checks_of_the_newest_dimensions_run_on_the_cpu(tmp_path):
    """What `make gpu-check` runs for issue 47, on the CPU: a GPU adds only what CUDA alone
    shows (the recompute on autograd's device thread, bf16 copies, host pointers)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu",
         "--only", "router,adapters,dims_syncs", "--out", str(tmp_path / "g.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    checks = json.loads((tmp_path / "g.json").read_text())["checks"]
    assert checks["router"]["sums_with_recompute"] == 2
    adapters = checks["adapters"]
    assert adapters["qlora_bf16"]["four_bit_layers"] == 14  # 7 linears of 2 layers
    for run in ("qlora_bf16", "qlora_bf16_offload"):
        assert adapters[run]["gathered_codes_equal_loaded"] == 14, adapters
    assert checks["dims_syncs"]["ep_dispatch_per_layer"] == {"forward": 1, "with_recompute": 2}
    assert checks["dims_syncs"]["pp_token_count"] == 0


def test_gpu_check_multi_with_fewer_than_two_gpus_says_so(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are visible: run `make gpu-check-multi` itself")
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check_multi.py"), "--out", str(tmp_path / "g.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gpu-check-multi: needs ≥ 2 GPUs" in out.stdout
    assert json.loads((tmp_path / "g.json").read_text())["checks"] == {}


def test_gpu_check_multi_runs_every_check_on_cpu_ranks(tmp_path):
    """`make gpu-check-multi`'s code paths with gloo standing in for NCCL, at world 4 (so
    hybrid_shard runs too); Fabric on devices=2 rather than [1, 0]."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check_multi.py"), "--device", "cpu", "--world", "4",
         "--out", str(tmp_path / "g.json")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    checks = json.loads((tmp_path / "g.json").read_text())["checks"]
    names = {"p2p_all_to_all", "pp_1f1b", "pp_interleaved", "ep2", "tp2", "hybrid_shard"}
    assert names | {"group", "fabric", "elastic"} == set(checks)
    for name in names - {"p2p_all_to_all"}:
        for rank in checks[name]["ranks"]:
            bars = {"fp32": 1e-4, "fp16": 5e-2} if name == "ep2" else {"": 1e-4}
            for key, bar in bars.items():
                run = rank[key] if key else rank
                assert run["params_compared"] > 0 and run["worst_rel"] < bar, (name, rank)
    assert checks["group"]["world"] == 4 and checks["elastic"]["restarts"] == 1
    assert checks["fabric"]["params_compared"] > 0


def test_mfu_holds_one_variant_at_a_time(monkeypatch):
    """Issue 26: both compared models (and their AdamW states) were resident at once; at
    1.3B with batch 8 x 2048 that does not fit an 80 GB GPU."""
    import argparse
    import gc
    import importlib.util
    import weakref

    spec = importlib.util.spec_from_file_location("mfu_bench", BENCH / "mfu.py")
    monkeypatch.syspath_prepend(str(BENCH))  # mfu.py imports its sibling `common`
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    alive: list[weakref.ref] = []
    most = []
    real = mfu.build

    def build(*args, **kwargs):
        gc.collect()
        most.append(sum(r() is not None for r in alive))
        model, state = real(*args, **kwargs)
        alive.append(weakref.ref(model))
        return model, state

    monkeypatch.setattr(mfu, "build", build)
    args = argparse.Namespace(vocab=64, seq_len=8, batch=2, warmup=1, steps=1, peak_tflops=None)
    out = mfu.measure(args, "tiny", None, torch.device("cpu"))
    assert out["handwritten"]["tokens_per_s"] > 0 and out["shardwise"]["tokens_per_s"] > 0
    assert most == [0, 0]  # nothing of the first variant left when the second is built
