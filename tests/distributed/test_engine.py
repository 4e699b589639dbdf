"""Engine in a running job: accumulation and clipping parity, no needless syncs, predictions,
the OpenMMLab contract, fp16 skipping, and the before-wrapping optimizer error.

Reference: one process trains on the whole global batch (k micro-batches x N ranks worth of
samples) with plain torch: loss, global grad norm (clip_grad_norm_), AdamW step.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise import Engine, ParallelConfig, TrainConfig, unwrap, wrap
from shardwise.testing import count_collectives, count_host_syncs, run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import worst_of

CFG = GPTConfig()
STEPS, GLOBAL_BATCH, K = 3, 8, 2
RTOL = 1e-5
CLIP = 0.05  # well below the ~0.7 gradient norm: clipping is active every step
# Clipped gradients are compared directly at this max_norm: clipping a second time scales
# them by max_norm / (max_norm + 1e-6), a 1e-3 change, 100x the fp32 tolerance.
TINY_CLIP = 1e-3
HUGE_CLIP = 1e3  # far above the norm: clipping must change nothing
build = functools.partial(GPT, CFG)
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
# Clipping is checked under SGD: AdamW is invariant to a uniform gradient scale, so clipped
# and unclipped AdamW updates are nearly identical and would prove little.
sgd = functools.partial(torch.optim.SGD, lr=0.5)


class Poisonable(GPT):
    """Returns an infinite loss while `poison` is set (to force an fp16 overflow)."""

    poison = False

    def forward(self, idx, targets=None):
        loss = super().forward(idx, targets)
        return loss * float("inf") if self.poison else loss


def reference(data, max_grad_norm=None, optimizer=adamw):
    torch.manual_seed(0)
    model = build()
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return {"losses": losses, "norms": norms, "params": _full_params(model)}


def _full_params(model):
    out = {}
    for name, p in unwrap(model).named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def _micro_batches(batch, k):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch[0].shape[0] // world
    mine = [t[rank * per : (rank + 1) * per] for t in batch]
    m = per // k
    return [tuple(t[i * m : (i + 1) * m] for t in mine) for i in range(k)]


def engine_run(data, parallel, train, count=False, optimizer=adamw, optim_wrapper=False):
    if optim_wrapper:  # mmengine's OptimWrapper carries accumulation and clipping instead
        from mmengine.optim import OptimWrapper

        torch.manual_seed(0)
        model = wrap(build(), parallel)
        clip = {"max_norm": train.max_grad_norm} if train.max_grad_norm else None
        wrapper = OptimWrapper(
            optimizer(model.parameters()),
            accumulative_counts=train.accumulate_steps,
            clip_grad=clip,
        )
        engine = Engine(model, wrapper)
    else:
        torch.manual_seed(0)
        engine = Engine(build(), optimizer, parallel, train=train)
    hook_calls = []
    if count and parallel.strategy == "ddp":

        def hook(state, bucket):
            hook_calls.append(1)
            return default_hooks.allreduce_hook(None, bucket)

        engine.model.register_comm_hook(None, hook)
    losses, norms, comms = [], [], []
    for batch in data:
        for i, micro in enumerate(_micro_batches(batch, train.accumulate_steps)):
            before = len(hook_calls)
            with count_collectives(("reduce_scatter_single", "all_reduce")) as counts:
                logs = engine.train_step(micro)
            last = i == train.accumulate_steps - 1
            # all_reduce on the last micro-step includes the engine's own log/norm reductions.
            comms.append((last, sum(counts.values()) + len(hook_calls) - before))
        losses.append(logs["loss"])
        norms.append(logs["grad_norm"])
    return {"losses": losses, "norms": norms, "params": _full_params(engine.model), "comms": comms}


def predictions(data):
    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    engine = Engine(build(), adamw, ParallelConfig(strategy="full_shard"))
    x = data[0][0]
    got = engine.val_step((x,))
    test = engine.test_step((x,))
    want = plain(x)
    return {
        "val": float((got - want).abs().max()),
        "test": float((test - want).abs().max()),
        "still_training": engine.model.training,
    }


class MMToy(nn.Module):
    """OpenMMLab-style: data_preprocessor + forward(inputs, data_samples, mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def data_preprocessor(self, data, training):
        return {"inputs": data["img"] * 2.0, "data_samples": data["label"]}

    def forward(self, inputs, data_samples=None, mode="tensor"):
        logits = self.head(torch.relu(self.backbone(inputs)))
        if mode == "loss":
            losses = {
                "loss_cls": nn.functional.cross_entropy(logits, data_samples),
                "loss_reg": [logits.pow(2).mean() * 0.01, logits.abs().mean() * 0.01],
                "acc": (logits.argmax(-1) == data_samples).float().mean(),
            }
            return losses, logits.detach()  # mmpose/mmseg: predictions passed through
        return logits.argmax(-1)


def openmmlab():
    torch.manual_seed(0)
    engine = Engine(MMToy(), adamw, ParallelConfig())
    g = torch.Generator().manual_seed(dist.get_rank())
    data = {"img": torch.randn(6, 4, generator=g), "label": torch.randint(0, 3, (6,), generator=g)}
    logs = engine.train_step(data)
    preds = engine.val_step(data)
    return {
        "keys": sorted(logs),
        "vis_passed": logs["vis_preds"].shape == (6, 3),
        "pred_shape": tuple(preds.shape),
    }


def fp16_skip(data):
    torch.manual_seed(0)
    engine = Engine(Poisonable(CFG), adamw, ParallelConfig(mixed_precision="fp16"))
    out = []
    for step, batch in enumerate(data):
        unwrap(engine.model).poison = dist.get_rank() == 0 and step == 1
        before = _full_params(engine.model)
        logs = engine.train_step(_micro_batches(batch, 1)[0])
        changed = any(not torch.equal(before[n], p) for n, p in _full_params(engine.model).items())
        out.append({"skipped": logs["skipped"], "changed": changed, "scale": logs["loss_scale"]})
    return out


class NaNOnRank1(GPT):
    """Its loss is NaN on the second forward, on rank 1 only."""

    calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        loss = super().forward(idx, targets)
        bad = self.calls == 2 and dist.get_rank() == 1
        return loss * float("nan") if bad else loss


def nonfinite(data, strategy, on_nonfinite):
    """Steps 1-3, the loss NaN at step 2 on rank 1: what each rank saw."""
    import warnings

    torch.manual_seed(0)
    engine = Engine(
        NaNOnRank1(CFG),
        adamw,
        ParallelConfig(strategy=strategy),
        train=TrainConfig(on_nonfinite=on_nonfinite),
    )
    out: dict = {"changed": [], "skipped": []}
    for batch in data:
        before = _full_params(engine.model)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logs = engine.train_step(_micro_batches(batch, 1)[0])
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            break
        out["warnings"] = out.get("warnings", []) + [str(w.message) for w in caught]
        after = _full_params(engine.model)
        out["changed"].append(any(not torch.equal(before[n], after[n]) for n in before))
        out["skipped"].append(logs["skipped"])
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in _full_params(engine.model).values())
    out["step"] = engine.step
    return out


