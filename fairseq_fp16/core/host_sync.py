"""Count host syncs: tensor reads that make the host wait for the device.

:class:`HostSyncCounter` is a ``TorchFunctionMode`` that counts calls such as
``Tensor.item()``, ``bool(tensor)``, ``float(tensor)`` and ``tensor.tolist()``
made inside its ``with`` block. It works on any device, CPU included, so the
tests can prove that a mixed-precision step reads nothing back on a normal
update; on CUDA, ``torch.cuda.set_sync_debug_mode`` gives the same answer.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter"]

_SYNC_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


class HostSyncCounter(TorchFunctionMode):
    """Count host-syncing tensor reads in a block: ``with HostSyncCounter() as c``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_METHODS:
            self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))
