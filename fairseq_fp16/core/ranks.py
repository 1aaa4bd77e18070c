"""The ranks of a multi-process run, as the optimizer wrapper and the traces ask about them
(torch.distributed only; one process answers for itself)."""

from __future__ import annotations

import torch

__all__ = ["agree_on_every_rank", "distributed", "first_on_any_rank", "rank"]


def distributed() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree_on_every_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` and-ed over all ranks (one all-reduce; the caller is on every rank)."""
    if not distributed():
        return flag
    dist = torch.distributed
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def first_on_any_rank(first):
    """``first`` of the lowest rank where it is not None, on every rank (None where no rank has
    one)."""
    if not distributed():
        return first
    seen = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(seen, first)
    return next((f for f in seen if f is not None), None)
