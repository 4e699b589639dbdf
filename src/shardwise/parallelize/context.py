"""Context parallel (cp): each rank of a cp group holds 1/cp of every sequence.

The ranks of one cp group read the same rows of the batch, as a tp group does; `wrap`
installs a hook on the model that cuts them, so the Engine, the Runner and a loop of your
own all call the model with whole sequences:

- every sequence-shaped entry (a tensor whose second dimension is the sequence: input_ids,
  labels, position_ids, attention_mask, inputs_embeds, ...) is cut into cp contiguous
  chunks, and rank j of the group keeps chunk j;
- positions are global: the batch's own position_ids, or 0..S-1, are cut like the rest, so
  rotary or learned positions see where each token really is;
- labels are shifted over the whole sequence before the cut (a transformers causal LM
  shifts inside what it is given, which would drop the first label of every chunk and
  pair each chunk's last token with nothing), and the loss is each rank's sum of token
  losses over the valid tokens of the whole rows, times cp: the gradient mean over the
  data-parallel and cp ranks is then the rows' token mean, never a mean of per-chunk
  means (a chunk with no valid label adds nothing instead of NaN);
- the layout every attention call needs (the sequence length, the documents of a packed
  row, the padding) is kept for the process, so a block recomputed in backward (on
  autograd's device thread on CUDA) reads the same one.

Documents: as transformers does in one process (`find_packed_sequence_indices`), a row
whose position ids restart holds several documents, found only when no 2-D attention mask
is given and the forward makes no key/value cache (use_cache off, in the call or the
config; a training forward with use_cache on attends across documents in one process, and
so it does here); a 2-D attention mask masks its padded keys.

Owns: `ContextLayout`, `current_layout`, cutting a call's inputs (`install`) and the check
that the model's attention went through shardwise (`ulysses.py` computes it).

Must not: compute attention, build a mesh, or import transformers.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.distributed.worker_errors import refused

__all__ = ["ContextLayout", "Cutter", "current_layout", "cutter_for", "install"]

IGNORE_INDEX = -100
TARGET_NAMES = ("labels", "targets", "target")
_SEQUENCE_NAMES = ("input_ids", "inputs_embeds")
_CACHE_NAMES = ("past_key_values", "cache")  # transformers 5 renamed the first
ROW_NAMES = ("shardwise_cp_documents", "shardwise_cp_keep")
"""Under pp, the keywords that carry each micro-batch's rows of `ContextLayout.documents`
and `.keep` to its attention calls (a transformers model passes them down)."""


@dataclass(eq=False)
class ContextLayout:
    """The whole sequence behind this rank's chunk, as every attention call reads it."""

    group: dist.ProcessGroup
    size: int
    """cp: the ranks that share each sequence."""
    index: int
    """This rank's chunk: positions index * seq_len / size on."""
    seq_len: int
    documents: torch.Tensor | None = None
    """(B, S) document ids of packed rows; None: one document per row."""
    keep: torch.Tensor | None = None
    """(B, S) the keys a 2-D attention mask keeps; None: every key."""
    attention_calls: int = 0


# The layout of the forward running, and of the last one, for the process: a checkpointed
# block recomputes inside backward, after the forward returned, where a context variable
# set in forward is not visible on CUDA's autograd thread (global_batch.py has the same
# reason). Outside both, no layout: a model called later outside cp attends as SDPA does.
_ACTIVE: list[ContextLayout | None] = [None]
_LAST: list[ContextLayout | None] = [None]


def current_layout() -> ContextLayout | None:
    """The layout of the context-parallel forward running (or, inside backward, of the
    last one, whose checkpointed blocks are recomputing); None outside both."""
    if _ACTIVE[0] is not None:
        return _ACTIVE[0]
    if torch._C._current_graph_task_id() != -1:
        return _LAST[0]
    return None


def _refuse(cp: int, what: str) -> Exception:
    return refused(ValueError(f"ParallelConfig.cp={cp}: {what}"))


@functools.lru_cache(maxsize=64)
def _signature(forward: Any) -> inspect.Signature:
    return inspect.signature(forward)


def _documents(positions: torch.Tensor) -> torch.Tensor | None:
    """Document ids of packed rows from their position ids, or None (one document a row):
    transformers' rule, with its one host check."""
    first = positions[:, :1] - 1
    documents = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((documents[:, -1] == 0).all()) else documents


