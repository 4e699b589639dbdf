"""Tensor-parallel plans and their checks, before any process group (issue 24)."""

from __future__ import annotations

import re

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise import ParallelConfig, resolve_mesh
from shardwise.parallelize.tensor import check_tensor_parallel, resolve_tp_plan


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)


def _llama(**sizes: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**config, **sizes}))


def test_a_model_without_a_plan_is_refused_naming_tp_plan():
    with pytest.raises(
        ValueError, match=r"tp_plan='auto' but MLP has no tensor-parallel plan .*e\.g\. tp_plan=\{"
    ):
        resolve_tp_plan(MLP(), "auto")


def test_a_dict_plan_becomes_torch_styles_and_a_typo_is_refused():
    plan = resolve_tp_plan(MLP(), {"up": "colwise", "down": RowwiseParallel()})
    assert isinstance(plan, dict)
    assert isinstance(plan["up"], ColwiseParallel) and isinstance(plan["down"], RowwiseParallel)
    with pytest.raises(ValueError, match=r"names 'upp', which matches no module of MLP"):
        resolve_tp_plan(MLP(), {"upp": "colwise"})


def test_a_hugging_face_models_own_plan_is_read():
    plan = resolve_tp_plan(_llama(), "auto")
    assert isinstance(plan, dict)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)


class Holder(nn.Module):
    """A host's module (a LightningModule, a wrapper of one's own) holding a model with a plan."""

    def __init__(self, **sizes: int) -> None:
        super().__init__()
        self.model, self.head = _llama(**sizes), nn.Linear(4, 4)


def test_a_module_holding_a_hugging_face_model_takes_its_plan_under_its_name():
    plan = resolve_tp_plan(Holder(), "auto")
    assert isinstance(plan, dict)
    assert isinstance(plan["model.model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert not any(k.startswith(("model.layers", "head")) for k in plan)  # outermost only
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's config.num_key_value_heads=2"):
        check_tensor_parallel(Holder(), ParallelConfig(tp=4))  # its sizes are checked too


def test_tp_that_does_not_divide_the_kv_heads_fails_at_plan_time_in_one_line():
    # Before: accepted, and failed in the first forward with a reshape error.
    with pytest.raises(ValueError) as caught:
        check_tensor_parallel(_llama(), ParallelConfig(tp=4))
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(
        "ParallelConfig.tp=4: LlamaForCausalLM's config.num_key_value_heads=2 does not divide by 4"
    )
    assert (
        "tp values that divide all of num_attention_heads, num_key_value_heads, intermediate_size, vocab_size: [2]"
        in said
    )
    check_tensor_parallel(_llama(), ParallelConfig(tp=2))  # fits


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"strategy": "ddp", "tp": 2}, r"tp=2 with strategy='ddp'.*Use strategy='no_shard'"),
        ({"tp": 0}, r"ParallelConfig.tp=0 must be >= 1"),
        ({"tp": 2, "tp_plan": "megatron"}, r"tp_plan='megatron': use 'auto'"),
        (
            {"tp": 2, "tp_plan": {"up": "diagonal"}},
            r"tp_plan\['up'\]='diagonal': use one of colwise, rowwise",
        ),
        ({"loss_parallel": True}, r"loss_parallel=True needs tp > 1"),
        ({"sequence_parallel": True}, r"sequence_parallel=True needs tp > 1"),
        (
            {"tp": 2, "sequence_parallel": True, "tp_plan": lambda model, mesh: None},
            r"sequence_parallel=True with a callable tp_plan: .* leave sequence_parallel off",
        ),
    ],
)
def test_config_refuses_what_cannot_work(kwargs, said):
    with pytest.raises(ValueError, match=said):
        ParallelConfig(**kwargs)


