"""Tensor parallel × data parallel at world 4 (dp 2 × tp 2) equals one process.

A small language model of our own (a tied embedding and output head, LayerNorm, MLP blocks)
is split by a dict plan and trained 3 SGD steps with clipping active; each data-parallel
rank reads its half of every global batch and the two ranks of a tp group read the same
half. Compared with one process on the whole batch: the loss at every step, every gradient
after the first step (loss-only parity misses a parameter a plan leaves whole between split
layers), and the final parameters. The layout is shown to be real: the MLP's weights are
split over the mesh dimension named tp, and the tie holds; under sequence_parallel a norm
inside a block holds half of each sequence. All cases run in one spawned group of 4; the
negative controls (each rank of a tp group reading a different batch, as a sampler that
ignores tp would give; norms on split tokens whose gradients nothing sums over tp) must fail
the same comparison.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import shardwise
from shardwise.parallelize.tensor import SplitGradientError, check_tp_gradients
from shardwise.testing import run_distributed
from shardwise.testing.parity import split_batch, worst_of

pytestmark = pytest.mark.tensor_parallel  # `make test-tp` (and .ci/run), not `make test`

VOCAB, D, STEPS, BATCH, SEQ = 32, 16, 3, 8, 6  # VOCAB divides by tp
PLAN = {
    "emb": "embedding_rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "head": "colwise_gather_output",
}
MAX_NORM = 0.05  # well below the gradients' norm: clipping acts at every step
RTOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as most language models

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _call(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*batch)


def _hf_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def train(model: nn.Module, rank_batch, loss_of=None, adamw=False) -> dict:  # type: ignore[no-untyped-def]
    if adamw:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], {}
    for step, batch in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        loss = (loss_of or _call)(model, rank_batch(batch))
        loss.backward()
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        shardwise.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(
            shardwise.mean_across_ranks(loss.detach())
            if dist.is_initialized()
            else float(loss.detach())
        )
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params}


def reference() -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    return train(TinyLM(), lambda b: b)


def _own_rows(batch, rank):  # type: ignore[no-untyped-def]
    return tuple(t.repeat(2, 1) for t in split_batch(batch, rank, 4))


def _distributed_cases() -> dict:  # type: ignore[type-arg]
    out = {}
    rank = dist.get_rank()
    for name, strategy, wrong, sp in [
        ("full_shard", "full_shard", False, False),
        ("no_shard", "no_shard", False, False),  # replicate 2 x tp 2
        ("hybrid_shard", "hybrid_shard", False, False),  # replicate 2 x shard 1 x tp 2
        ("full_shard_sp", "full_shard", False, True),
        ("hybrid_shard_sp", "hybrid_shard", False, True),
        ("tp_ranks_read_different_data", "full_shard", True, False),
    ]:
        torch.manual_seed(0)
        config = shardwise.ParallelConfig(
            strategy=strategy, tp=2, tp_plan=PLAN, sequence_parallel=sp
        )
        model = shardwise.wrap(TinyLM(), config)
        tokens = _tokens_seen(model.blocks[0].norm)
        info = shardwise.wrap_info(model)
        assert info is not None
        dp_rank, dp_size = info.dp_rank, info.dp_size
        if wrong:  # a sampler that ignores tp: each rank of a tp group reads its own rows
            shard = functools.partial(_own_rows, rank=rank)
        else:
            shard = functools.partial(split_batch, rank=dp_rank, world_size=dp_size)
        up = model.blocks[0].up.weight
        layout = {
            "mesh_dims": up.device_mesh.mesh_dim_names,
            "tp_placement": str(up.placements[up.device_mesh.mesh_dim_names.index("tp")]),
            "tied": model.head.weight is model.emb.weight,
            "dp": (info.dp_rank, info.dp_size),
            "described": str(info),
        }
        out[name] = {**train(model, shard), "layout": {**layout, "norm_tokens": tokens[0]}}
    out["sp_norm_gradients_not_summed"] = _sp_without_summed_norm_gradients()
    torch.manual_seed(0)
    model = shardwise.wrap(TinyLM(), shardwise.ParallelConfig(tp=2, tp_plan=PLAN))
    info = shardwise.wrap_info(model)
    assert info is not None
    shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
    out["adamw"] = train(model, shard, adamw=True)
    torch.manual_seed(0)
    config = shardwise.ParallelConfig(tp=2, tp_plan=PLAN, sequence_parallel=True)
    model = shardwise.wrap(TinyLM(), config)
    out["adamw_sp"] = train(model, shard, adamw=True)
    try:  # refused before any group is made, the same on every rank
        shardwise.wrap(TinyLM(), shardwise.ParallelConfig(tp=2, tp_plan=PLAN, cpu_offload=True))
        out["offload"] = "no error"
    except NotImplementedError as exc:
        out["offload"] = str(exc)
    odd = torch.zeros(2, 5, dtype=torch.long)  # 5 tokens do not split over tp 2
    try:
        model(odd, odd)
        out["odd_sequence"] = "no error"
    except ValueError as exc:
        out["odd_sequence"] = str(exc)
    out["engine"] = _engine_run()
    out["engine_loss_parallel"] = _engine_run(loss_parallel=True)
    out["gain_between_split_layers"] = _gain_between_split_layers()
    return out


def _tokens_seen(norm: nn.Module) -> list[int]:
    """How many tokens a norm's forward holds on this rank (sequence parallel: SEQ / tp)."""
    seen: list[int] = []

    def record(_: nn.Module, args: tuple, out: torch.Tensor) -> None:  # type: ignore[type-arg]
        x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        if not seen:
            seen.append(x.shape[1])

    norm.register_forward_hook(record)
    return seen


