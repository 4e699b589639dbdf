"""torchtitan job configs (the TOML files of its 2025 releases, or a dict of sections):
each translates to the documented layout, or is refused naming the key and the reason.
The sections follow the shapes torchtitan's Llama 3 train configs use; the values are this
file's own."""

from __future__ import annotations

import pytest
from _refusals import assert_refused, unnamed_keys

from shardwise.cli.main import main
from shardwise.config.run_file import ConfigError
from shardwise.config.torchtitan import translate_torchtitan

OWN = """[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[metrics]
log_freq = 10
enable_tensorboard = true

[model]
name = "llama3"
flavor = "8B"

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
"""
FSDP = (
    OWN
    + """
[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
fsdp_reshard_after_forward = "default"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
"""
)
HSDP_TP = (
    OWN
    + """
[training]
local_batch_size = 2
max_norm = 0.5

[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 2
tensor_parallel_degree = 2
enable_async_tensor_parallel = false

[activation_checkpoint]
mode = "full"

[compile]
enable = true
components = ["model", "loss"]
"""
)
PIPELINE = (
    OWN
    + """
[training]
local_batch_size = 8
mixed_precision_param = "float32"

[parallelism]
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "Interleaved1F1B"
num_pp_microbatches = 8
"""
)
DDP = """
[parallelism]
data_parallel_replicate_degree = 4
data_parallel_shard_degree = 1
"""


def _layout(config):  # type: ignore[no-untyped-def]
    p = config.parallel
    return (p.strategy, p.dp_shard, p.tp, p.sequence_parallel, p.pp, p.pp_schedule,
            str(p.precision), p.activation_checkpointing, config.train.max_grad_norm,
            config.runner.batch_size)  # fmt: skip


BF16 = "param=bfloat16 reduce=float32 output=None"


@pytest.mark.parametrize(
    ("text", "layout"),
    [
        (FSDP, ("full_shard", -1, 1, False, 1, "1f1b", BF16, "every_2", 1.0, 1)),
        (HSDP_TP, ("hybrid_shard", 2, 2, True, 1, "1f1b", BF16, "full", 0.5, 2)),
        (PIPELINE, ("shard_grad_op", -1, 1, False, 2, "interleaved_1f1b", "fp32", "none", 1.0,
                    8)),
        (DDP, ("ddp", -1, 1, False, 1, "1f1b", BF16, "none", 1.0, 8)),
    ],
    ids=["fsdp", "hsdp_tp", "pipeline", "ddp"],
)  # fmt: skip
def test_a_toml_translates_to_its_documented_layout(tmp_path, text, layout) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "llama3_8b.toml"
    path.write_text(text)
    translation = translate_torchtitan(path)
    assert _layout(translation.config) == layout, translation.table()


def test_the_rows_name_torchtitans_defaults_and_own_sections() -> None:
    import tomllib

    translation = translate_torchtitan(tomllib.loads(FSDP))
    rows = {r.key: r for r in translation.rows}
    assert rows["checkpoint"].verdict == "no effect" and rows["job"].verdict == "no effect"
    assert translation.config.runner.max_steps == 1000
    ddp = {r.key: r for r in translate_torchtitan(tomllib.loads(DDP)).rows}
    assert ddp["training.mixed_precision_param"].note == "torchtitan's default, bfloat16"
    tp = {r.key: r for r in translate_torchtitan(tomllib.loads(HSDP_TP)).rows}
    assert "sequence parallel on by default" in tp["parallelism.tensor_parallel_degree"].note
    pipeline = {r.key: r for r in translate_torchtitan(tomllib.loads(PIPELINE)).rows}
    assert "torchtitan's default under pp" in pipeline["parallelism.data_parallel_*_degree"].note


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (FSDP.replace('selective_ac_option = "2"', 'selective_ac_option = "op"'),
         {"activation_checkpoint.mode": "per-op selective checkpointing is not built"}),
        (DDP + "expert_tensor_parallel_degree = 2\n",
         {"parallelism.expert_tensor_parallel_degree": "not built"}),
        (DDP + "\n[float8]\nenable_fsdp_float8_all_gather = true\n",
         {"float8": "float8 training is not built"}),
        (DDP + "\n[lr_scheduler]\nwarmup_steps = 200\n",
         {"lr_scheduler": "warm-up, stable, decay schedule is not built"}),
        (DDP + 'pipeline_parallel_schedule = "ZBVZeroBubble"\n',
         {"parallelism.pipeline_parallel_schedule": "not built"}),
    ],
    ids=["per_op_ac", "expert_tensor_parallel", "float8", "wsd_schedule", "zbv"],
)  # fmt: skip
def test_what_cannot_mean_the_same_is_refused_by_key(tmp_path, text, refused) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert_refused(translate_torchtitan(path), refused)


