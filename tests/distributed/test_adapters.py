"""Adapters (PEFT's LoRA) train under every layout as one process, and the base stays put.

Four transformers families get LoRA adapters from `peft.get_peft_model` (llama; gemma, whose
embedding and output head are tied; qwen2, with attention biases; qwen3_moe, a mixture of
experts), with `init_lora_weights=False` so that both halves of every adapter have a
gradient at the first step. Each trains 3 steps with SGD and with AdamW, each data-parallel
rank on its part of every global batch, at world 2 (full_shard) and at world 4 (hybrid
2 x 2, and full_shard over dp 2 with tp 2, where the adapted layers' base layers follow the
base model's own plan and their adapters are split to match). At world 2, llama also trains
under ddp, no_shard and shard_grad_op, and with DoRA, with IA³, with a saved output head
(`modules_to_save`, also under tp) and as a bf16 base with fp32 adapters. Compared with one
process on the whole batch: the loss at every step, the adapters' first-step gradients and
final values (1e-5; AdamW's losses 1e-4), and every frozen parameter bit-identical to where
it started, holding no gradient. The tp layout is shown to be real (which LoRA halves are
split, and how), and a wrong split (a row-split base's lora_A whose partial outputs nothing
sums over tp) fails the same comparison. Under accumulation, keeping the frozen base
gathered saves all-gathers and changes nothing. All cases run in two spawned groups
(`make test-adapters`).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import split_batch, worst_of

pytestmark = pytest.mark.adapters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, BATCH, SEQ, STEPS = 32, 8, 6, 3
RTOL, ADAMW_LOSS_RTOL = 1e-5, 1e-4
DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ["q_proj", "v_proj", "down_proj"]),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 4}, ["q_proj", "v_proj", "down_proj"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ["q_proj", "v_proj", "o_proj"]),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 8}, ["q_proj", "v_proj", "o_proj"]),
}  # fmt: skip
WORLD2 = {"full_shard": {"strategy": "full_shard"}}
# Every other strategy at world 2, on llama with SGD.
OTHER_STRATEGIES = ("ddp", "no_shard", "shard_grad_op")
WORLD4 = {
    "hybrid_shard": {"strategy": "hybrid_shard"},  # replicate 2 x shard 2
    "tp2": {"strategy": "full_shard", "tp": 2},  # dp 2 x tp 2
}
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.5),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2),
}


# llama with other peft methods and settings, at world 2 (full_shard): name -> (peft config
# builder, base dtype). IA³'s vectors start at 1 and DoRA's magnitude at the weight's norm,
# so both train from the first step; modules_to_save trains a copy of the output head.
VARIANTS = {
    "llama+dora": (lambda: peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj", "down_proj"]), None),
    "llama+ia3": (lambda: peft.IA3Config(target_modules=["q_proj", "v_proj", "down_proj"],
                                         feedforward_modules=["down_proj"]), None),
    "llama+head": (lambda: peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj"],
                                           modules_to_save=["lm_head"]), None),
    "llama+bf16": (lambda: peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj", "down_proj"]),
                   torch.bfloat16),
}  # fmt: skip
# Two bf16 roundings: the bf16 base computes in another order over a slice than over the batch.
BF16_RTOL = 2 * 2**-9


def build(name: str) -> nn.Module:
    family = name.split("+")[0]
    config_cls, model_cls, extra, targets = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**DECODER, **extra})
    base = getattr(transformers, model_cls)(config)
    if name in VARIANTS:
        make, dtype = VARIANTS[name]
        if dtype is not None:  # a bf16 base; the adapters made after it stay fp32
            base = base.to(dtype)
        return peft.get_peft_model(base, make())
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(base, lora)


def batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def train(model: nn.Module, rank_batch, optimizer: str) -> dict:  # type: ignore[no-untyped-def]
    """3 steps: the losses (averaged over the ranks), the adapters' first-step gradients,
    the final adapters and the final frozen parameters, all whole."""
    user = shardwise.unwrap(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[optimizer](trainable)
    losses, first_grads, frozen_grads = [], {}, []
    for step, (ids,) in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        mine = rank_batch((ids,))[0]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in user.named_parameters() if p.requires_grad}
            frozen_grads = [
                n for n, p in user.named_parameters() if not p.requires_grad and p.grad is not None
            ]
        opt.step()
        detached = loss.detach()
        losses.append(
            shardwise.mean_across_ranks(detached) if dist.is_initialized() else float(detached)
        )
    named = list(user.named_parameters())
    return {
        "losses": losses,
        "grads": first_grads,
        "frozen_grads": frozen_grads,
        "adapters": {n: _full(p) for n, p in named if p.requires_grad},
        "frozen": {n: _full(p) for n, p in named if not p.requires_grad},
    }


def references() -> dict:  # type: ignore[type-arg]
    out = {}
    for name in [*FAMILIES, *VARIANTS]:
        torch.manual_seed(0)
        model = build(name)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        for optimizer in OPTIMIZERS:
            torch.manual_seed(0)
            out[f"{name}/{optimizer}"] = train(build(name), lambda b: b, optimizer)
        out[f"{name}/start"] = start
    return out


def _wrapped(name: str, fields: dict, optimizer: str) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", shardwise.PlanNotice)
        model = shardwise.wrap(build(name), shardwise.ParallelConfig(**fields))
    info = shardwise.wrap_info(model)
    assert info is not None
    shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
    result = train(model, shard, optimizer)
    notices = [str(w.message) for w in caught if w.category is shardwise.PlanNotice]
    return {**result, "notices": notices, "layout": _layout(model)}


def _layout(model: nn.Module) -> dict[str, str]:
    """Each LoRA half and base layer of layer 0's q_proj (column-split base) and o_proj or
    down_proj (row-split base): its tp placement, or 'whole'."""
    out = {}
    for name, p in shardwise.unwrap(model).named_parameters():
        if ".layers.0." not in name or not any(
            k in name for k in ("q_proj", "o_proj", "down_proj")
        ):
            continue
        dims = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        tp = str(p.placements[dims.index("tp")]) if dims and "tp" in dims else "whole"
        out[name.split(".layers.0.")[1]] = tp
    return out


def _world2() -> dict:  # type: ignore[type-arg]
    out = {
        f"{name}/{layout}/{opt}": _wrapped(name, fields, opt)
        for name in [*FAMILIES, *VARIANTS]
        for layout, fields in WORLD2.items()
        for opt in OPTIMIZERS
    }
    for strategy in OTHER_STRATEGIES:
        out[f"llama/{strategy}/sgd"] = _wrapped("llama", {"strategy": strategy}, "sgd")
    for keep in (False, True):
        out[f"accumulate/keep={keep}"] = _accumulate(keep)
    return out


ACCUMULATE = 4


def _accumulate(keep: bool) -> dict:  # type: ignore[type-arg]
    """The Engine over llama's 3 batches as one window of 4 micro-batches each (one SGD
    update per batch), with and without `keep_frozen_gathered`: the all-gathers of one
    optimizer step, and the adapters after it."""
    from shardwise.testing import count_collectives

    torch.manual_seed(0)
    train = shardwise.TrainConfig(accumulate_steps=ACCUMULATE, keep_frozen_gathered=keep)
    engine = shardwise.Engine(
        build("llama"),
        lambda params: torch.optim.SGD([p for p in params if p.requires_grad], lr=0.5),
        shardwise.ParallelConfig(strategy="full_shard"),
        train=train,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, gathers = [], []
    for (ids,) in batches():
        mine = split_batch((ids,), rank, world)[0]
        with count_collectives() as counted:
            for micro in mine.chunk(ACCUMULATE):
                logs = engine.train_step({"input_ids": micro, "labels": micro})
        gathers.append(counted["all_gather_single"] + counted["all_gather_into_tensor"])
        losses.append(logs["loss"])
    user = shardwise.unwrap(engine.model)
    adapters = {n: _full(p) for n, p in user.named_parameters() if p.requires_grad}
    return {"losses": losses, "adapters": adapters, "gathers": gathers}


def _world4() -> dict:  # type: ignore[type-arg]
    out = {
        f"{name}/{layout}/{opt}": _wrapped(name, fields, opt)
        for name in FAMILIES
        for layout, fields in WORLD4.items()
        for opt in OPTIMIZERS
    }
    out["llama+head/tp2/sgd"] = _wrapped("llama+head", WORLD4["tp2"], "sgd")  # a saved copy
    out["llama/tp2_unsummed_lora_A/sgd"] = _unsummed_lora_a()
    out["frozen_norms_sp"] = _frozen_norms_under_sequence_parallel()
    return out


def _frozen_norms_under_sequence_parallel() -> list[str]:
    """A plain llama with frozen norms under tp 2 + sequence parallel: which parameters
    thawed (torch's SequenceParallel makes each norm weight a new Parameter)."""
    config_cls, model_cls, _, _ = FAMILIES["llama"]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**DECODER))
    for name, p in model.named_parameters():
        p.requires_grad_("norm" not in name)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    config = shardwise.ParallelConfig(tp=2, sequence_parallel=True)
    wrapped = shardwise.wrap(model, config)
    return sorted(n for n, p in wrapped.named_parameters() if n in frozen and p.requires_grad)


