"""shardwise.Muon at world 4 equals one-process Muon, layout by layout.

A bias-free MLP (32 -> 70 -> 40 -> 24: 70 rows split unevenly over 4 shard ranks) and a
tiny llama built from its config (no download) are trained 3 steps with float32
Newton–Schulz and an SGD fallback (AdamW's float32 rounding alone lands near 1e-5), under
ddp, full_shard, shard_grad_op, hybrid 2 x 2 and dp 2 x tp 2 (and the llama with peft's
LoRA adapters, whose A and B are matrices of their own, under full_shard, hybrid and dp 2 x
tp 2; and pp 2 x dp 2 through the Engine; a tiny mixtral's 3-D expert stacks, each expert's
matrix on its own, under full_shard, hybrid and ep 2; a tiny qwen2, a third family with
biased q, k and v, under full_shard, hybrid and dp 2 x tp 2), each rank on its part of the
same global batch. Compared with one process on the whole batch: the loss at every step
and the final parameters, within 1e-5 relative. The negative control orthogonalises each
rank's local shard and must miss by about its measured size. Newton–Schulz is counted on
every rank: once per matrix and step in the whole job, and the collectives of a step are
counted too. The Engine takes shardwise.Muon through a factory and refuses torch's Muon
over sharded parameters. All cases run in one spawned group of 4. A checkpoint saved
there under dp 2 x tp 2 is loaded by a group of 2 (full_shard, ddp) and by one process:
the momentum exact, the next step equal to one process's.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.testing import count_collectives, run_distributed
from shardwise.testing.parity import split_batch, worst_of
from shardwise.train import muon as muon_module

pytestmark = pytest.mark.muon  # `make test-muon` (and .ci/run), not `make test`

STEPS, BATCH, SEQ, VOCAB = 3, 16, 6, 32
RTOL = 1e-5
MUON: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
LLAMA = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MLP_TP = {"0": "colwise", "2": "rowwise"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 70, bias=False),
        nn.ReLU(),
        nn.Linear(70, 40, bias=False),
        nn.ReLU(),
        nn.Linear(40, 24, bias=False),
    )


def llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def lora() -> nn.Module:
    """The llama with LoRA adapters (B not zero, so every A and B trains from step 1)."""
    import peft

    base = llama()
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    return peft.get_peft_model(base, config)


def mixtral() -> nn.Module:
    """A mixture of 4 experts (3-D stacks: each expert's matrix is a matrix of its own)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def qwen2() -> nn.Module:
    """A third family: biased q, k and v projections (the biases go to the fallback)."""
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA))


MODELS = {"mlp": mlp, "llama": llama, "lora": lora, "mixtral": mixtral, "qwen2": qwen2}


def batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if model == "mlp":
        return [
            (torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 24, generator=g))
            for _ in range(STEPS)
        ]
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def loss_of(model_name: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if model_name == "mlp":
        return nn.functional.mse_loss(model(batch[0]), batch[1])
    return model(input_ids=batch[0], labels=batch[1]).loss


def make_muon(model: nn.Module, cls: type[shardwise.Muon] | None = None) -> shardwise.Muon:
    return (cls or shardwise.Muon)(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        **MUON,
        fallback=lambda ps: torch.optim.SGD(ps, lr=0.1),
        process_group=getattr(model, "process_group", None),
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def train(model_name: str, model: nn.Module, opt: torch.optim.Optimizer, shard) -> dict:  # type: ignore[no-untyped-def]
    losses, collectives = [], Counter[str]()
    for batch in batches(model_name):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model_name, model, shard(batch))
        loss.backward()
        with count_collectives(("gather", "scatter", "broadcast", "all_gather")) as counts:
            opt.step()
        collectives.update(counts)
        losses.append(
            shardwise.mean_across_ranks(loss.detach())
            if dist.is_initialized()
            else float(loss.detach())
        )
    inner = model.module if hasattr(model, "module") else model
    params = {n: _full(p) for n, p in inner.named_parameters()}
    return {"losses": losses, "params": params, "collectives": dict(collectives)}


def reference(model_name: str) -> dict:  # type: ignore[type-arg]
    model = MODELS[model_name]()
    return train(model_name, model, make_muon(model), lambda b: b)


class LocalShardMuon(shardwise.Muon):
    """The negative control: Newton–Schulz on each rank's own piece of every matrix."""

    def _orthogonalise(self, items):  # type: ignore[no-untyped-def]
        return [it.orthogonalise(it.local.float()) for it in items]


CASES = [  # name, model, ParallelConfig fields, optimizer class
    ("mlp_ddp", "mlp", dict(strategy="ddp"), None),
    ("mlp_full_shard", "mlp", dict(strategy="full_shard"), None),
    ("mlp_shard_grad_op", "mlp", dict(strategy="shard_grad_op"), None),
    ("mlp_hybrid_2x2", "mlp", dict(strategy="hybrid_shard", dp_shard=2), None),
    ("mlp_dp2_tp2", "mlp", dict(strategy="full_shard", tp=2, tp_plan=MLP_TP), None),
    ("mlp_local_shards", "mlp", dict(strategy="full_shard"), LocalShardMuon),
    ("llama_full_shard", "llama", dict(strategy="full_shard"), None),
    ("llama_hybrid_2x2", "llama", dict(strategy="hybrid_shard", dp_shard=2), None),
    ("llama_dp2_tp2", "llama", dict(strategy="full_shard", tp=2), None),
    ("lora_full_shard", "lora", dict(strategy="full_shard"), None),
    ("lora_hybrid_2x2", "lora", dict(strategy="hybrid_shard", dp_shard=2), None),
    ("mixtral_full_shard", "mixtral", dict(strategy="full_shard"), None),
    ("mixtral_hybrid_2x2", "mixtral", dict(strategy="hybrid_shard", dp_shard=2), None),
    ("mixtral_ep2", "mixtral", dict(strategy="full_shard", ep=2), None),
    ("qwen2_full_shard", "qwen2", dict(strategy="full_shard"), None),
    ("qwen2_hybrid_2x2", "qwen2", dict(strategy="hybrid_shard", dp_shard=2), None),
    ("qwen2_dp2_tp2", "qwen2", dict(strategy="full_shard", tp=2), None),
    ("lora_dp2_tp2", "lora", dict(strategy="full_shard", tp=2), None),
]


def _counting_newton_schulz(counter: Counter[str], events: list[str] | None = None):  # type: ignore[no-untyped-def]
    real = muon_module.newton_schulz

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counter["newton_schulz"] += 1
        if events is not None:
            events.append("n")
        return real(x, *args, **kwargs)

    return counted


@contextlib.contextmanager
def _recording(events: list[str]):  # type: ignore[no-untyped-def]
    """Muon's collectives in the order this rank makes them (g, s, b), and a `|` where each
    step's orthogonalise_whole begins (Newton–Schulz adds its `n`)."""
    from unittest import mock

    def record(letter: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(letter)
            return fn(*args, **kwargs)

        return call

    comm = muon_module.muon_comm
    with (
        mock.patch.object(dist, "gather", record("g", dist.gather)),
        mock.patch.object(dist, "scatter", record("s", dist.scatter)),
        mock.patch.object(dist, "broadcast", record("b", dist.broadcast)),
        mock.patch.object(comm, "orthogonalise_whole", record("|", comm.orthogonalise_whole)),
    ):
        yield


def _distributed_cases(root: str, root_tp: str) -> dict:  # type: ignore[type-arg]
    from unittest import mock

    out = {}
    for name, model_name, fields, cls in CASES:
        model = shardwise.wrap(MODELS[model_name](), shardwise.ParallelConfig(**fields))
        info = shardwise.wrap_info(model)
        assert info is not None
        shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
        opt = make_muon(model, cls)
        calls: Counter[str] = Counter()
        events: list[str] = []
        counted = _counting_newton_schulz(calls, events)
        with mock.patch.object(muon_module, "newton_schulz", counted), _recording(events):
            result = train(model_name, model, opt, shard)
        result["newton_schulz"] = calls["newton_schulz"]
        result["order"] = "".join(events).split("|")[1:]  # one string per step
        stacks = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
        # a 3-D stack holds one matrix per expert
        result["matrices"] = sum(p.shape[0] if p.ndim == 3 else 1 for p in stacks)
        result["matrix_names"] = list(opt.matrix_names)
        result["tp_split"] = _split_over(model, "tp")
        out[name] = result
    out["engine"] = _engine_run()
    out["checkpoint"] = _checkpoint_across_layouts(root)
    out["checkpoint_tp"] = resume(root_tp, shardwise.ParallelConfig(tp=2, tp_plan=MLP_TP), False)
    out["llama_pp2_dp2"] = _pipeline_run()
    out["torch_muon"] = _torch_muon_refused()
    return out


def _split_over(model: nn.Module, dim: str) -> list[str]:
    """The parameters cut over mesh dim `dim` (the layout is real, not a copy per rank)."""
    out = []
    for n, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if dim in names and isinstance(p.placements[names.index(dim)], Shard):  # type: ignore[union-attr]
            out.append(n)
    return out


def _engine_run() -> dict:  # type: ignore[type-arg]
    engine = shardwise.Engine(
        _MSE(),
        lambda p: shardwise.Muon(p, **MUON, fallback=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        shardwise.ParallelConfig(strategy="full_shard"),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    losses = []
    for x, y in batches("mlp"):
        batch = split_batch((x, y), info.dp_rank, info.dp_size)
        logs = engine.train_step(batch)
        losses.append(logs["loss"])
    params = {n.removeprefix("net."): _full(p) for n, p in engine.model.named_parameters()}
    return {"losses": losses, "params": params, "optimizer": type(engine.optimizer).__name__}


def _checkpoint_across_layouts(root: str) -> dict:  # type: ignore[type-arg]
    """Two steps under full_shard, saved; loaded under hybrid 2 x 2, the third step there.
    The momentum comes back exact, and the third step equals the uninterrupted one's."""

    def run(config: shardwise.ParallelConfig, steps: range, load: bool) -> tuple[dict, dict]:
        model = shardwise.wrap(mlp(), config)
        info = shardwise.wrap_info(model)
        assert info is not None
        opt = make_muon(model)
        buffers = {}
        if load:
            shardwise.load_checkpoint(root, model, opt)
            buffers = {
                n: _full(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters()
            }
        for b in [batches("mlp")[i] for i in steps]:
            opt.zero_grad(set_to_none=True)
            rows = split_batch(b, info.dp_rank, info.dp_size)
            loss_of("mlp", model, rows).backward()
            opt.step()
        if not load:
            shardwise.save_checkpoint(root, model, opt, step=2)
            buffers = {
                n: _full(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters()
            }
        return buffers, {n: _full(p) for n, p in model.named_parameters()}

    saved, _ = run(shardwise.ParallelConfig(strategy="full_shard"), range(2), load=False)
    hybrid = shardwise.ParallelConfig(strategy="hybrid_shard", dp_shard=2)
    loaded, params = run(hybrid, range(2, 3), load=True)
    return {"saved": saved, "loaded": loaded, "params": params}


def biased_mlp() -> nn.Module:
    """The MLP with biases, for checkpoints: its fallback (SGD with momentum) has state too."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 70), nn.ReLU(), nn.Linear(70, 40), nn.ReLU(), nn.Linear(40, 24)
    )


def resume(root: str, config: shardwise.ParallelConfig | None, load: bool) -> dict:  # type: ignore[type-arg]
    """Steps 1-2 then a save (`load` False), or a load then step 3, of the biased MLP under
    `config` (None: one process, unwrapped). Returns every momentum buffer, whole, by name
    (after the save, or right after the load) and the parameters at the end."""
    model = biased_mlp() if config is None else shardwise.wrap(biased_mlp(), config)
    info = shardwise.wrap_info(model)
    rank, world = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    opt = shardwise.Muon(
        model.named_parameters(), **MUON, process_group=getattr(model, "process_group", None),
        fallback=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )  # fmt: skip

    def buffers() -> dict[str, torch.Tensor]:
        return {
            n.removeprefix("module."): _full(opt.state[p]["momentum_buffer"])
            for n, p in model.named_parameters()
        }

    got: dict[str, torch.Tensor] = {}
    if load:
        shardwise.load_checkpoint(root, model, opt)
        got = buffers()
    for b in batches("mlp")[2:] if load else batches("mlp")[:2]:
        opt.zero_grad(set_to_none=True)
        loss_of("mlp", model, split_batch(b, rank, world)).backward()
        opt.step()
    if not load:
        shardwise.save_checkpoint(root, model, opt, step=2)
        got = buffers()
    params = {n.removeprefix("module."): _full(p) for n, p in model.named_parameters()}
    return {"buffers": got, "params": params, "tp_split": _split_over(model, "tp")}


def _load_at_world_2(root: str) -> dict:  # type: ignore[type-arg]
    return {
        "full_shard": resume(root, shardwise.ParallelConfig(strategy="full_shard"), True),
        "ddp": resume(root, shardwise.ParallelConfig(strategy="ddp"), True),
    }


def _pipeline_run() -> dict:  # type: ignore[type-arg]
    """pp 2 x dp 2 through the Engine (1F1B): each stage's matrices on its own ranks."""
    from unittest import mock

    engine = shardwise.Engine(
        llama(),
        lambda p: shardwise.Muon(p, **MUON, fallback=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        shardwise.ParallelConfig(strategy="full_shard", pp=2),
    )
    info = shardwise.wrap_info(engine.model)
    assert info is not None
    calls: Counter[str] = Counter()
    losses = []
    with mock.patch.object(muon_module, "newton_schulz", _counting_newton_schulz(calls)):
        for x, y in batches("llama"):
            rows = split_batch((x, y), info.dp_rank, info.dp_size)
            losses.append(engine.train_step({"input_ids": rows[0], "labels": rows[1]})["loss"])
    assert isinstance(engine.optimizer, shardwise.Muon)
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in engine.model.named_parameters()},
        "newton_schulz": calls["newton_schulz"],
        "matrix_names": list(engine.optimizer.matrix_names),
        "matrices": len(engine.optimizer.matrix_names),
    }


class _MSE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def _torch_muon_refused() -> str:
    try:
        shardwise.Engine(
            _MSE(),
            lambda p: torch.optim.Muon(p, lr=0.02),
            shardwise.ParallelConfig(strategy="full_shard"),
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("muon")
    return str(root / "ckpt"), str(root / "ckpt_tp")


@pytest.fixture(scope="module")
def ranks(roots: tuple[str, str]) -> list[dict]:  # type: ignore[type-arg]
    return run_distributed(_distributed_cases, 4, args=roots, timeout_s=600)


@pytest.fixture(scope="module")
def other_worlds(ranks: list[dict], roots: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    """The dp 2 x tp 2 checkpoint (saved by `ranks`) loaded at world 2 and in one process."""
    at_2 = run_distributed(_load_at_world_2, 2, args=(roots[1],), timeout_s=300)[0]
    return {**at_2, "one_process": resume(roots[1], None, True)}


@pytest.fixture(scope="module")
def results(ranks: list[dict]) -> dict:  # type: ignore[type-arg]
    return ranks[0]


@pytest.fixture(scope="module")
def references() -> dict:  # type: ignore[type-arg]
    return {m: reference(m) for m in MODELS}


def _errors(got: dict, want: dict, stage: bool = False) -> tuple[float, float]:  # type: ignore[type-arg]
    """Worst relative error of the losses and of the parameters (`stage`: a pipeline
    stage's own parameters only)."""
    pairs = zip(got["losses"], want["losses"], strict=True)
    loss = worst_of(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    names = set(got["params"]) if stage else set(want["params"])
    assert set(got["params"]) <= set(want["params"]) and (stage or set(got["params"]) == names)
    param = worst_of(
        float((got["params"][n] - want["params"][n]).norm() / want["params"][n].norm())
        for n in names
    )
    return loss, param


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] is None] + ["engine"])
def test_equals_one_process(case: str, results: dict, references: dict) -> None:  # type: ignore[type-arg]
    model_name = "mlp" if case == "engine" else case.split("_")[0]
    loss, param = _errors(results[case], references[model_name])
    print(f"{case}: losses {loss:.1e}, parameters {param:.1e}")
    # measured: losses at most 1.4e-7, parameters at most 6.5e-6 (float32 Newton–Schulz;
    # the transformers families' attention output projections, see docs/optimizers.md)
    assert loss < RTOL, f"{case}: loss off by {loss:.2e}"
    assert param < RTOL, f"{case}: parameters off by {param:.2e}"


def test_pipeline_stages_equal_one_process(ranks: list[dict], references: dict) -> None:  # type: ignore[type-arg]
    for r in ranks:
        loss, param = _errors(r["llama_pp2_dp2"], references["llama"], stage=True)
        # measured: losses 6.9e-8, parameters 4.6e-6 on stage 0's ranks
        assert loss < RTOL and param < RTOL, (loss, param)
    stages = {frozenset(r["llama_pp2_dp2"]["params"]) for r in ranks}
    assert len(stages) == 2 and set().union(*stages) == set(references["llama"]["params"])
    matrices = {n for r in ranks for n in r["llama_pp2_dp2"]["matrix_names"]}
    job = sum(r["llama_pp2_dp2"]["newton_schulz"] for r in ranks)
    assert len(matrices) == 14 and job == 14 * STEPS, (len(matrices), job)


def test_local_shards_are_wrong(results: dict, references: dict) -> None:  # type: ignore[type-arg]
    _, param = _errors(results["mlp_local_shards"], references["mlp"])
    # measured: 4e-2 (the issue measured 4.1e-2 on its 32-72-40-24 MLP)
    assert 1e-2 < param < 1e-1, f"Newton–Schulz on local shards: {param:.2e}"


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] is None])
def test_newton_schulz_once_per_matrix_in_the_job(case: str, ranks: list[dict]) -> None:  # type: ignore[type-arg]
    per_rank = [r[case]["newton_schulz"] for r in ranks]
    matrices = ranks[0][case]["matrices"]
    assert sum(per_rank) == matrices * STEPS, f"{case}: {per_rank} runs per rank"
    assert sum(1 for n in per_rank if n) > 1, f"{case}: every matrix on one owner {per_rank}"


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] is None])
def test_owners_run_newton_schulz_at_the_same_time(case: str, ranks: list[dict]) -> None:  # type: ignore[type-arg]
    """In each step every rank makes all its gathers before any Newton–Schulz, and its
    scatters and broadcasts after: no owner waits for another owner's results before
    starting its own (bucket by bucket, the step would take the sum of the owners' work)."""
    for rank, r in enumerate(ranks):
        order = r[case]["order"]
        assert len(order) == STEPS, (case, rank, order)
        for step in order:
            assert re.fullmatch("g*n*s*b*", step), f"{case}: rank {rank} made {step}"
    assert any("gn" in r[case]["order"][0] for r in ranks[1:]) or case == "mlp_ddp", case


