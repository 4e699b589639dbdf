"""Context parallel without processes: the config's refusals, the mesh's degrees, the mask
Ulysses builds from the global layout, the KV heads it repeats, and what the hook hands
the model (checked on a rank's chunk with no process group: cutting needs none)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise import ParallelConfig
from shardwise.distributed.mesh import resolve_mesh
from shardwise.parallelize import context
from shardwise.parallelize.context import ContextLayout, Cutter
from shardwise.parallelize.ulysses import _mask, _repeat_kv, check_context_parallel

transformers = pytest.importorskip("transformers")

SEQ = 8
COMMON = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


# --- config ----------------------------------------------------------------------------


def test_every_cp_field_is_checked_and_what_is_not_built_is_refused():
    assert ParallelConfig(cp=2).cp_style == "auto"
    assert ParallelConfig(cp=2, cp_style="ulysses", cp_load_balance=False).cp == 2
    with pytest.raises(ValueError, match=r"ParallelConfig.cp=0 must be >= 1"):
        ParallelConfig(cp=0)
    with pytest.raises(ValueError, match=r"cp_style='rings' is not valid.*'auto', 'ulysses'"):
        ParallelConfig(cp=2, cp_style="rings")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cp_load_balance='yes' is not valid"):
        ParallelConfig(cp=2, cp_load_balance="yes")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"cp_style='ring' \(cp=2\) is not built yet"):
        ParallelConfig(cp=2, cp_style="ring")
    assert ParallelConfig(cp=1, cp_style="ring").cp == 1  # nothing to run at cp 1
    with pytest.raises(ValueError, match=r"cp_load_balance=True with cp_style='auto'.*nothing"):
        ParallelConfig(cp=2, cp_load_balance=True)
    with pytest.raises(ValueError, match=r"cp=2 with strategy='ddp'.*'no_shard'"):
        ParallelConfig(cp=2, strategy="ddp")
    assert ParallelConfig(cp=2, tp=2).tp == 2  # built: Ulysses over the heads tp leaves
    assert ParallelConfig(cp=2, pp=2).pp == 2  # built: the step cuts the whole batch
    assert ParallelConfig(cp=2, ep=2).ep == 2  # built: an ep group takes whole cp groups
    unbuilt = [
        ({"tp": 2, "sequence_parallel": True}, "sequence_parallel"),
        ({"tp": 2, "loss_parallel": True}, "loss_parallel"),
        ({"strategy": "auto"}, "strategy='auto'"),
        ({"compile": True}, "compile"),
    ]
    for fields, what in unbuilt:
        with pytest.raises(NotImplementedError, match=rf"cp=2 with {what} is not built yet"):
            ParallelConfig(cp=2, **fields)
    with pytest.raises(NotImplementedError, match=r"cp=2 with a device_mesh of your own"):
        ParallelConfig(cp=2, device_mesh=object())  # type: ignore[arg-type]


# --- mesh ------------------------------------------------------------------------------


def test_cp_ranks_sit_between_the_shard_ranks_and_tp():
    spec = resolve_mesh("full_shard", -1, 8, cp=2)
    assert (spec.dp_replicate, spec.dp_shard, spec.cp, spec.world_size) == (1, 4, 2, 8)
    assert spec.dp_size == 4  # the cp ranks of a group read the same rows
    assert "4 shard rank(s) x cp 2 = world 8" in str(spec)
    four = resolve_mesh("full_shard", -1, 8, cp=4)
    assert (four.dp_shard, four.cp, four.dp_size) == (2, 4, 2)
    # hybrid: each replica shards over its cp ranks when the rest has no 2-D split
    hybrid = resolve_mesh("hybrid_shard", -1, 4, cp=2)
    assert (hybrid.dp_replicate, hybrid.dp_shard, hybrid.cp) == (2, 1, 2)
    wide = resolve_mesh("hybrid_shard", -1, 16, local_world_size=8, cp=2)
    assert (wide.dp_replicate, wide.dp_shard, wide.cp) == (2, 4, 2)  # a node's 4 x cp 2
    # 4 ranks a node: a shard group of 2 x cp 2 fills one node; one of 4 would span two
    narrow = resolve_mesh("hybrid_shard", -1, 16, local_world_size=4, cp=2)
    assert (narrow.dp_replicate, narrow.dp_shard, narrow.cp) == (4, 2, 2)
    ones = resolve_mesh("hybrid_shard", 1, 8, cp=2)
    assert (ones.dp_replicate, ones.dp_shard) == (4, 1)
    replicas = resolve_mesh("no_shard", -1, 4, cp=2)
    assert (replicas.dp_replicate, replicas.dp_shard, replicas.engine) == (2, 1, "fsdp")
    with pytest.raises(
        ValueError, match=r"cp=4 does not divide the job's 6 rank\(s\).*\[2, 3, 6\]"
    ):
        resolve_mesh("full_shard", -1, 6, cp=4)
    with pytest.raises(ValueError, match=r"dp_shard=3 with strategy='full_shard'"):
        resolve_mesh("full_shard", 3, 8, cp=2)  # dp_shard counts data ranks, not cp's
    with_tp = resolve_mesh("full_shard", -1, 8, cp=2, tp=2)
    assert (with_tp.dp_shard, with_tp.cp, with_tp.tp, with_tp.dp_size) == (2, 2, 2, 2)
    assert "2 shard rank(s) x cp 2 x tp 2 = world 8" in str(with_tp)
    hybrid_tp = resolve_mesh("hybrid_shard", -1, 8, cp=2, tp=2)
    assert (hybrid_tp.dp_replicate, hybrid_tp.dp_shard, hybrid_tp.tp) == (2, 1, 2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide"):
        resolve_mesh("full_shard", -1, 4, cp=2, tp=4)
    stages = resolve_mesh("full_shard", -1, 8, cp=2, pp=2)
    assert (stages.pp, stages.dp_shard, stages.cp, stages.dp_size) == (2, 2, 2, 2)
    hybrid_stages = resolve_mesh("hybrid_shard", -1, 8, cp=2, pp=2)
    assert (hybrid_stages.pp, hybrid_stages.dp_replicate, hybrid_stages.dp_shard) == (2, 2, 1)
    assert resolve_mesh("full_shard", -1, 16, cp=2, pp=2, tp=2).world_size == 16
    # experts: an ep group is ep // cp shard ranks with their cp ranks
    for world, ep, shard in ((4, 2, 2), (4, 4, 1), (8, 2, 4), (8, 4, 2), (8, 8, 1)):
        experts = resolve_mesh("full_shard", -1, world, cp=2, ep=ep)
        assert (experts.ep, experts.ep_shard, experts.ep_borrows_tp) == (ep, shard, False)
    with pytest.raises(ValueError, match=r"ep=3 with cp=2: an ep group takes whole cp groups"
                       r".*Choose ep in \[2, 4, 8\]"):  # fmt: skip
        resolve_mesh("full_shard", -1, 8, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep=2 with cp=4.*Choose ep in \[4, 8\]"):
        resolve_mesh("full_shard", -1, 8, cp=4, ep=2)
    with pytest.raises(ValueError, match=r"ep=4 with cp=2.*and not with tp yet"):
        resolve_mesh("full_shard", -1, 8, cp=2, ep=4, tp=2)


# --- what Ulysses holds -----------------------------------------------------------------


def test_what_ulysses_cannot_hold_is_refused_before_any_group():
    check_context_parallel(llama(), 4)  # 4 heads, 2 KV heads (repeated): fine
    check_context_parallel(llama(), 2, tp=2)  # 4 heads: 2 per tp rank, 1 per rank after cp
    with pytest.raises(ValueError, match=r"num_attention_heads / \(tp x cp\).*its 4 heads do "
                       r"not divide by tp x cp = 2 x 4\. Choose cp in \[2\]"):  # fmt: skip
        check_context_parallel(llama(), 4, tp=2)
    with pytest.raises(ValueError, match=r"cp=3: .*its 4 heads do not divide by 3.*\[2, 4\]"):
        check_context_parallel(llama(), 3)
    capped = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**COMMON, head_dim=4, attn_logit_softcapping=50.0)
    )
    with pytest.raises(NotImplementedError, match=r"caps its attention scores.*50\.0"):
        check_context_parallel(capped, 2)
    sinks = llama()
    sinks.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(4))
    with pytest.raises(NotImplementedError, match=r"attention sinks \(model.layers.0.self_attn"):
        check_context_parallel(sinks, 2)
    check_context_parallel(nn.Linear(2, 2), 2)  # a model of its own: checked at its forward


def _brute(layout: ContextLayout, causal: bool, window: int | None) -> torch.Tensor:
    rows = 1 if layout.documents is None and layout.keep is None else 2
    out = torch.zeros(rows, 1, layout.seq_len, layout.seq_len, dtype=torch.bool)
    for b in range(rows):
        for q in range(layout.seq_len):
            for k in range(layout.seq_len):
                ok = k <= q if causal else True
                if window:
                    ok = ok and abs(q - k) < window
                if layout.documents is not None:
                    ok = ok and bool(layout.documents[b, q] == layout.documents[b, k])
                if layout.keep is not None:
                    ok = ok and bool(layout.keep[b, k])
                out[b, 0, q, k] = ok or q == k
    return out


def test_the_mask_is_the_models_at_sizes_where_the_wrong_ones_differ():
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    cpu = torch.device("cpu")
    for docs, kept in ((None, None), (documents, None), (None, keep), (documents, keep)):
        for causal in (True, False):
            for window in (None, 3):
                layout = ContextLayout(None, 2, 0, SEQ, docs, kept)  # type: ignore[arg-type]
                got = _mask(layout, causal, window, cpu)
                if got is None:  # SDPA's own is_causal, or nothing masked
                    assert docs is None and kept is None and window is None
                    continue
                assert torch.equal(got.expand(_brute(layout, causal, window).shape),
                                   _brute(layout, causal, window)), (docs, kept, causal, window)  # fmt: skip


def test_kv_heads_are_repeated_within_their_query_groups():
    torch.manual_seed(0)
    q = torch.randn(1, 8, 5, 4)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for cp in (1, 2, 4, 8):
        k2, v2 = _repeat_kv(k, 8, cp), _repeat_kv(v, 8, cp)
        assert k2.shape[1] % cp == 0 and 8 % k2.shape[1] == 0
        got = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got, want)
        # each rank's slice of the query heads reads its own slice of the KV heads
        per_q, per_kv = 8 // cp, k2.shape[1] // cp
        for r in range(cp):
            part = F.scaled_dot_product_attention(
                q[:, r * per_q : (r + 1) * per_q], k2[:, r * per_kv : (r + 1) * per_kv],
                v2[:, r * per_kv : (r + 1) * per_kv], is_causal=True, enable_gqa=True,
            )  # fmt: skip
            torch.testing.assert_close(part, want[:, r * per_q : (r + 1) * per_q])
    assert _repeat_kv(k, 8, 2) is k  # nothing to repeat


# --- the hook ---------------------------------------------------------------------------


def _cut(model: nn.Module, index: int = 1, size: int = 2, transformers_model: bool = True,
         **batch: Any) -> dict[str, Any]:  # fmt: skip
    cutter = Cutter(None, size, index, transformers_model)
    args, kwargs = cutter.before(model, (), batch)
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs).arguments
    return {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}


def test_a_transformers_batch_is_cut_with_global_positions_and_shifted_labels():
    ids = torch.arange(2 * SEQ).view(2, SEQ)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    labels = ids.masked_fill(positions == 0, -100)
    got = _cut(llama(), input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.equal(got["input_ids"], ids[:, 4:])
    assert torch.equal(got["position_ids"], positions[:, 4:])  # global, not 0..3
    assert torch.equal(got["labels"], shifted[:, 4:])
    assert torch.equal(got["shift_labels"], shifted[:, 4:])
    count = int((shifted != -100).sum())  # the whole rows' valid labels, over cp
    assert count == 12 and float(got["num_items_in_batch"]) == count / 2
    assert got["use_cache"] is False
    layout = context.current_layout()
    assert layout is not None and (layout.seq_len, layout.size, layout.index) == (SEQ, 2, 1)
    assert layout.documents is not None and layout.documents.tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert layout.keep is None
    first = _cut(llama(), index=0, input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(6))
    assert torch.equal(first["position_ids"], torch.arange(4).expand(2, 4))  # 0..S-1, cut
    assert float(first["num_items_in_batch"]) == 3.0  # the caller's own count, over cp
    assert context.current_layout().documents is None  # type: ignore[union-attr]
    # a 2-D attention mask: transformers finds no documents then, and masks the padding
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    _cut(llama(), input_ids=ids, position_ids=positions, attention_mask=mask, labels=labels)
    layout = context.current_layout()
    assert layout is not None and layout.documents is None and torch.equal(layout.keep, mask)  # type: ignore[arg-type]
    four = _cut(llama(), index=3, size=4, input_ids=ids)
    assert torch.equal(four["input_ids"], ids[:, 6:])


class Plain(nn.Module):
    def forward(self, input_ids, labels=None, position_ids=None, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        return input_ids


class NoPositions(nn.Module):
    def forward(self, input_ids, labels=None):  # type: ignore[no-untyped-def]
        return input_ids


class NoCount(nn.Module):
    def forward(self, input_ids, labels=None, position_ids=None):  # type: ignore[no-untyped-def]
        return input_ids


def test_a_model_of_your_own_gets_its_targets_cut_and_counted_as_they_are():
    ids = torch.arange(2 * SEQ).view(2, SEQ)
    targets = ids.clone()
    targets[:, :3] = -100  # chunk 0 holds 2 x 1 valid target, chunk 1 holds 2 x 4
    got = _cut(Plain(), index=0, transformers_model=False, input_ids=ids, labels=targets)
    assert torch.equal(got["labels"], targets[:, :4])  # not shifted: aligned by the model
    assert float(got["num_items_in_batch"]) == 10 / 2
    assert torch.equal(got["position_ids"], torch.arange(4).expand(2, 4))


def test_what_the_hook_cannot_cut_is_refused_with_the_fix():
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cp=2: the batch's sequence length 7 does not divide"):
        _cut(llama(), input_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cp=3: the batch's sequence length 8.*multiple of 3"):
        _cut(llama(), size=3, input_ids=ids)
    with pytest.raises(ValueError, match=r"called with no sequence"):
        _cut(Plain(), transformers_model=False, input_ids=torch.zeros(SEQ))
    with pytest.raises(NotImplementedError, match=r"key/value cache \(generation\)"):
        _cut(llama(), input_ids=ids, past_key_values=transformers.DynamicCache())
    with pytest.raises(ValueError, match=r"NoPositions.forward takes no position_ids"):
        _cut(NoPositions(), transformers_model=False, input_ids=ids)
    with pytest.raises(ValueError, match=r"NoCount.forward takes labels but no num_items_in_batch"):
        _cut(NoCount(), transformers_model=False, input_ids=ids, labels=ids)
    masked = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=32,
    ))  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"cp=2 with BertForMaskedLM's loss"):
        _cut(masked, input_ids=ids, labels=ids, position_ids=ids)


def test_under_pp_each_micro_batch_carries_its_rows_of_the_mask_whole():
    """The pipeline's schedule cuts the batch into micro-batches after the cutter: the
    documents and kept keys travel as keywords (uncut, one row per row), not in the layout
    every micro-batch shares; a model of your own, whose attention takes no keywords, is
    refused a padding mask under pp."""
    ids = torch.arange(2 * SEQ).view(2, SEQ)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    model = llama()
    signature = inspect.signature(type(model).forward)
    cutter = Cutter(None, 2, 1, True, pipelined=True)
    got = cutter.keywords(model, signature, dict(input_ids=ids, position_ids=positions,
                                                 use_cache=False))  # fmt: skip
    documents, keep = got[context.ROW_NAMES[0]], got[context.ROW_NAMES[1]]
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * SEQ] and keep is None
    assert torch.equal(got["input_ids"], ids[:, 4:])  # the rest is cut
    layout = context.current_layout()
    assert layout is not None and layout.documents is None and layout.keep is None
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    got = cutter.keywords(model, signature, dict(input_ids=ids, attention_mask=mask))
    assert got[context.ROW_NAMES[0]] is None and torch.equal(got[context.ROW_NAMES[1]], mask)
    assert torch.equal(got["attention_mask"], mask[:, 4:])
    one = cutter.keywords(model, signature, dict(input_ids=ids, use_cache=False))
    assert context.ROW_NAMES[0] not in one and context.ROW_NAMES[1] not in one  # one document
    plain = Cutter(None, 2, 0, False, pipelined=True)
    plain_signature = inspect.signature(MaskedPlain.forward)
    plain.keywords(MaskedPlain(), plain_signature, dict(input_ids=ids))  # no mask: fine
    with pytest.raises(NotImplementedError, match=r"cp=2 with pp and a 2-D attention mask is "
                       r"built for transformers models only: MaskedPlain"):  # fmt: skip
        plain.keywords(MaskedPlain(), plain_signature, dict(input_ids=ids, attention_mask=mask))
    # a micro-batch's rows are the mask, not the layout's (which holds no rows under pp)
    rows = documents[:1], None
    whole = ContextLayout(None, 2, 0, SEQ, None, None)  # type: ignore[arg-type]
    got_mask = _mask(whole, True, None, torch.device("cpu"), rows)
    assert got_mask is not None and got_mask.shape == (1, 1, SEQ, SEQ)
    assert torch.equal(got_mask, _mask(ContextLayout(None, 2, 0, SEQ, documents[:1], None),  # type: ignore[arg-type]
                                       True, None, torch.device("cpu")))  # fmt: skip


class MaskedPlain(nn.Module):
    def forward(self, input_ids, position_ids=None, attention_mask=None):  # type: ignore[no-untyped-def]
        return input_ids


def test_a_forward_whose_attention_ignores_shardwise_is_refused_once():
    cutter = Cutter(None, 2, 0, False)
    model = Plain()
    cutter.before(model, (torch.zeros(1, SEQ, dtype=torch.long),), {})
    with pytest.raises(
        RuntimeError, match=r"ran no attention through shardwise.*context_attention"
    ):
        cutter.after(model, (), {}, None)
    cutter.after(model, (), {}, None)  # checked once: a later forward pays nothing
    fine = Cutter(None, 2, 0, False)
    fine.before(model, (torch.zeros(1, SEQ, dtype=torch.long),), {})
    context.current_layout().attention_calls = 2  # type: ignore[union-attr]
    fine.after(model, (), {}, None)


def test_context_attention_is_sdpa_outside_context_parallel():
    context._ACTIVE[0] = None
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(shardwise.context_attention(q, k, v), want)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True, scale=0.5)
    torch.testing.assert_close(
        shardwise.context_attention(q, k, v, is_causal=False, scale=0.5), full
    )


@pytest.mark.heavy
def test_the_simulation_holds_each_ranks_part_of_the_sequence():
    """Each rank's activations shrink with cp (its 1/cp of every sequence); model states
    stay those of full_shard over every rank (dp_shard x cp). Against a real run: in the cp
    tier (tests/distributed/test_context_parallel.py)."""

    def run(cp: int):  # type: ignore[no-untyped-def]
        return shardwise.simulate_step(
            llama, ParallelConfig(cp=cp), world=4, batch=1, seq_len=128, backend="gloo"
        )

    one, two, four = run(1), run(2), run(4)
    for report in (two, four):
        assert report.at_peak["params"] == one.at_peak["params"]  # sharded over all 4 ranks
        assert report.at_peak["optimizer"] == one.at_peak["optimizer"]
    assert 1.6 < one.at_peak["activations"] / two.at_peak["activations"] < 2.4
    assert 1.6 < two.at_peak["activations"] / four.at_peak["activations"] < 2.4


def test_documents_are_found_only_where_transformers_finds_them():
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    model = llama()
    assert model.config.use_cache  # a training forward makes a cache: no documents
    _cut(model, input_ids=ids, position_ids=positions)
    assert context.current_layout().documents is None  # type: ignore[union-attr]
    _cut(model, input_ids=ids, position_ids=positions, use_cache=False)
    assert context.current_layout().documents is not None  # type: ignore[union-attr]
    model.config.use_cache = False
    _cut(model, input_ids=ids, position_ids=positions)
    assert context.current_layout().documents is not None  # type: ignore[union-attr]
    _cut(model, input_ids=ids, position_ids=positions, use_cache=True)
    assert context.current_layout().documents is None  # type: ignore[union-attr]
    model.gradient_checkpointing_enable()  # transformers turns the cache off in training
    _cut(model, input_ids=ids, position_ids=positions, use_cache=True)
    assert context.current_layout().documents is not None  # type: ignore[union-attr]
    model.eval()  # not in eval: the cache is made again
    _cut(model, input_ids=ids, position_ids=positions, use_cache=True)
    assert context.current_layout().documents is None  # type: ignore[union-attr]


def test_a_layout_is_current_during_its_forward_and_its_recompute_only():
    """After a cp forward, a model called outside cp in the same process (an evaluation of
    another copy, generation on rank 0) attends as SDPA does; only a recompute inside
    backward reads the last forward's layout (found when a one-process reference ran in
    the process of an earlier cut: it all-to-all'ed over no group)."""
    cutter = Cutter(None, 2, 0, False)
    model = Plain()
    cutter.before(model, (torch.zeros(1, SEQ, dtype=torch.long),), {})
    layout = context.current_layout()
    assert layout is not None
    layout.attention_calls = 1
    cutter.after(model, (), {}, None)
    assert context.current_layout() is None
    seen = []
    x = torch.ones(2, requires_grad=True)

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[no-untyped-def]
            return t.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            seen.append(context.current_layout())
            return grad

    Spy.apply(x).sum().backward()
    assert seen == [layout]  # a recompute in backward reads the last forward's
    cutter.before(model, (torch.zeros(1, SEQ, dtype=torch.long),), {})
    cutter.forget()  # a step that ended early
    assert context.current_layout() is None
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 4)
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(shardwise.context_attention(q, q, q), want)


@pytest.mark.parametrize(("heads", "kv", "cp"), [(12, 6, 4), (12, 4, 6), (12, 3, 4), (6, 2, 3)])
def test_kv_heads_are_repeated_within_their_groups_at_sizes_that_are_not_powers_of_two(
    heads, kv, cp
):  # type: ignore[no-untyped-def]
    """cp // kv and cp // gcd(kv, cp) agree at powers of two only (third audit)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, heads, 5, 4), torch.randn(1, kv, 5, 4)
    v = torch.randn(1, kv, 5, 4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k2, v2 = _repeat_kv(k, heads, cp), _repeat_kv(v, heads, cp)
    assert k2.shape[1] % cp == 0 and heads % k2.shape[1] == 0
    per_q, per_kv = heads // cp, k2.shape[1] // cp
    for r in range(cp):  # each rank's query heads read its own slice of the KV heads
        part = F.scaled_dot_product_attention(
            q[:, r * per_q : (r + 1) * per_q], k2[:, r * per_kv : (r + 1) * per_kv],
            v2[:, r * per_kv : (r + 1) * per_kv], is_causal=True, enable_gqa=True,
        )  # fmt: skip
        torch.testing.assert_close(part, want[:, r * per_q : (r + 1) * per_q])
