"""shardwise's Runner inside Ray Train's TorchTrainer, on a local Ray cluster (2 CPUs).

One Ray instance for the module. The runs, each a TorchTrainer over the same loop
(`_ray_loop.train_loop`): one worker (the one-process reference), two workers with full_shard, two
workers where rank 1 dies at step 5 of the first attempt (Ray restarts the group, which
resumes from the step-4 checkpoint it reported), and two workers to step 4 followed by a
new trainer of the same run name at one worker (a restart at another size). Each compares
the losses of every step and the final parameters with the reference, rel 1e-5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray  # `make test-ray` (and .ci/run), not `make test`
ray = pytest.importorskip("ray")

import torch  # noqa: E402
from _ray_loop import train_loop  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from shardwise.testing.parity import _rel as rel_diff  # noqa: E402

STEPS = 8
TOL = 1e-5  # fp32 against one process; measured: losses 1.1e-7, parameters 1.3e-7 at most


def _train(out: Path, workers: int, name: str, **cfg: Any) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    failures = cfg.pop("max_failures", 0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"out": str(out), "strategy": "full_shard", "max_steps": STEPS, **cfg},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(out / "ray"),
            failure_config=FailureConfig(max_failures=failures),
        ),
    )
    return trainer.fit()


def _losses(out: Path) -> list[float]:
    from shardwise.train.metrics import read_metrics

    rows = read_metrics(out / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return [float(r["loss"]) for r in rows]


def _params(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "weights" / "model.safetensors"))


def _assert_same(out: Path, ref: Path) -> None:
    got, want = _losses(out), _losses(ref)
    worst = max(rel_diff(torch.tensor(g), torch.tensor(w)) for g, w in zip(got, want, strict=True))
    assert worst <= TOL, (got, want)
    p, q = _params(out), _params(ref)
    assert sorted(p) == sorted(q)
    worst_param = max(rel_diff(p[k], q[k]) for k in p)
    assert worst_param <= TOL
    print(f"{out.name}: losses {worst:.1e}, parameters {worst_param:.1e}")  # -s shows it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    src = str(Path(__file__).resolve().parents[2] / "src")
    here = str(Path(__file__).resolve().parent)  # _ray_loop, imported by the workers
    ray.init(
        num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
        log_to_driver=False, runtime_env={"env_vars": {
            "PYTHONPATH": os.pathsep.join([src, here, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }},
    )  # fmt: skip
    yield tmp_path_factory.mktemp("ray")
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(cluster: Path) -> Path:
    out = cluster / "one"
    _train(out, 1, "one")
    return out


def test_two_workers_with_full_shard_equal_one_process(cluster: Path, reference: Path) -> None:
    out = cluster / "two"
    _train(out, 2, "two")
    adopted, world, backend = json.loads((out / "groups.json").read_text())
    assert (adopted, world, backend) == (True, 2, "gloo")
    _assert_same(out, reference)


def test_a_killed_worker_resumes_from_the_reported_checkpoint(
    cluster: Path, reference: Path
) -> None:
    out = cluster / "killed"
    result = _train(out, 2, "killed", kill_at=5, max_failures=1)
    assert (out / "killed").exists()  # rank 1 died in step 5 of the first attempt
    assert result.checkpoint is not None and result.checkpoint.path.startswith(str(out / "ray"))
    # The second attempt resumed from the copy Ray keeps of the step-4 checkpoint, not
    # from the Runner's own directory (which holds step 4 too: 'latest' would pass parity).
    (resumed,) = (out / "resumed_from").read_text().splitlines()
    assert resumed.startswith(str(out / "ray")), resumed
    assert json.loads((Path(resumed) / "shardwise.json").read_text())["step"] == 4
    _assert_same(out, reference)


def test_a_new_trainer_of_the_run_resumes_at_another_number_of_workers(
    cluster: Path, reference: Path
) -> None:
    out = cluster / "resized"
    _train(out, 2, "resized", max_steps=4)
    _train(out, 1, "resized")  # same name: Ray hands it the run's latest checkpoint
    first, second = (out / "resumed_from").read_text().splitlines()
    assert first == "latest" and second.startswith(str(out / "ray")), (first, second)
    saved = json.loads((Path(second) / "shardwise.json").read_text())
    assert (saved["step"], saved["world_size"]) == (4, 2)
    _assert_same(out, reference)


def test_an_asynchronous_save_is_refused(cluster: Path) -> None:
    """Ray copies a checkpoint when it is reported; an asynchronous one is complete only at
    the next save."""
    from torch.utils.data import TensorDataset

    from shardwise import Engine, ParallelConfig, RunnerConfig
    from shardwise.integrations.ray import RayRunner

    engine = Engine(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), ParallelConfig())
    data = TensorDataset(torch.randn(4, 2))
    config = RunnerConfig(run_dir=str(cluster / "async"), async_save=True, progress=False)
    with pytest.raises(ValueError, match=r"RayRunner: RunnerConfig.async_save=True is not"):
        RayRunner(engine, data, config=config)
    RayRunner(engine, data, config=RunnerConfig(run_dir=str(cluster / "sync"), progress=False))