def early_optimizer():
    model = build()
    opt = torch.optim.AdamW(model.parameters())  # built before wrapping: the classic mistake
    try:
        Engine(model, opt, ParallelConfig(strategy="full_shard"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def local_norm_clipping(data):
    """Wrong on purpose: each rank clips by the norm of its own gradient shards only."""
    torch.manual_seed(0)
    engine = Engine(build(), sgd, ParallelConfig(strategy="full_shard"))
    losses, norms = [], []
    for batch in data:
        loss = engine.forward(_micro_batches(batch, 1)[0])
        loss.backward()
        grads = [p.grad.to_local() for p in engine.model.parameters() if p.grad is not None]
        local = torch.stack([g.norm() for g in grads]).norm()
        for g in grads:
            g.mul_(min(1.0, CLIP / (float(local) + 1e-6)))
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
        norms.append(float(local))
    return {"losses": losses, "norms": norms, "params": _full_params(engine.model)}


def _named_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient in full (a collective for DTensors: call on every rank)."""
    out = {}
    for name, p in unwrap(model).named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    return out


def clipped_grads(data, strategy):
    """The gradients the optimizer steps with, after the Engine's clipping, per update."""
    torch.manual_seed(0)
    engine = Engine(
        build(), sgd, ParallelConfig(strategy=strategy), train=TrainConfig(max_grad_norm=TINY_CLIP)
    )
    seen = []
    engine.optimizer.register_step_pre_hook(lambda *_: seen.append(_named_grads(engine.model)))
    for batch in data[:2]:
        engine.train_step(_micro_batches(batch, 1)[0])
    return seen


def reference_clipped_grads(data, clips=1):
    torch.manual_seed(0)
    model = build()
    opt = sgd(model.parameters())
    seen = []
    for x, y in data[:2]:
        opt.zero_grad()
        model(x, y).backward()
        for _ in range(clips):
            torch.nn.utils.clip_grad_norm_(model.parameters(), TINY_CLIP)
        seen.append(_named_grads(model))
        opt.step()
    return seen


def _grads_rel(got, want) -> float:
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    return worst_of(
        float((g[n] - w[n]).norm() / w[n].norm()) for g, w in zip(got, want, strict=True) for n in w
    )


SYNC_K = 4


def host_syncs(data, strategy):
    """Host syncs of each train_step outside optimizer.step: accumulation 4, clipping on."""
    torch.manual_seed(0)
    engine = Engine(
        build(),
        adamw,
        ParallelConfig(strategy=strategy),
        train=TrainConfig(accumulate_steps=SYNC_K, max_grad_norm=CLIP),
    )
    per_call = []
    with count_host_syncs() as syncs:
        engine.optimizer.register_step_pre_hook(lambda *_: setattr(syncs, "paused", True))
        engine.optimizer.register_step_post_hook(lambda *_: setattr(syncs, "paused", False))
        for batch in data[:2]:
            for micro in _micro_batches(batch, SYNC_K):
                before = dict(syncs)
                logs = engine.train_step(micro)
                per_call.append(
                    (
                        "grad_norm" in logs,
                        {k: v - before.get(k, 0) for k, v in syncs.items() if v - before.get(k, 0)},
                    )
                )
    return {"per_call": per_call, "steps": engine.step}


def mmengine_own_update(data):
    """mmengine's own OptimWrapper.update_params on a sharded model: its clip_grad_norm_
    call is what shardwise replaces."""
    from mmengine.optim import OptimWrapper

    torch.manual_seed(0)
    model = wrap(build(), ParallelConfig(strategy="full_shard"))
    wrapper = OptimWrapper(sgd(model.parameters()), clip_grad={"max_norm": CLIP})
    losses, norms = [], []
    for batch in data:
        loss = model(*_micro_batches(batch, 1)[0])
        wrapper.update_params(loss)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
        norms.append(float(wrapper.message_hub.get_scalar("train/grad_norm").current()))
    return {"losses": losses, "norms": norms, "params": _full_params(model)}


def world2_cases(data):
    out = {}
    for s in ("ddp", "full_shard"):
        p = ParallelConfig(strategy=s)
        out[f"accum_{s}"] = engine_run(data, p, TrainConfig(accumulate_steps=K), count=True)
        out[f"clip_{s}"] = engine_run(data, p, TrainConfig(max_grad_norm=CLIP), optimizer=sgd)
        out[f"accum_clip_{s}"] = engine_run(
            data, p, TrainConfig(accumulate_steps=K, max_grad_norm=CLIP), optimizer=sgd
        )
        out[f"optim_wrapper_{s}"] = engine_run(
            data,
            p,
            TrainConfig(accumulate_steps=K, max_grad_norm=CLIP),
            optimizer=sgd,
            optim_wrapper=True,
        )
        out[f"clip_above_{s}"] = engine_run(
            data, p, TrainConfig(max_grad_norm=HUGE_CLIP), optimizer=sgd
        )
        out[f"clip_grads_{s}"] = clipped_grads(data, s)
    out["wrong_local_clip"] = local_norm_clipping(data)
    for s in ("ddp", "full_shard"):
        out[f"syncs_{s}"] = host_syncs(data, s)
    out["mmengine_own_update"] = mmengine_own_update(data)
    out["accum_sync_each"] = engine_run(
        data,
        ParallelConfig(),
        TrainConfig(accumulate_steps=K, sync_each_microbatch=True),
        count=True,
    )
    out["accum_offload"] = engine_run(
        data, ParallelConfig(cpu_offload=True), TrainConfig(accumulate_steps=K)
    )
    out["predictions"] = predictions(data)
    out["openmmlab"] = openmmlab()
    out["fp16"] = fp16_skip(data)
    out["early_optimizer"] = early_optimizer()
    for strategy in ("ddp", "full_shard"):
        for mode in ("stop", "skip"):
            out[f"nonfinite_{strategy}_{mode}"] = nonfinite(data, strategy, mode)
    return out


def world4_cases(data):
    p = ParallelConfig(strategy="hybrid_shard")
    return {
        "accum_hybrid_shard": engine_run(data, p, TrainConfig(accumulate_steps=K), count=True),
        "clip_hybrid_shard": engine_run(
            data, p, TrainConfig(accumulate_steps=K, max_grad_norm=CLIP), optimizer=sgd
        ),
    }


@pytest.fixture(scope="module")
def data():
    return random_lm_batches(CFG, STEPS, GLOBAL_BATCH * 2, seed=3)  # divisible by k x 4 ranks


@pytest.fixture(scope="module")
def world2(data):
    return run_distributed(world2_cases, 2, args=(data,), timeout_s=240)


@pytest.fixture(scope="module")
def world4(data):
    return run_distributed(world4_cases, 4, args=(data,), timeout_s=240)


def _assert_matches(ref, got, label):
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"{label}: loss step {step}: {a} vs {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"{label}: grad norm step {step}: {a} vs {b}"
    for name, want in ref["params"].items():
        rel = float((got["params"][name] - want).norm() / want.norm())
        assert rel <= RTOL, f"{label}: {name} rel {rel:.2e}"


@pytest.mark.parametrize(
    "case",
    ["accum_ddp", "accum_full_shard", "accum_sync_each", "accum_offload", "accum_hybrid_shard"],
)
def test_accumulation_equals_one_big_batch(world2, world4, data, case):
    results = world4 if "hybrid" in case else world2
    ref = reference(data)
    for rank, r in enumerate(results):
        _assert_matches(ref, r[case], f"{case} rank {rank}")


@pytest.mark.parametrize(
    "case",
    ["clip_ddp", "clip_full_shard", "accum_clip_ddp", "accum_clip_full_shard", "clip_hybrid_shard"],
)
def test_clipping_uses_the_true_global_norm(world2, world4, data, case):
    results = world4 if "hybrid" in case else world2
    ref = reference(data, max_grad_norm=CLIP, optimizer=sgd)
    assert min(ref["norms"]) > 5 * CLIP  # clipping really happened
    for rank, r in enumerate(results):
        _assert_matches(ref, r[case], f"{case} rank {rank}")


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_mmengine_optim_wrapper_accumulates_and_clips_by_the_global_norm(world2, data, strategy):
    ref = reference(data, max_grad_norm=CLIP, optimizer=sgd)
    for rank, r in enumerate(world2):
        _assert_matches(ref, r[f"optim_wrapper_{strategy}"], f"OptimWrapper {strategy} rank {rank}")
        comms = r[f"optim_wrapper_{strategy}"]["comms"]
        assert [c for last, c in comms if not last] == [0] * (len(comms) // K)


def test_mmengine_own_update_params_on_fsdp2_matches_too(world2, data):
    # Measured, not assumed: torch 2.13's clip_grad_norm_ reduces DTensor gradient norms over
    # the mesh, so mmengine's own clip on FSDP2 shards also uses the global norm here. The
    # Engine still clips with its own total_grad_norm (ignored, non-DTensor gradients count).
    ref = reference(data, max_grad_norm=CLIP, optimizer=sgd)
    _assert_matches(ref, world2[0]["mmengine_own_update"], "mmengine own update_params")


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_clipping_above_the_norm_changes_nothing(world2, data, strategy):
    ref = reference(data, optimizer=sgd)  # unclipped
    assert max(ref["norms"]) < HUGE_CLIP / 100
    for rank, r in enumerate(world2):
        _assert_matches(ref, r[f"clip_above_{strategy}"], f"max_norm above the norm rank {rank}")


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_clipped_update_equals_one_process(world2, data, strategy):
    once = reference_clipped_grads(data)
    for rank, r in enumerate(world2):
        rel = _grads_rel(r[f"clip_grads_{strategy}"], once)
        assert rel <= RTOL, f"{strategy} rank {rank}: clipped gradients rel {rel:.2e}"
    # The same check catches clipping applied twice, by far more than its tolerance.
    assert _grads_rel(reference_clipped_grads(data, clips=2), once) > 50 * RTOL


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_one_host_sync_per_update_none_per_micro_step(world2, strategy):
    # Before: float() of every log on each micro-step, and 8 syncs per update (the norm,
    # the non-finite check, the reduced means, clipping's coefficient).
    for rank, r in enumerate(world2):
        got = r[f"syncs_{strategy}"]
        assert got["steps"] == 2
        micro = [calls for updated, calls in got["per_call"] if not updated]
        updates = [calls for updated, calls in got["per_call"] if updated]
        assert len(micro) == 2 * (SYNC_K - 1) and len(updates) == 2
        assert all(calls == {} for calls in micro), (rank, micro)
        assert all(sum(calls.values()) <= 1 for calls in updates), (rank, updates)


def test_the_sync_counter_sees_a_sync():
    x = torch.ones(3)
    with count_host_syncs() as syncs:
        float(x.sum())
        x.tolist()
        x.cpu()
        x.to("cpu", non_blocking=True)  # does not wait
        syncs.paused = True
        x[0].item()  # not counted
    assert dict(syncs) == {"__float__": 1, "tolist": 1, "cpu": 1}


def test_clipping_check_catches_local_norm_clipping(world2, data):
    # The silent bug of clipping each shard by its local norm is caught by the same check.
    ref = reference(data, max_grad_norm=CLIP, optimizer=sgd)
    with pytest.raises(AssertionError, match="local norm clipping: loss step 1"):
        _assert_matches(ref, world2[0]["wrong_local_clip"], "local norm clipping")
    with pytest.raises(AssertionError, match="unclipped"):
        _assert_matches(reference(data, optimizer=sgd), world2[0]["clip_full_shard"], "unclipped")


@pytest.mark.parametrize("case", ["accum_ddp", "accum_full_shard", "accum_hybrid_shard"])
def test_no_gradient_collective_before_the_last_micro_batch(world2, world4, case):
    results = world4 if "hybrid" in case else world2
    for r in results:
        comms = r[case]["comms"]
        assert [c for last, c in comms if not last] == [0] * (len(comms) // K)
        assert all(c > 0 for last, c in comms if last)


def test_sync_each_microbatch_communicates_every_time(world2):
    # Same numbers as deferred sync (checked above), but a reduction on every micro-batch.
    for r in world2:
        comms = r["accum_sync_each"]["comms"]
        assert all(c > 0 for _, c in comms), comms


def test_val_and_test_predictions_equal_unsharded_model(world2):
    for r in world2:
        p = r["predictions"]
        assert p["val"] <= 1e-5 and p["test"] <= 1e-5, p
        assert p["still_training"] is True  # eval mode is restored after predicting


def test_openmmlab_contract(world2):
    for r in world2:
        assert r["openmmlab"] == {
            "keys": [
                "acc",
                "grad_norm",
                "loss",
                "loss_cls",
                "loss_reg",
                "lr",
                "skipped",
                "stop",
                "vis_preds",
            ],
            "vis_passed": True,
            "pred_shape": (6,),
        }


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world2):
    for rank, r in enumerate(world2):
        steps = r["fp16"]
        assert [s["skipped"] for s in steps] == [0.0, 1.0, 0.0], (rank, steps)
        assert [s["changed"] for s in steps] == [True, False, True], (rank, steps)
        assert steps[1]["scale"] == steps[0]["scale"] / 2  # the scale backed off


def test_optimizer_built_before_wrapping(world2):
    for r in world2:
        assert "the optimizer holds" in r["early_optimizer"]
        assert "it was built before wrapping" in r["early_optimizer"]
        assert "Pass a factory instead" in r["early_optimizer"]


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_nan_loss_on_rank_1_stops_every_rank_naming_the_step_and_rank(world2, strategy):
    for r in world2:
        got = r[f"nonfinite_{strategy}_stop"]
        assert got["changed"] == [True] and got["step"] == 1, got  # stopped at step 2
        assert got["error"].startswith("NonFiniteError: Engine: non-finite loss or gradient ")
        assert "at optimizer step 2 on " in got["error"]
        assert "rank 1: grad_norm, loss" in got["error"]  # the rank whose loss was NaN
        assert "Training stopped on every rank (TrainConfig.on_nonfinite='stop')" in got["error"]


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_nan_loss_on_rank_1_with_skip_drops_that_update_everywhere(world2, strategy):
    for rank, r in enumerate(world2):
        got = r[f"nonfinite_{strategy}_skip"]
        assert "error" not in got, got
        assert got["skipped"] == [0.0, 1.0, 0.0] and got["changed"] == [True, False, True]
        assert got["finite"] and got["step"] == 2
        warned = [w for w in got["warnings"] if "update was skipped" in w]
        assert len(warned) == (1 if rank == 0 else 0), got["warnings"]  # rank 0 speaks
        if rank == 0:
            assert "at optimizer step 2" in warned[0] and "rank 1: grad_norm, loss" in warned[0]
