"""Lightning scenarios for tests/integrations/test_lightning.py, run as a script.

`python _lt_worker.py OUT_DIR PHASE`: Lightning's own launcher starts the second rank (it
re-runs this script), every scenario runs in the same process group, and rank 0 writes
OUT_DIR/<PHASE>.json after each scenario (parameters as .pt files beside it).
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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardwise
from shardwise.integrations.lightning import ShardwiseStrategy
from shardwise.testing.parity import full_parameters

warnings.filterwarnings("ignore")
N, DIM, BATCH = 64, 16, 8  # 64 samples, 8 per rank per step: 4 steps an epoch at world 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, DIM, generator=g)
    y = (x @ torch.randn(DIM, 1, generator=g)).tanh() + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))


class Lit(L.LightningModule):
    def __init__(self, opt: str = "adamw", lr: float = 1e-2, batch: int = BATCH) -> None:
        super().__init__()
        self.net = make_net()
        self.opt, self.lr, self.batch = opt, lr, batch
        self.losses: list[float] = []

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, idx: int) -> None:
        loss = self.trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses.append(float(loss))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        # Rank r takes samples r, r + world, ...: step s covers samples [s*G, (s+1)*G) of
        # the global batch G, whatever the world size (the single-process reference's order).
        t = self.trainer
        sampler = DistributedSampler(dataset(), t.world_size, t.global_rank, shuffle=False)
        return DataLoader(dataset(), batch_size=self.batch, sampler=sampler)


class WideLit(Lit):
    """Lit on a net whose parameters are each a multiple of 64 elements (but the last bias).
    Under float16, torch's CPU kernels round an update of a shard that is no whole number
    of vectors apart from the whole tensor's (measured with plain torch, DDP against
    fully_shard at world 2: gradients equal, then 2 of make_net's first bias's 32 elements
    one ulp apart after one SGD step)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))


class ForwardLit(Lit):
    """training_step calls self(...): a nested call of the root's forward under FSDP2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class GatherCount:
    """Counts FSDP2's all-gathers (`dist.all_gather_single`) while active."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = dist.all_gather_single

    def __enter__(self) -> GatherCount:
        def counted(*a: Any, **k: Any) -> Any:
            self.n += 1
            return self._orig(*a, **k)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self._orig


def gathers_per_plain_step() -> int:
    """All-gathers in one `loss = model(x); loss.backward()` step of a model wrapped by hand."""
    from shardwise import ParallelConfig, wrap

    model = wrap(ForwardLit(), ParallelConfig(strategy="full_shard"))
    x, y = dataset().tensors
    with GatherCount() as count:
        nn.functional.mse_loss(model(x[:BATCH]), y[:BATCH]).backward()
    return count.n


class MetaLit(Lit):
    """Layers built in configure_model: on the meta device under ShardwiseStrategy."""

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        self.net = make_net()
        self.built_on_meta = all(p.is_meta for p in self.net.parameters())


class PeftLit(Lit):
    """The net as a peft model: LoRA on both linears (both halves drawn, so each moves from
    the first step), the base frozen. configure_optimizers still gives AdamW every
    parameter, frozen ones included, as `self.parameters()` does in most modules."""

    def __init__(self, **kw: Any) -> None:
        import peft

        super().__init__(**kw)
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["0", "3"], init_lora_weights=False
        )
        self.net = peft.get_peft_model(self.net, lora)


def tokens() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randint(0, 64, (32, 16), generator=g))