def test_the_mesh_puts_tp_innermost_and_checks_it_divides():
    spec = resolve_mesh("hybrid_shard", -1, 16, local_world_size=8, tp=2)
    assert (spec.dp_replicate, spec.dp_shard, spec.tp, spec.dp_size) == (2, 4, 2, 8)
    assert "x tp 2 = world 16" in str(spec)
    # With tp, hybrid over (replicate 2, shard 1) is a real layout (refused without tp).
    spec = resolve_mesh("hybrid_shard", -1, 4, tp=2)
    assert (spec.dp_replicate, spec.dp_shard, spec.tp) == (2, 1, 2)
    with pytest.raises(
        ValueError, match=r"tp=4 does not divide the 6 ranks .* Choose tp in \[2, 3, 6\]"
    ):
        resolve_mesh("full_shard", -1, 6, tp=4)


def _moe(family: str = "mixtral", **sizes: object) -> nn.Module:
    import transformers

    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
    if family == "mixtral":
        config["num_local_experts"] = 4
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**config, **sizes}))
    config.update(num_experts=4, moe_intermediate_size=8, head_dim=4)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**config, **sizes}))


def test_a_plan_word_not_built_yet_is_refused_not_skipped():
    # A packed Linear outside a 'moe_tp_experts' module: skipping it would train it whole on
    # every rank while its neighbours are split.
    with pytest.raises(
        NotImplementedError, match=r"plan word 'packed_colwise' is not supported yet"
    ):
        resolve_tp_plan(MLP(), {"up": "packed_colwise"})


def test_the_experts_entries_of_a_mixture_of_experts_plan_become_one_style():
    from torch.distributed.tensor import Replicate, Shard

    from shardwise.parallelize.moe import ExpertsParallel
    from shardwise.parallelize.sequence import HiddenStates

    # Mixtral's plan names the experts' parameters ('...experts.gate_up_proj': 'packed_colwise'),
    # which are not modules: they are folded into the experts module's entry.
    plan = check_tensor_parallel(_moe(), ParallelConfig(tp=2)).apply
    assert isinstance(plan, dict)
    experts = plan["model.layers.*.mlp.experts"]
    assert isinstance(experts, ExpertsParallel)
    assert experts.splits == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    assert not any(k.endswith("_proj") and ".experts." in k for k in plan)
    # Qwen3-MoE's plan also names a dense MLP (mlp.gate_proj) that a config with experts in
    # every layer lacks: the model's own plan may name what this config does not build.
    qwen = resolve_tp_plan(_moe("qwen3_moe"), "auto")
    assert isinstance(qwen, dict) and "model.layers.*.mlp.gate_proj" not in qwen
    assert isinstance(qwen["model.layers.*.mlp.experts"], ExpertsParallel)
    # Under sequence_parallel the MoE block takes whole tokens as a plain tensor (its router
    # is whole) and cuts its summed output back to this rank's tokens.
    sp = check_tensor_parallel(_moe(), ParallelConfig(tp=2, sequence_parallel=True)).apply
    assert isinstance(sp, dict)
    block = sp["model.layers.1.mlp"]
    assert isinstance(block, HiddenStates) and block.local_input
    assert (block.given, block.wanted, block.out) == (
        Shard(1),
        Replicate(),
        (Replicate(), Shard(1)),
    )


@pytest.mark.parametrize(
    ("family", "cls", "field"),
    [
        ("mixtral", "MixtralForCausalLM", "intermediate_size"),
        ("qwen3_moe", "Qwen3MoeForCausalLM", "moe_intermediate_size"),
    ],
)
def test_an_expert_size_that_does_not_divide_tp_fails_at_plan_time_in_one_line(family, cls, field):
    with pytest.raises(ValueError) as caught:
        check_tensor_parallel(_moe(family, **{field: 7}), ParallelConfig(tp=2, tp_plan="auto"))
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(f"ParallelConfig.tp=2: {cls}'s config.{field}=7 does not divide by 2"), (
        said
    )


