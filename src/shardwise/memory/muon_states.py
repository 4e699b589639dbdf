"""Muon's memory in the plan: its state (one buffer per matrix) and its step's temporaries.

Owns: `MuonShares` (what shardwise.Muon takes of a model: the matrices' shapes, and what
goes to the fallback), `muon_shares` (read from a meta-device model with the same split
shardwise.Muon makes, config/matrices.py), `muon_state_bytes` and `muon_step_bytes`, the
per-rank figures `estimate_memory` reports for `optimizer="muon"`.

What train/muon_comm.py allocates at the step, per rank (float32 on the wire, the
parameters taken as float32):
  - every rank, for all its matrices at once: the Nesterov update of its piece (none
    without Nesterov) and its piece of the result, padded like the message (under ddp the
    whole matrix: ddp's pieces are whole);
  - the owner, one bucket (all the matrices it owns) at a time: the pieces it gathers and
    the parts it scatters, each `dp_shard` padded pieces per matrix (its own piece sent
    too), then for one matrix at a time the assembled whole and Newton–Schulz's buffers in
    `ns_dtype` (its copy of the matrix, the Gram matrix and the next iterate: at most
    2·r·c + 2·s² or r·c + 3·s² elements with s = min(r, c)), and the result in float32;
  - in one process nothing travels: each matrix's result stays until the update, in
    `ns_dtype`, while the next is orthogonalised.
Owners are chosen as muon_comm chooses them (largest matrix first, to the least-loaded
rank), so the figure is the worst owner's, not every matrix's on every rank. Small
copies (the padded message before it is sent, index tensors) are not counted.

Must not: import the train package (it sits above memory), allocate tensors, or measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from shardwise.config.matrices import DEFAULT_FALLBACK_NAMES, EXPERT_NAMES, split_parameters

MUON_STATES = 1
"""Momentum buffers per matrix element (AdamW keeps two)."""


@dataclass(frozen=True)
class MuonShares:
    """What shardwise.Muon takes of a model, for the memory plan."""

    shapes: tuple[tuple[int, ...], ...]
    """Each trainable matrix Muon orthogonalises, in parameter order (3-D: an expert stack)."""
    fallback_states: int = 2
    """Fp32 states per element the fallback keeps (AdamW: 2, SGD: 1)."""
    ns_bytes: int = 2
    """Bytes per element of Newton–Schulz's dtype (bf16 by default, as torch)."""
    nesterov: bool = True
    ns_steps: int = 5

    @property
    def matrix_numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def muon_shares(
    model: nn.Module,
    *,
    fallback_names: Sequence[str] = DEFAULT_FALLBACK_NAMES,
    matrix_names: Sequence[str] = (),
    expert_names: Sequence[str] = EXPERT_NAMES,
    fallback_states: int = 2,
    ns_bytes: int = 2,
    nesterov: bool = True,
    ns_steps: int = 5,
) -> MuonShares:
    """The matrices shardwise.Muon would take of `model` (a meta-device model will do)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices, _ = split_parameters(named, fallback_names, matrix_names, expert_names)
    shapes = tuple(tuple(p.shape) for _, p in matrices)
    return MuonShares(shapes, fallback_states, ns_bytes, nesterov, ns_steps)


def muon_state_bytes(shares: MuonShares, trainable: float, shard: int) -> int:
    """One fp32 buffer per matrix element, the fallback's states for the other trainable
    elements, sharded over `shard` ranks like the parameters."""
    matrices = shares.matrix_numel
    total = 4 * (MUON_STATES * matrices + shares.fallback_states * (trainable - matrices))
    return -(-round(total) // shard)


def _newton_schulz(shape: Sequence[int], shares: MuonShares) -> int:
    """Newton–Schulz's peak bytes on one whole matrix (an expert stack: expert by expert,
    the results stacked), not counting its input."""
    *experts, rows, cols = shape
    area, small = rows * cols, min(rows, cols) ** 2
    if shares.ns_steps == 0:
        one = area
    elif shares.ns_steps == 1:
        one = 2 * area + 2 * small
    else:  # the next Gram matrix is made while the last one and its product are alive
        one = max(2 * area + 2 * small, area + 3 * small)
    n = math.prod(experts)
    peak = one if not experts else max((n - 1) * area + one, 2 * n * area)
    return shares.ns_bytes * peak


def _owners(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """muon_comm.choose_owners on sizes alone: each owner's matrices (indices)."""
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        load[owner] += sizes[i]
        owned[owner].append(i)
    return owned


def muon_step_bytes(shares: MuonShares, world: int, shard: int, ddp: bool) -> int:
    """The worst rank's temporaries at Muon's step (see the module docstring): `shard` ranks
    hold pieces of each matrix (FSDP's shard group), `world` ranks may own matrices."""
    shapes = shares.shapes
    sizes = [math.prod(s) for s in shapes]
    if not shapes:
        return 0
    update = 4 * sum(sizes) if shares.nesterov else 0
    if world == 1:  # each result (ns dtype) stays while the next is orthogonalised
        kept, peak = 0, 0
        for shape, n in zip(shapes, sizes, strict=True):
            peak = max(peak, kept + _newton_schulz(shape, shares))
            kept += shares.ns_bytes * n
        return update + peak
    wide = 4 if shares.ns_bytes != 4 else 0  # the result back in float32 for the wire
    if ddp or shard == 1:  # pieces are whole: every rank keeps each whole result
        worst = 0
        for owned in _owners(sizes, world):
            bucket = sum(sizes[i] for i in owned)
            ns = max((_newton_schulz(shapes[i], shares) for i in owned), default=0)
            # the message sent, the results in ns dtype, then padded to float32 and joined
            worst = max(worst, 4 * bucket + max(ns, (shares.ns_bytes + 4) * bucket))
        return update + 4 * sum(sizes) + worst
    # FSDP shards dim 0: the fullest rank holds ceil(rows / shard) rows of each matrix
    pads = [-(-s[0] // shard) * (n // s[0]) for s, n in zip(shapes, sizes, strict=True)]
    update = 4 * sum(pads) if shares.nesterov else 0
    pieces = 4 * sum(pads)  # this rank's part of every result, kept until the update
    worst = 0
    for owned in _owners(sizes, world):
        if not owned:
            continue
        message = 4 * sum(pads[i] for i in owned)
        whole = max((4 + wide) * sizes[i] + _newton_schulz(shapes[i], shares) for i in owned)
        worst = max(worst, message + 2 * shard * message + whole)  # sent, gathered, scattered
    return update + pieces + worst
