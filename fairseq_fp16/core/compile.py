"""Compile a module's training forward with ``torch.compile`` (pure torch).

A fairseq transformer layer runs a few dozen small kernels (projections, dropout, residual add,
LayerNorm, activation); eager PyTorch launches each one from Python. Compiled, the elementwise
work around the matrix products fuses into a few kernels and the host issues far fewer
launches, which is what bounds a half-precision update on a fast GPU.

Only the training forward is compiled: a call in eval mode, or with an ``incremental_state``
(fairseq's step-by-step decoding), runs the module's own forward, so generation and
validation behave exactly as without compilation. A deep copy of a wrapped module (fairseq's
EMA copies the model) is wrapped anew, around the copy's own forward and weights.

The compiled forward gets its tensor arguments contiguous. Compiled code is specialised on its
inputs' strides, and a transformer's layers see different ones: the first encoder layer gets
the embeddings transposed to time-major (a view whose strides depend on the batch's length),
the decoder its cached causal mask cut to the batch's length, the later layers contiguous
tensors. Every new stride pattern recompiles, and after ``torch._dynamo``'s recompile limit (8)
the layer silently runs eagerly for the rest of the run. A contiguous copy of those few
tensors costs a kernel each; one compiled graph then serves every batch shape.

What still takes separate graphs is the layers' Python control flow: a fairseq decoder's last
layer returns attention weights (``need_attn``), and padding masks come as tensors or None,
which gives a decoder layer up to eight variants, torch's default limit. The limit is raised
to :data:`RECOMPILE_LIMIT` so that none of them falls back to eager.

Under a Python dispatch mode (the plugin's check of the CPU's half products on the first step,
an operator census) the module's own forward runs: torch.compile compiles no frame under one,
and would run the frame eagerly from then on. So it does while something holds a model's compiled
modules to their own forward (:func:`hold_eager`): the non-finite watch's forward hooks, which
a compiled graph would be guarded on, each arming's new hooks a recompile. A hold is on one
model's modules: a watch left armed by a run that stopped holds no other model.

With ``mode="reduce-overhead"`` (``--cuda-graphs``) the compiled code runs as CUDA graphs
(torch's cudagraph trees): a graph is recorded for each new input shape and replayed after,
launching a layer's kernels at once instead of one by one from Python. The code is still
compiled once for all shapes; the graphs are per shape, so they need batches of few shapes
(:mod:`.buckets`). Off CUDA torch skips the graphs and the layers run compiled.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Iterable, Optional

import torch

from .swap import swap_attribute

__all__ = ["compile_dynamic", "compile_training_forward", "dispatch_mode_active", "hold_eager",
           "is_compiled", "release_eager"]

_MARK = "_fairseq_fp16_compiled"
#: graphs a compiled forward may have (``torch._dynamo.config.recompile_limit``; torch's is 8)
RECOMPILE_LIMIT = 32
#: inductor's C++ kernels pick their thread count per call (see :func:`compile_dynamic`)
DYNAMIC_THREADS = {"cpp.dynamic_threads": True}


def compile_dynamic(fn, mode: Optional[str] = None, backend="inductor"):
    """``torch.compile(fn, dynamic=True)`` with the CPU loops' threads chosen at each call.

    Inductor otherwise decides whether a CPU loop runs on all threads from the size it is first
    compiled for, and keeps that code for every size: a kernel first traced on a small tensor
    (a probe, an availability check) ran on one core in every training run, a large one on all
    of them (counter dropout, 2M bf16 elements: 1.14 ms a call single-threaded, 0.79 on two
    cores). ``mode`` (torch.compile's; it excludes options) and a ``backend`` other than
    inductor compile with their own settings.
    """
    if mode is not None or backend != "inductor":
        return torch.compile(fn, dynamic=True, backend=backend, mode=mode)
    return torch.compile(fn, dynamic=True, backend=backend, options=DYNAMIC_THREADS)


def compile_training_forward(modules: Iterable[torch.nn.Module], dynamic: bool = True,
                             backend="inductor", mode: Optional[str] = None) -> int:
    """Replace each module's ``forward`` by one that runs a compiled forward in training mode.

    Modules of one class share the compiled code (torch treats their parameters as inputs);
    ``dynamic`` compiles for varying batch and sequence sizes up front rather than after the
    first recompile; ``backend`` and ``mode`` are ``torch.compile``'s (``"reduce-overhead"``:
    CUDA graphs, see the module docstring). Idempotent. Returns how many modules were wrapped.
    """
    import torch._dynamo

    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    count = 0
    for module in modules:
        if not is_compiled(module):
            _wrap(module, (dynamic, backend, mode))
            count += 1
    return count


def _wrap(module: torch.nn.Module, options: tuple) -> None:
    dynamic, backend, mode = options
    before = vars(module).get("forward")  # an instance's own forward (fairseq's checkpoint wrapper)
    eager = module.forward
    compiled = (compile_dynamic(eager, mode, backend) if dynamic
                else torch.compile(eager, dynamic=False, backend=backend, mode=mode))
    # what holds this module to its own forward (hold_eager); a holder dropped lets go
    holders: "weakref.WeakSet[object]" = weakref.WeakSet()

    @functools.wraps(eager)
    def forward(*args, _eager=eager, _compiled=compiled, _module=module, _holders=holders, **kwargs):
        if (_module.training and kwargs.get("incremental_state") is None
                and not _holders and not dispatch_mode_active()):
            return _compiled(*[_contiguous(a) for a in args],
                             **{k: _contiguous(v) for k, v in kwargs.items()})
        return _eager(*args, **kwargs)

    swap_attribute(module, "forward", forward)
    setattr(module, _MARK, holders)
    # a deep copy (fairseq's EMA copies the model) is wrapped anew: this wrapper runs this module
    module.__deepcopy__ = functools.partial(_deepcopy, module, before, options)


def _deepcopy(module: torch.nn.Module, before, options: tuple, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of a wrapped module: the module as it was before the wrap, copied, then
    the copy wrapped around its own forward, with no holds."""
    own = {name: vars(module).pop(name) for name in ("forward", _MARK, "__deepcopy__")}
    if before is not None:
        module.forward = before
    try:
        twin = copy.deepcopy(module, memo)
    finally:
        vars(module).pop("forward", None)
        vars(module).update(own)
    _wrap(twin, options)
    return twin


def _contiguous(x):
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (``TorchDispatchMode``) is on, where torch.compile runs
    nothing compiled."""
    return torch._C._len_torch_dispatch_stack() > 0


def hold_eager(holder: object, model: torch.nn.Module) -> None:
    """Run the compiled modules in ``model`` on their own forward until :func:`release_eager`
    (``holder``: whose hold)."""
    for module in model.modules():
        if is_compiled(module):
            getattr(module, _MARK).add(holder)


def release_eager(holder: object, model: torch.nn.Module) -> None:
    for module in model.modules():
        if is_compiled(module):
            getattr(module, _MARK).discard(holder)


def is_compiled(module: torch.nn.Module) -> bool:
    return getattr(module, _MARK, None) is not None