def test_experts_whose_parameters_the_plan_does_not_all_split_are_refused():
    from shardwise.parallelize.moe import ExpertsParallel

    half = ExpertsParallel({"gate_up_proj": "packed_colwise"})  # down_proj would stay whole
    with pytest.raises(
        ValueError,
        match=r"'moe_tp_experts' module model.layers.0.mlp.experts has the parameters \['down_proj', 'gate_up_proj'\]",
    ):
        resolve_tp_plan(_moe(), {"model.layers.*.mlp.experts": half})
    with pytest.raises(
        NotImplementedError, match=r"word 'colwise' on a parameter of a 'moe_tp_experts'"
    ):
        ExpertsParallel({"gate_up_proj": "colwise", "down_proj": "rowwise"})
    # A parameter's entry is read as one only under its experts module's entry.
    with pytest.raises(
        ValueError, match=r"names 'model.layers.\*.mlp.experts.down_proj', which matches no module"
    ):
        resolve_tp_plan(_moe(), {"model.layers.*.mlp.experts.down_proj": "rowwise"})


@pytest.mark.heavy
def test_the_simulation_models_tp_and_sequence_parallel():
    """Per rank at world 4: full_shard alone holds 1/4 of every parameter; with tp 2 the
    split layers are cut in 4 (2 tp parts, each sharded over 2) and the norms, whole on tp,
    in 2. Sequence parallel then lowers the activations. The simulation against a real run
    at world 4 is bench/memory_sim.py's (equal on CPU)."""
    import shardwise

    def peak(**kw: object) -> shardwise.SimReport:
        config = ParallelConfig(strategy="full_shard", **kw)  # type: ignore[arg-type]
        return shardwise.simulate_step(
            lambda: _llama(num_hidden_layers=2), config, world=4, batch=2, seq_len=32
        )

    fsdp, tp, sp = peak(), peak(tp=2), peak(tp=2, sequence_parallel=True)
    model = _llama(num_hidden_layers=2)
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert fsdp.at_peak["params"] == pytest.approx(total / 4, rel=0.02)
    assert tp.at_peak["params"] == pytest.approx((total - norms) / 4 + norms / 2, rel=0.02)
    assert tp.category_peaks["activations"] < fsdp.category_peaks["activations"]
    assert sp.category_peaks["activations"] < tp.category_peaks["activations"]
    assert str(sp).startswith("full_shard x tp 2 (sequence parallel) at world 4")
    # The instant estimate of model states under tp agrees with the simulation.
    from shardwise.memory.model_states import estimate_memory, tp_shares
    from shardwise.parallelize.tensor import split_parameters
    from shardwise.plan.planner import plan_wrap

    config = ParallelConfig(strategy="full_shard", tp=2)
    plan = plan_wrap(model, config)
    split = split_parameters(model, check_tensor_parallel(model, config))
    assert split is not None
    shares = tp_shares(model, plan, split, 2)
    (states,) = estimate_memory(plan, 4, tp=2, tp_share=shares, strategies=("full_shard",))
    assert states.params == pytest.approx(tp.at_peak["params"], rel=0.01)
    assert states.optimizer == pytest.approx(tp.at_peak["optimizer"], rel=0.01)
    assert states.grads == pytest.approx(tp.category_peaks["grads"], rel=0.01)


def test_loss_parallel_finds_the_head_or_says_how_to_give_it():
    plan = check_tensor_parallel(_llama(), ParallelConfig(tp=2, loss_parallel=True))
    assert isinstance(plan.apply, dict)
    head = plan.apply["lm_head"]
    assert isinstance(head, ColwiseParallel) and not head.use_local_output
    assert plan.described["lm_head"].startswith("colwise (loss_parallel")
    config = ParallelConfig(tp=2, loss_parallel=True, tp_plan={"up": "colwise", "down": "rowwise"})
    with pytest.raises(
        ValueError,
        match=r"no output head that keeps its logits split: give the head's tp_plan entry ColwiseParallel\(output_layouts=Shard\(-1\), use_local_output=False\)",
    ):
        check_tensor_parallel(MLP(), config)