def test_traffic_is_bucketed_by_owner(ranks: list[dict]) -> None:  # type: ignore[type-arg]
    """One gather and one scatter per owner and step (4 owners for the llama's 14 matrices),
    not one per matrix; under hybrid each rank gathers only where the owner is in its
    replica, and every rank receives each matrix's part by one broadcast per owner."""
    for r in ranks:
        full = r["llama_full_shard"]["collectives"]
        assert full == {"gather": 4 * STEPS, "scatter": 4 * STEPS}, full
        hybrid = r["llama_hybrid_2x2"]["collectives"]
        assert hybrid["broadcast"] == 4 * STEPS, hybrid
        assert hybrid["gather"] == hybrid["scatter"] == 2 * STEPS, hybrid
        assert r["mlp_ddp"]["collectives"] == {"broadcast": 3 * STEPS}


@pytest.mark.parametrize("case", [c[0] for c in CASES if "tp2" in c[0]])
def test_tp_layouts_are_real(case: str, results: dict) -> None:  # type: ignore[type-arg]
    """Under dp 2 x tp 2 the attention and MLP matrices are cut over tp (LoRA: its B
    beside a colwise base, its A beside a rowwise one), so orthogonalising them whole is
    not a copy's work."""
    split = results[case]["tp_split"]
    matrices = set(results[case]["matrix_names"])
    least = {"mlp": 2, "lora": 6}.get(case.split("_")[0], 14)  # lora: 2 layers x 3 adapters
    assert len(matrices & set(split)) >= least, (case, sorted(matrices & set(split)))


