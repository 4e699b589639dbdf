"""The configuration schema: round trip, overrides, every error, and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import ParallelConfig, RunnerConfig
from shardwise.cli import main
from shardwise.cli.demo import DemoConfig
from shardwise.config.run_file import (
    REFERENCE_BEGIN,
    REFERENCE_END,
    Config,
    ConfigError,
    OptimizerConfig,
    apply_overrides,
    dump_config,
    from_dict,
    load_config,
    parse_override,
    reference_markdown,
    to_dict,
    update_reference,
)

ROOT = Path(__file__).resolve().parents[3]
CONFIG_PAGE = ROOT / "docs" / "configuration.md"


def test_defaults_round_trip():
    config = Config()
    assert from_dict(Config, yaml.safe_load(dump_config(config))) == config


def test_non_default_round_trip_through_a_file(tmp_path):
    config = Config(
        parallel=ParallelConfig(
            strategy="HYBRID_SHARD",
            dp_shard=2,
            mixed_precision="bf16",
            keep_fp32=["LayerNorm"],
            ignored_modules=["re:pos_emb"],
        ),
        optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
        runner=RunnerConfig(max_steps=10, max_epochs=None, resume="latest", save_every=5),
    )
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(config))
    loaded = load_config(path)
    assert loaded == config
    assert loaded.parallel.strategy == "hybrid_shard" and loaded.parallel.keep_fp32 == (
        "LayerNorm",
    )


def test_demo_config_round_trip():
    config = DemoConfig()
    assert from_dict(DemoConfig, yaml.safe_load(dump_config(config))) == config


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("runner:\n  max_steps: 10\n  max_epochs: null\noptimizer:\n  lr: 0.01\n")
    config = load_config(
        path, ["runner.max_steps=20", "optimizer.betas=[0.8, 0.9]", "parallel.strategy=ddp"]
    )
    assert (
        config.runner.max_steps,
        config.optimizer.lr,
        config.optimizer.betas,
        config.parallel.strategy,
    ) == (20, 0.01, (0.8, 0.9), "ddp")


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"runer": {}},
            r"unknown key 'runer'\. Did you mean 'runner'\? Valid keys: \['adapter', 'optimizer', 'parallel', 'runner', 'scheduler', 'train'\]",
        ),
        (
            {"runner": {"max_step": 3}},
            r"unknown key 'runner\.max_step'\. Did you mean 'max_steps'\? Valid keys in runner: \[",
        ),
        (
            {"runner": {"max_steps": "ten"}},
            r"runner\.max_steps: expected int \| null, got str \('ten'\)",
        ),
        ({"runner": {"progress": 1}}, r"runner\.progress: expected bool, got int \(1\)"),
        ({"optimizer": {"lr": "fast"}}, r"optimizer\.lr: expected float, got str"),
        (
            {"optimizer": {"betas": [0.9]}},
            r"optimizer\.betas: expected 2 values \(tuple\[float, float\]\), got 1",
        ),
        (
            {"optimizer": {"name": "adamm"}},
            r"optimizer\.name='adamm' is not allowed\. Did you mean 'adam'\? Choose one of \['adamw', 'adam', 'sgd', 'muon'\]",
        ),
        ({"runner": 3}, r"runner: expected RunnerConfig, got int \(3\)"),
        (
            {"parallel": {"strategy": "zero4"}},
            r"parallel: ParallelConfig\.strategy='zero4' is not a known strategy",
        ),
        (
            {"train": {"accumulate_steps": 0}},
            r"train: TrainConfig\.accumulate_steps=0 must be an int >= 1",
        ),
        ({"optimizer": {"lr": 0}}, r"optimizer\.lr=0\.0 must be a finite number > 0"),
    ],
)
def test_every_error_names_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(Config, data)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("runner.max_steps", r"override 'runner\.max_steps' is not of the form section\.key=value"),
        ("runner..max_steps=3", r"'runner\.\.max_steps' is not a dotted key"),
        ("1runner.x=3", r"is not a dotted key"),
        ("runner.max_steps=[1", r"the value is not valid YAML"),
    ],
)
def test_bad_overrides(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_override(text)


def test_override_into_a_value_not_a_section():
    with pytest.raises(ConfigError, match=r"'max_steps' is a value, not a section"):
        apply_overrides({"runner": {"max_steps": 3}}, ["runner.max_steps.x=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("runner: [unclosed")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"the top level must be a mapping of sections, got list"):
        load_config(listy)


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("runner: !!python/object/apply:os.system ['touch /tmp/shardwise_yaml_pwned']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(evil)
    assert not Path("/tmp/shardwise_yaml_pwned").exists()


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    # Before: the last one silently won; a second `runner:` replaced the first whole, so its
    # max_steps became null.
    twice = tmp_path / "twice.yaml"
    twice.write_text("optimizer:\n  lr: 1.0e-3\n  lr: 1.0e-2\n")
    with pytest.raises(
        ConfigError, match=rf"{twice}: key 'lr' appears twice in the same mapping, on lines 2 and 3"
    ):
        load_config(twice)
    twice.write_text(
        "runner:\n  max_steps: 5\ntrain:\n  max_grad_norm: 1.0\nrunner:\n  batch_size: 4\n"
    )
    with pytest.raises(
        ConfigError, match=r"key 'runner' appears twice in the same mapping, on lines 1 and 5"
    ):
        load_config(twice)
    twice.write_text("runner:\n  max_steps: 5\ntrain:\n  max_steps: 5\n")  # one per section
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_steps'"):
        load_config(twice)


def test_objects_that_yaml_cannot_hold():
    config = Config(parallel=ParallelConfig(auto_wrap_policy=lambda fqn, module: False))
    with pytest.raises(
        ConfigError, match=r"auto_wrap_policy=<function .*> cannot be written to YAML"
    ):
        to_dict(config)


def test_floats_in_yaml_exponent_form():
    # PyYAML reads 1e-4 (no dot) as a string; float fields accept it as the number it is.
    assert load_config(None, ["optimizer.lr=1e-4"]).optimizer.lr == 1e-4


# --- property-based tests of the override parser ----------------------------------------------

keys = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
scalars = st.one_of(
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(),
    st.none(),
    st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4))


@settings(max_examples=200, deadline=None)
@given(path=st.lists(keys, min_size=1, max_size=4), value=values)
def test_override_round_trips_any_value(path, value):
    text = f"{'.'.join(path)}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
    parts, parsed = parse_override(text)
    assert parts == path
    assert parsed == value or (isinstance(value, float) and parsed == pytest.approx(value))


@settings(max_examples=100, deadline=None)
@given(path=st.lists(keys, min_size=1, max_size=3), value=scalars, other=scalars)
def test_later_overrides_win_and_others_are_kept(path, value, other):
    data = {"keep": {"me": 1}}
    key = ".".join(path)
    result = apply_overrides(
        data,
        [
            f"{key}={yaml.safe_dump(other, default_flow_style=True).strip().removesuffix('...').strip()}",
            f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}",
        ],
    )
    node = result
    for part in path[:-1]:
        node = node[part]
    got = node[path[-1]]
    assert got == value or (isinstance(value, float) and got == pytest.approx(value))
    if path[0] != "keep":
        assert result["keep"] == {"me": 1}
    assert data == {"keep": {"me": 1}}  # the input is not modified


@settings(max_examples=50, deadline=None)
@given(
    steps=st.integers(1, 10**6),
    lr=st.floats(1e-6, 1.0),
    strategy=st.sampled_from(["ddp", "full_shard", "shard_grad_op", "no_shard"]),
)
def test_overrides_build_valid_configs(steps, lr, strategy):
    config = load_config(
        None, [f"runner.max_steps={steps}", f"optimizer.lr={lr!r}", f"parallel.strategy={strategy}"]
    )
    assert (config.runner.max_steps, config.optimizer.lr, config.parallel.strategy) == (
        steps,
        lr,
        strategy,
    )


# --- the docs' reference is generated, so it cannot drift ----------------------------------


def test_docs_reference_matches_the_schema():
    text = CONFIG_PAGE.read_text()
    block = text.split(REFERENCE_BEGIN, 1)[1].split(REFERENCE_END, 1)[0]
    assert block.strip() == reference_markdown().strip(), (
        "docs/configuration.md's config reference is out of date: run "
        "`shardwise config reference --update docs/configuration.md`"
    )


def test_reference_command_as_documented_leaves_the_page_as_it_is(tmp_path, monkeypatch, capsys):
    # The page's own command, run from a copy of the repository's docs/ so nothing is written.
    (tmp_path / "docs").mkdir()
    copy = tmp_path / "docs" / "configuration.md"
    copy.write_text(CONFIG_PAGE.read_text())
    monkeypatch.chdir(tmp_path)
    assert "`shardwise config reference --update docs/configuration.md`" in CONFIG_PAGE.read_text()
    assert main(["config", "reference", "--update", "docs/configuration.md"]) == 0
    assert capsys.readouterr().out == "docs/configuration.md: already up to date\n"
    assert main(["config", "reference", "--update"]) == 0  # the page is the default
    assert capsys.readouterr().out == "docs/configuration.md: already up to date\n"
    copy.write_text(copy.read_text().replace("Peak learning rate.", "stale"))
    assert main(["config", "reference", "--update"]) == 0
    assert capsys.readouterr().out == "docs/configuration.md: updated\n"
    assert copy.read_text() == CONFIG_PAGE.read_text()


def test_update_reference_needs_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# no markers\n")
    with pytest.raises(ConfigError, match=r"page.md has no generated-reference markers"):
        update_reference(page)


def test_reference_lists_every_key_with_its_doc():
    ref = reference_markdown()
    for section, cls in (
        ("runner", RunnerConfig),
        ("parallel", ParallelConfig),
        ("optimizer", OptimizerConfig),
    ):
        for name in cls.__dataclass_fields__:
            if cls.__dataclass_fields__[name].init:
                assert f"`{section}.{name}`" in ref
    assert "Save a checkpoint every N optimizer steps" in ref


def test_overrides_keep_the_sections_own_defaults():
    # The demo's runner saves at the end by default; overriding another runner key keeps that.
    demo = load_config(None, ["runner.max_steps=6"], cls=DemoConfig)
    assert demo.runner.max_steps == 6 and demo.runner.save_at_end is True
    assert demo.runner.run_dir == DemoConfig().runner.run_dir


def test_a_multi_node_job_is_named_at_the_rendezvous_by_its_id_or_slurms(monkeypatch):
    # torch keys a rendezvous by its id ('none' by default): two jobs on one store with the
    # same id would join one job.
    from torch.distributed.run import get_args_parser

    from shardwise.cli import build_parser, launcher_args

    def torchrun(*flags: str):
        args = build_parser().parse_args(["run", *flags, "train.py"])
        return get_args_parser().parse_args([*launcher_args(args), "train.py"])

    multi = ("--nnodes", "1:2", "--rdzv-endpoint", "head:29400")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert torchrun(*multi).rdzv_id == "none"  # torchrun's default
    assert torchrun(*multi, "--rdzv-id", "lm-7").rdzv_id == "lm-7"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert torchrun(*multi).rdzv_id == "4242"
    assert torchrun(*multi, "--rdzv-id", "lm-7").rdzv_id == "lm-7"
    assert "--rdzv_id" not in launcher_args(build_parser().parse_args(["run", "train.py"]))


def test_run_flags_map_onto_torchrun():
    from argparse import Namespace

    from shardwise.cli import launcher_args

    single = launcher_args(
        Namespace(nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None, max_restarts=0)
    )
    assert single == [
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--standalone",
        "--max_restarts",
        "0",
    ]
    multi = launcher_args(
        Namespace(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="head:29400", max_restarts=3)
    )
    assert multi == [
        "--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "head:29400", "--max_restarts", "3",
    ]  # fmt: skip
    # ...and torchrun itself accepts them.
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args([*multi, "train.py"])
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint, parsed.max_restarts) == (
        "2",
        1,
        "head:29400",
        3,
    )
