"""Streams in one process: packing, the order of parts at any world size and worker count,
resuming a part where it stopped, and every refusal (train/packing.py, train/stream.py)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import IterableDataset

from shardwise import Engine, Runner, RunnerConfig, TrainConfig
from shardwise.train.packing import (
    IGNORE_INDEX,
    Packer,
    count_label_tokens,
    pack,
    packed_attention_notice,
)
from shardwise.train.stream import StreamLoader

SEQ = 16
# 4 workers on a 2-core machine: torch warns, as it should a user.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def documents(n=120, seed=0):
    rng = random.Random(seed)
    # Every token of document i is 1 + i: a row's tokens name the documents it holds.
    return [[1 + i] * rng.randint(1, 40) for i in range(n)]


class Docs(IterableDataset):
    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def loaders(data, world, *, parts=8, batch=2, workers=0):
    return [
        StreamLoader(data, "train_data", parts=parts, batch_size=batch, num_workers=workers,
                     rank=r, world=world, device=torch.device("cpu"))
        for r in range(world)
    ]  # fmt: skip


def run(loaders_, window=1, steps=None):
    """Each step's rows, per rank, until a rank runs out (or `steps`)."""
    its = [ld.batches(0, window) for ld in loaders_]
    out = []
    while steps is None or len(out) < steps:
        try:
            out.append([[next(it) for _ in range(window)] for it in its])
        except StopIteration:
            break
    return out


def step_rows(out):
    return [sorted(tuple(r) for rank in step for b in rank for r in b["input_ids"].tolist())
            for step in out]  # fmt: skip


def saved(loaders_):
    # What the Runner's checkpoint holds: every rank's parts (state_dict gathers them).
    state = loaders_[0].state_dict()
    for ld in loaders_[1:]:
        state["positions"].update({str(p): ld.starts[p].as_list() for p in ld._mine()})
    return state


def tokens_per_doc(*outs):
    count: dict[int, int] = {}
    for out in outs:
        for step in out:
            for rank in step:
                for b in rank:
                    for t in b["input_ids"].reshape(-1).tolist():
                        count[t] = count.get(t, 0) + 1
    return count


# --- packing ---------------------------------------------------------------------------


def test_rows_cut_documents_with_labels_and_positions_that_restart():
    rows = list(pack([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6]], 4))
    assert [r["input_ids"].tolist() for r in rows] == [[5, 6, 7, 8], [9, 1, 2, 3]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0], [1, 0, 1, 2]]
    assert [r["labels"].tolist() for r in rows] == [[-100, 6, 7, -100], [9, -100, 2, 3]]
    # The last 3 tokens do not fill a row: not trained.


def test_packer_reports_where_the_next_row_starts():
    packer = Packer(4)
    packer.feed(0, [1, 2, 3])
    assert packer.row() is None
    packer.feed(1, [4, 5, 6, 7, 8])
    _, end = packer.row()
    assert end[:3] == (1, 1, 1)  # next row: document 1 from token 1; last touched: 1
    _, end = packer.row()
    assert end[:3] == (2, 0, 1)  # document 1 ended exactly: the next row starts document 2
    packer.feed(2, [])  # an empty document adds nothing
    packer.feed(3, [9, 9, 9, 9, 9])
    _, end = packer.row()
    assert end[:3] == (3, 4, 3)


def test_count_label_tokens_skips_ignored_labels_and_each_rows_first():
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX], [3, 4, IGNORE_INDEX, 5]])
    assert count_label_tokens({"labels": labels}) == 2 + 2  # row 2's first (3) is not predicted
    with pytest.raises(ValueError, match=r"loss_over='tokens'.*no 'labels' tensor"):
        count_label_tokens({"input_ids": labels})
    with pytest.raises(ValueError, match=r"no 'labels' tensor of shape \(rows, tokens\)"):
        count_label_tokens({"labels": torch.tensor([1, 2])})


@pytest.mark.parametrize("seq_len", [1, 0, -3, 2.5, True])
def test_pack_refuses_a_row_without_two_tokens(seq_len):
    with pytest.raises(ValueError, match=rf"pack\(seq_len={seq_len!r}\): a row needs at least 2"):
        pack([[1, 2]], seq_len)