def test_each_expert_is_a_matrix_of_its_own(results: dict) -> None:  # type: ignore[type-arg]
    for case in ("mixtral_full_shard", "mixtral_hybrid_2x2", "mixtral_ep2"):
        names = results[case]["matrix_names"]
        assert sum(".experts." in n for n in names) == 4, names  # 2 layers x 2 stacks
        assert results[case]["matrices"] == 8 + 4 * 4  # 8 attention matrices, 16 experts'


def test_checkpoint_moves_between_layouts(results: dict, references: dict) -> None:  # type: ignore[type-arg]
    """Saved under full_shard, loaded under hybrid 2 x 2: the momentum exact, and the next
    step equal to one process's third."""
    ckpt = results["checkpoint"]
    assert set(ckpt["saved"]) == set(ckpt["loaded"]) == {"0.weight", "2.weight", "4.weight"}
    for name, buf in ckpt["saved"].items():
        assert torch.equal(ckpt["loaded"][name], buf), name
        assert buf.abs().sum() > 0, name  # a real momentum, not zeros on both sides
    _, param = _errors(
        {"losses": [], "params": ckpt["params"]}, {**references["mlp"], "losses": []}
    )
    assert param < RTOL, f"after the resumed step: {param:.2e}"  # measured: 2.0e-7