def _sp_without_summed_norm_gradients() -> dict:  # type: ignore[type-arg]
    """A wrong setup: the norms run on split tokens as plain modules, so each rank of a tp
    group trains them on the gradient of its own tokens only (nothing sums it over tp)."""
    from unittest import mock

    from torch.distributed.tensor.parallel import ParallelStyle

    from shardwise.parallelize import sequence

    class Plain(ParallelStyle):
        def __init__(self, **_: object) -> None:
            super().__init__()

        def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
            return module

    torch.manual_seed(0)
    config = shardwise.ParallelConfig(tp=2, tp_plan=PLAN, sequence_parallel=True)
    with mock.patch.object(sequence, "SequenceParallel", Plain):
        model = shardwise.wrap(TinyLM(), config)
    info = shardwise.wrap_info(model)
    assert info is not None
    return train(model, functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size))


class GainBlock(Block):
    """A trainable gain between the column-split `up` and the row-split `down`."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))) * self.gain)


def _gain_between_split_layers() -> str:
    torch.manual_seed(0)
    model = TinyLM()
    model.blocks[1] = GainBlock()
    engine = shardwise.Engine(
        model, lambda p: torch.optim.SGD(p, lr=0.5), shardwise.ParallelConfig(tp=2, tp_plan=PLAN)
    )
    try:
        engine.train_step(batches()[0])
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _engine_run(loss_parallel: bool = False) -> dict:  # type: ignore[type-arg]
    """The Engine's own step (its clipping included) on a tp model; with loss_parallel the
    head keeps its logits split and the cross-entropy runs on the split logits."""
    torch.manual_seed(0)
    plan = dict(PLAN)
    if loss_parallel:
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    engine = shardwise.Engine(
        TinyLM(),
        lambda params: torch.optim.SGD(params, lr=0.5),
        shardwise.ParallelConfig(tp=2, tp_plan=plan, loss_parallel=loss_parallel),
        train=shardwise.TrainConfig(max_grad_norm=MAX_NORM),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    losses = []
    for batch in batches():
        logs = engine.train_step(split_batch(batch, info.dp_rank, info.dp_size))
        losses.append(shardwise.mean_across_ranks(logs["loss"]))
    params = {n: _full(p) for n, p in engine.model.named_parameters()}
    val = engine.val_step(split_batch(batches()[0], info.dp_rank, info.dp_size))
    return {"losses": losses, "params": params, "val": shardwise.mean_across_ranks(val)}


# Hugging Face families, tiny, trained with their own plan (tp_plan="auto"). Gemma ties its
# embedding and output head; phi3 and olmo2 use the gather/split-input words.
DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"residual_dropout": 0.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),  # per-head q/k norms
    # Mixtures of experts: 3-D experts with gate and up packed ('packed_colwise' under
    # 'moe_tp_experts'); qwen3_moe's layer 0 is a dense MLP, its layer 1 has experts.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 4, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [0]}),
}  # fmt: skip
MOE = ("mixtral", "qwen3_moe")


def build_family(name: str) -> nn.Module:
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**DECODER, **extra})
    return getattr(transformers, model_cls)(config)


def hf_reference(name: str) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    return train(build_family(name), lambda b: b, _hf_loss)


def _hf_cases() -> dict:  # type: ignore[type-arg]
    out = {}
    cases = [(f, False, "none") for f in FAMILIES] + [(f, True, "none") for f in FAMILIES]
    for name, sp, ac in [*cases, ("llama", True, "full"), ("mixtral", True, "full")]:
        torch.manual_seed(0)
        config = shardwise.ParallelConfig(
            strategy="full_shard", tp=2, sequence_parallel=sp, activation_checkpointing=ac
        )
        model = shardwise.wrap(build_family(name), config)
        tokens = _tokens_seen(model.model.layers[0].post_attention_layernorm)
        info = shardwise.wrap_info(model)
        assert info is not None
        shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
        result = train(model, shard, _hf_loss)
        try:  # the last step's gradients: no parameter the plan leaves whole is split
            check_tp_gradients(model)
            result["whole_gradients"] = "equal"
        except SplitGradientError as exc:
            result["whole_gradients"] = str(exc)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        split = [n for n, p in model.named_parameters()
                 if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())]  # fmt: skip
        out[f"{name}{'_sp' if sp else ''}{'_ac' if ac == 'full' else ''}"] = {
            **result,
            "tied": tied,
            "split": split,
            "norm_tokens": tokens[0],
            "experts": _experts_layout(model) if name in MOE else None,
        }
    for name in FAMILIES:  # AdamW, replicate 2 x tp 2, the sequence split
        torch.manual_seed(0)
        config = shardwise.ParallelConfig(strategy="hybrid_shard", tp=2, sequence_parallel=True)
        model = shardwise.wrap(build_family(name), config)
        info = shardwise.wrap_info(model)
        assert info is not None
        shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
        out[f"{name}_hybrid_sp_adamw"] = {
            **train(model, shard, _hf_loss, adamw=True),
            "mesh": str(info.mesh_spec),
        }
    out["llama_loss_parallel"] = _hf_engine_loss_parallel()
    out["llama_loss_parallel_sp"] = _hf_engine_loss_parallel(sequence_parallel=True)
    out["mixtral_gate_up_plain_shard"] = _mixtral_gate_up_plain_shard()
    return out


def _experts_layout(model: nn.Module) -> dict:  # type: ignore[type-arg]
    """Where the last layer's experts sit: the mesh and each weight's tp placement."""
    experts = model.model.layers[-1].mlp.experts
    out = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        dims = p.device_mesh.mesh_dim_names
        out[name] = (dims, p.placements[dims.index("tp")])
    return out


def _mixtral_gate_up_plain_shard() -> dict:  # type: ignore[type-arg]
    """A wrong layout: gate_up_proj split by a plain Shard(1), so one rank holds every
    expert's gate columns and the other every up column."""
    from shardwise.parallelize.moe import ExpertsParallel

    torch.manual_seed(0)
    model = build_family("mixtral")
    experts = "model.layers.*.mlp.experts"
    plan: dict = {k: v for k, v in model._tp_plan.items() if not k.startswith(experts)}  # type: ignore[type-arg]
    plan[experts] = ExpertsParallel({"gate_up_proj": Shard(1), "down_proj": Shard(2)})
    model = shardwise.wrap(model, shardwise.ParallelConfig(tp=2, tp_plan=plan))
    info = shardwise.wrap_info(model)
    assert info is not None
    shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
    return train(model, shard, _hf_loss)


