"""Weights-only checkpoint loading for fairseq checkpoints on torch >= 2.6.

Since torch 2.6, ``torch.load`` unpickles in weights-only mode by default, and
every fairseq checkpoint holds an ``argparse.Namespace`` (the legacy ``args``
entry), so ``fairseq-generate`` and resuming ``fairseq-train`` fail with
``UnpicklingError``. :func:`allow_fairseq_globals` adds exactly the globals
fairseq checkpoints need to torch's allow-list (process-wide, idempotent);
``torch.load`` stays in weights-only mode, so a checkpoint carrying any other
global is still refused without running it.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["FAIRSEQ_CHECKPOINT_GLOBALS", "allow_fairseq_globals"]

#: What fairseq 0.12 checkpoints pickle beyond tensors and plain containers
#: (``torch.serialization.get_unsafe_globals_in_checkpoint`` on fp32 and
#: mixed-precision checkpoints of this plugin lists only this).
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace,)


def allow_fairseq_globals() -> None:
    """Allow-list :data:`FAIRSEQ_CHECKPOINT_GLOBALS` for weights-only loading."""
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_GLOBALS))