def test_config_show_from_reads_a_toml_as_torchtitans(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.toml"
    path.write_text(HSDP_TP)
    assert main(["config", "show", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "strategy: hybrid_shard" in out and "sequence_parallel: true" in out
    path.write_text("[parallelism\n")
    assert main(["config", "show", "--from", str(path)]) == 2
    assert "is not TOML" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("replicate", "shard", "pp", "reshard", "strategy"),
    [
        (1, 4, 1, "default", "full_shard"),
        (1, 4, 2, "default", "shard_grad_op"),  # pp: torchtitan keeps the gathered weights
        (1, 4, 1, "never", "shard_grad_op"),
        (1, 4, 2, "always", "full_shard"),
        (2, 2, 1, "default", "hybrid_shard"),
        (2, 2, 2, "default", "hybrid_shard_zero2"),  # the replication kept under pp
        (2, 2, 1, "never", "hybrid_shard_zero2"),
        (2, 1, 1, "default", "ddp"),
        (2, 1, 2, "default", "ddp"),
    ],
)
def test_each_data_parallel_layout_and_reshard_setting_maps_to_its_strategy(
    replicate: int, shard: int, pp: int, reshard: str, strategy: str
) -> None:
    """Issue 48: every branch of the mapping, not only the first: replication and resharding
    are two separate choices, and neither may be lost to the other."""
    parallelism = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "pipeline_parallel_degree": pp,
        "fsdp_reshard_after_forward": reshard,
    }
    assert translate_torchtitan({"parallelism": parallelism}).parallel["strategy"] == strategy


@pytest.mark.parametrize(
    ("parallelism", "world", "strategy", "dp_shard"),
    [
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": -1}, 8,
         "hybrid_shard", 4),
        ({"data_parallel_replicate_degree": 2}, 8, "hybrid_shard", 4),  # shard -1: the default
        ({"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": -1,
          "pipeline_parallel_degree": 2}, 16, "hybrid_shard_zero2", 2),
        ({"data_parallel_replicate_degree": 2, "tensor_parallel_degree": 2,
          "context_parallel_degree": 2}, 24, "hybrid_shard", 3),
        ({"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1}, 8,
         "full_shard", None),
        ({}, None, "full_shard", None),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}, None, "ddp",
         None),
    ],
    ids=["replicate_2_shard_rest", "replicate_2_shard_default", "replicate_4_shard_rest_pp",
         "replicate_2_tp_cp", "replicate_1_shard_rest", "defaults", "replicate_2_shard_1"],
)  # fmt: skip
def test_a_shard_degree_of_the_rest_of_the_ranks_shards(
    parallelism, world, strategy, dp_shard
) -> None:  # type: ignore[no-untyped-def]
    """Fourth audit: data_parallel_shard_degree -1 (torchtitan's default) is the ranks
    left after the other degrees, more than one whenever replication leaves any: with
    replication that is HSDP, not DDP, which only a shard degree of 1 means; and its size
    is torchtitan's (world // the other degrees), not shardwise's own -1 (a node's ranks)."""
    translation = translate_torchtitan({"parallelism": parallelism}, world=world)
    assert translation.parallel["strategy"] == strategy
    assert translation.parallel.get("dp_shard") == dp_shard
    (row,) = [r for r in translation.rows if r.key == "parallelism.data_parallel_*_degree"]
    assert row.became == f"parallel.strategy='{strategy}'"


