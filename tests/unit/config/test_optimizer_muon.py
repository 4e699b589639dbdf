"""`optimizer: {name: muon, ...}` in run files (issue 52): what it builds, and what it refuses.

A run file with muon trains through the path run files take (load_config, then the Engine
with `cfg.optimizer.build`, as examples/train_lm.py does) and lands bit for bit where
`shardwise.Muon` built by hand with the same hyperparameters lands; one hyperparameter
changed moves it. Every key and bad value is refused at load time in one line naming the
key, the value and the fix.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import shardwise
from shardwise.cli.main import main
from shardwise.config import ConfigError, load_config


class TinyLM(nn.Module):
    """Hidden matrices for Muon, and an embedding, norm, head and biases for the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.down(torch.relu(self.up(self.embed_tokens(tokens)))))
        return nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), labels.flatten())


FULL = """
optimizer:
  name: muon
  lr: 0.02
  weight_decay: 0.05
  momentum: 0.9
  nesterov: false
  eps: 1.0e-6
  ns_steps: 4
  ns_coefficients: [3.0, -4.0, 2.0]
  adjust_lr_fn: match_rms_adamw
  ns_dtype: float32
  fallback: {name: sgd, lr: 0.1, momentum: 0.5, weight_decay: 0.01}
  fallback_names: ['embed', 'norm', 'lm_head']
  matrix_names: ['lm_head']
"""


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _train(factory, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    engine = shardwise.Engine(TinyLM(), factory)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    losses = [float(engine.train_step((tokens, tokens))["loss"]) for _ in range(steps)]
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return losses, params, engine.optimizer


def _by_hand(**change):
    settings = dict(
        lr=0.02,
        weight_decay=0.05,
        momentum=0.9,
        nesterov=False,
        eps=1e-6,
        ns_steps=4,
        ns_coefficients=(3.0, -4.0, 2.0),
        adjust_lr_fn="match_rms_adamw",
        ns_dtype=torch.float32,
        fallback=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.01),
        fallback_names=("embed", "norm", "lm_head"),
        matrix_names=("lm_head",),
    )
    settings.update(change)
    return lambda params: shardwise.Muon(params, **settings)


def test_a_run_file_with_muon_trains_as_muon_built_by_hand(tmp_path):
    cfg = load_config(_write(tmp_path, FULL))
    losses, params, optimizer = _train(cfg.optimizer.build)
    hand_losses, hand_params, _ = _train(_by_hand())
    assert losses == hand_losses  # bit for bit: the same arithmetic
    for name, value in params.items():
        assert torch.equal(value, hand_params[name]), name
    assert isinstance(optimizer, shardwise.Muon)
    # matrix_names kept lm_head on Muon although fallback_names names it
    assert optimizer.matrix_names == ["up.weight", "down.weight", "lm_head.weight"]
    assert type(optimizer.fallback) is torch.optim.SGD
    # The same comparison rejects a run that differs in one hyperparameter.
    nesterov_losses, nesterov_params, _ = _train(_by_hand(nesterov=True))
    assert nesterov_losses[-1] != losses[-1]
    assert (nesterov_params["up.weight"] - params["up.weight"]).abs().max() > 1e-4


def test_every_muon_key_reaches_the_optimizer(tmp_path):
    cfg = load_config(_write(tmp_path, FULL))
    optimizer = cfg.optimizer.build(TinyLM().named_parameters())
    muon, fallback = optimizer.param_groups
    expected = dict(
        lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=False, eps=1e-6, ns_steps=4,
        ns_coefficients=(3.0, -4.0, 2.0), adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32,
    )  # fmt: skip
    assert {k: muon[k] for k in expected} == expected
    assert (fallback["lr"], fallback["momentum"], fallback["weight_decay"]) == (0.1, 0.5, 0.01)


