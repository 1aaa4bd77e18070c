"""Bound the CPU kernel caches that make native half-precision training grow in memory.

On the CPU, torch runs bf16 (and native fp16) matrix products through oneDNN,
which keeps a compiled kernel per operand shape in two least-recently-used
caches: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
ideep's (``LRU_CACHE_CAPACITY``), 1,024 entries each by default. fp32 products
go to BLAS and do not use these caches. Translation batches come in hundreds of shapes
(tokens per batch vary), each cached kernel holds memory of its own, and a bf16
run's resident memory grows with every new shape until both caches are full.

Both capacities are read from the environment when the first such product
runs, so :func:`cap_cpu_kernel_caches` sets them once the model is built, before
it computes anything. A variable the user has set is left alone.

On a CPU with AMX tiles, a cache miss costs more than memory: oneDNN compiles
(JITs) an AMX kernel for each new shape, and with few entries kept a run compiles
the same kernels again and again. Fewer shapes cure both: with each batch's source and target
lengths padded to a multiple of 8 (fairseq's ``--required-seq-len-multiple``;
padded positions are masked, the sentences of each batch are unchanged) the
batches come in far fewer shapes, each kernel is compiled once, and 1,024-entry
caches hold them all in a fraction of the memory they take without padding.

Padding pays while compiling kernels weighs against a batch's products, and costs more than
it saves once the products are large: batches are cut by padded lengths, so each holds fewer
sentences. :func:`resolve_length_multiple` and :func:`resolve_kernel_cache` make padding the
default (``auto``) where the half products run on AMX tiles and a batch's products
(:func:`batch_products`) take fewer than :data:`AMX_UNPADDED_MIN_MACS` multiply-adds, and keep
lengths as they are and 64 entries otherwise (docs/cpu-batch-shapes.md has the measurements).
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, MutableMapping, Optional

import torch

from .half_matmul import cpu_has_amx

__all__ = [
    "AMX_UNPADDED_MIN_MACS",
    "CACHE_ENV_VARS",
    "batch_products",
    "check_capacity",
    "cap_cpu_kernel_caches",
    "resolve_kernel_cache",
    "resolve_length_multiple",
]

#: oneDNN's primitive cache, then ideep's (torch's oneDNN wrapper)
CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
#: ``--cpu-kernel-cache auto``: lengths as they are (many shapes: bound the memory) /
#: padded (few shapes: keep them all; torch's own capacity)
CAPPED_CACHE, BUCKETED_CACHE = 64, 1024
#: ``--cpu-length-multiple auto`` where the half products run on AMX tiles
AMX_LENGTH_MULTIPLE = 8
#: multiply-adds of a batch's products from which ``auto`` keeps lengths as they are on AMX.
#: Measured, AMX Xeon, bf16, Debian en-de (benchmarks/amx-xeon-480/length_multiple): padded
#: faster at 4 G (the demo) and 15 G (1.72x against 1.55x stock fp32's words/s), alike at 49
#: and 61 G (unpadded at 0.74x the memory at 61 G), unpadded faster at 197 G (transformer
#: base, 4,096 tokens: 2.69x against 2.41x, at 0.75x against 0.91x the memory)
AMX_UNPADDED_MIN_MACS = 32 * 10**9


def batch_products(model: Optional[torch.nn.Module], max_tokens) -> Optional[int]:
    """Multiply-adds of the matrix products in the forward of a batch of ``max_tokens`` tokens
    (``--max-tokens``): ``max_tokens`` times the weights of ``model``'s ``nn.Linear`` modules
    (each token passes through its side's projections and feed-forward layers, and each target
    token through the output projection; the attention's own products, growing with the
    sentences' lengths, are left out). None where either is unknown."""
    if model is None or not max_tokens:
        return None
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return int(max_tokens) * weights


def resolve_length_multiple(
    choice, dtype: Optional[torch.dtype], native: bool, flags: Optional[Iterable[str]] = None,
    products: Optional[int] = None,
) -> int:
    """``--cpu-length-multiple`` as the multiple each batch's lengths are padded to.

    Args:
        choice: ``"auto"`` or an integer >= 1.
        dtype: the model's half dtype (None: fp32, which ``auto`` never pads).
        native: whether the CPU half products run on torch's native (oneDNN) kernels.
        flags: /proc/cpuinfo flags (default: this CPU's).
        products: a batch's multiply-adds (:func:`batch_products`; None: unknown).

    Returns:
        ``choice`` as an int; for ``auto``, :data:`AMX_LENGTH_MULTIPLE` when native
        ``dtype`` products run on AMX tiles and ``products`` is unknown or under
        :data:`AMX_UNPADDED_MIN_MACS`, else 1 (lengths as they are).

    Raises:
        ValueError: naming the flag, for anything but ``auto`` or an integer >= 1.
    """
    if str(choice) == "auto":
        small = products is None or products < AMX_UNPADDED_MIN_MACS
        return AMX_LENGTH_MULTIPLE if native and small and cpu_has_amx(dtype, flags) else 1
    return _at_least_one(choice, "--cpu-length-multiple must be auto or an integer >= 1 "
                                 "(1 = lengths as they are)")


def resolve_kernel_cache(choice, length_multiple: int) -> int:
    """``--cpu-kernel-cache`` as a capacity: ``auto`` keeps :data:`BUCKETED_CACHE` kernels
    when batch lengths are padded to a multiple above 1, else :data:`CAPPED_CACHE`.

    Raises:
        ValueError: naming the flag (see :func:`check_capacity`).
    """
    if str(choice) == "auto":
        return BUCKETED_CACHE if length_multiple > 1 else CAPPED_CACHE
    return check_capacity(choice)


def check_capacity(capacity) -> int:
    """``--cpu-kernel-cache`` as an int.

    Raises:
        ValueError: naming the flag, for anything but an integer >= 1.
    """
    return _at_least_one(capacity, "--cpu-kernel-cache must be auto or an integer >= 1 "
                                   "(kernels kept per cache; torch's default is 1024)")


def _at_least_one(value, message: str) -> int:
    """``value`` as an int >= 1, or ValueError(f"{message}, got {value!r}")."""
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{message}, got {value!r}")
    return number


def cap_cpu_kernel_caches(
    capacity: int, environ: Optional[MutableMapping[str, str]] = None
) -> Dict[str, str]:
    """Set each cache capacity the environment does not set already to ``capacity``.

    Returns:
        the value in effect for each variable of :data:`CACHE_ENV_VARS`.

    Raises:
        ValueError: naming ``--cpu-kernel-cache`` (see :func:`check_capacity`).
    """
    value = check_capacity(capacity)
    environ = os.environ if environ is None else environ
    for var in CACHE_ENV_VARS:
        environ.setdefault(var, str(value))
    return {var: environ[var] for var in CACHE_ENV_VARS}