def _unsummed_lora_a() -> dict:  # type: ignore[type-arg]
    """A wrong split: under the row-split down_proj each rank keeps its columns of lora_A
    as a plain tensor and adds its partial product, which nothing sums over tp."""
    from unittest import mock

    from torch.distributed.tensor.parallel import ParallelStyle

    from shardwise.parallelize import adapters

    class KeepPartial(ParallelStyle):
        def __init__(self, *_: object) -> None:
            super().__init__()

        def _apply(self, module: nn.Module, mesh: object) -> nn.Module:
            tp, rank = mesh.size(), mesh.get_local_rank()  # type: ignore[attr-defined]
            columns = module.weight.shape[1] // tp
            part = module.weight.detach()[:, rank * columns : (rank + 1) * columns].clone()
            module.weight = nn.Parameter(part)
            return module

    with mock.patch.object(adapters, "lora_a_style", KeepPartial):
        return _wrapped("llama", WORLD4["tp2"], "sgd")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _worst(ref: dict, got: dict, loss_rtol: float = RTOL, rtol: float = RTOL) -> tuple[float, str]:  # type: ignore[type-arg]
    """The largest difference relative to its bar (above 1 fails) and where it is."""
    seen: list[tuple[float, str]] = []
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        seen.append((abs(a - b) / abs(b) / loss_rtol, f"loss at step {i}"))
    for kind in ("grads", "adapters"):
        for n, b in ref[kind].items():
            seen.append((_rel(got[kind][n], b) / rtol, f"{kind} {n}"))
    worst_of(value for value, _ in seen)  # a NaN anywhere fails here, not silently
    return max(seen, default=(0.0, ""))