def test_sequence_parallel_splits_tokens_inside_the_decoder_layers_only():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    from shardwise.parallelize.sequence import HiddenStates

    model = _llama(num_hidden_layers=3)
    plan = check_tensor_parallel(model, ParallelConfig(tp=2, sequence_parallel=True))
    styles = plan.apply
    assert isinstance(styles, dict)
    first, last = styles["model.layers.0"], styles["model.layers.2"]
    assert isinstance(first, HiddenStates) and first.wanted == Shard(1) and first.out is None
    assert isinstance(last, HiddenStates) and last.given is None
    assert last.out == (Shard(1), Replicate())
    assert "model.layers.1" not in styles  # the middle layers take and give split tokens
    for i in range(3):  # norms run on their own tokens; attention and MLP gather them
        assert isinstance(styles[f"model.layers.{i}.input_layernorm"], SequenceParallel)
        assert isinstance(styles[f"model.layers.{i}.self_attn"], HiddenStates)
        down = styles[f"model.layers.{i}.mlp.down_proj"]
        assert isinstance(down, RowwiseParallel) and down.output_layouts == (Shard(1),)
    for outside in ("model.norm", "model.embed_tokens", "lm_head"):
        assert not isinstance(styles.get(outside), (SequenceParallel, HiddenStates))
    assert plan.described["model.layers.*.input_layernorm"] == "sequence_parallel"


def test_sequence_parallel_without_a_list_of_layers_is_refused():
    config = ParallelConfig(
        tp=2, sequence_parallel=True, tp_plan={"up": "colwise", "down": "rowwise"}
    )
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel=True, but the plan splits no module inside a list of layers",
    ):
        check_tensor_parallel(MLP(), config)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))


@pytest.mark.parametrize(
    ("plan", "said"),
    [
        (
            {"layers.0": "colwise", "layers.*.up": "colwise"},
            r"the plan gives the whole layer layers\.0 a style; shardwise splits sequences only "
            r"around the layers' children",
        ),
        (
            {"layers.*.up": "colwise", "layers.*.norm": "replicated_with_grad_allreduce"},
            r"layers\.0\.norm has the style SequenceParallel, which shardwise cannot place on a "
            r"split sequence yet",
        ),
    ],
)
def test_sequence_parallel_refuses_a_plan_it_cannot_place(plan, said):
    config = ParallelConfig(tp=2, sequence_parallel=True, tp_plan=plan)
    with pytest.raises(NotImplementedError, match=said):
        check_tensor_parallel(_Stack(), config)


def test_sequence_parallel_refuses_experts_outside_a_layers_child():
    from shardwise.parallelize.moe import ExpertsParallel
    from shardwise.parallelize.sequence import add_sequence_parallel

    model = _Stack()
    model.experts = nn.Linear(8, 8)  # outside the layers: no block gathers its tokens
    plan = {"layers.0.up": ColwiseParallel(), "experts": ExpertsParallel({"weight": "rowwise"})}
    with pytest.raises(
        NotImplementedError, match=r"the experts experts do not sit directly inside"
    ):
        add_sequence_parallel(model, plan, {})


def test_the_tp_estimate_needs_the_shares_of_what_the_plan_splits():
    from shardwise.memory.model_states import estimate_memory
    from shardwise.plan.planner import plan_wrap

    plan = plan_wrap(_Stack(), ParallelConfig())
    with pytest.raises(ValueError, match=r"estimate_memory\(tp>1\) needs tp_share"):
        estimate_memory(plan, 4, tp=2)


