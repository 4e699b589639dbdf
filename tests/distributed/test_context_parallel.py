"""Context parallel (Ulysses) over the data-parallel strategies at world 4 equals one process.

Four transformers families (Llama with 8 heads and 2 KV heads, so cp 4 has fewer KV heads
than ranks; Qwen2; Mistral with a sliding window shorter than the sequence; Qwen3 with its
q/k norms) train 3 SGD steps, clipping active, on batches of packed documents: position
ids restart inside each row, and each document's first token has label -100. Each rank of
a cp group is given its data-parallel rank's whole rows; wrap's hook cuts them. Compared
with one process on the whole batch (use_cache=False, so transformers masks the documents):
the loss at every step, every gradient after the first step, and the final parameters.

Layouts: cp 2 x full_shard over 2 data-parallel ranks, cp 4, and cp 2 x tp 2 (the model's own
tp plan, Ulysses over the heads tp leaves) for every family; hybrid_shard,
no_shard and shard_grad_op with cp 2, a padded batch (2-D attention mask), activation
checkpointing (the attention recomputed in backward), the Engine, a mixture of experts with
its router loss, peft's LoRA, and a model of our own that calls shardwise.context_attention. The layout
is shown real: a rank's q_proj sees 1/cp of each sequence while the attention's layout is
the whole of it, and every parameter is sharded over dp_shard x cp. The negative controls
(positions local to each chunk; labels handed to the model per chunk, which shifts inside
them; the mean of per-chunk means; a model whose attention ignores shardwise) must fail.
All cases run in one spawned group of 4. A second group of 8 runs pp 2 x cp 2 x dp 2 for
every family on the same packed documents (and llama on the padded batch), where the
schedule's micro-batches each carry their own rows of the mask, and experts under cp 2 x
ep 2 over 4 shard ranks.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.parallelize import context
from shardwise.testing import run_distributed
from shardwise.testing.parity import ParityError, worst_of

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.context_parallel  # `make test-cp` (and .ci/run), not `make test`

VOCAB, SEQ, ROWS, STEPS = 64, 16, 4, 3
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=6)
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=4)),
}
MAX_NORM = 0.5  # below the gradients' norm: clipping acts
RTOL = 1e-5


def build(family: str) -> nn.Module:
    model = _build(family)
    if hasattr(model, "config") and family != "lora":  # no documents masked with a cache
        model.config.use_cache = False
    return model


def _build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "lora":  # peft's LoRA on llama, its B initialised away from zero
        import peft

        base = FAMILIES["llama"]()
        base.config.use_cache = False
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                 target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
        return peft.get_peft_model(base, config)
    if family == "moe":
        config = transformers.Qwen3MoeConfig(
            **COMMON, head_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.5,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "plain":
        return PlainLM()
    return FAMILIES[family]()


def batches(padded: bool = False) -> list[dict[str, torch.Tensor]]:
    """Rows of packed documents: two documents a row at different cuts (the same number of
    valid labels in every row, so that each data-parallel rank's mean is the batch's),
    or, `padded`, one document a row with its last 3 tokens padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        if padded:
            mask = torch.ones(ROWS, SEQ, dtype=torch.long)
            mask[:, -3:] = 0
            labels = ids.masked_fill(mask == 0, -100)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
            continue
        cuts = torch.randint(2, SEQ - 2, (ROWS,), generator=g).tolist()
        pos = torch.stack([torch.cat([torch.arange(c), torch.arange(SEQ - c)]) for c in cuts])
        labels = ids.masked_fill(pos == 0, -100)
        out.append({"input_ids": ids, "position_ids": pos, "labels": labels})
    return out


class PlainAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(d, -1)
        )
        y = shardwise.context_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class PlainLM(nn.Module):
    """A model of our own: learned positions from position_ids, attention through
    shardwise.context_attention, the summed token loss over num_items_in_batch."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.attn = nn.ModuleList(PlainAttention(d, heads) for _ in range(2))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        h = self.emb(input_ids) + self.pos(position_ids)
        for block in self.attn:
            h = h + block(h)
        losses = F.cross_entropy(
            self.head(h).flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
        )
        count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
        return losses / count


def plain_batches() -> list[dict[str, torch.Tensor]]:
    """Next-token targets of our own (aligned with the inputs: nothing to shift), some
    ignored, so the chunks of a row hold different numbers of them."""
    out = []
    for b in batches():
        targets = torch.roll(b["input_ids"], -1, dims=1)
        targets[:, -1] = -100
        targets[:, 1:5] = -100
        out.append({"input_ids": b["input_ids"], "labels": targets})
    return out


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def train(model: nn.Module, rows: Any, data: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], {}
    for step, batch in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model(**rows(batch)))
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        shardwise.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        detached = loss.detach()
        losses.append(
            shardwise.mean_across_ranks(detached) if dist.is_initialized() else float(detached)
        )
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def reference(family: str, data: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    model = build(family)
    extra = {} if family == "plain" else {"use_cache": False}
    return train(model, lambda b: {**b, **extra}, data)


def _rows(batch: dict[str, torch.Tensor], info: Any) -> dict[str, torch.Tensor]:
    """The data-parallel rank's whole rows: every rank of a cp group reads the same."""
    return {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch.items()}


