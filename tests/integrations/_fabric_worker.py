"""Lightning Fabric scenarios for tests/integrations/test_fabric.py, run as a script.

`python _fabric_worker.py OUT_DIR PHASE`: the first `fabric.launch()` starts the other ranks
(Fabric re-runs this script); every later Fabric in the process joins the same group.
Rank 0 writes OUT_DIR/<PHASE>.json after each scenario, parameters as .pt files beside it.

Phase w2 (2 processes) and w4 (4 processes). Each step takes the same 16 rows of the data
whatever the layout: `fabric.setup_dataloaders` gives each data-parallel rank its own rows
through the strategy's sampler arguments, in micro-batches of 16 / (2 * dp) accumulated
twice under `fabric.no_backward_sync`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from _host_runs import param_dtypes
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.integrations.fabric import ShardwiseFabricStrategy
from shardwise.testing.parity import full_parameters

warnings.filterwarnings("ignore")
N, DIM, GLOBAL, ACCUM, STEPS = 64, 16, 16, 2, 8
LR, MOMENTUM, MAX_NORM = 0.05, 0.9, 0.05
TP_PLAN = {"net.0": "colwise", "net.2": "rowwise"}
CLIP = {"max_norm": MAX_NORM}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, DIM, generator=g)
    y = (x @ torch.randn(DIM, 1, generator=g)).tanh() + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WideNet(nn.Module):
    """Net with every parameter a multiple of 64 elements (but the last bias): each rank's
    shard a multiple of 32. torch's CPU kernels run bf16 elementwise ops (the optimizer's)
    in whole vectors and the rest of a tensor by another path, which can round otherwise:
    on Net, the update of a half-length shard differed from the whole tensor's under DDP
    (measured with plain torch: 1 bf16 ulp in 2 elements after one SGD step, 1e-2 after
    8; with every dimension 64, bit for bit)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_fabric(strategy: Any, devices: int, precision: str = "32-true") -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def loader(fabric: L.Fabric, dp: int) -> list[Any]:
    # Fabric adds the sampler: the strategy's data-parallel rank and size.
    dl = DataLoader(dataset(), batch_size=GLOBAL // (ACCUM * dp), shuffle=False)
    return list(fabric.setup_dataloaders(dl))


def train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    batches: list[Any],
    start: int = 0,
    stop: int = STEPS,
    clip: dict[str, float] | None = CLIP,
) -> list[float]:
    """A LitGPT-style loop: fabric.backward, no_backward_sync while accumulating,
    fabric.clip_gradients (unless `clip` is None), optimizer.step."""
    losses = []
    for step in range(start, stop):
        total = torch.zeros(())
        for k in range(ACCUM):
            x, y = batches[(step * ACCUM + k) % len(batches)]
            with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                loss = nn.functional.mse_loss(model(x), y) / ACCUM
                fabric.backward(loss)
            total += loss.detach()
        if clip is not None:
            fabric.clip_gradients(model, optimizer, **clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
    return losses


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole 16 rows of each step, torch's clip_grad_norm_."""
    torch.manual_seed(0)
    model = Net()
    optimizer = sgd(model.parameters())
    x, y = dataset().tensors
    losses = []
    for step in range(STEPS):
        rows = slice(GLOBAL * step % N, GLOBAL * step % N + GLOBAL)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, full_parameters(model)


def joint(
    strategy: Any,
    devices: int,
    dp: int,
    seed: int = 0,
    precision: str = "32-true",
    net: type[nn.Module] = Net,
    **kw: Any,
) -> tuple[Any, ...]:
    """`model, optimizer = fabric.setup(model, optimizer)`, then the loop."""
    fabric = make_fabric(strategy, devices, precision)
    torch.manual_seed(seed)
    model = net()
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    return fabric, model, train(fabric, model, optimizer, loader(fabric, dp), **kw)


def litgpt_style(strategy: Any, devices: int, dp: int, empty_init: bool = False) -> tuple:
    """LitGPT's order: init_module, setup the model, build the optimizer from it, set it up."""
    fabric = make_fabric(strategy, devices)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=empty_init):
        model = Net()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(sgd(model.parameters()))
    return fabric, model, optimizer, loader(fabric, dp), on_meta


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    results: dict[str, Any] = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))

    def record(name: str, model: Any, losses: list[float], **more: Any) -> None:
        params = full_parameters(model.module)  # collective under FSDP2: every rank
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        results[name] = {"losses": losses, "sharded": sharded, **more}
        if rank == 0:
            torch.save(params, out / f"{phase}-{name}.pt")
            (out / f"{phase}.json").write_text(json.dumps(results))

    ck = out / "ckpt-litgpt"
    if phase == "w2":
        if rank == 0:
            losses, params = reference()
            results["reference"] = {"losses": losses}
            torch.save(params, out / f"{phase}-reference.pt")
        record("fabric_ddp", *joint("ddp", 2, 2)[1:])
        record("full_shard", *joint(ShardwiseFabricStrategy(strategy="full_shard"), 2, 2)[1:])
        record("shardwise_ddp", *joint(ShardwiseFabricStrategy(strategy="ddp"), 2, 2)[1:])
        record("other_seed", *joint(ShardwiseFabricStrategy(strategy="full_shard"), 2, 2, 1)[1:])
        clip_value = {"clip": {"clip_val": 0.01}}
        record("fabric_ddp_clip_value", *joint("ddp", 2, 2, **clip_value)[1:])
        record(
            "clip_value",
            *joint(ShardwiseFabricStrategy(strategy="full_shard"), 2, 2, **clip_value)[1:],
        )

        # LitGPT's order, saved through fabric.save halfway, and resumed by a fresh model.
        fabric, model, optimizer, batches, _ = litgpt_style(
            ShardwiseFabricStrategy(strategy="full_shard"), 2, 2
        )
        losses = train(fabric, model, optimizer, batches, stop=STEPS // 2)
        fabric.save(ck, {"model": model, "optimizer": optimizer, "iter_num": STEPS // 2})
        losses += train(fabric, model, optimizer, batches, start=STEPS // 2)
        record("litgpt", model, losses)
        fabric, model, optimizer, batches, _ = litgpt_style(
            ShardwiseFabricStrategy(strategy="full_shard"), 2, 2
        )
        state = {"model": model, "optimizer": optimizer, "iter_num": 0}
        remainder = fabric.load(ck, state)
        start = state["iter_num"]
        losses = train(fabric, model, optimizer, batches, start=start)
        record("resumed", model, losses, start=start, remainder=sorted(remainder))

        fabric, model, optimizer, batches, on_meta = litgpt_style(
            ShardwiseFabricStrategy(strategy="full_shard"), 2, 2, empty_init=True
        )
        record("meta", model, train(fabric, model, optimizer, batches), built_on_meta=on_meta)

        fabric = make_fabric(ShardwiseFabricStrategy(strategy="full_shard"), 2)
        early = Net()
        optimizer = sgd(early.parameters())
        model = fabric.setup_module(early)
        try:
            fabric.setup_optimizers(optimizer)
            results["stale"] = "no error"
        except RuntimeError as exc:
            results["stale"] = str(exc)

        # Lightning's precision plugins: autocast (bf16-mixed), a bf16 model (bf16-true) and
        # an fp16 model (16-true). The true ones unclipped: shardwise sums the shards'
        # gradient norms in fp32, where torch's clip_grad_norm_ under Fabric's DDP rounds
        # them in the parameters' dtype (measured on WideNet under bf16-true: 3.3e-3 in the
        # parameters after 8 clipped steps, bf16's rounding of the coefficient, and none
        # unclipped).
        for precision, clip in (("bf16-mixed", CLIP), ("bf16-true", None), ("16-true", None)):
            key = precision.replace("-", "_")
            kw = {"precision": precision, "clip": clip, "net": WideNet}
            record(f"{key}_fabric_ddp", *joint("ddp", 2, 2, **kw)[1:])
            _, model, losses = joint(ShardwiseFabricStrategy(strategy="full_shard"), 2, 2, **kw)
            record(f"{key}_full_shard", model, losses, dtypes=param_dtypes(model))

        # A model already holding FSDP1 modules.
        fabric = make_fabric(ShardwiseFabricStrategy(strategy="full_shard"), 2)
        fsdp1 = Net()
        fsdp1.net[0] = FullyShardedDataParallel(fsdp1.net[0], device_id=torch.device("cpu"))
        try:
            fabric.setup_module(fsdp1)
            results["fsdp1"] = "no error"
        except TypeError as exc:
            results["fsdp1"] = str(exc)
    elif phase == "w4":
        record("fabric_ddp4", *joint("ddp", 4, 4)[1:])
        hybrid = ShardwiseFabricStrategy(strategy="hybrid_shard", dp_shard=2)
        record("hybrid", *joint(hybrid, 4, 4)[1:])
        # The world-2 checkpoint, resharded into hybrid_shard at world 4.
        fabric, model, optimizer, batches, _ = litgpt_style(
            ShardwiseFabricStrategy(strategy="hybrid_shard", dp_shard=2), 4, 4
        )
        state = {"model": model, "optimizer": optimizer, "iter_num": 0}
        fabric.load(ck, state)
        losses = train(fabric, model, optimizer, batches, start=state["iter_num"], stop=6)
        ck4 = out / "ckpt-hybrid"  # saved at world 4 too, and resumed there
        fabric.save(ck4, {"model": model, "optimizer": optimizer, "iter_num": 6})
        losses += train(fabric, model, optimizer, batches, start=6)
        record("hybrid_resumed", model, losses)
        fabric, model, optimizer, batches, _ = litgpt_style(
            ShardwiseFabricStrategy(strategy="hybrid_shard", dp_shard=2), 4, 4
        )
        state = {"model": model, "optimizer": optimizer, "iter_num": 0}
        fabric.load(ck4, state)
        losses = train(fabric, model, optimizer, batches, start=state["iter_num"])
        record("hybrid_resumed_at_4", model, losses, start=state["iter_num"])
        # Tensor parallel: dp 2 x tp 2, the sampler given the data-parallel coordinates.
        tp = ShardwiseFabricStrategy(strategy="full_shard", tp=2, tp_plan=TP_PLAN)
        fabric, model, losses = joint(tp, 4, 2)
        weight = model.module.net[0].weight
        record(
            "tp",
            model,
            losses,
            sampler=tp.distributed_sampler_kwargs,
            local_rows=weight.to_local().shape[0],
            placements=[str(p) for p in weight.placements],
        )
    if rank == 0:
        (out / f"{phase}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
    shardwise.shutdown()


if __name__ == "__main__":
    main()
