"""Patch of fairseq's ``FairseqDropout``: counter-based masks on the CPU (``--cpu-dropout``).

Every dropout of fairseq's models is a ``FairseqDropout`` module calling ``F.dropout``, whose
CPU masks cost some 6 ns an element (:mod:`fairseq_fp16.core.dropout`). The replacement calls
:func:`~fairseq_fp16.core.dropout.counter_dropout` for a CPU tensor of at least the module's
``counter_min_numel`` elements (:func:`fairseq_fp16.features.cpu_dropout_masks` sets it on every
dropout of a model trained on the CPU, as ``--cpu-dropout`` says) where the kernel compiles, and
fairseq's own forward otherwise: on CUDA (torch's dropout there is one fused kernel), in place,
past 2**31 elements, inside code that torch.compile
traces (``--compile-layers``: the compiled layer draws its own masks), and for modules of a
model built without the run's flags.
"""

from __future__ import annotations

import torch

from ..core.dropout import MAX_NUMEL, counter_dropout, counter_dropout_available
from ..features import COUNTER_MASKS
from .registry import Patch
from .registry import original as _original

FORWARD = "fairseq.modules.fairseq_dropout:FairseqDropout.forward"


def _forward(self, x, inplace: bool = False):
    min_numel = getattr(self, COUNTER_MASKS, None)
    if (min_numel is not None and self.p > 0 and (self.training or self.apply_during_inference)
            and not inplace and x.device.type == "cpu" and min_numel <= x.numel() <= MAX_NUMEL
            and not torch.compiler.is_compiling() and counter_dropout_available(x.dtype)):
        return counter_dropout(x, self.p)
    return _original(FORWARD)(self, x, inplace)


PATCHES = [
    Patch(FORWARD, group="precision", replacement=_forward,
          expects=["if self.p > 0 and (self.training or self.apply_during_inference):",
                   "return F.dropout(x, p=self.p, training=True, inplace=inplace)"],
          why="fairseq's dropout draws its CPU masks with torch's bernoulli_, a hundred times "
              "slower than a pass over the tensor; a module with counter_min_numel set (the "
              "run's --cpu-dropout) draws those of large enough tensors from a counter in one "
              "compiled pass"),
]
