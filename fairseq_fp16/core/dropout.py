"""Dropout whose mask costs one pass over memory on the CPU (pure torch).

torch's CPU dropout draws its mask with ``bernoulli_`` from the generator's sequential
Mersenne Twister: about 6 ns an element on the 2-core EPYC, 13 ms for a 4,096 x 512 activation
that a multiplication reads and writes in 0.15 ms (``scripts/bench_dropout.py``). A transformer
update draws some thirty such masks.

:func:`counter_dropout` decides each element from its index instead: element ``i`` is kept
where ``h(i * (s1 | 1) + s0)``, read as a signed 32-bit integer, is at least
``round(p * 2**32) - 2**31``. ``h`` is Chris Wellons' ``lowbias32`` (two multiply-xorshift
rounds; a bijection of 32-bit integers with low avalanche bias) and ``(s0, s1)`` the call's seed:
the odd multiplier drawn with it makes each call hash another progression, so two calls share
no run of decisions unless their multipliers match (one pair in 2**31; an offset alone would
repeat one call's mask in the next, shifted). Each
decision depends on nothing but its index and the seed, so the mask, the scaling
(``1 / (1 - p)``, in fp32) and the rounding to the input's dtype are one vectorised loop,
compiled once per dtype with ``torch.compile`` (32-bit integer lanes, as wide as the fp32 ones):
0.6 ms for 2M bf16 elements on the 2-core EPYC, where a multiplication takes 0.2. The backward
pass runs the same loop on the gradient with the same seed: no mask is kept for it (torch keeps
one of the input's size and dtype).

Each call draws its seed from torch's default CPU generator, so the masks follow
``torch.manual_seed`` as torch's do: fairseq seeds every update with ``--seed`` plus the
update number, and a resumed run draws the masks of the uninterrupted one. The keep
probability is ``1 - round(p * 2**32) / 2**32``, within ``2**-33`` of ``1 - p``.

Where the compiled kernel cannot be built or gives other bits than the eager one
(:func:`counter_dropout_available`, tried once per dtype), callers keep torch's dropout. Under
a Python dispatch mode (an operator census, the CPU's check of native half products) the same
mask is computed by eager torch operations (slow: a dozen passes), so the bits never depend on
what was watching.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, Optional

import torch

from .compile import compile_dynamic, dispatch_mode_active

logger = logging.getLogger(__name__)

__all__ = ["AUTO_MIN_NUMEL", "MAX_NUMEL", "counter_dropout", "counter_dropout_available", "keep_mask"]

# lowbias32's multipliers, as signed 32-bit integers (torch multiplies int32 modulo 2**32)
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B - (1 << 32)
#: the most elements a call takes (the index is a 32-bit integer); larger tensors keep torch's
MAX_NUMEL = 1 << 31
#: the fewest elements for which the counter-based mask pays where callers choose (``auto``): a
#: compiled call costs some 0.07 ms a pass whatever the size, ``bernoulli_`` about 6 ns an
#: element (``scripts/bench_dropout.py``)
AUTO_MIN_NUMEL = 1 << 15


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` as unsigned 32-bit (torch shifts int32 arithmetically)."""
    return (z >> bits) & ((1 << (32 - bits)) - 1)


def _hash(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 16)) * MIX1
    z = (z ^ _shift_right(z, 15)) * MIX2
    return z ^ _shift_right(z, 16)


def _masked(x: torch.Tensor, seed: torch.Tensor, threshold: torch.Tensor,
            scale: torch.Tensor) -> torch.Tensor:
    """``x * keep * scale`` of a 1-d ``x``, in fp32 (fp64 for fp64), rounded once to ``x``'s
    dtype."""
    index = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
    keep = _hash(index * (seed[1] | 1) + seed[0]) >= threshold
    wide = torch.promote_types(x.dtype, torch.float32)
    return torch.where(keep, x.to(wide) * scale, 0.0).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled():
    return compile_dynamic(_masked)


def _apply(x: torch.Tensor, seed, threshold, scale) -> torch.Tensor:
    flat = x.reshape(-1)
    kernel = _masked if dispatch_mode_active() else _compiled()
    return kernel(flat, seed, threshold, scale).view(x.shape)


class _CounterDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seed, threshold, scale):
        ctx.save_for_backward(seed, threshold, scale)
        return _apply(x, seed, threshold, scale)

    @staticmethod
    def backward(ctx, grad):
        seed, threshold, scale = ctx.saved_tensors
        return _apply(grad, seed, threshold, scale), None, None, None


@functools.lru_cache(maxsize=None)
def _constants(p: float):
    """The threshold (signed 32-bit) and the scale of drop probability ``p``."""
    threshold = torch.tensor(round(p * 2.0**32) - 2**31, dtype=torch.int32)
    return threshold, torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)


def _seed(generator: Optional[torch.Generator] = None) -> torch.Tensor:
    return torch.randint(-(1 << 31), 1 << 31, (2,), dtype=torch.int32, generator=generator)


def keep_mask(numel: int, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The keep decisions (bool, 1-d) of ``numel`` elements at drop probability ``p`` for the
    2-element int32 ``seed``: what :func:`counter_dropout` applies (eager; for checks)."""
    return _masked(torch.ones(numel), seed, *_constants(p)) != 0


def counter_dropout(x: torch.Tensor, p: float, generator: Optional[torch.Generator] = None
                    ) -> torch.Tensor:
    """Training-mode dropout of a CPU tensor with drop probability ``p`` in [0, 1): each
    element kept with probability ``1 - p`` (to ``2**-33``) and scaled by ``1 / (1 - p)``.

    The seed is drawn from ``generator`` (torch's default CPU generator when None).

    Raises:
        ValueError: for ``p`` outside [0, 1), a tensor off the CPU or of more than
            :data:`MAX_NUMEL` elements.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if x.device.type != "cpu" or x.numel() > MAX_NUMEL:
        raise ValueError(f"counter_dropout takes CPU tensors of at most 2**31 elements; got "
                         f"{x.numel()} on {x.device}")
    if p == 0.0:
        return x
    return _CounterDropout.apply(x.contiguous(), _seed(generator), *_constants(p))


#: sizes the check runs: the vectorised loop, its tail, and a tail alone
_CHECK_SIZES = (1000, 5)


#: dtype -> whether the compiled kernel gives the eager kernel's bits here
_AVAILABLE: Dict[torch.dtype, bool] = {}


def counter_dropout_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the compiled kernel builds here and gives the eager kernel's bits for ``dtype``
    (tried once per dtype, on small tensors; not under a dispatch mode, where the eager kernel
    serves and True is answered until the try)."""
    known = _AVAILABLE.get(dtype)
    if known is None:
        if dispatch_mode_active():
            return True
        known = _AVAILABLE[dtype] = _compiles_as_eager(dtype)
    return known


def _compiles_as_eager(dtype: torch.dtype) -> bool:
    try:
        seed, (threshold, scale) = torch.tensor([12345, -678], dtype=torch.int32), _constants(0.25)
        same = True
        for n in _CHECK_SIZES:
            x = torch.linspace(-3, 3, n).to(dtype)
            same &= torch.equal(_compiled()(x, seed, threshold, scale), _masked(x, seed, threshold, scale))
    except Exception as e:  # no C++ compiler, or a torch without inductor on this platform
        logger.warning("dropout: torch.compile cannot build the counter-based mask here (%s: "
                       "%s); torch's dropout is used", type(e).__name__, str(e).splitlines()[0])
        return False
    if not same:
        logger.warning("dropout: the compiled counter-based mask differs from its eager "
                       "definition on this machine (%s); torch's dropout is used", dtype)
    return bool(same)