def _hf_engine_loss_parallel(sequence_parallel: bool = False) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    config = shardwise.ParallelConfig(tp=2, loss_parallel=True, sequence_parallel=sequence_parallel)
    engine = shardwise.Engine(
        build_family("llama"),
        lambda p: torch.optim.SGD(p, lr=0.5),
        config,
        train=shardwise.TrainConfig(max_grad_norm=MAX_NORM),  # as the reference clips
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    losses = []
    for batch in batches():
        tokens, labels = split_batch(batch, info.dp_rank, info.dp_size)
        logs = engine.train_step({"input_ids": tokens, "labels": labels})
        losses.append(shardwise.mean_across_ranks(logs["loss"]))
    return {"losses": losses, "params": {n: _full(p) for n, p in engine.model.named_parameters()},
            "described": str(info)}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _worst(ref: dict, got: dict) -> tuple[float, str]:  # type: ignore[type-arg]
    seen: list[tuple[float, str]] = []
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        seen.append((abs(a - b) / abs(b), f"loss at step {i}"))
    for kind in ("grads", "params"):
        for n, b in ref[kind].items():
            seen.append((_rel(got[kind][n], b), f"{kind[:-1]} {n}"))
    worst_of(value for value, _ in seen)  # a NaN anywhere fails here, not silently
    return max(seen, default=(0.0, ""))


@pytest.fixture(scope="module")
def results() -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    return reference(), run_distributed(_distributed_cases, 4, timeout_s=300)


@pytest.mark.parametrize(
    "case", ["full_shard", "no_shard", "hybrid_shard", "full_shard_sp", "hybrid_shard_sp"]
)
def test_dp2_tp2_equals_one_process(results, case):
    ref, ranks = results
    got = ranks[0][case]
    rel, where = _worst(ref, got)
    print(f"{case}: the largest difference is {where}, rel {rel:.2e}")  # shown with -s
    assert rel < RTOL, f"{case}: {where} differs by {rel:.2e}"
    layout = got["layout"]
    want = {"full_shard": ("dp_shard", "tp"), "no_shard": ("dp_replicate", "dp_shard", "tp"),
            "hybrid_shard": ("dp_replicate", "dp_shard", "tp")}  # fmt: skip
    assert layout["mesh_dims"] == want[case.removesuffix("_sp")]  # over dp, split over tp
    # Sequence parallel is real: a norm inside a block holds half of each sequence's tokens.
    assert layout["norm_tokens"] == (SEQ // 2 if case.endswith("_sp") else SEQ)
    assert layout["tp_placement"] == str(Shard(0))  # the MLP's rows split over tp
    assert layout["tied"], "the embedding and the head were untied"
    assert [r[case]["layout"]["dp"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert "tp: blocks.*.up -> colwise" in layout["described"]
    # Clipping acted: the first update is the clipped one (the norm is far above MAX_NORM).
    assert sum(float(g.norm()) ** 2 for g in ref["grads"].values()) ** 0.5 > 10 * MAX_NORM


@pytest.mark.parametrize("wrong", ["tp_ranks_read_different_data", "sp_norm_gradients_not_summed"])
def test_the_comparison_catches_a_wrong_setup(results, wrong):
    ref, ranks = results
    rel, where = _worst(ref, ranks[0][wrong])
    print(f"{wrong}: the largest difference is {where}, rel {rel:.2e}")
    assert rel > 1e-3, f"a wrong setup passed ({where}: {rel:.2e})"


@pytest.fixture(scope="module")
def hf_results() -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    pytest.importorskip("transformers")
    refs = {name: hf_reference(name) for name in FAMILIES}
    return refs, run_distributed(_hf_cases, 4, timeout_s=600)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hugging_face_families_with_their_own_plan_equal_one_process(hf_results, family, sp):
    refs, ranks = hf_results
    got = ranks[0][f"{family}_sp" if sp else family]
    rel, where = _worst(refs[family], got)
    # Sequence parallel is real: a norm inside a decoder layer holds half of the tokens.
    assert got["norm_tokens"] == (SEQ // 2 if sp else SEQ)
    print(f"{family}: the largest difference is {where}, rel {rel:.2e}")
    assert rel < RTOL, f"{family}: {where} differs by {rel:.2e}"
    assert any("self_attn" in n or "attention" in n for n in got["split"]), got["split"]
    assert got["whole_gradients"] == "equal", got["whole_gradients"]
    if family == "gemma":
        assert got["tied"], "gemma's embedding and output head were untied"
    if family in MOE:  # each rank holds its part of every expert's gate AND up columns
        from torch.distributed.tensor.placement_types import _StridedShard

        (dims, gate_up), (_, down) = got["experts"]["gate_up_proj"], got["experts"]["down_proj"]
        assert dims == ("dp_shard", "tp"), dims  # experts sharded over dp by FSDP, split over tp
        assert gate_up == _StridedShard(1, split_factor=2), gate_up
        assert down == Shard(2), down


def test_a_plain_split_of_packed_experts_fails_the_comparison(hf_results):
    refs, ranks = hf_results
    rel, where = _worst(refs["mixtral"], ranks[0]["mixtral_gate_up_plain_shard"])
    print(f"mixtral, gate_up_proj on Shard(1): the largest difference is {where}, rel {rel:.2e}")
    assert rel > 1e-3, f"a wrong split of the experts passed ({where}: {rel:.2e})"


# --- checkpoints and exports across layouts ---------------------------------------------------


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, shard, which) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for i in which:
        opt.zero_grad(set_to_none=True)
        loss = model(*shard(batches()[i]))
        loss.backward()
        opt.step()
        losses.append(shardwise.mean_across_ranks(loss.detach()))
    return losses


def _save_at_dp2_tp2(root: str) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = shardwise.wrap(TinyLM(), shardwise.ParallelConfig(tp=2, tp_plan=PLAN))
    info = shardwise.wrap_info(model)
    assert info is not None
    shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
    opt = _adamw(model)
    _steps(model, opt, shard, [0, 1])
    shardwise.save_checkpoint(f"{root}/ck", model, opt, step=2)
    saved = {n: _full(p) for n, p in model.named_parameters()}
    shardwise.export_weights(model, f"{root}/export")
    after = _steps(model, opt, shard, [2])  # the uninterrupted run's next step
    return {
        "saved": saved,
        "next_loss": after,
        "next": {n: _full(p) for n, p in model.named_parameters()},
    }


def _load_and_step(root: str) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(1)  # other initial values: the load must replace them all
    model = shardwise.wrap(TinyLM(), shardwise.ParallelConfig())  # tp 1, full_shard
    opt = _adamw(model)
    manifest = shardwise.load_checkpoint(f"{root}/ck", model, opt)
    loaded = {n: _full(p) for n, p in model.named_parameters()}
    rank, world = shardwise.get_dist_info().rank, shardwise.get_dist_info().world_size
    shard = functools.partial(split_batch, rank=rank, world_size=world)
    after = _steps(model, opt, shard, [2])
    return {"step": manifest["step"], "loaded": loaded, "next_loss": after,
            "next": {n: _full(p) for n, p in model.named_parameters()}}  # fmt: skip


def test_a_dp2_tp2_checkpoint_loads_at_tp1_and_at_world_1_and_its_export_opens(tmp_path):
    saved = run_distributed(_save_at_dp2_tp2, 4, args=(str(tmp_path),), timeout_s=300)[0]
    at_world2 = run_distributed(_load_and_step, 2, args=(str(tmp_path),), timeout_s=300)[0]
    shardwise.shutdown()
    at_world1 = _load_and_step(str(tmp_path))
    shardwise.shutdown()
    for label, got in (("world 2, tp 1", at_world2), ("world 1", at_world1)):
        assert got["step"] == 2
        for n, p in saved["saved"].items():
            assert torch.equal(got["loaded"][n], p), f"{label}: {n} not loaded exactly"
        # The next AdamW step continues the same run: the optimizer state came along.
        rel = abs(got["next_loss"][0] - saved["next_loss"][0]) / abs(saved["next_loss"][0])
        assert rel < RTOL, f"{label}: next loss differs by {rel:.2e}"
        worst = max(_rel(got["next"][n], p) for n, p in saved["next"].items())
        assert worst < 1e-4, f"{label}: parameters after the next step differ by {worst:.2e}"
    plain = TinyLM()
    shardwise.load_weights(plain, tmp_path / "export")
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved["saved"][n]), n


@pytest.mark.parametrize("case", ["engine", "engine_loss_parallel"])
def test_the_engine_steps_a_tp_model_as_one_process(results, case):
    ref, ranks = results
    got = ranks[0][case]
    rel, where = _worst({**ref, "grads": {}}, {**got, "grads": {}})
    assert rel < RTOL, f"engine: {where} differs by {rel:.2e}"
    trained = TinyLM()
    trained.load_state_dict(ref["params"], strict=False)  # (the tied head follows emb)
    with torch.no_grad():
        want = float(trained(*batches()[0]))
    assert abs(got["val"] - want) / want < RTOL, (got["val"], want)  # val_step, same weights


# --- the Runner ----------------------------------------------------------------------------------


def _dataset() -> torch.utils.data.TensorDataset:
    tokens = torch.cat([b[0] for b in batches()])
    labels = torch.cat([b[1] for b in batches()])
    return torch.utils.data.TensorDataset(tokens, labels)


def _runner(root: str, tp: int) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    engine = shardwise.Engine(
        TinyLM(),
        lambda params: torch.optim.SGD(params, lr=0.5),
        shardwise.ParallelConfig(tp=tp, tp_plan=PLAN),
    )
    world = shardwise.get_dist_info().world_size
    config = shardwise.RunnerConfig(
        run_dir=f"{root}/run_tp{tp}", max_steps=STEPS, max_epochs=None, shuffle=False,
        batch_size=BATCH * tp // world, progress=False, tensorboard=False, save_at_end=False,
        log_every=1,
    )  # fmt: skip
    runner = shardwise.Runner(engine, _dataset(), config=config)
    runner.fit()
    losses = [row["loss"] for row in runner.history if row.get("split") == "train"]
    return {"losses": losses, "params": {n: _full(p) for n, p in engine.model.named_parameters()}}


def test_the_runner_feeds_each_tp_group_one_part_of_the_batch(tmp_path):
    """Before: the Runner's sampler split the data over all 4 ranks, so the two ranks of a tp
    group read different rows (the wrong setup the comparison above catches)."""
    ranks = run_distributed(_runner, 4, args=(str(tmp_path), 2), timeout_s=300)
    shardwise.shutdown()
    want = _runner(str(tmp_path), 1)
    shardwise.shutdown()
    got = ranks[0]
    assert len(got["losses"]) == STEPS, got["losses"]
    rel, where = _worst({**want, "grads": {}}, {**got, "grads": {}})
    assert rel < RTOL, f"runner: {where} differs by {rel:.2e}"


def test_cpu_offload_with_tp_is_refused_with_the_reason(results):
    said = results[1][0]["offload"]
    assert said.startswith("ParallelConfig.tp=2 with cpu_offload is not built yet"), said


def test_sequence_parallel_refuses_a_sequence_that_does_not_split(results):
    said = results[1][0]["odd_sequence"]
    assert said.startswith(
        "ParallelConfig.sequence_parallel=True with tp=2: this batch's sequence length 5"
    ), said
    assert "pad_to_multiple_of=2" in said


def test_a_parameter_left_whole_between_split_layers_is_refused(results):
    """Loss-only parity misses it (each tp rank trains the gain on its half of the columns);
    the Engine compares the gradients of whole parameters across the tp group once."""
    said = results[1][0]["gain_between_split_layers"]
    assert said.startswith(
        "SplitGradientError: ParallelConfig.tp_plan leaves ['blocks.1.gain'] whole"
    ), said


@pytest.mark.parametrize("case", ["adamw", "adamw_sp"])
def test_adamw_losses_equal_one_process(results, case):
    """AdamW normalises tiny gradient differences, so parameters may drift by more than
    SGD's; the losses must still agree (the issue's bar: rel 1e-4)."""
    _, ranks = results
    torch.manual_seed(0)
    ref = train(TinyLM(), lambda b: b, adamw=True)
    got = ranks[0][case]
    worst = worst_of(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"adamw: the largest loss difference is rel {worst:.2e}")
    assert worst < 1e-4, f"AdamW loss differs by {worst:.2e}"


def _load_exported_into_tp(root: str) -> dict:  # type: ignore[type-arg]
    config = shardwise.ParallelConfig(tp=2, tp_plan=PLAN)
    out = {}
    torch.manual_seed(5)  # other initial values: the load must replace them all
    model = shardwise.wrap(TinyLM(), config)
    shardwise.load_weights(model, f"{root}/plain")
    out["load_weights"] = {n: _full(p) for n, p in model.named_parameters()}
    torch.manual_seed(6)
    model = shardwise.wrap(TinyLM(), config, weights=f"{root}/plain")
    out["wrap(weights=)"] = {n: _full(p) for n, p in model.named_parameters()}
    torch.manual_seed(7)  # only rank 0 can read the file; the others are sent their slices
    only_rank0 = f"{root}/plain" if dist.get_rank() == 0 else "/nonexistent"
    model = shardwise.wrap(TinyLM(), config, weights=only_rank0, broadcast_from_rank0=True)
    out["broadcast_from_rank0"] = {n: _full(p) for n, p in model.named_parameters()}
    with shardwise.init_empty():
        meta = TinyLM()
    model = shardwise.wrap(meta, config, weights=f"{root}/plain")
    out["meta-built, wrap(weights=)"] = {n: _full(p) for n, p in model.named_parameters()}
    with shardwise.init_empty():
        meta = TinyLM()
    model = shardwise.wrap(meta, config)  # initialised by the modules' reset_parameters
    init = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return {"loaded": out, "initialised": {n: t.detach().clone() for n, t in init.items()}}


def test_load_weights_fills_a_tp_model_exactly(tmp_path):
    torch.manual_seed(0)
    plain = TinyLM()
    shardwise.export_weights(plain, tmp_path / "plain")
    ranks = run_distributed(_load_exported_into_tp, 4, args=(str(tmp_path),), timeout_s=300)
    for how, got in ranks[0]["loaded"].items():
        for n, p in plain.named_parameters():
            assert torch.equal(got[n], p.detach()), f"{how}: {n}"
    # Initialised on meta: the ranks of a tp group (0 and 1) hold the same values of what
    # the plan leaves whole, and different parts of what it splits.
    a, b = ranks[0]["initialised"], ranks[1]["initialised"]
    assert torch.equal(a["blocks.0.down.bias"], b["blocks.0.down.bias"])  # random, whole
    assert not torch.equal(a["blocks.0.up.weight"], b["blocks.0.up.weight"])  # split
    assert not any(t.isnan().any() for t in a.values())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hugging_face_families_under_adamw_hybrid_and_sequence_parallel(hf_results, family):
    """Replicate 2 x tp 2 with the sequence split, trained with AdamW: the losses equal one
    process's (AdamW normalises tiny gradient differences, so parameters are not compared;
    the issue's bar is rel 1e-4)."""
    _, ranks = hf_results
    got = ranks[0][f"{family}_hybrid_sp_adamw"]
    assert got["mesh"].startswith("hybrid_shard: 2 replica group(s) x 1 shard rank(s) x tp 2")
    torch.manual_seed(0)
    ref = train(build_family(family), lambda b: b, _hf_loss, adamw=True)
    worst = worst_of(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"{family} hybrid + sp + AdamW: the largest loss difference is rel {worst:.2e}")
    assert worst < 1e-4, f"{family}: AdamW loss differs by {worst:.2e}"


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_sequence_parallel_under_activation_checkpointing_equals_one_process(hf_results, family):
    """The recompute runs the sequence split's gathers and reduce-scatters again."""
    refs, ranks = hf_results
    got = ranks[0][f"{family}_sp_ac"]
    rel, where = _worst(refs[family], got)
    print(f"{family} sp + AC full: the largest difference is {where}, rel {rel:.2e}")
    assert rel < RTOL, f"{family} sp + AC full: {where} differs by {rel:.2e}"
    assert got["norm_tokens"] == SEQ // 2


@pytest.mark.parametrize("case", ["llama_loss_parallel", "llama_loss_parallel_sp"])
def test_loss_parallel_on_a_hugging_face_model_equals_one_process(hf_results, case):
    """llama's head keeps its logits split over the vocabulary and its own loss function
    runs on them inside torch's loss_parallel (the Engine enters it); also with the
    sequence split inside the decoder layers."""
    refs, ranks = hf_results
    got = ranks[0][case]
    rel, where = _worst({**refs["llama"], "grads": {}}, {**got, "grads": {}})
    print(f"{case}: the largest difference is {where}, rel {rel:.2e}")
    assert rel < RTOL, f"{case}: {where} differs by {rel:.2e}"
    assert "tp: lm_head -> colwise (loss_parallel" in got["described"]
