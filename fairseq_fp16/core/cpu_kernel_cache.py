"""Bound the CPU kernel caches that make native half-precision training grow in memory.

On the CPU, torch runs bf16 (and native fp16) matrix products through oneDNN,
which keeps a compiled kernel per operand shape in two least-recently-used
caches: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
ideep's (``LRU_CACHE_CAPACITY``), 1,024 entries each by default. fp32 products
go to BLAS and do not use these caches. Translation batches come in hundreds of shapes
(tokens per batch vary), each cached kernel holds memory of its own, and a bf16
run's resident memory grows with every new shape until both caches are full:
on this project's demo, 3.6x the fp32 run's peak.

Both capacities are read from the environment when the first such product
runs, so :func:`cap_cpu_kernel_caches` sets them when the task is built, before
the model computes anything. A variable the user has set is left alone.
"""

from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

__all__ = ["CACHE_ENV_VARS", "check_capacity", "cap_cpu_kernel_caches"]

#: oneDNN's primitive cache, then ideep's (torch's oneDNN wrapper)
CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def check_capacity(capacity) -> int:
    """``--cpu-kernel-cache`` as an int.

    Raises:
        ValueError: naming the flag, for anything but an integer >= 1.
    """
    try:
        value = int(str(capacity))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            "--cpu-kernel-cache must be an integer >= 1 (kernels kept per cache; "
            f"torch's default is 1024), got {capacity!r}"
        )
    return value


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
