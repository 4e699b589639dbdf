"""What a model's loss-mode forward returns, turned into a loss to backpropagate and logs.

Owns: mmengine's loss contract, followed exactly where a model speaks it (a dict of
losses whose tensors are averaged, lists of tensors averaged then summed, keys containing
'loss' summed into the total; a model's own `parse_losses` called instead when it has
one), the tuple outputs of mmpose/mmseg `(losses, preds)` and mmpretrain
`(losses, preds, masks)`, and the plain contracts (a scalar tensor, an object with a
`.loss` tensor such as a Hugging Face output).

Must not: step optimizers, reduce across ranks or log (engine.py and runner.py do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

VIS_KEYS = ("vis_preds", "vis_masks")
"""Keys of a train step's result that carry predictions through, never logged."""


def split_outputs(outputs: object) -> tuple[object, dict[str, object]]:
    """(losses, pass-through extras) for `(losses, preds)` and `(losses, preds, masks)`.

    The same rule as OpenMMLab's wrappers: a 3-tuple is mmpretrain's (losses, preds,
    masks), a 2-tuple mmpose's and mmseg's (losses, preds). Anything else is the losses.
    """
    if isinstance(outputs, tuple) and not hasattr(outputs, "_fields"):
        if len(outputs) == 3:
            return outputs[0], {"vis_preds": outputs[1], "vis_masks": outputs[2]}
        if len(outputs) == 2:
            return outputs[0], {"vis_preds": outputs[1]}
    return outputs, {}


def parse_losses(outputs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The total loss to backpropagate and the (detached, scalar) values to log, from what
    a model's forward returned (any object; what is none of these is a TypeError):

    - A scalar tensor is the loss.
    - An object with a `.loss` tensor (Hugging Face model outputs) gives that loss.
    - A dict follows mmengine's `BaseModel.parse_losses`: every tensor entry is logged as
      its mean, a list of tensors as the sum of their means, and the entries whose key
      contains 'loss' are summed into the total. Any other entry is an error, as there.
    """
    if isinstance(outputs, torch.Tensor):
        if outputs.numel() != 1:
            raise ValueError(
                f"Engine: the model returned a tensor of shape {tuple(outputs.shape)}; a loss "
                "must be a scalar. Reduce it (e.g. .mean()) in forward, or return a dict of "
                "losses (each entry is then averaged, as mmengine does)."
            )
        return outputs.reshape(()), {"loss": outputs.detach().reshape(())}
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return parse_losses(loss)
    if isinstance(outputs, Mapping):
        return _parse_loss_dict(outputs)
    raise TypeError(
        f"Engine: the model returned {_describe(outputs)}; expected a scalar loss tensor, a "
        "dict of losses (keys containing 'loss' are summed), (losses, preds[, masks]), or "
        "an object with a .loss tensor."
    )


def _parse_loss_dict(losses: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    values: dict[str, torch.Tensor] = {}
    for key, value in losses.items():
        if isinstance(value, torch.Tensor):
            values[key] = value.mean()
        elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            # Python's sum from 0, as mmengine: keeps the tensors' dtype and device.
            values[key] = torch.as_tensor(sum(v.mean() for v in value))
        else:
            raise TypeError(
                f"Engine: the model's loss dict has {key!r} = {_describe(value)}, which is not "
                "a tensor or a list of tensors (mmengine's parse_losses refuses it too). Return "
                "predictions beside the losses instead: forward(mode='loss') -> (losses, preds)."
            )
    loss_keys = [k for k in values if "loss" in k]
    if not loss_keys:
        raise ValueError(
            f"Engine: the model returned {_describe(losses)}: no key contains 'loss', so "
            "there is nothing to backpropagate. Name the loss entries e.g. 'loss_cls'."
        )
    total = values[loss_keys[0]]
    for key in loss_keys[1:]:  # mmengine's order of addition, so totals match bit for bit
        total = total + values[key]
    logs = {"loss": total.detach()}
    logs.update({k: v.detach() for k, v in values.items() if k != "loss"})
    return total, logs


def model_parse_losses(
    model: nn.Module, losses: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Parse with the model's own `parse_losses(losses)` when it has one (an mmengine
    `BaseModel`, perhaps reweighting), else with mmengine's rule above."""
    own = getattr(model, "parse_losses", None)
    if not callable(own):
        return parse_losses(losses)
    result = own(losses)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        raise TypeError(
            f"Engine: {type(model).__name__}.parse_losses returned {_describe(result)}; "
            "expected (loss tensor, dict of values to log), as mmengine's BaseModel does."
        )
    total, raw = result
    if not isinstance(total, torch.Tensor) or total.numel() != 1:
        raise ValueError(
            f"Engine: {type(model).__name__}.parse_losses returned a total of "
            f"{_describe(total)}; it must be a scalar tensor."
        )
    logs: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
        if tensor.numel() != 1:
            raise ValueError(
                f"Engine: {type(model).__name__}.parse_losses logged {key!r} with shape "
                f"{tuple(tensor.shape)}; logged values must be scalars."
            )
        logs[key] = tensor.reshape(())
    return total.reshape(()), logs


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:8]}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        kinds = [type(v).__name__ for v in value[:4]]
        return f"a {type(value).__name__} of {len(value)} item(s) ({', '.join(kinds)})"
    text = repr(value)
    return f"{type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"
