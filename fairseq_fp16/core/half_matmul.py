"""Half-precision matrix products on CPUs without half-precision units (pure torch).

A GPU's tensor cores take fp16/bf16 operands, multiply and accumulate in fp32,
and round the result to fp16/bf16. :class:`Fp32AccumulateMatmul` keeps that
contract on the CPU: below autograd (a ``TorchDispatchMode``, so the backward
products and fused attention are covered too) it upcasts the half operands of
``mm``/``addmm``/``bmm``/``baddbmm`` and of CPU scaled-dot-product attention
to fp32 (exact), runs fp32 kernels, and rounds the results back to the half
dtype. Weights, activations and gradients stay half; a product that exceeds
the half range still becomes ``inf``, as on the GPU. Other ops (softmax, layer
norm, elementwise) run in their own precision, as they would on the GPU.

On a CPU without fp16 arithmetic, native fp16 matrix products are ~26x slower
than fp32 (measured on this project's Cascade Lake machine); with this mode a
half-precision step runs at about fp32 speed.

:func:`resolve_half_matmul` turns ``--half-matmul {auto,native,fp32-accumulate}``
into a decision; ``auto`` uses fp32 accumulation for a half dtype the CPU has no
native units for (fp16: AVX512-FP16 or AMX-FP16; bf16: AVX512-BF16 or AMX-BF16).
CUDA tensors are never touched.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "HALF_MATMUL_CHOICES",
    "Fp32AccumulateMatmul",
    "cpu_has_native_half",
    "resolve_half_matmul",
    "half_matmul_context",
]

HALF_MATMUL_CHOICES = ("auto", "native", "fp32-accumulate")

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)

#: ops whose tensor operands are upcast and whose tensor outputs are rounded back
COVERED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
}
#: outputs the native kernel returns in fp32 even for half inputs (kept fp32)
FP32_OUTPUTS = {}
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _sdpa = _aten._scaled_dot_product_flash_attention_for_cpu.default
    COVERED_OPS.add(_sdpa)
    COVERED_OPS.add(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    FP32_OUTPUTS[_sdpa] = {1}  # logsumexp

#: /proc/cpuinfo flags that give native arithmetic per dtype
NATIVE_FLAGS = {
    torch.float16: ("avx512_fp16", "amx_fp16"),
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> Optional[frozenset]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_has_native_half(dtype: torch.dtype, flags: Optional[Iterable[str]] = None) -> bool:
    """Whether the CPU has arithmetic units for ``dtype`` (from /proc/cpuinfo).

    Where the flags cannot be read (not Linux), the CPU is assumed to have them
    (Apple and other ARM CPUs compute fp16 natively).
    """
    flags = _cpu_flags() if flags is None else frozenset(flags)
    if flags is None:
        return True
    return any(f in flags for f in NATIVE_FLAGS[dtype])


def resolve_half_matmul(choice: str, dtype: Optional[torch.dtype],
                        flags: Optional[Iterable[str]] = None) -> bool:
    """True when CPU matrix products of ``dtype`` should accumulate in fp32.

    Raises:
        ValueError: naming ``--half-matmul`` for an unknown choice.
    """
    if choice not in HALF_MATMUL_CHOICES:
        raise ValueError(
            f"--half-matmul must be one of {', '.join(HALF_MATMUL_CHOICES)}, got {choice!r}"
        )
    if dtype not in _HALF or choice == "native":
        return False
    if choice == "fp32-accumulate":
        return True
    return not cpu_has_native_half(dtype, flags)


def _half_cpu_dtype(args) -> Optional[torch.dtype]:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type == "cpu" and a.dtype in _HALF:
                return a.dtype
        elif isinstance(a, (list, tuple)):
            d = _half_cpu_dtype(a)
            if d is not None:
                return d
    return None


def _cast(x, src: Set[torch.dtype], dst: torch.dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dst) if x.dtype in src else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, src, dst) for v in x)
    return x


class Fp32AccumulateMatmul(TorchDispatchMode):
    """Within the block, CPU half matrix products multiply in fp32 and round to half.

    ``calls`` counts the intercepted products (for tests and logs).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COVERED_OPS:
            dtype = _half_cpu_dtype(args)
            if dtype is not None:
                self.calls += 1
                out = func(*_cast(args, {dtype}, torch.float32),
                           **{k: _cast(v, {dtype}, torch.float32) for k, v in kwargs.items()})
                keep = FP32_OUTPUTS.get(func)
                if keep and isinstance(out, tuple):
                    return tuple(o if i in keep else _cast(o, {torch.float32}, dtype)
                                 for i, o in enumerate(out))
                return _cast(out, {torch.float32}, dtype)
        return func(*args, **kwargs)


def half_matmul_context(enabled: bool):
    """``Fp32AccumulateMatmul()`` when enabled, else a do-nothing context."""
    return Fp32AccumulateMatmul() if enabled else contextlib.nullcontext()
