"""The host-sync counter sees a sync wherever Python makes one: in a forward, inside a
checkpointed block's recompute in backward (where torch carries no function mode), and on
another thread (CUDA's autograd device thread); a call inside a counted one counts once."""

from __future__ import annotations

import threading

import torch
from torch.utils.checkpoint import checkpoint

from shardwise.testing import count_host_syncs


def _block(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = linear(x)
    y.tolist()
    return torch.tanh(y)  # saved: the recompute runs through tolist


def test_a_recompute_in_backward_is_counted():
    linear = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4, requires_grad=True)
    with count_host_syncs() as syncs:
        out = checkpoint(_block, linear, x, use_reentrant=False).sum()
        assert dict(syncs) == {"tolist": 1}
        out.backward()
    assert dict(syncs) == {"tolist": 2}


def test_a_call_on_another_thread_is_counted():
    x = torch.arange(4)
    with count_host_syncs() as syncs:
        worker = threading.Thread(target=lambda: (torch.bincount(x), x.nonzero()))
        worker.start()
        worker.join(timeout=30)
    assert dict(syncs) == {"bincount": 1, "nonzero": 1}


def test_each_call_counts_once_and_nothing_after_the_block():
    x = torch.ones(3)
    with count_host_syncs() as syncs:
        f"{x.sum():.1f}"  # __format__ reads .item() itself
        bool(x.sum() > 0)
        int(x[0])
    assert dict(syncs) == {"__format__": 1, "__bool__": 1, "__int__": 1}
    x.tolist()  # after the block: the originals are back
    assert dict(syncs) == {"__format__": 1, "__bool__": 1, "__int__": 1}
    assert "tolist" not in torch.Tensor.__dict__  # inherited again, not patched


def test_an_index_that_waits_is_counted_and_a_view_is_not():
    # a list becomes a host tensor copied to the device; a mask's nonzero sizes the output
    x = torch.arange(6.0)
    with count_host_syncs() as syncs:
        x[[0, 2]]
        x[x > 2]
        x[:, None][[1, 3], 0]  # a list inside a tuple of indices
    assert dict(syncs) == {"__getitem__": 3}
    with count_host_syncs() as views:
        x[0], x[1:4], x[None], x[..., 2], x[torch.tensor(1)], x[torch.tensor([1, 2])]
    assert dict(views) == {}  # an int, a slice, None, a device tensor: nothing waits on CPU
