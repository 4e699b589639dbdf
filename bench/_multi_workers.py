"""The processes `bench/gpu_check_multi.py` launches: a Lightning Fabric script and an
elastic Runner. Not a benchmark of its own.

    python bench/_multi_workers.py fabric cuda|cpu OUT.pt
    shardwise run --nproc 2 --max-restarts 1 bench/_multi_workers.py elastic RUN_DIR KIND

KIND is `killed` (rank 1 of the first attempt dies after its third step) or
`uninterrupted`.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_multi as multi


def fabric(device_type: str, out: Path) -> None:
    """Fabric with devices=[1, 0] on GPUs (rank 0 on cuda:1), devices=2 on the CPU: 3 SGD
    steps of the GPT, each rank its half of every batch; rank 0 saves the losses, the
    whole parameters and where each rank's model and batches sat."""
    import lightning
    import torch.distributed as dist

    from shardwise.integrations.fabric import ShardwiseFabricStrategy

    devices: list[int] | int = [1, 0] if device_type == "cuda" else 2
    accelerator = "cuda" if device_type == "cuda" else "cpu"
    strategy = ShardwiseFabricStrategy(strategy="full_shard")
    f = lightning.Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
    f.launch()
    model = multi.gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = f.setup(model, optimizer)
    per = multi.BATCH // f.world_size
    losses, placed = [], []
    for ids, targets in multi.data("gpt")[: multi.STEPS]:
        ids, targets = (f.to_device(t[f.global_rank * per : (f.global_rank + 1) * per])
                        for t in (ids, targets))  # fmt: skip
        loss = model(ids, targets)
        f.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / f.world_size)
        param = next(model.parameters())
        local = param.to_local() if hasattr(param, "to_local") else param
        placed.append((str(f.device), str(local.device), str(ids.device)))
    everyone = [None] * f.world_size
    dist.all_gather_object(everyone, placed[-1])
    from torch.distributed.tensor import DTensor

    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
        for n, p in model.named_parameters()
    }
    if f.global_rank == 0:
        names = {n.removeprefix("_forward_module.").removeprefix("module."): t
                 for n, t in params.items()}  # fmt: skip
        torch.save({"losses": losses, "params": names, "placed": everyone}, out)


STEPS_ELASTIC, KILLED_AFTER = 6, 3


def elastic(run_dir: Path, kind: str) -> None:
    """A Runner over the GPT that saves after every step and resumes from the latest; with
    `killed`, rank 1 of the first attempt dies after its third step."""
    import shardwise
    from shardwise import Engine, ParallelConfig, Runner, RunnerConfig

    info = shardwise.init_distributed()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = multi.gpt()
    engine = Engine(model, functools.partial(torch.optim.SGD, lr=0.5), ParallelConfig())

    def die(optimizer: object, args: object, kwargs: object) -> None:
        if kind == "killed" and restarts == 0 and info.rank == 1 and engine.step == KILLED_AFTER:
            os._exit(1)  # after the step-3 checkpoint, before step 4 updates anything

    engine.optimizer.register_step_pre_hook(die)
    ids = torch.cat([b[0] for b in multi.data("gpt")])
    targets = torch.cat([b[1] for b in multi.data("gpt")])
    config = RunnerConfig(
        run_dir=str(run_dir), batch_size=2, max_steps=STEPS_ELASTIC, max_epochs=None,
        save_every=1, progress=False, resume="latest", seed=3, shuffle=False,
    )  # fmt: skip
    Runner(engine, torch.utils.data.TensorDataset(ids, targets), config=config).fit()
    from torch.distributed.tensor import DTensor

    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
        for n, p in engine.model.named_parameters()
    }
    if info.rank == 0:
        torch.save({"params": params, "restarts": restarts}, run_dir / "final.pt")
    shardwise.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "fabric":
        fabric(sys.argv[2], Path(sys.argv[3]))
    else:
        elastic(Path(sys.argv[2]), sys.argv[3])