@pytest.mark.parametrize(
    ("degrees", "named"),
    [
        ({"data_parallel_shard_degree": 0}, "replicate 1 x shard 0 x tp 1 x pp 1"),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": -2},
         "replicate 2 x shard -2 x tp 1 x pp 1"),
        ({"data_parallel_replicate_degree": 0}, "replicate 0 x shard -1 x tp 1 x pp 1"),
        ({"tensor_parallel_degree": 0}, "replicate 1 x shard -1 x tp 0 x pp 1"),
        ({"pipeline_parallel_degree": -1}, "replicate 1 x shard -1 x tp 1 x pp -1"),
    ],
)  # fmt: skip
def test_a_degree_below_one_is_refused(degrees, named) -> None:  # type: ignore[no-untyped-def]
    # Before: a shard degree of 0 or -2 beside replicas became hybrid_shard over a node.
    translation = translate_torchtitan({"parallelism": degrees}, world=8)
    (row,) = [r for r in translation.rows if r.key == "parallelism.*_degree"]
    assert (row.value, row.verdict, row.note) == (
        named,
        "refused",
        "each degree is a whole number >= 1, and data_parallel_shard_degree may also be -1 "
        "(the rest of the ranks), as torchtitan requires",
    )
    assert "strategy" not in translation.parallel


def test_a_shard_degree_of_the_rest_beside_replicas_needs_the_world() -> None:
    hsdp = {"parallelism": {"data_parallel_replicate_degree": 4, "tensor_parallel_degree": 2}}
    assert_refused(translate_torchtitan(hsdp), {
        "parallelism.data_parallel_shard_degree": "-1 beside replicas is the ranks "
        "data_parallel_replicate 4 x tensor_parallel 2 x pipeline_parallel 1 x "
        "context_parallel 1 leave, and the world size is not known here: give the degree, "
        "or translate with world= (shardwise run --from passes it)"})  # fmt: skip
    assert_refused(translate_torchtitan(hsdp, world=12), {
        "parallelism.data_parallel_shard_degree": "-1 beside replicas: world 12 does not "
        "divide by data_parallel_replicate 4 x tensor_parallel 2 x pipeline_parallel 1 x "
        "context_parallel 1 = 8"})  # fmt: skip
    assert translate_torchtitan(hsdp, world=16).parallel["dp_shard"] == 2


def test_context_parallel_becomes_ulysses_and_says_so() -> None:
    import tomllib

    text = FSDP.replace(
        "pipeline_parallel_degree = 1\n",
        "pipeline_parallel_degree = 1\ncontext_parallel_degree = 2\n"
        'context_parallel_rotate_method = "allgather"\n',
    )
    translation = translate_torchtitan(tomllib.loads(text))
    rows = {r.key: r for r in translation.rows}
    assert translation.config.parallel.cp == 2
    cp = rows["parallelism.context_parallel_degree"]
    assert (cp.became, cp.verdict) == ("parallel.cp=2", "differs")
    assert "Ulysses" in cp.note and "in place of torch's ring" in cp.note
    assert rows["parallelism.context_parallel_rotate_method"].verdict == "no effect"
    one = FSDP.replace("pipeline_parallel_degree = 1\n", "pipeline_parallel_degree = 1\n"
                       "context_parallel_degree = 1\n")  # fmt: skip
    translated = translate_torchtitan(tomllib.loads(one))
    assert translated.config.parallel.cp == 1
    assert {r.key: r for r in translated.rows}["parallelism.context_parallel_degree"].verdict == (
        "exact"
    )


