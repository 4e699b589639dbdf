"""Precision: presets, translations from torch/FSDP1 objects, autocast where FSDP2 is absent."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from shardwise.config import PRESETS, Precision, resolve_precision
from shardwise.parallelize.autocast import apply_autocast


@pytest.mark.parametrize(
    ("name", "param"),
    [
        ("fp32", None),
        ("32-true", None),
        ("bf16", torch.bfloat16),
        ("bf16-mixed", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("fp16", torch.float16),
        ("16-mixed", torch.float16),
    ],
)
def test_presets_and_aliases(name, param):
    p = resolve_precision(name)
    assert p.param_dtype == param
    if param is not None:
        assert p.reduce_dtype == torch.float32  # reduce in fp32 by default


def test_explicit_mapping_with_dtype_names():
    p = resolve_precision(
        {"param_dtype": "bfloat16", "reduce_dtype": "bf16", "output_dtype": "fp32"}
    )
    assert (p.param_dtype, p.reduce_dtype, p.output_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )


def test_torch_policy_translated_both_ways():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    p = resolve_precision(policy)
    assert p.to_fsdp_policy() == policy


def test_fsdp1_mixed_precision_translated():
    p = resolve_precision(MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
    assert (p.param_dtype, p.reduce_dtype) == (torch.float16, torch.float32)


def test_fsdp1_fields_without_fsdp2_twin_are_refused():
    # Both used to be warnings while training went on with another meaning: now refusals.
    with pytest.raises(
        ValueError,
        match=r"FSDP1 MixedPrecision\.buffer_dtype=torch\.float16 has no FSDP2 equivalent: FSDP2 keeps buffers in their own dtype",
    ):
        resolve_precision(MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"keep_low_precision_grads=True\) has no FSDP2 equivalent: FSDP2 keeps gradients in the parameters' storage dtype",
    ):
        resolve_precision(MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    fp32_buffers = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float32)
    assert resolve_precision(fp32_buffers).param_dtype == torch.bfloat16  # what FSDP2 does


def test_unknown_preset():
    with pytest.raises(
        ValueError, match=r"mixed_precision='bf32' is not a known precision\. Use one of"
    ):
        resolve_precision("bf32")


def test_unknown_mapping_key():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['param'\]\. Allowed keys"):
        resolve_precision({"param": "bf16"})


def test_bad_dtype_name():
    with pytest.raises(
        ValueError, match=r"mixed_precision\.param_dtype='int8' is not a floating-point dtype"
    ):
        resolve_precision({"param_dtype": "int8"})


def test_wrong_type():
    with pytest.raises(TypeError, match=r"mixed_precision got int; expected a preset name"):
        resolve_precision(16)


def test_str_and_dict():
    assert str(PRESETS["fp32"]) == "fp32"
    assert "param=bfloat16" in str(PRESETS["bf16"])
    assert PRESETS["bf16"].to_dict()["param_dtype"] == "bfloat16"


def test_autocast_computes_low_precision_and_keeps_fp32_storage():
    model = nn.Linear(4, 4)
    apply_autocast(model, PRESETS["bf16"], "cpu")
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32
    assert list(model.state_dict()) == ["weight", "bias"]  # class and keys unchanged


def test_autocast_output_dtype_and_idempotence():
    model = nn.Linear(4, 4)
    prec = Precision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    apply_autocast(model, prec, "cpu")
    apply_autocast(model, prec, "cpu")  # second application is a no-op
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_fp32_is_a_no_op():
    model = nn.Linear(4, 4)
    forward = model.forward
    apply_autocast(model, PRESETS["fp32"], "cpu")
    assert model.forward == forward


def test_output_cast_keeps_containers():
    from collections import namedtuple

    Out = namedtuple("Out", ["logits", "ids"])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"pair": (y, [y]), "nt": Out(y, torch.arange(2))}

    model = apply_autocast(
        Model(), Precision(param_dtype=torch.bfloat16, output_dtype=torch.float32), "cpu"
    )
    out = model(torch.randn(2, 4))
    assert out["pair"][0].dtype == torch.float32 and out["pair"][1][0].dtype == torch.float32
    assert isinstance(out["nt"], Out) and out["nt"].logits.dtype == torch.float32
    assert out["nt"].ids.dtype == torch.int64
