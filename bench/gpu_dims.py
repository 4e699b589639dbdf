"""The newest dimensions on one device: what `make gpu-check` runs for issue 47's findings.

Each check takes the device it runs on, so the suite runs the same code on the CPU
(`python bench/gpu_check.py --device cpu --only router,adapters,dims_syncs`), where what
is CUDA's alone cannot show:

- router: a load-balancing statistic summed with `global_batch_sum` inside an
  activation-checkpointed block, at a pretend data-parallel size of 2 (groups of no rank:
  the sum is counted, not communicated). On CUDA autograd recomputes the block on its
  device thread, which sees none of the caller's context variables: the recompute must
  still sum.
- adapters: LoRA over a tiny Llama, and QLoRA over its 4-bit base stored as bf16 (the FSDP1
  recipe) under bf16 mixed precision, with and without `cpu_offload`, sharded by FSDP2 on
  a one-rank mesh: after one step, every 4-bit layer's codes as FSDP gathered them equal
  the loaded ones byte for byte (CUDA's bf16 copies rewrite NaN bit patterns), and the
  offloaded run does not hand bitsandbytes a host pointer.
- dims_syncs: host syncs that shardwise adds, counted by torch.cuda.set_sync_debug_mode on
  a GPU and by shardwise.testing.count_host_syncs on the CPU: the expert dispatch on a
  one-rank ep mesh, per MoE layer and forward, a recompute included (the target is 1); the
  pipeline's token count (0); an update with a save request (1, as without it).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 32


@contextlib.contextmanager
def counting_syncs(device: torch.device) -> Iterator[Callable[[], int]]:
    """The host syncs inside the block so far, as a callable: CUDA's own sync debug mode on
    a GPU (it sees every wait), count_host_syncs elsewhere (the calls that would wait)."""
    if device.type == "cuda":
        with warnings.catch_warnings():  # the first switch-on in a process warns once (H200)
            warnings.simplefilter("ignore")
            torch.cuda.set_sync_debug_mode(1)
            torch.cuda.set_sync_debug_mode(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                yield lambda: sum("synchroniz" in str(w.message).lower() for w in caught)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return
    from shardwise.testing import count_host_syncs

    with count_host_syncs() as syncs:
        yield lambda: sum(syncs.values())


# --- router ------------------------------------------------------------------------------


class _Recomputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        import shardwise

        # tanh saves its output: the recompute runs through the sum
        return torch.tanh(shardwise.global_batch_sum(self.inner(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False).sum()


def check_router(device: torch.device) -> dict[str, Any]:
    from shardwise.parallelize.global_batch import BatchGroups, attach

    model = _Recomputed().to(device)
    batch = BatchGroups((), 2)
    attach(model, batch)
    loss = model(torch.ones(4, 8, device=device))
    forward = batch.used
    loss.backward()
    return {"ok": (forward, batch.used) == (1, 2), "sums_in_forward": forward,
            "sums_with_recompute": batch.used}  # fmt: skip


# --- adapters ----------------------------------------------------------------------------


def _llama_dir(tmp: Path) -> str:
    import transformers

    path = tmp / "llama"
    if not path.exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _adapter_model(base: str, device: torch.device, quantized: bool) -> nn.Module:
    import peft
    import transformers

    transformers.utils.logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": torch.float32, "device_map": {"": str(device)}}
    if quantized:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if quantized:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, lora).train()


def _four_bit(model: nn.Module) -> dict[str, nn.Module]:
    return {  # bitsandbytes' layers (peft's LoRA wrapper of one shares the name)
        n: m
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().clone()


def _one_step(base: str, device: torch.device, quantized: bool, offload: bool) -> dict[str, Any]:
    import shardwise

    model = _adapter_model(base, device, quantized)
    loaded = {n: _bytes(m.weight) for n, m in _four_bit(model).items()}
    config = shardwise.ParallelConfig(
        force_wrap=True, mixed_precision="bf16" if quantized else "fp32", cpu_offload=offload
    )
    model = shardwise.wrap(model, config)
    gathered: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            gathered[name] = _bytes(module.weight)  # as FSDP gathered it for this forward

        return hook

    for name, layer in _four_bit(shardwise.unwrap(model)).items():
        layer.register_forward_pre_hook(record(name))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    model(input_ids=ids, labels=ids)  # the codes gathered again after the step
    same = sorted(n for n in loaded if torch.equal(gathered.get(n, torch.empty(0)), loaded[n]))
    value = float(loss)
    return {
        "ok": math.isfinite(value) and len(same) == len(loaded),
        "loss": round(value, 4),
        "four_bit_layers": len(loaded),
        "gathered_codes_equal_loaded": len(same),
    }


def check_adapters(device: torch.device, tmp: Path) -> dict[str, Any]:
    base = _llama_dir(tmp)
    out = {
        "lora": _one_step(base, device, quantized=False, offload=False),
        "qlora_bf16": _one_step(base, device, quantized=True, offload=False),
        "qlora_bf16_offload": _one_step(base, device, quantized=True, offload=True),
    }
    ok = all(r["ok"] for r in out.values()) and out["qlora_bf16"]["four_bit_layers"] > 0
    return {"ok": ok, **out}


# --- host syncs of ep, pp and the Runner's timer ------------------------------------------


def _moe_syncs(device: torch.device, ep: bool, recompute: bool) -> int:
    """Host syncs of one forward and backward of TinyMoE (2 layers), its experts on a
    one-rank ep mesh when `ep`, each block checkpointed when `recompute`."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.parallelize.experts import apply_expert_parallel, find_experts
    from shardwise.testing.models import TinyMoE

    torch.manual_seed(0)
    model = TinyMoE(vocab_size=VOCAB).to(device)
    if ep:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("ep",))
        apply_expert_parallel(find_experts(model), mesh)
    if recompute:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    model(ids, ids)["loss"].backward()  # warm-up: lazy initialisation may sync
    with counting_syncs(device) as count:
        model(ids, ids)["loss"].backward()
        return count()