def test_muon_keys_not_given_are_torchs_defaults_and_the_fallback_is_the_run_files_adamw():
    cfg = load_config(None, ["optimizer.name=muon", "optimizer.lr=0.02"])
    optimizer = cfg.optimizer.build(TinyLM().named_parameters())
    muon, fallback = optimizer.param_groups
    torch_muon = torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))]).defaults
    for key in ("weight_decay", "momentum", "nesterov", "eps", "ns_steps", "adjust_lr_fn"):
        assert muon[key] == torch_muon[key], key
    assert tuple(muon["ns_coefficients"]) == tuple(torch_muon["ns_coefficients"])
    assert muon["ns_dtype"] == torch.bfloat16
    assert type(optimizer.fallback) is torch.optim.AdamW
    adamw = load_config(None, ["optimizer.lr=0.02"]).optimizer.build([nn.Parameter(torch.ones(1))])
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert fallback[key] == adamw.param_groups[0][key], key
    # the fallback's own lr, when given, is its own
    cfg = load_config(None, ["optimizer.name=muon", "optimizer.fallback.lr=0.001"])
    assert cfg.optimizer.build(TinyLM().named_parameters()).param_groups[1]["lr"] == 0.001


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "{name: muon, betas: [0.9, 0.99]}",
            r"optimizer\.betas=\(0\.9, 0\.99\) is given, but optimizer\.name='muon' has no betas "
            r".*Remove it\. To set it for the fallback, write it under optimizer\.fallback",
        ),
        (
            "{name: adamw, ns_steps: 3}",
            r"optimizer\.ns_steps=3 is given, but optimizer\.name='adamw' has no ns_steps .*"
            r"It is muon's: set optimizer\.name to use it\.",
        ),
        ("{name: adamw, momentum: 0.9}", r"optimizer\.momentum=0\.9 is given, but .*'adamw'"),
        (
            "{name: sgd, fallback: {name: adamw}}",
            r"optimizer\.fallback=\{'name': 'adamw'\} is given, but .*'sgd' has no fallback",
        ),
        ("{name: muon, momentum: 1.0}", r"optimizer\.momentum=1\.0 must be in \[0, 1\) for muon"),
        ("{name: muon, weight_decay: -0.1}", r"optimizer\.weight_decay=-0\.1 must be a finite"),
        ("{name: muon, ns_steps: 100}", r"optimizer\.ns_steps=100 must be an int from 0 to 99"),
        ("{name: muon, ns_steps: 2.5}", r"optimizer\.ns_steps: expected int"),
        (
            "{name: muon, ns_coefficients: [3.0, -4.0]}",
            r"optimizer\.ns_coefficients: expected 3 values",
        ),
        (
            "{name: muon, ns_dtype: bf16}",
            r"optimizer\.ns_dtype='bf16' is not allowed\..* Choose one of \['bfloat16', 'float32'",
        ),
        (
            "{name: muon, adjust_lr_fn: match_rms}",
            r"optimizer\.adjust_lr_fn='match_rms' is not allowed\. Did you mean 'match_rms_adamw'",
        ),
        ("{name: muon, nesterof: true}", r"unknown key 'optimizer\.nesterof'\. Did you mean 'nest"),
        (
            "{name: muon, fallback: {name: muon}}",
            r"optimizer\.fallback\.name='muon' is not allowed\. Choose one of \['adamw', 'adam'",
        ),
        (
            "{name: muon, fallback: {name: sgd, betas: [0.9, 0.9]}}",
            r"optimizer\.fallback\.betas=\(0\.9, 0\.9\) is given, but optimizer\.fallback\.name="
            r"'sgd' has no betas",
        ),
        ("{name: muon, fallback: {lr: 0}}", r"optimizer\.fallback\.lr=0\.0 must be a finite"),
        ("{name: muon, fallback: {ns_steps: 3}}", r"unknown key 'optimizer\.fallback\.ns_steps'"),
        (
            "{name: muon, fallback_names: ['lm_head(']}",
            r"optimizer\.fallback_names\[0\]='lm_head\(' is not a regular expression",
        ),
    ],
)
def test_bad_muon_sections_are_refused_at_load_time_in_one_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as caught:
        load_config(_write(tmp_path, f"optimizer: {text}\n"))
    assert "\n" not in str(caught.value)


def test_the_cli_reads_and_writes_muons_keys(tmp_path, capsys):
    assert main(["config", "show", "--config", str(_write(tmp_path, FULL))]) == 0
    shown = capsys.readouterr().out
    assert "name: muon" in shown and "ns_dtype: float32" in shown and "name: sgd" in shown
    again = tmp_path / "again.yaml"
    again.write_text(shown)  # what `config show` writes loads back to the same section
    assert load_config(again).optimizer == load_config(tmp_path / "run.yaml").optimizer
    assert main(["config", "show", "optimizer.name=muon", "optimizer.betas=[0.9,0.99]"]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "optimizer.betas=(0.9, 0.99) is given, but optimizer.name='muon' has no betas" in line


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=4)
        self.qkv_proj = nn.Linear(8, 16, bias=False)  # q 8, k 4, v 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv_proj(x).square().mean()


def test_split_fused_in_a_run_file_reads_the_split_from_the_engines_model():
    on = load_config(None, ["optimizer.name=muon", "optimizer.split_fused=true"])
    engine = shardwise.Engine(_Fused(), on.optimizer.build)
    assert engine.optimizer.fused_names == ["qkv_proj.weight"]
    off = load_config(None, ["optimizer.name=muon"])
    assert shardwise.Engine(_Fused(), off.optimizer.build).optimizer.fused_names == []