# Trainable tensors per variant: DoRA adds a magnitude per adapted layer; IA³ has one vector
# per adapted layer; the saved head adds its copy's weight.
TRAINABLE = {"llama+dora": 3 * 2 * 3, "llama+ia3": 3 * 2, "llama+head": 2 * 2 * 2 + 1}


@pytest.fixture(scope="module")
def results() -> tuple[dict, dict]:  # type: ignore[type-arg]
    refs = references()
    got = run_distributed(_world2, 2, timeout_s=600)[0]
    got.update(run_distributed(_world4, 4, timeout_s=600)[0])
    return refs, got


CASES = [f"{n}/{layout}/{o}" for n in FAMILIES for layout in [*WORLD2, *WORLD4] for o in OPTIMIZERS]
CASES += [f"{n}/{layout}/{o}" for n in VARIANTS for layout in WORLD2 for o in OPTIMIZERS]
CASES += ["llama+head/tp2/sgd"]  # the head's frozen original and trained copy split alike
CASES += [f"llama/{strategy}/sgd" for strategy in OTHER_STRATEGIES]


@pytest.mark.parametrize("case", CASES)
def test_adapters_train_as_one_process_and_the_base_stays_put(results, case):
    refs, got = results
    name, _, optimizer = case.split("/")
    ref, run = refs[f"{name}/{optimizer}"], got[case]
    bar = ADAMW_LOSS_RTOL if optimizer == "adamw" else RTOL
    bf16 = name == "llama+bf16"
    ratio, where = _worst(
        ref, run, loss_rtol=BF16_RTOL if bf16 else bar, rtol=BF16_RTOL if bf16 else RTOL
    )
    print(f"{case}: the largest difference is {where}, {ratio:.2e} of its bar")
    assert ratio < 1, f"{case}: {where} differs by {ratio:.2e} of its bar"
    # Nothing thawed: the same parameters train (3 adapted layers x 2 layers x lora_A, B).
    assert set(run["grads"]) == set(ref["grads"]) == set(ref["adapters"])
    assert len(ref["grads"]) == TRAINABLE.get(name, 3 * 2 * 2)
    start = refs[f"{name}/start"]
    assert set(run["frozen"]) == set(start)
    moved = [n for n, p in run["frozen"].items() if not torch.equal(p, start[n])]
    assert not moved, f"{case}: frozen parameters changed: {moved[:3]}"
    assert run["frozen_grads"] == [], run["frozen_grads"][:3]  # no gradient is even held
    assert len(run["notices"]) <= 1, run["notices"]  # at most one line of notice
    assert all("\n" not in n for n in run["notices"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_under_tp_each_lora_half_follows_its_base_layer(results, name):
    _, got = results
    layout = got[f"{name}/tp2/sgd"]["layout"]
    col, row = (
        "self_attn.q_proj",
        "self_attn.o_proj" if name in ("qwen2", "qwen3_moe") else "mlp.down_proj",
    )
    want = {
        f"{col}.base_layer.weight": str(Shard(0)),  # output features split
        f"{col}.lora_A.default.weight": "whole",
        f"{col}.lora_B.default.weight": str(Shard(0)),  # its rows: the same features
        f"{row}.base_layer.weight": str(Shard(1)),  # input features split
        f"{row}.lora_A.default.weight": str(Shard(1)),  # the same features, summed over tp
        f"{row}.lora_B.default.weight": "whole",
    }
    assert {k: layout[k] for k in want} == want, layout
    assert str(Replicate()) not in layout.values()


def test_the_comparison_catches_lora_a_partial_sums_left_unsummed(results):
    refs, got = results
    # Its down_proj lora_A holds half the columns as a plain tensor: the rest compares.
    ref, wrong = refs["llama/sgd"], got["llama/tp2_unsummed_lora_A/sgd"]
    same = {n for n, g in ref["grads"].items() if g.shape == wrong["grads"][n].shape}
    assert len(same) == len(ref["grads"]) - 2  # the two layers' down_proj.lora_A
    keep = {k: {n: ref[k][n] for n in same} for k in ("grads", "adapters")}
    ratio, where = _worst({**ref, **keep}, wrong)
    print(f"lora_A's partial sums not summed over tp: {where}, {ratio * RTOL:.2e}")
    assert ratio > 100, f"a wrong split passed ({where}: {ratio:.2e} of the bar)"


def test_tensor_parallel_keeps_frozen_parameters_frozen(results):
    """Per-head norms (qwen3_moe's q_norm, above) and sequence-parallel norms come back from
    torch's SequenceParallel as new Parameters that require gradients: wrap freezes them again."""
    _, got = results
    assert got["frozen_norms_sp"] == []


def test_a_bf16_base_keeps_fp32_adapters_and_trains(results):
    """FSDP2 shards a unit holding bf16 base weights and fp32 adapters as they are."""
    _, got = results
    run = got["llama+bf16/full_shard/adamw"]
    assert {str(p.dtype) for p in run["adapters"].values()} == {"torch.float32"}
    assert {str(p.dtype) for p in run["frozen"].values()} == {"torch.bfloat16"}


def test_keeping_the_frozen_base_gathered_saves_all_gathers_and_changes_nothing(results):
    """Under accumulation, each unit holding frozen weights (every decoder layer of an
    adapter model, and the root) is gathered once per optimizer step instead of for every
    micro-batch's forward and backward."""
    _, got = results
    plain, kept = got["accumulate/keep=False"], got["accumulate/keep=True"]
    units = 3  # two decoder layers and the root, each one all-gather (FSDP2 per unit)
    print(f"all-gathers per optimizer step at accumulation {ACCUMULATE}: "
          f"{plain['gathers'][0]} plain, {kept['gathers'][0]} kept")  # fmt: skip
    # The root stays gathered after forward by itself: per micro-batch 2 per layer + 1.
    assert plain["gathers"] == [ACCUMULATE * (2 * (units - 1) + 1)] * STEPS
    assert kept["gathers"] == [units] * STEPS
    assert kept["losses"] == plain["losses"]
    for name, value in plain["adapters"].items():
        assert torch.equal(kept["adapters"][name], value), name