def test_pack_refuses_a_document_that_is_not_token_ids():
    with pytest.raises(TypeError, match=r"a document gave str, not token ids\. Pass tokenize"):
        list(pack(["some text"], 4))
    with pytest.raises(TypeError, match=r"a document's token ids must be ints \(.*float"):
        list(pack([[1.5, 2.0]], 4))
    rows = list(pack(["abcd", "ef"], 3, tokenize=lambda s: [ord(c) for c in s]))
    assert [r["input_ids"].tolist() for r in rows] == [[97, 98, 99], [100, 101, 102]]


# --- the order of parts --------------------------------------------------------------------


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
@pytest.mark.parametrize(("world", "workers"), [(2, 0), (2, 2), (4, 1), (8, 1), (1, 4), (4, 2)])
def test_every_world_and_worker_count_takes_the_same_rows_each_step(world, workers):
    docs = documents()
    one = run(loaders(pack(Docs(docs), SEQ), 1, batch=8))
    other = run(loaders(pack(Docs(docs), SEQ), world, batch=8 // world, workers=workers))
    assert len(one) > 10 and step_rows(other) == step_rows(one)


def samples(n=120):
    """Samples that are not packed: sample i is a tensor of three (i + 1)s."""
    return [torch.full((3,), i + 1) for i in range(n)]


def firsts(out):
    return [sorted(int(r[0]) - 1 for rank in step for b in rank for r in b) for step in out]


def test_a_rank_reads_only_its_parts():
    out = run(loaders(Docs(samples()), 4, parts=8, batch=1))
    for r in range(4):
        ids = [int(step[r][0][0, 0]) - 1 for step in out]
        assert len(ids) == 30 and all(i % 8 % 4 == r for i in ids), (r, ids)


def test_a_stream_of_samples_keeps_the_global_order_and_drops_the_incomplete_step():
    # 20 samples in 8 parts: parts 0-3 hold 3, parts 4-7 hold 2; a step takes 6, so the
    # fourth step (18, 19 and part 2's missing third) is incomplete on rank 0: not trained.
    out = run(loaders(Docs(samples(20)), 2, parts=8, batch=3))
    assert firsts(out) == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
@pytest.mark.parametrize(
    ("first", "then"), [((2, 0), (2, 0)), ((2, 2), (2, 2)), ((2, 2), (1, 4)), ((2, 2), (4, 2))]
)
def test_a_resume_takes_every_remaining_row_once(first, then):
    docs = documents()
    whole = run(loaders(pack(Docs(docs), SEQ), 2, batch=4, workers=2))
    before = loaders(pack(Docs(docs), SEQ), first[0], batch=8 // first[0], workers=first[1])
    done = run(before, steps=5)
    state = saved(before)
    after = loaders(pack(Docs(docs), SEQ), then[0], batch=8 // then[0], workers=then[1])
    for ld in after:
        ld.load_state_dict(state, "latest")
    rest = run(after)
    assert step_rows(done) + step_rows(rest) == step_rows(whole)
    assert tokens_per_doc(done, rest) == tokens_per_doc(whole)
    if then == first:  # same world and workers: each rank's batches, bit for bit
        flat = [[b["input_ids"].tolist() for b in step[r]] for step in done + rest for r in (0, 1)]
        assert flat == [
            [b["input_ids"].tolist() for b in step[r]] for step in whole for r in (0, 1)
        ]


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
@pytest.mark.parametrize(("batch", "then"), [(3, (2, 2)), (3, (1, 4)), (5, (2, 1))])
def test_a_resume_mid_cycle_of_a_ranks_parts_keeps_the_order(batch, then):
    """3 rows a rank a step over 4 parts a rank: the stop falls between parts, so the
    workers must be dealt the parts from the one whose turn it is."""
    docs = documents()
    whole = run(loaders(pack(Docs(docs), SEQ), 2, batch=batch, workers=2))
    before = loaders(pack(Docs(docs), SEQ), 2, batch=batch, workers=2)
    done = run(before, steps=3)
    after = loaders(pack(Docs(docs), SEQ), then[0], batch=batch * 2 // then[0], workers=then[1])
    state = saved(before)
    for ld in after:
        ld.load_state_dict(state, "latest")
    rest = run(after)
    assert step_rows(done) + step_rows(rest) == step_rows(whole)
    if then == (2, 2):
        flat = [[b["input_ids"].tolist() for b in step[r]] for step in done + rest for r in (0, 1)]
        assert flat == [
            [b["input_ids"].tolist() for b in step[r]] for step in whole for r in (0, 1)
        ]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_of_samples_not_packed_continues_each_part(workers):
    whole = run(loaders(Docs(samples()), 2, batch=3))
    before = loaders(Docs(samples()), 2, batch=3)
    done = run(before, steps=4)
    after = loaders(Docs(samples()), 4, batch=3, workers=workers)  # global batch 12 now
    state = saved(before)
    for ld in after:
        ld.load_state_dict(state, None)
    rest = run(after)
    taken = sorted(i for step in firsts(done) + firsts(rest) for i in step)
    assert taken == list(range(120))  # 4 steps of 6, then 8 of 12: each sample once
    assert [i for step in firsts(whole) for i in step] == list(range(120))


# --- refusals ------------------------------------------------------------------------------


def test_parts_that_do_not_split_over_the_world_are_refused():
    with pytest.raises(ValueError, match=r"RunnerConfig\.stream_parts=8 does not split over 3 "):
        loaders(Docs(documents()), 3)


@pytest.mark.parametrize(("world", "workers"), [(2, 3), (4, 4), (1, 3)])
def test_workers_that_do_not_share_a_ranks_parts_evenly_are_refused(world, workers):
    per = 8 // world
    stream = loaders(Docs(documents()), world, workers=workers)[0]
    with pytest.raises(ValueError, match=rf"num_workers={workers}: .* reads {per} part\(s\)"):
        next(stream.batches(0, 1))  # before anything is read


def test_a_worker_count_that_does_not_divide_at_resume_names_the_saved_count():
    before = loaders(pack(Docs(documents()), SEQ), 2, workers=2)
    run(before, steps=2)
    after = loaders(pack(Docs(documents()), SEQ), 4)
    after[0].num_workers = 4  # as a DataLoader with 4 workers would set it
    with pytest.raises(ValueError, match=r"num_workers=4 \(the checkpoint was saved with 2\)"):
        after[0].load_state_dict(saved(before), "latest")


@pytest.mark.parametrize(
    ("parts", "seq", "packed", "match"),
    [
        (16, SEQ, True, r"cut into 8 part\(s\), packed into rows of 16 tokens; this run's is 16"),
        (8, 32, True, r"this run's is 8 part\(s\), packed into rows of 32 tokens"),
        (8, SEQ, False, r"this run's is 8 part\(s\), not packed\."),
    ],
)
def test_a_resume_into_another_cut_is_refused(parts, seq, packed, match):
    before = loaders(pack(Docs(documents()), SEQ), 2)
    run(before, steps=2)
    data = pack(Docs(documents()), seq) if packed else Docs(documents())
    after = loaders(data, 2, parts=parts)
    with pytest.raises(ValueError, match=match):
        after[0].load_state_dict(saved(before), "latest")


@pytest.mark.parametrize("packed", [True, False])
def test_a_stream_whose_order_changed_is_refused_before_training(packed):
    docs = documents()
    items = docs if packed else samples()
    before = loaders(pack(Docs(items), SEQ) if packed else Docs(items), 2)
    run(before, steps=3)
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    after = loaders(pack(Docs(shuffled), SEQ) if packed else Docs(shuffled), 2)
    after[0].load_state_dict(saved(before), "latest")
    with pytest.raises(ValueError, match=r"no longer holds, at item \d+, the item the checkpoint"):
        next(after[0].batches(0, 1))


# --- datasets streams --------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize("parts", [8, 16])  # 8 divides the 8 shards: whole shards; 16 deals
def test_a_datasets_stream_is_read_whole_in_either_cut(parts):
    datasets = pytest.importorskip("datasets")
    docs = documents(200)
    table = datasets.Dataset.from_dict({"ids": docs}).to_iterable_dataset(num_shards=8)
    data = pack(table, SEQ, tokenize=lambda d: d["ids"])
    out = run(loaders(data, 2, parts=parts, batch=2, workers=2))
    one = run(loaders(data, 1, parts=parts, batch=4))
    assert step_rows(out) == step_rows(one)
    # The epoch ends when the shortest part runs out (shards hold unequal token counts).
    assert len(out) * 4 * SEQ > 0.6 * sum(len(d) for d in docs)


# --- the Runner ----------------------------------------------------------------------------


def test_loss_over_refuses_other_values_and_where_it_is_not_built():
    from shardwise import ParallelConfig
    from shardwise.train.engine import _check_loss_over

    with pytest.raises(ValueError, match=r"TrainConfig\.loss_over='rows' is not allowed"):
        TrainConfig(loss_over="rows")
    tokens = TrainConfig(loss_over="tokens")
    for name in ("pp", "cp"):
        with pytest.raises(NotImplementedError, match=rf"'tokens' with ParallelConfig\.{name}=2 "):
            _check_loss_over(tokens, ParallelConfig(strategy="full_shard", **{name: 2}))
        _check_loss_over(TrainConfig(), ParallelConfig(strategy="full_shard", **{name: 2}))
    _check_loss_over(tokens, ParallelConfig(strategy="full_shard", tp=2))


def test_tokens_weigh_each_micro_batch_by_its_share_of_the_step():
    from types import SimpleNamespace

    from shardwise.train.progress import Window
    from shardwise.train.stream import micro_batches

    def batch(valid):  # rows of 6 labels, `valid` of them predicted after the first
        labels = torch.full((1, 6), IGNORE_INDEX)
        labels[0, 1 : 1 + valid] = 7
        return {"labels": labels}

    data = [batch(v) for v in (1, 3, 4, 4, 2)]  # windows of 2: (1, 3), (4, 4), then (2)
    engine = SimpleNamespace(train_config=TrainConfig(accumulate_steps=2, loss_over="tokens"),
                             device=torch.device("cpu"))  # fmt: skip
    got = list(micro_batches(data, engine, 0, Window(), 1))
    assert [w for _, _, w in got] == [2 * 1 / 4, 2 * 3 / 4, 2 * 4 / 8, 2 * 4 / 8, 2 * 2 / 2]
    assert [last for _, last, _ in got] == [False, False, False, False, True]
    engine.train_config = TrainConfig(accumulate_steps=2)
    assert [w for _, _, w in micro_batches(data, engine, 0, Window(), 1)] == [None] * 5


def test_the_engine_weighs_the_loss_and_what_it_logs():
    class Mean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inner = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.inner(x).pow(2).mean()

    x = torch.ones(2, 3)
    moved, logged = [], []
    for weight in (None, 0.25):
        model = Mean()
        before = model.inner.weight.detach().clone()
        engine = Engine(model, lambda p: torch.optim.SGD(p, lr=1.0))
        logged.append(engine.train_step(x, loss_weight=weight)["loss"])
        moved.append(model.inner.weight.detach() - before)
    assert logged[1] == pytest.approx(logged[0] * 0.25)
    torch.testing.assert_close(moved[1], moved[0] * 0.25)


def test_packed_rows_turn_off_a_transformers_cache_and_name_other_models():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache
    held = torch.nn.Sequential(model)  # a user's module holding it
    assert "use_cache set to False" in packed_attention_notice(held)
    assert not model.config.use_cache
    assert packed_attention_notice(held) == ""
    assert "cannot tell whether its attention" in packed_attention_notice(torch.nn.Linear(2, 2))


class LM(torch.nn.Module):
    """The test GPT, taking packed rows (its attention ignores position_ids)."""

    def __init__(self):
        super().__init__()
        from shardwise.testing.models import GPT, GPTConfig

        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(vocab_size=256))

    def forward(self, input_ids, labels, position_ids):
        return self.gpt(input_ids, labels)


def runner(tmp_path, train, val=None, **config):
    engine = Engine(LM(), lambda p: torch.optim.SGD(p, lr=0.1),
                    train=TrainConfig(loss_over="tokens"))  # fmt: skip
    values = {"batch_size": 2, "max_epochs": 1, "progress": False, "stream_parts": 4}
    cfg = RunnerConfig(run_dir=str(tmp_path), **(values | config))
    return Runner(engine, train, val, config=cfg)


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
def test_runner_trains_a_packed_stream_and_validates_on_all_of_another(tmp_path, capsys):
    val = pack(Docs(documents(20, seed=1)), SEQ)
    # One batch a validation: each starts the stream afresh, not where the last one stopped.
    fit = runner(tmp_path, pack(Docs(documents(40)), SEQ), val, val_every=2, max_steps=4,
                 val_batches=1)  # fmt: skip
    summary = fit.fit()
    assert summary["steps"] == 4 and summary["ended_by"] == "max_steps=4"
    assert summary["train"]["tokens_per_s"] > 0 and summary["train"]["data_wait_s"] >= 0
    vals = [r for r in fit.history if r["split"] == "val"]
    assert len(vals) == 2 and vals[0]["loss"] != vals[1]["loss"]  # trained in between
    again = fit.validate()  # the same first batch again
    assert again["loss"] == pytest.approx(vals[1]["loss"], rel=1e-6)
    err = capsys.readouterr().err
    assert "LM gets position_ids that restart at each document; shardwise cannot tell" in err
    summary = runner(tmp_path / "epoch", pack(Docs(documents(40)), SEQ)).fit()
    err = capsys.readouterr().err
    assert f"epoch 0 of the stream ended after optimizer step {summary['steps']}: a " in err
    assert "an epoch reads the stream once" in err


def test_a_dataloader_over_a_stream_keeps_its_batch_size_and_workers():
    from torch.utils.data import DataLoader

    (stream,) = loaders(DataLoader(Docs(samples()), batch_size=3, num_workers=2), 1)
    assert (stream.batch_size, stream.num_workers) == (3, 2)
    assert firsts(run([stream]))[:2] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match=r"DataLoader\(\.\.\., batch_size=None\)\): shardwise"):
        loaders(DataLoader(Docs(samples()), batch_size=None), 1)


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
def test_every_epoch_reads_the_stream_from_its_start(tmp_path):
    one = runner(tmp_path / "one", pack(Docs(documents(40)), SEQ)).fit()
    two = runner(tmp_path / "two", pack(Docs(documents(40)), SEQ), max_epochs=2).fit()
    assert two["steps"] == 2 * one["steps"] and two["epochs"] == 2


@pytest.mark.heavy  # DataLoader workers or a Runner: a second or more
def test_a_resume_across_kinds_of_data_is_refused(tmp_path):
    from torch.utils.data import TensorDataset

    rows = list(pack(documents(40), SEQ))
    table = TensorDataset(torch.stack([r["input_ids"] for r in rows]))
    runner(tmp_path, pack(Docs(documents(40)), SEQ), max_steps=2, save_at_end=True).fit()
    with pytest.raises(ValueError, match=r"saved training on a stream, and this run's train_data"):
        runner(tmp_path, table, resume="latest", max_steps=4).fit()


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_packed_row_of_two_documents_trains_as_the_two_apart(family):
    transformers = pytest.importorskip("transformers")
    kinds = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    config = kinds[family](vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    a, b = [5, 9, 3, 7, 1, 4, 2], [8, 6, 11, 12, 10]
    (row,) = list(pack([a, b], len(a) + len(b)))
    packed = {k: v[None] for k, v in row.items()}
    pad = len(a) - len(b)
    apart = {
        "input_ids": torch.tensor([a, b + [0] * pad]),
        "attention_mask": torch.tensor([[1] * len(a), [1] * len(b) + [0] * pad]),
        "labels": torch.tensor([a, b + [IGNORE_INDEX] * pad]),
    }
    assert count_label_tokens(packed) == count_label_tokens(apart) == len(a) - 1 + len(b) - 1

    def loss_and_grads(batch):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    packed_attention_notice(model)  # turns the cache off, as the Runner does
    together, grads = loss_and_grads(packed)
    alone, grads_apart = loss_and_grads(apart)
    torch.testing.assert_close(together, alone, rtol=1e-10, atol=1e-12)
    for g, h in zip(grads, grads_apart, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-12)
    # Negative control: with the cache on, transformers does not look for packed documents,
    # and b's tokens attend to a's.
    model.config.use_cache = True
    crossed, _ = loss_and_grads(packed)
    assert abs(float(crossed - alone)) > 1e-4