@pytest.mark.parametrize("where", ["full_shard", "ddp", "one_process"])
def test_checkpoint_moves_from_world_4_to_2_and_1(
    where: str, results: dict, other_worlds: dict
) -> None:  # type: ignore[type-arg]
    """Saved at world 4 under dp 2 x tp 2 (both matrices cut over tp), loaded at world 2
    (full_shard, ddp) and in one process: every momentum buffer exact (Muon's and the
    SGD fallback's), and the third step equal to three uninterrupted ones in one process."""
    saved, loaded = results["checkpoint_tp"], other_worlds[where]
    assert set(saved["tp_split"]) >= {"0.weight", "0.bias", "2.weight"}, saved["tp_split"]
    assert set(saved["buffers"]) == set(loaded["buffers"]) == set(saved["params"])
    for name, buf in saved["buffers"].items():
        assert torch.equal(loaded["buffers"][name], buf), (where, name)
        assert buf.abs().sum() > 0, name  # a real momentum, not zeros on both sides
    whole = resume_uninterrupted()
    worst = worst_of(float((loaded["params"][n] - w).norm() / w.norm()) for n, w in whole.items())
    print(f"checkpoint dp 2 x tp 2 at world 4 -> {where}: the third step off by {worst:.1e}")
    assert worst < RTOL, f"{where}: after the resumed step {worst:.2e}"  # measured: 2.2e-7


def resume_uninterrupted() -> dict[str, torch.Tensor]:
    model = biased_mlp()
    opt = shardwise.Muon(
        model.named_parameters(),
        **MUON,
        fallback=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    for b in batches("mlp"):
        opt.zero_grad(set_to_none=True)
        loss_of("mlp", model, b).backward()
        opt.step()
    return {n: _full(p) for n, p in model.named_parameters()}


def test_lora_a_and_b_are_matrices_of_their_own(results: dict) -> None:  # type: ignore[type-arg]
    names = results["lora_full_shard"]["matrix_names"]
    assert len(names) == 12  # 2 layers x (q_proj, v_proj, down_proj) x (A, B)
    assert sum("lora_A" in n for n in names) == sum("lora_B" in n for n in names) == 6


def test_engine_takes_muon_and_refuses_torch_muon(results: dict) -> None:  # type: ignore[type-arg]
    assert results["engine"]["optimizer"] == "Muon"
    assert "shardwise.Muon" in results["torch_muon"], results["torch_muon"]
    assert "torch.optim.Muon" in results["torch_muon"]
