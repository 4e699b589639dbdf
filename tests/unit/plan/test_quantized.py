"""A quantized base (bitsandbytes' 4-bit and 8-bit layers) recognised by its classes'
names, counted at its packed size with its quant_state, and refused where it cannot train
(plan/quantized.py); wrap keeps it ready (parallelize/quantized.py), and the simulation
refuses it. One process, small layers quantized on this CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.plan.quantized import (
    check_quantized,
    fsdp_holds_bytes,
    quant_state_bytes,
    quantized_params,
    stored_bytes,
)

bnb = pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[3]


def four_bit(storage: torch.dtype = torch.uint8, nested: bool = False, quantize: bool = True):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        64, 96, bias=False, compute_dtype=torch.float32, quant_type="nf4",
        quant_storage=storage, compress_statistics=nested,
    )  # fmt: skip
    return layer.to("cpu") if quantize else layer  # bitsandbytes quantizes on the move


def model_with(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Sequential(layer), nn.Linear(96, 4))


def eight_bit() -> nn.Module:
    return bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False).to("cpu")


def test_quantized_weights_are_found_by_their_class_names():
    found = quantized_params(model_with(four_bit(torch.bfloat16)))
    assert [(q.name, q.module, q.bits, q.storage, q.shape) for q in found] == [
        ("1.0.weight", "1.0", 4, "bfloat16", (96, 64))
    ]
    assert found[0].quantized and not found[0].cpu_packed and not found[0].requires_grad
    assert [(q.bits, q.storage) for q in quantized_params(eight_bit())] == [(8, "int8")]
    assert quantized_params(nn.Linear(4, 4)) == []


def test_detection_needs_no_bitsandbytes_import():
    class Params4bit(nn.Parameter):  # a stand-in: only the class name is read
        pass

    holder = nn.Linear(4, 4)
    holder.weight = Params4bit(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
    assert [q.storage for q in quantized_params(holder)] == ["uint8"]
    sources = "\n".join(p.read_text() for p in (ROOT / "src" / "shardwise").rglob("*.py"))
    assert not re.search(r"^\s*(import|from) bitsandbytes", sources, re.MULTILINE)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_a_4bit_weight_weighs_its_packed_codes_and_its_quant_state(storage, nested):
    layer = four_bit(storage, nested)
    blocks = 96 * 64 // 64
    codes = {str(storage).removeprefix("torch."): 96 * 64 // 2}
    # absmax per block (nested: uint8, then an fp32 offset, absmax and code book of 256),
    # and the 16-entry code book
    book = 16 * 4
    scales = {"uint8": blocks, "float32": book + 4 + 4 + 256 * 4} if nested else {
        "float32": book + 4 * blocks
    }  # fmt: skip
    assert stored_bytes(layer.weight) == codes
    assert quant_state_bytes(layer.weight) == scales
    # Before quantizing (a meta-built or unmoved layer holds fp32 values) it is counted as
    # it will be, not as the 4 bytes per value it holds now.
    unmoved = four_bit(storage, nested, quantize=False).weight
    assert (stored_bytes(unmoved), quant_state_bytes(unmoved)) == (codes, scales)
    assert stored_bytes(nn.Linear(64, 96).weight) == {"float32": 96 * 64 * 4}
    assert quant_state_bytes(nn.Linear(64, 96).weight) == {}


def test_an_8bit_weight_weighs_its_codes_and_row_scales():
    weight = eight_bit().weight
    assert (stored_bytes(weight), quant_state_bytes(weight)) == (
        {"int8": 64 * 64},
        {"float32": 64 * 4},
    )


def _check(model: nn.Module, **fields: object) -> list:  # type: ignore[type-arg]
    sharded = bool(fields.pop("sharded", True))
    on_meta = bool(fields.pop("on_meta", False))
    return check_quantized(
        model, shardwise.ParallelConfig(**fields), sharded=sharded, on_meta=on_meta
    )


def test_a_quantized_weight_that_requires_grad_is_refused():
    layer = four_bit(torch.bfloat16)  # uint8 codes cannot even require grad
    layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"quantized weight 1\.0\.weight \(4-bit, stored as "
                       r"bfloat16\) requires grad.*prepare_model_for_kbit_training"):  # fmt: skip
        _check(model_with(layer), sharded=False)


def test_codes_repacked_for_cpu_inference_are_refused():
    layer = four_bit()
    layer.weight.quant_state.packing_format_for_cpu = True  # what an eval forward leaves
    with pytest.raises(ValueError, match=r"repacked by bitsandbytes for its CPU inference"):
        _check(model_with(layer), sharded=False)


def test_tensor_parallel_over_a_quantized_base_is_refused():
    for model in (model_with(four_bit()), eight_bit()):
        with pytest.raises(NotImplementedError, match=r"ParallelConfig\.tp=2 over a quantized "
                           r"base .*neither split exists.*Use tp=1"):  # fmt: skip
            _check(model, tp=2)


def test_an_8bit_base_is_refused_by_fully_shard_and_taken_by_ddp():
    with pytest.raises(NotImplementedError, match=r"strategy='hybrid_shard' over an 8-bit base"
                       r".*drops the row scales \(SCB\).*Use strategy='ddp'"):  # fmt: skip
        _check(eight_bit(), strategy="hybrid_shard")
    assert len(_check(eight_bit(), strategy="ddp")) == 1
    assert len(_check(eight_bit(), sharded=False)) == 1  # world 1: nothing is sharded


def test_a_4bit_base_not_quantized_yet_is_refused_by_fully_shard():
    unmoved = model_with(four_bit(quantize=False))
    with pytest.raises(ValueError, match=r"is not quantized yet.*model\.to\(device\)"):
        _check(unmoved)
    assert len(_check(unmoved, strategy="ddp")) == 1  # ddp moves it: bitsandbytes quantizes
    with pytest.raises(NotImplementedError, match=r"quantized, on the meta device"):
        _check(unmoved, on_meta=True)


def test_a_plain_model_passes_every_check():
    assert _check(nn.Linear(4, 4), tp=2, on_meta=True) == []


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_wrap_holds_4bit_codes_as_the_bytes_they_are(storage):
    """Issue 47, item 5: float-stored codes are numbers to FSDP2 (cast to another compute
    dtype; gathered through CUDA's bf16 copies, which rewrite NaN bit patterns), so wrap
    views them as uint8, bitsandbytes' own layout, whatever the storage; the layer reads
    the same weights."""
    layer = four_bit(storage)
    before = layer.weight.detach().clone()
    x = torch.randn(3, 64)
    want = layer(x)
    model = shardwise.wrap(model_with(layer))
    codes = layer.weight.detach()
    assert (codes.dtype, tuple(codes.shape)) == (torch.uint8, (96 * 64 // 2, 1))
    assert torch.equal(codes.view(-1), before.view(torch.uint8).view(-1))  # the same bytes
    assert layer.weight.quant_storage == torch.uint8
    assert [q.storage for q in quantized_params(model)] == ["uint8"]
    assert torch.equal(layer(x), want)


def test_wrap_refuses_and_prepares_a_quantized_base_at_world_1():
    layer = four_bit(torch.bfloat16)
    layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires grad"):
        shardwise.wrap(model_with(layer))
    layer = four_bit()
    layer.quant_state = None  # quantized without its module: nothing to restore from
    shardwise.wrap(model_with(layer))
    assert layer.support_avx512bf16_for_cpu is False  # bitsandbytes' CPU repacking: off
    assert layer.quant_state is layer.weight.quant_state


def test_after_wrap_an_eval_forward_leaves_the_codes_trainable():
    """Without wrap, on a CPU with AVX512-BF16, the eval forward repacks the codes and the
    next backward fails inside bitsandbytes."""
    layer = four_bit()
    before = layer.weight.detach().clone()
    model = shardwise.wrap(model_with(layer))
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 64))
    model.train()
    model(torch.randn(2, 64, requires_grad=True)).sum().backward()
    assert torch.equal(layer.weight.detach(), before)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def _quantized_factory() -> nn.Module:
    return model_with(four_bit(quantize=False))


def _prebuilt_factory() -> nn.Module:
    return _PREBUILT[0]  # built outside the simulation's fake mode, real and quantized


_PREBUILT: list[nn.Module] = []


def test_the_simulation_refuses_a_quantized_base():
    _PREBUILT[:] = [model_with(four_bit())]
    with pytest.raises(
        NotImplementedError, match=r"quantized by bitsandbytes \(1\.0\.weight, 4-bit"
    ):
        shardwise.simulate_step(
            _prebuilt_factory, shardwise.ParallelConfig(), world=2, batch=1, seq_len=4
        )
    with pytest.raises(NotImplementedError, match=r"simulate_step: the model's base is quantized "
                       r"by bitsandbytes .*shardwise\.memory\.real_step"):  # fmt: skip
        shardwise.simulate_step(
            _quantized_factory, shardwise.ParallelConfig(), world=2, batch=1, seq_len=4
        )


def test_a_full_export_of_a_quantized_base_is_refused(tmp_path):
    """Its codes would be written without the quant_state that decodes them."""
    import shardwise

    model = model_with(four_bit())
    with pytest.raises(
        NotImplementedError,
        match=r"export_weights\(kind='full'\): 1 layer\(s\) of the model are quantized by "
        r"bitsandbytes \(e\.g\. 1\.0\).*kind='adapter'",
    ):
        shardwise.export_weights(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_4bit_base_under_fully_shard_needs_torch_2_12(monkeypatch):
    import shardwise.plan.quantized as quantized

    assert fsdp_holds_bytes("2.12.0") and fsdp_holds_bytes("2.13.0+cpu")
    assert fsdp_holds_bytes("3.0.0") and fsdp_holds_bytes("2.12.0a0+git1234")
    assert not fsdp_holds_bytes("2.11.0+cu130") and not fsdp_holds_bytes("2.6.0")
    assert not fsdp_holds_bytes("1.13.1")
    monkeypatch.setattr(quantized, "TORCH_VERSION", "2.11.0+cu130")
    for strategy in ("full_shard", "shard_grad_op", "hybrid_shard"):
        with pytest.raises(NotImplementedError, match=rf"strategy='{strategy}' over a 4-bit base "
                           r"\(1\.0\.weight.*needs torch >= 2\.12: torch 2\.11\.0\+cu130.*"
                           r"Upgrade torch, or use strategy='ddp'"):  # fmt: skip
            _check(model_with(four_bit()), strategy=strategy)
    assert len(_check(model_with(four_bit()), strategy="ddp")) == 1
    assert len(_check(model_with(four_bit()), sharded=False)) == 1  # world 1: nothing sharded
    monkeypatch.setattr(quantized, "TORCH_VERSION", "2.12.0")
    assert len(_check(model_with(four_bit()), strategy="full_shard")) == 1


@pytest.mark.parametrize("nested", [False, True])
def test_a_weight_whose_values_are_no_whole_number_of_blocks_is_counted_as_it_will_be(nested):
    """100 values: two blocks of 64, the last one partly filled. Counted ahead (not
    quantized yet) as the quantized layer really holds them (third audit: a floor counted
    one block short where 96 x 64, a multiple of 64, could not tell)."""

    def layer(quantize: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        made = bnb.nn.Linear4bit(
            10, 10, bias=False, compute_dtype=torch.float32, quant_type="nf4",
            compress_statistics=nested,
        )  # fmt: skip
        return made.to("cpu") if quantize else made

    real, ahead = layer(True).weight, layer(False).weight
    assert stored_bytes(ahead) == stored_bytes(real) == {"uint8": 50}
    assert quant_state_bytes(ahead) == quant_state_bytes(real)
    blocks = quant_state_bytes(real).get("uint8" if nested else "float32", 0)
    assert blocks == (2 if nested else 16 * 4 + 2 * 4)


@pytest.mark.parametrize(
    ("inputs", "outputs", "storage", "stored"),
    [
        (5, 3, torch.uint8, {"uint8": 8}),  # 15 values: 7 full bytes and a half-filled one
        (3, 3, torch.uint8, {"uint8": 5}),
        (7, 1, torch.uint8, {"uint8": 4}),
        (5, 3, torch.bfloat16, {"bfloat16": 8}),
    ],
)
def test_an_odd_number_of_values_is_counted_with_its_half_filled_byte(
    inputs, outputs, storage, stored
):
    """Fourth audit: two 4-bit codes to a byte, so an odd count of values ends in a byte
    holding one code. Counted ahead (not quantized yet) as bitsandbytes really packs it;
    an even count (every other test here) cannot tell a ceiling from a floor."""

    def layer(quantize: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        made = bnb.nn.Linear4bit(
            inputs, outputs, bias=False, compute_dtype=torch.float32, quant_type="nf4",
            quant_storage=storage,
        )  # fmt: skip
        return made.to("cpu") if quantize else made

    real, ahead = layer(True).weight, layer(False).weight
    assert stored_bytes(ahead) == stored_bytes(real) == stored
