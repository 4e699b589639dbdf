"""A quantized base's bytes and refusals at the sizes and mixes where the plausible wrong
formulas differ (the five habits of docs/testing.md): a nested quant state of more than 256
blocks and a block size other than 64, each counted ahead as bitsandbytes then holds it;
a refusal that counts the weights it did not name; tp over a base of both kinds; a weight
not quantized yet where nothing is sharded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.plan.quantized import check_quantized, quant_state_bytes

bnb = pytest.importorskip("bitsandbytes")


def _four_bit(inputs: int, outputs: int, *, nested: bool = False, blocksize: int | None = None,
              quantize: bool = True, storage: torch.dtype = torch.uint8) -> nn.Module:  # fmt: skip
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        inputs, outputs, bias=False, compute_dtype=torch.float32, quant_type="nf4",
        compress_statistics=nested, quant_storage=storage,
    )  # fmt: skip
    if blocksize is not None:
        layer.weight.blocksize = blocksize
    return layer.to("cpu") if quantize else layer  # bitsandbytes quantizes on the move


@pytest.mark.parametrize(
    ("inputs", "nested", "blocksize"),
    [(256, True, None), (256, False, 128), (256, True, 128), (80, True, 32)],
    ids=["384 nested blocks", "block size 128", "nested, block size 128", "block size 32"],
)
def test_a_quant_state_is_counted_ahead_as_bitsandbytes_holds_it(
    inputs: int, nested: bool, blocksize: int | None
) -> None:
    """256 x 96 values are 384 blocks of 64: a nested state's second absmax has
    ceil(384 / 256) = 2 entries, which one block's worth (96 x 64 values, the existing
    tests) cannot tell from 1; a block size of 128 or 32 halves or doubles the absmax."""

    def weight(quantize: bool) -> torch.Tensor:
        layer = _four_bit(inputs, 96, nested=nested, blocksize=blocksize, quantize=quantize)
        return layer.weight

    real, ahead = weight(True), weight(False)
    assert real.quant_state.blocksize == (blocksize or 64)
    assert quant_state_bytes(ahead) == quant_state_bytes(real)


def _check(model: nn.Module, **fields: object) -> list:  # type: ignore[type-arg]
    sharded = bool(fields.pop("sharded", True))
    return check_quantized(model, shardwise.ParallelConfig(**fields), sharded=sharded)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_a_refusal_names_the_first_weight_and_counts_the_others(layers: int) -> None:
    model = nn.Sequential(*(_four_bit(64, 64, storage=torch.bfloat16) for _ in range(layers)))
    for p in model.parameters():
        p.requires_grad_(True)  # float-stored codes can (uint8 ones cannot)
    more = f" and {layers - 1} more" if layers > 1 else ""
    with pytest.raises(ValueError, match=rf"quantized weight 0\.weight \(4-bit, stored as "
                       rf"bfloat16\){more} requires grad"):  # fmt: skip
        _check(model, sharded=False)


def test_tp_over_a_base_of_both_kinds_names_a_4bit_weight() -> None:
    """An 8-bit layer first, then a 4-bit one: the refusal speaks of the 4-bit codes' one
    flat column, so it names the 4-bit weight, wherever it sits."""
    eight = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False).to("cpu")
    model = nn.Sequential(eight, _four_bit(64, 64))
    with pytest.raises(NotImplementedError, match=r"ParallelConfig\.tp=2 over a quantized base "
                       r"\(1\.weight \(4-bit, stored as uint8\)\)"):  # fmt: skip
        _check(model, tp=2)


def test_a_4bit_weight_not_quantized_yet_is_taken_where_nothing_is_sharded() -> None:
    """The refusal's conditions each alone: sharded under full_shard (refused), sharded
    under ddp (taken: ddp moves it, which quantizes it) and not sharded at all (taken)."""
    unmoved = nn.Sequential(_four_bit(64, 64, quantize=False))
    with pytest.raises(ValueError, match=r"is not quantized yet"):
        _check(unmoved, strategy="full_shard")
    assert len(_check(unmoved, strategy="ddp")) == 1
    assert len(_check(unmoved, strategy="full_shard", sharded=False)) == 1
