"""The pipeline's tables and formulas, entry by entry, in one process (the five habits of
docs/testing.md): every schedule's stages per rank and its refusal, the default number of
micro-batches and the split of blocks at sizes where the plausible wrong formulas differ,
each form of the last stage's output and of a batch, every keyword that carries the
targets, a block called by keyword, tied names, and three ranks of two stages each.
"""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.config.pipeline import PP_SCHEDULES, default_microbatches
from shardwise.parallelize.pipeline import _counted_tokens, batch_keywords, tied_aliases
from shardwise.parallelize.stages import TARGET_NAMES, build_stage, loss_of
from shardwise.plan.stages import plan_stages
from shardwise.testing.models import GPT, GPTConfig

WIDTH = 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y if gate is None else y * gate


class _Tiny(nn.Module):
    """An embedding, `n` blocks called by keyword (`block(x=h)`), a head whose width is the
    vocabulary's; the loss from whichever target keyword is given, and a record of which
    keywords the forward received."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.received: list[set[str]] = []

    def forward(
        self,
        idx: torch.Tensor,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
    ) -> torch.Tensor:
        given = {"labels": labels, "targets": targets, "target": target}
        self.received.append({k for k, v in given.items() if v is not None})
        h = self.emb(idx)
        for block in self.blocks:
            h = block(x=h)
        logits = self.head(h)
        y = next((v for v in given.values() if v is not None), None)
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tiny(n: int = 4) -> _Tiny:
    torch.manual_seed(0)
    return _Tiny(n)


# --- the config: every schedule ------------------------------------------------------------

# torch's classes: Schedule1F1B and ScheduleGPipe run one stage per rank,
# ScheduleInterleaved1F1B two or more, ScheduleZBVZeroBubble exactly two (its V).
_PER_RANK = {"1f1b": {1}, "gpipe": {1}, "interleaved_1f1b": {2, 3, 4}, "zbv": {2}}


def test_the_table_covers_every_schedule() -> None:
    assert set(_PER_RANK) == set(PP_SCHEDULES)


@pytest.mark.parametrize("schedule", list(_PER_RANK))
def test_every_schedule_picks_its_stages_per_rank_when_none_is_given(schedule: str) -> None:
    config = shardwise.ParallelConfig(pp=1, pp_schedule=schedule)
    assert config.stages_per_rank == min(_PER_RANK[schedule])


@pytest.mark.parametrize("per_rank", [1, 2, 3])
@pytest.mark.parametrize("schedule", list(_PER_RANK))
def test_every_schedule_takes_its_stages_per_rank_and_refuses_the_others(
    schedule: str, per_rank: int
) -> None:
    if per_rank in _PER_RANK[schedule]:
        config = shardwise.ParallelConfig(pp=1, pp_schedule=schedule, pp_stages_per_rank=per_rank)
        assert config.stages_per_rank == per_rank
        return
    wanted = {"1f1b": "1", "gpipe": "1", "interleaved_1f1b": "2 or more", "zbv": "2"}[schedule]
    other = "interleaved_1f1b" if schedule in ("1f1b", "gpipe") else "1f1b or gpipe"
    with pytest.raises(ValueError) as caught:
        shardwise.ParallelConfig(pp=1, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    assert str(caught.value) == (
        f"ParallelConfig.pp_stages_per_rank={per_rank} with pp_schedule={schedule!r}: that "
        f"schedule runs {wanted} stage(s) per rank. Set pp_stages_per_rank to {wanted} "
        f"(None picks it), or choose {other}."
    )


@pytest.mark.parametrize("split", [[""], ["model.layers.2", ""], [None]])
def test_an_empty_or_missing_name_in_pp_split_is_refused(split: list[object]) -> None:
    with pytest.raises(TypeError, match=r"each entry must be a module name \(a non-empty string\)"):
        shardwise.ParallelConfig(pp=3, pp_split=split)  # type: ignore[arg-type]


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_the_default_micro_batches_are_twice_the_stages(pp: int) -> None:
    """pp 2 cannot tell 2 x pp from pp + 2 or pp ** 2; 3 and 5 can."""
    assert default_microbatches(pp) == pp + pp


# --- the split -----------------------------------------------------------------------------


@pytest.mark.parametrize(("blocks", "pp"), [(n, p) for n in range(1, 10) for p in range(1, n + 1)])
def test_the_auto_split_is_as_even_as_possible_with_the_remainder_first(
    blocks: int, pp: int
) -> None:
    plan = plan_stages(_tiny(blocks), pp)
    sizes = [len(s.blocks) for s in plan.stages]
    assert sum(sizes) == blocks and len(sizes) == pp
    assert max(sizes) - min(sizes) <= 1  # 5 over 3: [2, 2, 1], never [3, 1, 1]
    assert sizes == sorted(sizes, reverse=True)  # the earlier stages take the remainder
    assert [b for s in plan.stages for b in s.blocks] == [f"blocks.{i}" for i in range(blocks)]


def test_a_module_below_the_root_holding_its_own_parameters_is_refused() -> None:
    """The refusal's two conditions: parameters on the root itself (tested with the stage's
    error paths) and on a module between the root and the block list."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))  # no stage could own it alone
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(2))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    with pytest.raises(ValueError, match=r"a module on the path to the block list holds "
                       r"parameters of its own, which no stage could own alone; give pp=1 for "
                       r"Outer"):  # fmt: skip
        plan_stages(Outer(), 2)