# --- issue 34: every class of bad plan value, each by its message ------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("diagonal", r"'diagonal'"),  # a word shardwise does not know
        ("Colwise", r"'Colwise'"),  # a known word in the wrong case
        (ColwiseParallel, r"<class '[\w.]*ColwiseParallel'>"),  # the class, not an instance
        (None, r"None"),
        (1, r"1"),
        (["colwise"], r"\['colwise'\]"),
    ],
)
def test_a_plan_value_of_every_wrong_kind_is_refused(value, shown):
    with pytest.raises(
        ValueError,
        match=rf"ParallelConfig.tp_plan\['up'\]={shown}: use one of colwise, rowwise, "
        r"colwise_gather_output, .* or a torch ParallelStyle\.",
    ):
        ParallelConfig(tp=2, tp_plan={"up": value, "down": "rowwise"})


@pytest.mark.parametrize("plan", [3, ["up", "colwise"], ("colwise",), None, b"auto"])
def test_a_plan_that_is_no_word_dict_or_callable_is_refused(plan):
    with pytest.raises(
        TypeError,
        match=rf"ParallelConfig.tp_plan={re.escape(repr(plan))}: use 'auto', a dict or a "
        r"callable \(model, tp_mesh\)\.",
    ):
        ParallelConfig(tp=2, tp_plan=plan)


def test_every_plan_word_and_a_style_instance_are_taken():
    from shardwise.config.tensor_parallel import TP_STYLE_NAMES

    for word in TP_STYLE_NAMES:
        assert ParallelConfig(tp=2, tp_plan={"up": word}).tp_plan == {"up": word}
    style = ColwiseParallel()
    assert ParallelConfig(tp=2, tp_plan={"up": style}).tp_plan["up"] is style


def test_a_moe_plan_naming_parameters_the_experts_lack_is_refused():
    from shardwise.parallelize.moe import ExpertsParallel

    # One more than the experts have: a typo, or another family's name (Qwen's up_proj).
    extra = ExpertsParallel(
        {"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "up_proj": "rowwise"}
    )
    with pytest.raises(
        ValueError,
        match=r"the 'moe_tp_experts' module model.layers.0.mlp.experts has the parameters "
        r"\['down_proj', 'gate_up_proj'\], but the plan splits \['down_proj', 'gate_up_proj', "
        r"'up_proj'\]: each of its own parameters, and no other, needs a split",
    ):
        resolve_tp_plan(_moe(), {"model.layers.*.mlp.experts": extra})
    # The same through the model's own plan words: an entry for a parameter they lack.
    words = {
        "model.layers.*.mlp.experts": "moe_tp_experts",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
        "model.layers.*.mlp.experts.bias": "rowwise",
    }
    with pytest.raises(ValueError, match=r"but the plan splits \['bias', 'down_proj', "):
        resolve_tp_plan(_moe(), words)
    # Renamed: each of the two names right, in the wrong places, is refused too.
    swapped = ExpertsParallel({"gate_proj": "packed_colwise", "down_proj": "rowwise"})
    with pytest.raises(ValueError, match=r"but the plan splits \['down_proj', 'gate_proj'\]"):
        resolve_tp_plan(_moe(), {"model.layers.*.mlp.experts": swapped})


def test_experts_holding_parameters_in_inner_modules_are_refused():
    from shardwise.parallelize.moe import ExpertsParallel

    model = _moe()
    for layer in model.model.layers:  # a parameter below the experts module: left whole
        layer.mlp.experts.scale = nn.Linear(2, 2, bias=False)
    whole = ExpertsParallel({"gate_up_proj": "packed_colwise", "down_proj": "rowwise"})
    with pytest.raises(
        ValueError,
        match=r"experts has the parameters \['down_proj', 'gate_up_proj'\] and inner ones "
        r"\['scale.weight'\], but the plan splits \['down_proj', 'gate_up_proj'\]",
    ):
        resolve_tp_plan(model, {"model.layers.*.mlp.experts": whole})
    # Without the inner module the same style is taken.
    assert resolve_tp_plan(_moe(), {"model.layers.*.mlp.experts": whole})