class LlamaLit(Lit):
    """A transformers Llama held by the LightningModule: tensor parallel finds its own plan
    under `model.`; Lightning gives the sampler the strategy's data-parallel coordinates."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__(batch=4)
        del self.net
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            attn_implementation="eager",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(), batch_size=self.batch)  # Lightning adds the sampler


class EarlyOptimizer(Lit):
    """Builds its optimizer in __init__, from parameters sharding will replace."""

    def __init__(self) -> None:
        super().__init__()
        self.early = torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.early


def trainer(strategy: Any, epochs: int, devices: int = 2, **kw: Any) -> L.Trainer:
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("use_distributed_sampler", False)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def fit(
    strategy: Any,
    *,
    seed: int = 0,
    epochs: int = 2,
    module: type[Lit] = Lit,
    devices: int = 2,
    ckpt_path: str | None = None,
    mkw: dict[str, Any] | None = None,
    **kw: Any,
) -> tuple[Lit, L.Trainer]:
    L.seed_everything(seed, verbose=False)
    lit = module(**(mkw or {}))
    t = trainer(strategy, epochs, devices, **kw)
    t.fit(lit, ckpt_path=ckpt_path)
    return lit, t


def reference_clip(seed: int, steps: int, lr: float, clip: float) -> tuple[list[float], dict, list]:
    """One process, the whole global batch, torch.nn.utils.clip_grad_norm_."""
    L.seed_everything(seed, verbose=False)
    net = Lit(opt="sgd", lr=lr).net
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = dataset().tensors
    losses, norms = [], []
    for s in range(steps):
        s %= N // (2 * BATCH)
        sl = slice(2 * BATCH * s, 2 * BATCH * (s + 1))  # rank 0's + rank 1's batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x[sl]), y[sl])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        losses.append(float(loss))
    return losses, {f"net.{k}": v.detach().clone() for k, v in net.named_parameters()}, norms


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    results: dict[str, Any] = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))

    def record(name: str, lit: Lit) -> None:
        params = full_parameters(lit)  # collective under FSDP2: every rank
        sharded = any(isinstance(p, DTensor) for p in lit.parameters())
        results[name] = {"losses": lit.losses, "sharded": sharded}
        if rank == 0:
            torch.save(params, out / f"{phase}-{name}.pt")
            (out / f"{phase}.json").write_text(json.dumps(results))

    if phase == "main":
        record("lightning_ddp", fit("ddp")[0])
        record("full_shard", fit(ShardwiseStrategy(strategy="full_shard"))[0])
        record("shardwise_ddp", fit(ShardwiseStrategy(strategy="ddp"))[0])
        record(
            "fairscale_words",
            fit(
                ShardwiseStrategy(
                    strategy="ddp_fully_sharded",
                    fp32_reduce_scatter=True,
                    reshard_after_forward=False,
                )
            )[0],
        )
        record("forward_lightning_ddp", fit("ddp", module=ForwardLit)[0])
        with GatherCount() as count:
            lit = fit(ShardwiseStrategy(strategy="full_shard"), module=ForwardLit)[0]
        record("forward_full_shard", lit)
        results["forward_full_shard"]["gathers"] = count.n
        results["forward_full_shard"]["gathers_plain_step"] = gathers_per_plain_step()
        results["forward_full_shard"]["steps"] = 2 * N // (2 * BATCH)
        record("other_seed", fit(ShardwiseStrategy(strategy="full_shard"), seed=1)[0])

        # Resume: epoch 1 through ModelCheckpoint(save_last), then fit(ckpt_path="last").
        ck = out / "ckpt"
        cb = lambda: ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=0)  # noqa: E731
        lit, t = fit(
            ShardwiseStrategy(strategy="full_shard"),
            epochs=1,
            enable_checkpointing=True,
            callbacks=[cb()],
        )
        record("epoch1", lit)
        t.save_checkpoint(out / "epoch1-explicit.ckpt")
        lit, _ = fit(
            ShardwiseStrategy(strategy="full_shard"),
            ckpt_path="last",
            enable_checkpointing=True,
            callbacks=[cb()],
        )
        record("resumed_last", lit)
        lit, _ = fit(ShardwiseStrategy(strategy="ddp"), ckpt_path=str(out / "epoch1-explicit.ckpt"))
        record("resumed_as_ddp", lit)

        # Clipping by the global norm, against Lightning's DDP and one process.
        clip = {"mkw": {"opt": "sgd", "lr": 0.5}, "gradient_clip_val": 0.05}
        record("clip_full_shard", fit(ShardwiseStrategy(strategy="full_shard"), **clip)[0])
        record("clip_lightning_ddp", fit("ddp", **clip)[0])
        if rank == 0:
            losses, params, norms = reference_clip(0, 8, 0.5, 0.05)
            results["clip_reference"] = {"losses": losses, "norms": norms}
            torch.save(params, out / f"{phase}-clip_reference.pt")

        # A peft model, with clipping: the adapters train as under Lightning's DDP.
        L.seed_everything(0, verbose=False)
        if rank == 0:
            torch.save(full_parameters(PeftLit()), out / f"{phase}-peft_start.pt")
        peft_kw: dict[str, Any] = {"module": PeftLit, "gradient_clip_val": 0.05}
        record("peft_lightning_ddp", fit("ddp", **peft_kw)[0])
        record("peft_full_shard", fit(ShardwiseStrategy(strategy="full_shard"), **peft_kw)[0])

        llama: dict[str, Any] = {"module": LlamaLit, "use_distributed_sampler": True}
        record("llama_lightning_ddp", fit("ddp", **llama)[0])

        # Lightning's precision plugins: autocast (bf16-mixed), a bf16 model (bf16-true) and
        # an fp16 model (16-true), on WideLit under SGD: AdamW's eps=1e-8 is 0 in float16,
        # so a gradient whose square underflows divides by zero (NaN from the second step,
        # under Lightning's DDP too).
        fp16 = {"mkw": {"opt": "sgd", "lr": 0.1}, "module": WideLit}
        for precision, kw in (("bf16-mixed", {}), ("bf16-true", {}), ("16-true", fp16)):
            key = precision.replace("-", "_")
            record(f"{key}_lightning_ddp", fit("ddp", precision=precision, **kw)[0])
            lit, _ = fit(ShardwiseStrategy(strategy="full_shard"), precision=precision, **kw)
            record(f"{key}_full_shard", lit)
            results[f"{key}_full_shard"]["dtypes"] = param_dtypes(lit)

        lit, _ = fit(ShardwiseStrategy(strategy="full_shard"), module=MetaLit)
        record("meta", lit)
        results["meta"]["built_on_meta"] = lit.built_on_meta

        try:  # last: the failure ends this trainer's processes
            fit(ShardwiseStrategy(strategy="full_shard"), module=EarlyOptimizer)
            results["early_optimizer"] = "no error"
        except RuntimeError as exc:
            results["early_optimizer"] = str(exc)
        if rank == 0:
            (out / f"{phase}.json").write_text(json.dumps(results))
    elif phase == "tp":
        # dp 2 x tp 2 at world 4, with and without sequence parallelism.
        llama = {"module": LlamaLit, "use_distributed_sampler": True, "devices": 4}
        for name, sp in (("llama_tp", False), ("llama_tp_sp", True)):
            strategy = ShardwiseStrategy(strategy="full_shard", tp=2, sequence_parallel=sp)
            lit, t = fit(strategy, **llama)
            weight = lit.model.model.layers[0].self_attn.q_proj.weight
            record(name, lit)
            results[name].update(
                sampler=t.strategy.distributed_sampler_kwargs,
                local_rows=weight.to_local().shape[0],
                placements=[str(p) for p in weight.placements],
            )
        if rank == 0:
            (out / f"{phase}.json").write_text(json.dumps(results))
    elif phase == "world1":
        # The world-2 epoch-1 checkpoint, resumed by one process with the same global batch.
        lit, _ = fit(
            ShardwiseStrategy(strategy="full_shard"),
            devices=1,
            mkw={"batch": 2 * BATCH},
            ckpt_path=str(out / "epoch1-explicit.ckpt"),
        )
        record("resumed_world1", lit)
    if dist.is_initialized():
        dist.barrier()
    # Leave with no live process group: gloo's threads, still holding tensors while Python
    # shuts down, otherwise abort the exit now and then ("terminate called").
    shardwise.shutdown()


if __name__ == "__main__":
    main()