def test_three_ranks_of_two_stages_each_hold_every_third_stage() -> None:
    """At pp 2 x 2 per rank the degree and the stages per rank are both 2, so a placement
    stepping by either reads the same; at 3 x 2 they differ."""
    model = _tiny(6)
    plan = plan_stages(model, 3, per_rank=2)
    assert (plan.pp, plan.degree) == (6, 3)
    assert [plan.held_by(r) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert "6 stages over blocks, 2 per rank (rank r holds stages r, r + 3, ...)" in str(plan)
    states = [build_stage(copy.deepcopy(model), plan, r) for r in range(3)]
    assert [(s.is_first, s.is_last) for s in states] == [(True, False), (False, False),
                                                         (False, True)]  # fmt: skip


# --- the stage's forward -------------------------------------------------------------------

_LOSS = torch.tensor(1.5)


@pytest.mark.parametrize(
    "out",
    [
        _LOSS,
        {"loss": _LOSS, "logits": torch.ones(2, 3)},
        SimpleNamespace(loss=_LOSS, logits=torch.ones(2, 3)),
        (_LOSS, torch.ones(2, 3)),
        [_LOSS, torch.ones(2, 3)],
        SimpleNamespace(loss=(_LOSS, torch.ones(2))),
    ],
    ids=["tensor", "mapping", "attribute", "tuple", "list", "attribute holding a tuple"],
)
def test_each_form_of_the_last_stages_output_gives_its_loss(out: object) -> None:
    assert loss_of(out) is _LOSS


@pytest.mark.parametrize(
    "out",
    [None, torch.ones(2), {"logits": torch.ones(2)}, (), SimpleNamespace(loss=None), "loss"],
    ids=["none", "a vector", "a mapping without loss", "empty", "no loss", "text"],
)
def test_an_output_without_a_0_dim_loss_is_refused(out: object) -> None:
    with pytest.raises(ValueError, match=r"the last stage's forward must return the loss"):
        loss_of(out)


def _two_stages(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    plan = plan_stages(model, 2)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for rank, stage in enumerate((first, last)):
        build_stage(stage, plan, rank).running = True
        stage.received = []  # type: ignore[assignment]
    return first, last


def test_the_target_keywords_are_the_three_known() -> None:
    assert set(TARGET_NAMES) == {"labels", "targets", "target"}


@pytest.mark.parametrize("name", ["labels", "targets", "target"])
def test_every_target_keyword_reaches_the_last_stage_only(name: str) -> None:
    ids = torch.randint(0, WIDTH, (2, 3), generator=torch.Generator().manual_seed(0))
    whole = _tiny()
    want = whole(ids, **{name: ids})
    first, last = _two_stages(whole)
    hidden = first(idx=ids, **{name: ids})
    got = last(hidden, idx=ids, **{name: ids})
    assert first.received == [set()] and last.received == [{name}]
    assert torch.equal(got, want)


def test_a_block_called_by_keyword_receives_the_hidden_states_under_its_first_argument() -> None:
    """`block(x=h)`: the stage's received states enter as `x`, the block's first argument,
    not as another keyword it takes (`gate`) or a fixed name."""
    ids = torch.randint(0, WIDTH, (2, 3), generator=torch.Generator().manual_seed(1))
    whole = _tiny()
    want = whole(ids, labels=ids)
    first, last = _two_stages(whole)
    got = last(first(idx=ids, labels=ids), idx=ids, labels=ids)
    assert torch.equal(got, want)


def test_the_last_stage_names_each_tied_parameter_by_its_first_stage_name() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=6, d_model=16, n_layers=2))
    by_object: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(p), []).append(name)
    tied = [names for names in by_object.values() if len(names) > 1]
    assert tied == [["tok_emb.weight", "head.weight"]]  # the embedding first, the head last
    plan = plan_stages(model, 2)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    build_stage(first, plan, 0)
    build_stage(last, plan, 1)
    assert tied_aliases(last) == {"head.weight": "tok_emb.weight"}
    assert tied_aliases(first) == {}
    assert tied_aliases(model) == {}  # no stages