def _uses_cache(model: nn.Module, given: Any) -> bool:
    """Whether a transformers model's forward would make a key/value cache: the call's
    use_cache, else its config's, off under its own gradient checkpointing in training."""
    use = given if given is not None else getattr(getattr(model, "config", None), "use_cache", None)
    if not use:
        return False
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return not (checkpointing and model.training and torch.is_grad_enabled())


def _cut(t: torch.Tensor, seq_len: int, size: int, index: int) -> torch.Tensor:
    chunk = seq_len // size
    return t.narrow(1, index * chunk, chunk).contiguous()


def _sequence_length(arguments: dict[str, Any]) -> int | None:
    for name in _SEQUENCE_NAMES:
        value = arguments.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    for value in arguments.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


class Cutter:
    """Cuts a call's whole sequences for this rank (the forward pre-hook `install` makes,
    or the pipeline's step on the whole batch), and checks at the first forward that the
    model's attention read them whole."""

    def __init__(
        self, group: Any, size: int, index: int, transformers: bool, pipelined: bool = False
    ) -> None:
        self.group = group
        self.size = size
        self.index = index
        self.transformers = transformers
        self.pipelined = pipelined
        """The schedule cuts the batch into micro-batches after: one layout serves them all."""
        self.checked = False

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = self._bound(module, _signature(type(module).forward), args, kwargs)
        return bound.args[1:], bound.kwargs

    def keywords(
        self, module: nn.Module, signature: inspect.Signature, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """A whole batch of keyword arguments, cut (a pipeline's: `signature` is the
        model's own forward, before the stage's replaced it)."""
        bound = self._bound(module, signature, (), kwargs)
        extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), "")
        out = {k: v for k, v in bound.arguments.items() if k not in (extra, "self")}
        out.update(bound.arguments.get(extra, {}))
        out.pop(next(iter(signature.parameters)), None)  # self, whatever its name
        return out

    def _bound(
        self,
        module: nn.Module,
        signature: inspect.Signature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> inspect.BoundArguments:
        bound = signature.bind(module, *args, **kwargs)
        arguments = bound.arguments
        extra_name = next(
            (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )
        extra: dict[str, Any] = arguments.get(extra_name, {}) if extra_name else {}
        seq_len = _sequence_length({**arguments, **extra})
        cp = self.size
        if seq_len is None:
            name = type(module).__name__
            raise _refuse(cp, f"{name} was called with no sequence (a 2-D or wider tensor "
                          "such as input_ids) to cut over the cp ranks.")  # fmt: skip
        if seq_len % cp:
            raise _refuse(
                cp,
                f"the batch's sequence length {seq_len} does not divide by {cp}: each rank "
                f"holds 1/{cp} of every sequence. Pad the sequences to a multiple of {cp} "
                f"(labels {IGNORE_INDEX} on the padding).",
            )
        caches = [store.get(n) for store in (arguments, extra) for n in _CACHE_NAMES]
        if any(c is not None for c in caches):
            raise refused(
                NotImplementedError(
                    f"ParallelConfig.cp={cp} with a key/value cache (generation) is not built "
                    "yet: each rank would cache only its chunk. Generate with the model "
                    "outside context parallel (cp=1)."
                )
            )
        params = signature.parameters
        if "position_ids" not in params:
            raise _refuse(
                cp,
                f"{type(module).__name__}.forward takes no position_ids, so its positions "
                f"would be each rank's own 0..{seq_len // cp - 1}. Take position_ids and use "
                "them for whatever reads positions (shardwise passes the global ones), and "
                "compute attention with shardwise.context_attention.",
            )
        layout = self._layout(module, arguments, extra, seq_len)
        self._targets(module, arguments, extra, params, seq_len)
        for store in (arguments, extra):
            for name, value in store.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 2:
                    if value.shape[1] == seq_len:
                        store[name] = _cut(value, seq_len, cp, self.index)
        if self.pipelined and (layout.documents is not None or layout.keep is not None):
            # The schedule cuts the batch into micro-batches after this: each one's rows of
            # the mask travel with it, whole, as keywords its attention calls receive.
            extra[ROW_NAMES[0]], extra[ROW_NAMES[1]] = layout.documents, layout.keep
            layout.documents = layout.keep = None
        if "use_cache" in params:  # a cache of each rank's chunk would serve nothing
            arguments["use_cache"] = False
        elif extra_name and self.transformers:
            extra["use_cache"] = False
        if extra_name and extra:
            arguments[extra_name] = extra
        _ACTIVE[0] = _LAST[0] = layout
        return bound

    def _layout(
        self, module: nn.Module, arguments: dict[str, Any], extra: dict[str, Any], seq_len: int
    ) -> ContextLayout:
        reference = next(v for v in (*arguments.values(), *extra.values())
                         if isinstance(v, torch.Tensor) and v.dim() >= 2)  # fmt: skip
        rows, device = reference.shape[0], reference.device
        positions = arguments.get("position_ids")
        if positions is None:
            positions = torch.arange(seq_len, device=device).expand(rows, seq_len)
            arguments["position_ids"] = positions
            documents = None
        elif self.transformers and arguments.get("attention_mask") is None:
            # transformers finds packed documents only with no cache, which a training
            # forward makes too when use_cache is on: the same rule, so cp equals one process
            cached = _uses_cache(module, arguments.get("use_cache", extra.get("use_cache")))
            documents = None if cached else _documents(positions.expand(rows, seq_len))
        else:
            documents = None
        mask = arguments.get("attention_mask")
        keep = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        if self.pipelined and keep is not None and not self.transformers:
            raise refused(
                NotImplementedError(
                    f"ParallelConfig.cp={self.size} with pp and a 2-D attention mask is built "
                    f"for transformers models only: {type(module).__name__} calls "
                    "shardwise.context_attention, which takes no rows of a mask, and the "
                    "schedule cuts the batch into micro-batches. Give no padding mask under "
                    "pp, or use pp=1."
                )
            )
        return ContextLayout(self.group, self.size, self.index, seq_len, documents, keep)

    def _targets(
        self,
        module: nn.Module,
        arguments: dict[str, Any],
        extra: dict[str, Any],
        params: Any,
        seq_len: int,
    ) -> None:
        name = next((n for n in TARGET_NAMES if arguments.get(n) is not None), None)
        if name is None:
            return
        labels = arguments[name]
        cp = self.size
        given = arguments.get("num_items_in_batch", extra.get("num_items_in_batch"))
        if self.transformers:
            loss_type = getattr(module, "loss_type", None)
            if name != "labels" or loss_type != "ForCausalLM":
                raise refused(
                    NotImplementedError(
                        f"ParallelConfig.cp={cp} with {type(module).__name__}'s loss "
                        f"({loss_type}) is not built yet: shardwise shifts and counts the "
                        "labels of causal language models. Use cp=1 for this model."
                    )
                )
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            count = given if given is not None else (shifted != IGNORE_INDEX).sum()
            arguments["labels"] = shifted  # cut with the rest; shift_labels makes it final
            extra["shift_labels"] = shifted
            extra["num_items_in_batch"] = count / cp
            return
        if "num_items_in_batch" not in params:
            raise _refuse(
                cp,
                f"{type(module).__name__}.forward takes {name} but no num_items_in_batch: "
                "a mean over each rank's chunk of the sequence is not the mean over the "
                "whole rows. Take num_items_in_batch and return the sum of token losses "
                "divided by it (transformers' convention); shardwise passes it.",
            )
        count = given if given is not None else (labels != IGNORE_INDEX).sum()
        arguments["num_items_in_batch"] = count / cp

    def forget(self) -> None:
        """The step ended early (an error): its layout is no longer current."""
        _ACTIVE[0] = None

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The forward (or the pipeline's step) is over: its layout is no longer current,
        and at the first one, the check that attention read the sequences whole."""
        layout, _ACTIVE[0] = _ACTIVE[0], None
        if self.checked or layout is None:
            return
        self.checked = True
        if layout.attention_calls == 0:
            raise refused(
                RuntimeError(
                    f"ParallelConfig.cp={self.size}: {type(module).__name__}'s forward ran no "
                    "attention through shardwise, so each rank's attention read only its own "
                    f"1/{self.size} of each sequence. A model of your own calls "
                    "shardwise.context_attention in place of F.scaled_dot_product_attention; "
                    "a transformers model must take its attention from AttentionInterface."
                )
            )


def cutter_for(group: dist.ProcessGroup, transformers: bool) -> Cutter:
    """The cutter a pipeline's step runs on each whole batch (its stages are never called
    whole, so no hook could)."""
    size, index = dist.get_world_size(group), dist.get_rank(group)
    return Cutter(group, size, index, transformers, pipelined=True)


def install(model: nn.Module, group: dist.ProcessGroup, transformers: bool) -> None:
    """Cut every call of `model` over `group`, the cp ranks (see the module docstring)."""
    cutter = Cutter(group, dist.get_world_size(group), dist.get_rank(group), transformers)
    model.register_forward_pre_hook(cutter.before, with_kwargs=True, prepend=True)
    model.register_forward_hook(cutter.after, with_kwargs=True, always_call=True)
