"""Compile a module's training forward with ``torch.compile`` (pure torch).

A fairseq transformer layer runs a few dozen small kernels (projections, dropout, residual add,
LayerNorm, activation); eager PyTorch launches each one from Python. Compiled, the elementwise
work around the matrix products fuses into a few kernels and the host issues far fewer
launches, which is what bounds a half-precision update on a fast GPU.

Only the training forward is compiled: a call in eval mode, or with an ``incremental_state``
(fairseq's step-by-step decoding), runs the module's own forward, so generation and
validation behave exactly as without compilation.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch

__all__ = ["compile_training_forward", "is_compiled"]

_MARK = "_fairseq_fp16_compiled"


def compile_training_forward(modules: Iterable[torch.nn.Module], dynamic: bool = True,
                             backend="inductor") -> int:
    """Replace each module's ``forward`` by one that runs a compiled forward in training mode.

    Modules of one class share the compiled code (torch treats their parameters as inputs);
    ``dynamic`` compiles for varying batch and sequence sizes up front rather than after the
    first recompile; ``backend`` is ``torch.compile``'s. Idempotent. Returns how many modules
    were wrapped.
    """
    count = 0
    for module in modules:
        if is_compiled(module):
            continue
        eager = module.forward
        compiled = torch.compile(eager, dynamic=dynamic, backend=backend)

        @functools.wraps(eager)
        def forward(*args, _eager=eager, _compiled=compiled, _module=module, **kwargs):
            if _module.training and kwargs.get("incremental_state") is None:
                return _compiled(*args, **kwargs)
            return _eager(*args, **kwargs)

        module.forward = forward
        setattr(module, _MARK, True)
        count += 1
    return count


def is_compiled(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))