def _seen(module: nn.Module) -> list[int]:
    seen: list[int] = []

    def record(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if not seen:
            seen.append(int(out.shape[1]))
            layout = context.current_layout()
            seen.append(layout.seq_len if layout is not None else -1)
            seen.append(int(out.shape[-1]))  # features: split over tp

    module.register_forward_hook(record)
    return seen


def run_case(family: str, data: list[dict[str, torch.Tensor]], **fields: Any) -> dict[str, Any]:
    model = shardwise.wrap(build(family), shardwise.ParallelConfig(**fields))
    info = shardwise.wrap_info(model)
    assert info is not None
    attention = next(m for n, m in model.named_modules() if n.endswith(("q_proj", "attn.0.qkv")))
    seen = _seen(attention)
    head = "lm_head.weight" if family != "plain" else "emb.weight"
    weight = next(p for n, p in model.named_parameters() if n.endswith(head))
    result = train(model, functools.partial(_rows, info=info), data)
    result["layout"] = {
        "seen": seen,
        "mesh": str(info.mesh_spec),
        "dp": (info.dp_rank, info.dp_size),
        "weight_mesh": weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else None,
        "weight_local_rows": weight.to_local().shape[0] if isinstance(weight, DTensor) else None,
    }
    return result


def _engine_case() -> dict[str, Any]:
    """The Engine's own steps (accumulation 2: each micro-batch is one of the rank's rows)."""
    torch.manual_seed(0)
    engine = shardwise.Engine(
        build("llama"),
        lambda p: torch.optim.SGD(p, lr=0.5),
        shardwise.ParallelConfig(cp=2),
        train=shardwise.TrainConfig(accumulate_steps=2, max_grad_norm=MAX_NORM),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    losses = []
    for batch in batches():
        rows = _rows(batch, info)
        for micro in range(2):
            logs = engine.train_step({k: v[micro : micro + 1] for k, v in rows.items()})
        losses.append(logs["loss"])
    val = engine.val_step(_rows(batches()[0], info))
    params = {n: _full(p) for n, p in engine.model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "val": float(shardwise.mean_across_ranks(val["loss"])),
    }


def _adamw_engine(config: shardwise.ParallelConfig | None) -> shardwise.Engine:
    torch.manual_seed(0)
    return shardwise.Engine(build("llama"), functools.partial(torch.optim.AdamW, lr=1e-2), config)


def _next_step(engine: shardwise.Engine, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    info = shardwise.wrap_info(engine.model)
    rows = _rows(batch, info) if info is not None and info.wrapped else batch
    params = {n: _full(p) for n, p in engine.model.named_parameters()}
    return {"params": params, "next": float(engine.train_step(rows)["loss"])}


def _checkpoint_case(root: str) -> dict[str, Any]:
    """AdamW at cp 2 for 2 steps, saved; loaded at cp 1 (full_shard over the same ranks)."""
    engine = _adamw_engine(shardwise.ParallelConfig(cp=2))
    info = shardwise.wrap_info(engine.model)
    data = batches()
    for batch in data[:2]:
        engine.train_step(_rows(batch, info))
    shardwise.save_checkpoint(root, engine)
    out = {"cp2": _next_step(engine, data[2])}
    other = _adamw_engine(shardwise.ParallelConfig())
    shardwise.load_checkpoint(root, other)
    out["cp1"] = _next_step(other, data[2])
    return out


def _wrong_cases() -> dict[str, Any]:
    """Deliberately wrong setups, each of which must fail the comparison."""
    out: dict[str, Any] = {}
    local = [
        {**b, "position_ids": torch.arange(SEQ // 2).repeat(ROWS, 2)} for b in batches()
    ]  # positions 0..7 again in each rank's chunk (and documents cut at the chunk edge)
    out["positions_local"] = run_case("llama", local, cp=2)

    def unshifted(self: Any, module: Any, arguments: Any, extra: Any, params: Any, n: int) -> None:
        return None  # the labels are cut as they are: transformers shifts inside each chunk

    with mock.patch.object(context.Cutter, "_targets", unshifted):
        out["labels_per_chunk"] = run_case("llama", batches(), cp=2)
    real = context.Cutter._targets

    def mean_of_means(self: Any, module: Any, arguments: Any, extra: Any, *rest: Any) -> None:
        real(self, module, arguments, extra, *rest)
        extra.pop("num_items_in_batch", None)  # each chunk's own mean, averaged

    with mock.patch.object(context.Cutter, "_targets", mean_of_means):
        out["mean_of_chunk_means"] = run_case("llama", batches(), cp=2)
        out["mean_of_chunk_means_cp4"] = run_case("llama", batches(), cp=4)
    return out


class LocalAttentionLM(PlainLM):
    """A model whose attention is F.scaled_dot_product_attention: each rank's own chunk."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.attn:
            block.forward = functools.partial(_local_attention, block)  # type: ignore[method-assign]


def _local_attention(block: PlainAttention, x: torch.Tensor) -> torch.Tensor:
    b, s, d = x.shape
    q, k, v = (
        t.view(b, s, block.heads, d // block.heads).transpose(1, 2)
        for t in block.qkv(x).split(d, -1)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return block.out(y.transpose(1, 2).reshape(b, s, d))


def _refusals() -> dict[str, str]:
    out = {}
    torch.manual_seed(0)
    model = shardwise.wrap(LocalAttentionLM(), shardwise.ParallelConfig(cp=2))
    try:
        model(**plain_batches()[0])
        out["attention_not_through_shardwise"] = "no error"
    except RuntimeError as exc:
        out["attention_not_through_shardwise"] = str(exc)
    model = shardwise.wrap(build("llama"), shardwise.ParallelConfig(cp=2))
    try:
        model(input_ids=torch.zeros(2, 15, dtype=torch.long))
        out["odd_sequence"] = "no error"
    except ValueError as exc:
        out["odd_sequence"] = str(exc)
    return out


MEMORY_SEQ = 256


def memory_model() -> nn.Module:  # module level: the simulation may pickle it
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{**COMMON, "max_position_embeddings": MEMORY_SEQ}, use_cache=False
        )
    )


def _memory(cp: int) -> dict[str, Any]:
    from shardwise.memory import real_step

    torch.manual_seed(0)
    config = shardwise.ParallelConfig(cp=cp)
    return real_step(memory_model, config, batch=1, seq_len=MEMORY_SEQ)


def _cases(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"checkpoint": _checkpoint_case(root)}
    out["memory"] = {cp: _memory(cp) for cp in (2, 4)}
    for family in FAMILIES:
        out[f"{family}_cp2_full_shard"] = run_case(family, batches(), cp=2)
        out[f"{family}_cp4"] = run_case(family, batches(), cp=4)
        out[f"{family}_cp2_tp2"] = run_case(family, batches(), cp=2, tp=2)
    for strategy in ("hybrid_shard", "no_shard", "shard_grad_op"):
        out[f"llama_cp2_{strategy}"] = run_case("llama", batches(), cp=2, strategy=strategy)
    out["llama_cp2_padded"] = run_case("llama", batches(padded=True), cp=2)
    out["llama_cp2_recompute"] = run_case("llama", batches(), cp=2, activation_checkpointing="full")
    out["moe_cp2_router_loss"] = run_case("moe", batches(), cp=2)
    out["moe_cp2_ep2"] = run_case("moe", batches(), cp=2, ep=2)  # 1 shard rank x 2 cp ranks
    out["moe_cp2_ep4"] = run_case("moe", batches(), cp=2, ep=4)  # every rank: 1 expert each
    out["lora_cp2_adapters"] = run_case("lora", batches(), cp=2)
    out["plain_cp2"] = run_case("plain", plain_batches(), cp=2)
    out["engine"] = _engine_case()
    out.update(_wrong_cases())
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cp_checkpoints"))


@pytest.fixture(scope="module")
def results(root: str) -> dict[str, Any]:
    return run_distributed(_cases, 4, args=(root,), timeout_s=600)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def differences(case: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    loss = worst_of(abs(a - b) / abs(b) for a, b in zip(case["losses"], ref["losses"], strict=True))
    out = {"loss": loss}
    if "grads" in case:
        out["grads"] = worst_of(_rel(case["grads"][n], g) for n, g in ref["grads"].items())
    out["params"] = worst_of(_rel(case["params"][n], p) for n, p in ref["params"].items())
    return out


CASES = [
    *(f"{f}_cp2_full_shard" for f in FAMILIES),
    *(f"{f}_cp4" for f in FAMILIES),
    *(f"{f}_cp2_tp2" for f in FAMILIES),
    "llama_cp2_hybrid_shard",
    "llama_cp2_no_shard",
    "llama_cp2_shard_grad_op",
    "llama_cp2_padded",
    "llama_cp2_recompute",
    "moe_cp2_router_loss",
    "moe_cp2_ep2",
    "moe_cp2_ep4",
    "lora_cp2_adapters",
    "plain_cp2",
]


def _family(case: str) -> str:
    return case.split("_")[0]


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_equals_one_process(results, case):  # type: ignore[no-untyped-def]
    data = batches(padded=True) if case.endswith("padded") else batches()
    family = _family(case)
    ref = reference(family, plain_batches() if family == "plain" else data)
    worst = differences(results[case], ref)
    assert all(v < RTOL for v in worst.values()), (case, worst)


@pytest.mark.parametrize("case", CASES)
def test_the_layout_is_real(results, case):  # type: ignore[no-untyped-def]
    layout = results[case]["layout"]
    cp = 4 if case.endswith("cp4") else 2
    tp = 2 if case.endswith("tp2") else 1
    features = (96 if _family(case) == "plain" else 32) // tp  # qkv, or q_proj: 8 heads x 4
    # q_proj holds 1/cp of the sequence (and 1/tp of the heads); the attention reads it all
    assert layout["seen"] == [SEQ // cp, SEQ, features]
    assert f"x cp {cp}" in layout["mesh"]
    strategy = case.rsplit("cp2_", 1)[-1]
    if strategy.startswith("ep"):  # an ep group takes whole cp groups
        ep = int(strategy[2:])
        assert f"experts: ep {ep} x {4 // ep} shard rank(s)" in layout["mesh"]
    if strategy == "tp2":  # tp splits the head's rows, FSDP shards them over dp_shard x cp
        assert layout["weight_mesh"] == ("dp_shard_cp", "tp")
        assert layout["weight_local_rows"] == VOCAB // 4
    elif strategy == "no_shard":  # every rank a replica: a (dp_replicate x cp, 1) mesh
        assert layout["weight_mesh"] == ("dp_replicate_cp", "dp_shard")
        assert layout["weight_local_rows"] == VOCAB
    elif strategy == "hybrid_shard":  # 2 replicas, each sharded over its 2 cp ranks
        assert layout["weight_mesh"] == ("dp_replicate", "dp_shard_cp")
        assert layout["weight_local_rows"] == VOCAB // 2
    else:  # sharded over every rank: dp_shard x cp flattened, never (dp_shard, cp) HSDP
        assert layout["weight_mesh"] == ("dp_shard_cp",)
        assert layout["weight_local_rows"] == VOCAB // 4


def test_the_engine_trains_and_validates_as_one_process(results):  # type: ignore[no-untyped-def]
    model = build("llama")
    ref = train(model, lambda b: {**b, "use_cache": False}, batches())
    worst = differences(results["engine"], ref)
    assert worst["loss"] < RTOL and worst["params"] < RTOL, worst
    model.eval()
    with torch.no_grad():
        expected = float(model(**batches()[0], use_cache=False).loss)
    assert abs(results["engine"]["val"] - expected) / expected < RTOL


@pytest.mark.parametrize(
    "case",
    ["positions_local", "labels_per_chunk", "mean_of_chunk_means", "mean_of_chunk_means_cp4"],
)
def test_a_wrong_setup_fails_the_comparison(results, case):  # type: ignore[no-untyped-def]
    ref = reference("llama", batches())
    try:
        worst = differences(results[case], ref)
    except ParityError:  # a NaN or an infinity: failed too
        return
    assert worst["loss"] > 1e-3 or worst["params"] > 1e-3, (case, worst)


def test_what_cannot_be_cut_is_refused(results):  # type: ignore[no-untyped-def]
    refusals = results["refusals"]
    assert "ran no attention through shardwise" in refusals["attention_not_through_shardwise"]
    assert "context_attention" in refusals["attention_not_through_shardwise"]
    assert "sequence length 15 does not divide by 2" in refusals["odd_sequence"]


def test_a_cp2_checkpoint_loads_at_cp1_and_in_one_process_and_steps_on(results, root):  # type: ignore[no-untyped-def]
    saved = results["checkpoint"]["cp2"]
    engine = _adamw_engine(None)  # one process: no process group here
    shardwise.load_checkpoint(root, engine)
    alone = _next_step(engine, batches()[2])
    for other in (results["checkpoint"]["cp1"], alone):
        for name, value in saved["params"].items():
            assert torch.equal(other["params"][name], value), name
        assert abs(other["next"] - saved["next"]) / saved["next"] < RTOL


# --- pp 2 x cp 2 x dp 2 at world 8 -------------------------------------------------------

PP_FIELDS = {"cp": 2, "pp": 2, "pp_microbatches": 2}


def _pp_case(family: str, data: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    model = shardwise.wrap(build(family), shardwise.ParallelConfig(**PP_FIELDS))
    info = shardwise.wrap_info(model)
    assert info is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], {}
    for step, batch in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = shardwise.pipeline_step(model, _rows(batch, info))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        shardwise.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(shardwise.mean_across_ranks(loss.detach()))
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "mesh": str(info.mesh_spec),
        "stage": info.pp_rank,
        "dp": (info.dp_rank, info.dp_size),
    }


def _pp_cases() -> dict[str, Any]:
    out: dict[str, Any] = {family: _pp_case(family, batches()) for family in FAMILIES}
    out["llama_padded"] = _pp_case("llama", batches(padded=True))
    out["moe_cp2_ep2"] = run_case("moe", batches(), cp=2, ep=2)  # 4 shard ranks an expert
    return out


@pytest.fixture(scope="module")
def results8() -> list[dict[str, Any]]:
    return run_distributed(_pp_cases, 8, timeout_s=900)


@pytest.mark.parametrize("family", [*FAMILIES, "llama_padded"])
def test_pp_x_cp_x_dp_at_world_8_equals_one_process(results8, family):  # type: ignore[no-untyped-def]
    """Packed documents (and a padded batch): each micro-batch's attention masks its own
    rows' documents and padding."""
    merged: dict[str, Any] = {"losses": results8[0][family]["losses"], "grads": {}, "params": {}}
    for rank in results8:  # each stage holds its own layers' parameters
        merged["grads"].update(rank[family]["grads"])
        merged["params"].update(rank[family]["params"])
    padded = family.endswith("_padded")
    ref = reference(family.removesuffix("_padded"), batches(padded=padded))
    assert set(merged["params"]) == set(ref["params"])
    worst = differences(merged, ref)
    assert all(v < RTOL for v in worst.values()), (family, worst)
    layout = [(r[family]["stage"], r[family]["dp"]) for r in results8]
    assert "pp 2 x 1 replica group(s) x 2 shard rank(s) x cp 2" in results8[0][family]["mesh"]
    assert sorted(layout) == sorted((s, (d, 2)) for s in (0, 1) for d in (0, 1) for _ in (0, 1))
    stage_layers = {r[family]["stage"]: {n.split(".")[2] for n in r[family]["params"]
                                         if n.startswith("model.layers.")} for r in results8}  # fmt: skip
    assert stage_layers == {0: {"0"}, 1: {"1"}}  # each stage holds only its own layer


@pytest.mark.parametrize("cp", [2, 4])
def test_the_simulated_peak_is_within_5_percent_of_the_real_one(results, cp):  # type: ignore[no-untyped-def]
    """simulate_step under cp against the same step on real tensors (gloo, measured by the
    same tracker): each rank's 1/cp of the sequences, and the all-to-alls' buffers."""
    real = results["memory"][cp]["peak"]
    sim = shardwise.simulate_step(
        memory_model, shardwise.ParallelConfig(cp=cp), world=4, batch=1,
        seq_len=MEMORY_SEQ, backend="gloo",
    )  # fmt: skip
    assert abs(sim.peak / real - 1) <= 0.05, (sim.peak, real)


def test_experts_under_cp_x_ep_at_world_8_equal_one_process(results8):  # type: ignore[no-untyped-def]
    case = results8[0]["moe_cp2_ep2"]
    worst = differences(case, reference("moe", batches()))
    assert all(v < RTOL for v in worst.values()), worst
    assert "4 shard rank(s) x cp 2" in case["layout"]["mesh"]
    assert "experts: ep 2 x 4 shard rank(s)" in case["layout"]["mesh"]