def test_the_optimizer_is_torchtitans_whatever_the_file_leaves_out() -> None:
    """torchtitan's AdamW defaults (lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1)
    where the file is silent: shardwise's own (lr 3e-4, weight_decay 0) would train another
    optimizer with no error (fresh audit: beta2 read as torch's 0.999 went unseen)."""
    import tomllib

    full = {"name": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert translate_torchtitan(tomllib.loads(FSDP)).optimizer == full  # eps, lr given
    silent = FSDP.replace("lr = 3e-4\neps = 1e-8\n", "")
    translated = translate_torchtitan(tomllib.loads(silent))
    assert translated.optimizer == {**full, "lr": 8e-4}
    rows = {r.key: r for r in translated.rows}
    assert rows["optimizer.weight_decay"].note == "torchtitan's default"
    assert translated.config.optimizer.weight_decay == 0.1
    assert translated.config.optimizer.lr == 8e-4
    one_beta = FSDP.replace("eps = 1e-8\n", "eps = 1e-8\nbeta2 = 0.99\nweight_decay = 0.0\n")
    got = translate_torchtitan(tomllib.loads(one_beta)).optimizer
    assert got == {**full, "betas": (0.9, 0.99), "weight_decay": 0.0}
    other_beta = FSDP.replace("eps = 1e-8\n", "eps = 1e-8\nbeta1 = 0.8\n")
    assert translate_torchtitan(tomllib.loads(other_beta)).optimizer["betas"] == (0.8, 0.95)
    nothing = translate_torchtitan(tomllib.loads(DDP)).optimizer  # no [optimizer] section
    assert nothing == {**full, "lr": 8e-4}


# --------------------------------------------------------------------------- issue 50: a newcomer


def test_a_misspelt_key_names_the_closest_key_of_its_level() -> None:
    translation = translate_torchtitan({
        "parallelsim": {},
        "parallelism": {"tensor_paralel_degree": 2},
        "training": {"local_bach_size": 2},
        "optimizer": {"weight_decy": 0.1},
        "activation_checkpoint": {"mdoe": "full"},  # was 'no effect': checkpointing lost
        "compile": {"enabel": True},
        "lr_scheduler": {"warmup_step": 2, "decay_ratio": 0.0, "warmup_steps": 0},
        "xyzzy": {},
    })  # fmt: skip
    assert {r.key: r.note for r in translation.refused} == {
        "parallelsim": "not a torchtitan section shardwise reads. Did you mean 'parallelism'?",
        "parallelism.tensor_paralel_degree": "not a [parallelism] key shardwise reads. Did you "
        "mean 'tensor_parallel_degree'?",
        "training.local_bach_size": "not a [training] key shardwise reads. Did you mean "
        "'local_batch_size'?",
        "optimizer.weight_decy": "not an [optimizer] key shardwise reads. Did you mean "
        "'weight_decay'?",
        "activation_checkpoint.mdoe": "not an [activation_checkpoint] key shardwise reads. Did "
        "you mean 'mode'?",
        "compile.enabel": "not a [compile] key shardwise reads. Did you mean 'enable'?",
        "lr_scheduler.warmup_step": "not a [lr_scheduler] key shardwise reads. Did you mean "
        "'warmup_steps'?",
        "xyzzy": "not a torchtitan section shardwise reads",
    }


def _pipeline(local: int | None, size: int, pp: int = 2, **more: int) -> dict:  # type: ignore[type-arg]
    training = {} if local is None else {"local_batch_size": local}
    parallelism = {"pipeline_parallel_degree": pp, "pipeline_parallel_microbatch_size": size}
    return {"parallelism": {**parallelism, **more}, "training": training}


@pytest.mark.parametrize(
    ("local", "size", "count"),
    [(12, 2, 6), (12, 4, 3), (None, 4, 2), (8, 8, 1)],  # None: torchtitan's local batch, 8
)
def test_the_micro_batch_size_becomes_the_count_of_micro_batches(local, size, count) -> None:  # type: ignore[no-untyped-def]
    # Values where the count differs from the size, from pp and from shardwise's 2 x pp.
    translation = translate_torchtitan(_pipeline(local, size))
    assert translation.parallel["pp_microbatches"] == count, translation.table()
    row = {r.key: r for r in translation.rows}["parallelism.pipeline_parallel_microbatch_size"]
    named = f"training.local_batch_size={local}" if local else (
        "training.local_batch_size=8 (torchtitan's default)")  # fmt: skip
    assert (row.became, row.note) == (
        f"parallel.pp_microbatches={count}",
        f"{named} // {size}, as torchtitan splits the local batch",
    )


@pytest.mark.parametrize(("local", "count"), [(12, 12), (None, 8), (6, 6)])
def test_a_file_silent_on_micro_batches_takes_torchtitans_micro_batches_of_one_row(
    local, count
) -> None:  # type: ignore[no-untyped-def]
    # torchtitan's micro-batch size defaults to 1: local_batch_size micro-batches, not
    # shardwise's own 2 x pp (which at pp 2 and pp 3 gives 4 and 6).
    for pp in (2, 3):
        data = _pipeline(local, 1, pp=pp)
        del data["parallelism"]["pipeline_parallel_microbatch_size"]
        translation = translate_torchtitan(data)
        assert translation.parallel["pp_microbatches"] == count, translation.table()
        key = "parallelism.pipeline_parallel_microbatch_size (torchtitan's default)"
        row = {r.key: r for r in translation.rows}[key]
        assert (row.value, row.became) == (1, f"parallel.pp_microbatches={count}")
    flat = _pipeline(local, 1, pp=1)
    del flat["parallelism"]["pipeline_parallel_microbatch_size"]
    one = translate_torchtitan(flat)  # pp 1: no micro-batches, and no row for them
    assert "pp_microbatches" not in one.parallel
    assert not any("microbatch" in r.key for r in one.rows)


def test_a_micro_batch_size_that_does_not_divide_the_batch_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        translate_torchtitan(_pipeline(8, 3)).config  # noqa: B018
    assert str(exc.value) == (
        "this torchtitan config cannot mean the same in shardwise; refused:\n"
        "  parallelism.pipeline_parallel_microbatch_size = 3: does not divide "
        "training.local_batch_size=8 (torchtitan refuses it too); give a divisor of 8 "
        "(1, 2, 4, 8)"
    )
    assert_refused(translate_torchtitan(_pipeline(None, 3)), {
        "parallelism.pipeline_parallel_microbatch_size": "does not divide "
        "training.local_batch_size=8 (torchtitan's default) (torchtitan refuses it too)"})  # fmt: skip
    assert_refused(translate_torchtitan(_pipeline(12, 2, num_pp_microbatches=4)), {
        "parallelism.pipeline_parallel_microbatch_size": "training.local_batch_size=12 // 2 = 6 "
        "micro-batches, and num_pp_microbatches says otherwise"})  # fmt: skip
    one = translate_torchtitan(_pipeline(8, 3, pp=1))  # pp 1: no micro-batches at all
    assert "pp_microbatches" not in one.parallel and not one.refused
    assert {r.key: r for r in one.rows}["parallelism.pipeline_parallel_microbatch_size"].note == (
        "pp is 1"
    )


@pytest.mark.parametrize("text", [FSDP, HSDP_TP, PIPELINE, DDP, OWN + """
[parallelism]
pipeline_parallel_degree = 2
pipeline_parallel_microbatch_size = 2
tensor_parallel_degree = 2
enable_sequence_parallel = false

[activation_checkpoint]
mode = "full"
selective_ac_option = "2"
preserve_rng_state = true

[compile]
enable = true
backend = "aot_eager"

[optimizer]
beta1 = 0.8
beta2 = 0.9

[lr_scheduler]
warmup_steps = 0
"""], ids=["fsdp", "hsdp_tp", "pipeline", "ddp", "each_key"])  # fmt: skip
def test_every_key_read_is_named_in_the_table(text) -> None:  # type: ignore[no-untyped-def]
    import tomllib

    data = tomllib.loads(text)
    translation = translate_torchtitan(data)
    for section in ("job", "metrics", "model", "checkpoint"):
        data.pop(section, None)  # torchtitan's own sections: one row for each, named
        assert section not in text or section in {r.key for r in translation.rows}
    assert unnamed_keys(translation, data) == [], translation.table()


def test_a_file_of_another_kind_is_named_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as exc:
        translate_torchtitan({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0})
    assert str(exc.value) == (
        "the config given is a DeepSpeed config (it has zero_optimization, gradient_clipping), "
        "not a torchtitan config: read it as DeepSpeed's (a .json file, --deepspeed or --from)."
    )
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(ConfigError) as exc:
        translate_torchtitan(path)
    assert str(exc.value) == (
        f"{path}: a .json file is a DeepSpeed config to shardwise, not a torchtitan one "
        "(.toml): read it with shardwise.translate_deepspeed (shardwise run --from picks the "
        "reader by the suffix)."
    )
