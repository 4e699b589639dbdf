"""ShardwiseTrainer's checks, in one process and without launching: the Trainer arguments it
translates, each one it refuses and the words it refuses with. Training under the Trainer
is proven against the Trainer's own DDP in tests/integrations/test_transformers_trainer.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
import transformers
from transformers import Trainer, TrainingArguments

from shardwise import CheckpointError, ParallelConfig
from shardwise.config.run_file import Config
from shardwise.integrations.transformers import (
    ShardwiseTrainer,
    _sharded_dir,
    shardwise_trainer,
    trainer_config,
)


def _args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def _set(tmp_path: Path, **attrs: Any) -> TrainingArguments:
    """Arguments with fields set after construction (some would import their backend)."""
    args = _args(tmp_path)
    for k, v in attrs.items():
        setattr(args, k, v)
    return args


def test_plain_arguments_keep_the_config(tmp_path: Path) -> None:
    config = ParallelConfig(strategy="hybrid_shard", dp_shard=2)
    assert trainer_config(config, _args(tmp_path)) == config
    assert trainer_config(Config(parallel=config), _args(tmp_path)) == config


def test_bf16_is_shardwise_bf16_policy(tmp_path: Path) -> None:
    assert trainer_config(ParallelConfig(), _args(tmp_path, bf16=True)).mixed_precision == "bf16"
    assert trainer_config(ParallelConfig(), _args(tmp_path)).mixed_precision == "fp32"
    with pytest.raises(ValueError, match=r"bf16=True and ParallelConfig.mixed_precision='fp16'"):
        trainer_config(ParallelConfig(mixed_precision="fp16"), _args(tmp_path, bf16=True))


def test_a_float16_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' computes in float16"):
        trainer_config(ParallelConfig(mixed_precision="fp16"), _args(tmp_path))


def test_activation_checkpointing_is_shardwise_checkpointing(tmp_path: Path) -> None:
    for kw in ({"activation_checkpointing": True}, {"gradient_checkpointing": True}):
        config = trainer_config(ParallelConfig(), _args(tmp_path, **kw))
        assert config.activation_checkpointing == "full"
    kept = ParallelConfig(activation_checkpointing="every_2")
    assert trainer_config(kept, _args(tmp_path, activation_checkpointing=True)) == kept
    assert trainer_config(ParallelConfig(), _args(tmp_path)).activation_checkpointing == "none"
    with pytest.raises(
        ValueError, match=r"activation_checkpointing_kwargs=\{'use_reentrant': True\}"
    ):
        trainer_config(
            ParallelConfig(),
            _args(
                tmp_path,
                activation_checkpointing=True,
                activation_checkpointing_kwargs={"use_reentrant": True},
            ),
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("find_unused_parameters", True),
        ("bucket_cap_mb", 5),
        ("broadcast_buffers", False),
        ("static_graph", True),
    ],
)
def test_ddp_arguments_are_ddp_keywords(tmp_path: Path, field: str, value: Any) -> None:
    args = _args(tmp_path, **{f"ddp_{field}": value})
    config = trainer_config(ParallelConfig(strategy="ddp"), args)
    assert getattr(config, field) == value
    with pytest.raises(ValueError, match=field):  # FSDP2 has no such keyword: refused
        trainer_config(ParallelConfig(strategy="full_shard"), args)
    other = not value if isinstance(value, bool) else 7
    with pytest.raises(ValueError, match=rf"ddp_{field}={value!r} and ParallelConfig.{field}"):
        trainer_config(ParallelConfig(strategy="ddp", **{field: other}), args)


@pytest.mark.parametrize(
    ("attrs", "named"),
    [
        ({"fsdp": [transformers.trainer_utils.FSDPOption.FULL_SHARD]}, r"TrainingArguments.fsdp="),
        ({"fsdp_config": {"min_num_params": 10}}, r"TrainingArguments.fsdp_config="),
        ({"deepspeed": "ds_config.json"}, r"TrainingArguments.deepspeed='ds_config.json'"),
        ({"fp16": True}, r"TrainingArguments.fp16=True"),
        ({"mixed_precision": "fp16"}, r"TrainingArguments.fp16=True"),
        ({"fp16_full_eval": True}, r"TrainingArguments.fp16_full_eval=True"),
        ({"bf16_full_eval": True}, r"TrainingArguments.bf16_full_eval=True"),
        ({"torch_compile": True}, r"TrainingArguments.torch_compile=True"),
        ({"parallelism_config": object()}, r"TrainingArguments.parallelism_config="),
        ({"auto_find_batch_size": True}, r"TrainingArguments.auto_find_batch_size=True"),
    ],
)
def test_arguments_shardwise_would_change_are_refused(
    tmp_path: Path, attrs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        trainer_config(ParallelConfig(), _set(tmp_path, **attrs))


def test_accelerator_config_refusals(tmp_path: Path) -> None:
    args = _args(tmp_path, accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}})
    with pytest.raises(ValueError, match=r"gradient_accumulation_kwargs=\{'num_steps': 2\}"):
        trainer_config(ParallelConfig(), args)
    args = _args(tmp_path)
    args.accelerator_config.use_configured_state = True
    with pytest.raises(ValueError, match=r"accelerator_config.use_configured_state=True"):
        trainer_config(ParallelConfig(), args)
    kept = _args(tmp_path, accelerator_config={"even_batches": False, "split_batches": True})
    assert trainer_config(ParallelConfig(), kept) == ParallelConfig()


def test_layouts_the_loop_cannot_drive_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match=r"pp=2 inside the Hugging Face Trainer"):
        trainer_config(ParallelConfig(pp=2), _args(tmp_path))
    with pytest.raises(NotImplementedError, match=r"ep=2 inside the Hugging Face Trainer"):
        trainer_config(ParallelConfig(ep=2), _args(tmp_path))
    assert trainer_config(ParallelConfig(tp=2), _args(tmp_path)).tp == 2


def test_the_parallel_argument_is_required_and_typed(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"needs parallel=ParallelConfig"):
        trainer_config(None, _args(tmp_path))
    with pytest.raises(TypeError, match=r"expects a shardwise ParallelConfig or Config, got dict"):
        trainer_config({"strategy": "ddp"}, _args(tmp_path))  # type: ignore[arg-type]


def _tiny() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return transformers.LlamaForCausalLM(config)


def test_the_trainer_needs_args_and_a_built_model(tmp_path: Path) -> None:
    parallel = ParallelConfig()
    with pytest.raises(TypeError, match=r"needs args=TrainingArguments"):
        ShardwiseTrainer(model=_tiny(), parallel=parallel)
    with pytest.raises(TypeError, match=r"needs model=...: model_init"):
        ShardwiseTrainer(args=_args(tmp_path), model_init=_tiny, parallel=parallel)
    model = _tiny()
    model._tp_size = 2  # from_pretrained(tp_plan=...) sets it
    with pytest.raises(ValueError, match=r"sharded when it was loaded"):
        ShardwiseTrainer(model=model, args=_args(tmp_path), parallel=parallel)


def test_the_user_arguments_are_left_as_given(tmp_path: Path) -> None:
    args = _args(tmp_path, bf16=True, activation_checkpointing=True)
    trainer = ShardwiseTrainer(model=_tiny(), args=args, parallel=ParallelConfig())
    assert args.bf16 and args.activation_checkpointing and args.mixed_precision == "bf16"
    # The Trainer's own copy neither casts nor checkpoints: shardwise's policy does both.
    assert not trainer.args.bf16 and not trainer.args.activation_checkpointing
    assert trainer.args.mixed_precision == "no"
    assert trainer.shardwise_config.mixed_precision == "bf16"
    assert trainer.shardwise_config.activation_checkpointing == "full"


def test_shardwise_trainer_builds_from_any_trainer_and_refuses_dpo_and_grpo() -> None:
    class Mine(Trainer):
        pass

    made = shardwise_trainer(Mine)
    assert issubclass(made, Mine) and made.__name__ == "ShardwiseMine"
    assert shardwise_trainer(made) is made
    assert shardwise_trainer(ShardwiseTrainer) is ShardwiseTrainer
    with pytest.raises(
        TypeError, match=r"expects a transformers.Trainer subclass, got <class 'int'>"
    ):
        shardwise_trainer(int)
    for name, why in (("DPOTrainer", "reference model"), ("GRPOTrainer", "generates completions")):
        refused = type(name, (Trainer,), {})
        with pytest.raises(NotImplementedError, match=rf"shardwise_trainer\({name}\).*{why}"):
            shardwise_trainer(refused)
        subclass = type("MyTrainer", (refused,), {})  # a user's subclass is refused too
        with pytest.raises(
            NotImplementedError, match=rf"\(MyTrainer\) is not built: it \({name}\) .*{why}"
        ):
            shardwise_trainer(subclass)


def test_save_model_replaces_its_weights_and_leaves_the_rest(tmp_path: Path) -> None:
    trainer = ShardwiseTrainer(model=_tiny(), args=_args(tmp_path), parallel=ParallelConfig())
    out = tmp_path / "saved"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_text("an older, larger save")
    trainer.save_model(str(out))
    trainer.save_model(str(out))  # a second save over the first
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
        "training_args.bin",
    ]
    assert (out / "notes.txt").read_text() == "mine"
    reopened = transformers.LlamaForCausalLM.from_pretrained(out)
    for (name, a), b in zip(trainer.model.named_parameters(), reopened.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()), name


def test_a_resume_needs_a_shardwise_checkpoint(tmp_path: Path) -> None:
    plain = tmp_path / "checkpoint-3"
    plain.mkdir()
    with pytest.raises(CheckpointError, match=r"checkpoint-3 holds no shardwise/ directory"):
        _sharded_dir(plain)
    (plain / "shardwise").mkdir()
    assert _sharded_dir(plain) == plain / "shardwise"


def test_save_models_barriers_are_guarded_and_say_what_they_wait_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank missing at either barrier of save_model is named by watchdog.guard (its own
    tests show the message): both barriers run inside it, each saying what it waits for."""
    import contextlib

    import shardwise.integrations.transformers as hf

    events: list[str] = []

    @contextlib.contextmanager
    def guard(what: str) -> Any:
        events.append(f"enter {what}")
        yield
        events.append("exit")

    with monkeypatch.context() as m:  # undone before the suite's own process-group check
        m.setattr(hf, "guard", guard)
        m.setattr(hf.dist, "is_initialized", lambda: True)
        m.setattr(hf.dist, "barrier", lambda: events.append("barrier"))
        m.setattr(hf, "export_weights", lambda model, out: events.append("export"))
        hf._export_beside(torch.nn.Linear(2, 2), tmp_path / "out", writes=False)
    assert events == [
        "enter save_model: rank 0 clearing the staging directory", "barrier", "exit",
        "export",
        "enter save_model: rank 0 moving the exported files into place", "barrier", "exit",
    ]  # fmt: skip