# --- the batch -----------------------------------------------------------------------------


def test_each_form_of_a_batch_becomes_the_forwards_keywords() -> None:
    state = SimpleNamespace(signature=inspect.signature(GPT.forward))
    x, y = torch.zeros(2, 3), torch.ones(2, 3)
    cases = [({"idx": x, "targets": y}, {"idx": x, "targets": y}), ((x, y), {"idx": x, "targets": y}),
             ([x, y], {"idx": x, "targets": y}), (x, {"idx": x})]  # fmt: skip
    for batch, want in cases:
        got = batch_keywords(state, batch)  # type: ignore[arg-type]
        assert got.keys() == want.keys() and all(got[k] is want[k] for k in want), batch


def test_a_causal_lm_counts_the_labels_it_predicts_after_the_shift() -> None:
    """A causal LM predicts token t + 1 from the first t, so the first label of each row is
    never a target: the count is over labels[..., 1:] that are not -100 (at least 1)."""
    causal = SimpleNamespace(loss_type="ForCausalLM")
    labels = torch.tensor([[1, -100, -100, 2], [5, 6, 7, -100]])
    # Row 0 predicts -100, -100, 2; row 1 predicts 6, 7, -100: three targets. Counting every
    # label would give 5, dropping the last column instead of the first 4.
    want = sum(int(v != -100) for row in labels.tolist() for v in row[1:])
    assert want == 3
    got = _counted_tokens(causal, {"labels": labels})  # type: ignore[arg-type]
    assert isinstance(got, torch.Tensor) and int(got) == want
    ignored = torch.full((2, 4), -100)
    assert int(_counted_tokens(causal, {"labels": ignored})) == 1  # type: ignore[arg-type]
    assert _counted_tokens(nn.Linear(1, 1), {"labels": labels}) is None  # another model's loss


@pytest.mark.parametrize("split", ["auto", ("2",)], ids=["auto", "given"])
def test_a_model_that_is_its_own_list_of_blocks_is_refused_by_the_reason(split: object) -> None:
    """A bare Sequential of blocks cannot take the targets its last stage needs for the loss;
    its 'auto' split failed with KeyError '.0', a given one named blocks '.1' to '.3'."""
    model = nn.Sequential(*(_Block() for _ in range(4)))
    with pytest.raises(ValueError, match=r"pp_split: the blocks are the Sequential itself, and "
                       r"a pipeline's last stage runs the model's forward"):  # fmt: skip
        plan_stages(model, 2, split)  # type: ignore[arg-type]