def _pipeline_count_syncs(device: torch.device) -> int:
    from shardwise.parallelize.pipeline import _counted_tokens

    class CausalLM(nn.Module):
        loss_type = "ForCausalLM"

    labels = torch.randint(0, VOCAB, (4, 8), device=device)
    labels[0, :3] = -100
    with counting_syncs(device) as count:
        _counted_tokens(CausalLM(), {"labels": labels})
        return count()


def _update_syncs(device: torch.device, save: bool) -> int:
    """Host syncs of one update outside optimizer.step, with or without a save request."""
    import shardwise
    from shardwise.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=8)
    engine = shardwise.Engine(GPT(cfg), lambda p: torch.optim.SGD(p, lr=0.1))
    ids = torch.randint(0, VOCAB, (2, 8), device=device)
    engine.train_step((ids, ids))  # warm-up
    if save:
        engine.request_save()
    with counting_syncs(device) as count:
        engine.train_step((ids, ids))
        syncs = count()
    return syncs if not save or engine.save_requested else -1


def check_dims_syncs(device: torch.device) -> dict[str, Any]:
    layers = 2
    dispatch = {
        "forward": (_moe_syncs(device, True, False) - _moe_syncs(device, False, False)) / layers,
        "with_recompute": (_moe_syncs(device, True, True) - _moe_syncs(device, False, True))
        / layers,
    }
    pp = _pipeline_count_syncs(device)
    update = {"plain": _update_syncs(device, False), "save_requested": _update_syncs(device, True)}
    ok = dispatch == {"forward": 1, "with_recompute": 2} and pp == 0
    ok = ok and update["save_requested"] == update["plain"]
    return {"ok": ok, "ep_dispatch_per_layer": dispatch, "pp_token_count": pp,
            "update": update}  # fmt: skip
