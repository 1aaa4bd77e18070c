"""fp32 islands inside a half-precision model (pure torch, no fairseq import).

:func:`keep_in_fp32` marks modules whose parameters and arithmetic stay fp32
when the rest of the model is cast with ``model.half()`` or
``model.to(torch.bfloat16)``: their floating-point inputs are cast to fp32 in
``forward`` and the output is cast back to the input's dtype, so the
neighbouring half layers see half tensors. Normalisation layers (LayerNorm,
GroupNorm, BatchNorm) are islands by default, as in the apex recipe: their
mean/variance reductions lose too much in fp16.

The upcast costs a copy of each norm's input and of its output (two launches each
way). A ``LayerNorm`` island calls ``layer_norm`` on the half input with its fp32
weights directly where torch's kernel computes as the island does: statistics and
affine in fp32 from the half input, the output rounded once, the weights' gradients
summed in fp32 (:func:`direct_half_layer_norm`, probed once per device type and
dtype). torch's CPU kernel takes the mixed dtypes but sums the weights' gradients at
lower precision (0.3% off in fp16, 1.5% in bf16, ``tests/core/test_fp32_islands.py``); its
CUDA kernel (``aten/src/ATen/native/cuda/layer_norm_kernel.cu``, as far as its source was
read) computes in fp32 but reads the weights as the input's dtype, and so refuses fp32
ones ("expected scalar type Half but found Float", pytorch/pytorch#135969, open). Neither is
called on the half input, then; a torch whose kernel passes the probe runs without the casts
(``tests/core/test_cuda_fp32_islands.py`` tells on a GPU).

On the CPU, a LayerNorm island of at least :data:`COMPILED_NORM_MIN_NUMEL` elements runs the
island's own definition (cast, fp32 layer_norm, cast back) compiled with ``torch.compile``,
which fuses the casts into the normalisation's loops, forward and backward: one pass reads the
half input and writes the half output, the backward keeps the half input, not an fp32 copy, and
the weights' gradients are still summed in fp32 (:func:`compiled_half_layer_norm`: compiled
once per dtype for every shape, and taken only where it gives the island's results; below that
size the compiled call's fixed cost is more than the casts it saves).

A marked module keeps its fp32 parameters through later dtype casts (its
``_apply`` drops the half cast but keeps device moves), so no precision is
lost by ``model.half()``.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Dict, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from .compile import compile_dynamic, dispatch_mode_active

logger = logging.getLogger(__name__)

__all__ = ["COMPILED_NORM_MIN_NUMEL", "NORM_TYPES", "apply_fp32_islands",
           "compiled_half_layer_norm", "default_norm_types", "direct_half_layer_norm",
           "is_fp32_island", "keep_in_fp32"]

NORM_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
#: apex's normalisation layers (what fairseq's ``LayerNorm()`` returns where apex is installed)
APEX_NORMS = ("FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm")


def default_norm_types() -> Tuple[Type[nn.Module], ...]:
    """:data:`NORM_TYPES` and, where apex is installed, its fused normalisation layers."""
    try:
        from apex import normalization  # optional: fairseq's LayerNorm() prefers apex's
    except ImportError:
        return NORM_TYPES
    return NORM_TYPES + tuple(getattr(normalization, n) for n in APEX_NORMS if hasattr(normalization, n))

_HALF = (torch.float16, torch.bfloat16)
_island_classes: Dict[type, type] = {}


def _map(x, fn):
    """``fn`` applied to every tensor in nested tuples, lists and dicts (fairseq's encoder
    returns a dict of lists of tensors); other values as they are."""
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_map(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _map(v, fn)) for k, v in x.items())
    return x


def _to_fp32(x):
    return _map(x, lambda t: t.float() if t.dtype in _HALF else t)


def _to_dtype(x, dtype):
    return _map(x, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


def _first_half_dtype(args, kwargs) -> Optional[torch.dtype]:
    for v in list(args) + list(kwargs.values()):
        if torch.is_tensor(v) and v.dtype in _HALF:
            return v.dtype
    return None


#: (device type, dtype) -> whether torch's layer_norm there computes a half input with fp32
#: weights as the island does (:func:`direct_half_layer_norm`)
_DIRECT_NORM: Dict[Tuple[str, torch.dtype], bool] = {}
#: the probe's sizes: enough rows that a weight gradient summed in half precision misses
_PROBE_ROWS, _PROBE_WIDTH = 256, 64


def within_one_ulp(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
                   scale_slack: float = 0.0) -> torch.Tensor:
    """Whether ``a`` is within one ``dtype`` ulp of ``b`` everywhere (a 0-dim bool tensor): the
    spacing of ``dtype`` at ``|b|``, ``eps * 2**floor(log2 |b|)``, never below the subnormal
    spacing; or, element by element, within ``scale_slack`` times ``b``'s largest magnitude
    (two fp32 computations of a sum that cancels near zero round differently there)."""
    info = torch.finfo(dtype)
    a, b = a.float(), b.float()
    _, exponent = torch.frexp(b)
    ulp = torch.ldexp(torch.full_like(b, info.eps), exponent - 1).clamp(min=info.tiny * info.eps)
    ulp = torch.where(b == 0, info.tiny * info.eps, ulp)
    if scale_slack:
        ulp = ulp.clamp(min=scale_slack * b.abs().max())
    return ((a - b).abs() <= ulp).all()


def _island_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """A LayerNorm island over the last dimension: an fp32 copy of ``x`` normalised with the
    fp32 weights, the output rounded to ``x``'s dtype."""
    return F.layer_norm(x.float(), weight.shape, weight, bias, eps).to(x.dtype)


def _layer_norm_of_half_input(x, weight, bias, eps):
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def _probe_layer_norm(device: torch.device, dtype: torch.dtype, kernel, compiled: bool = False
                      ) -> bool:
    """Run ``layer_norm`` on seeded data on ``device`` as the island does (an fp32 copy of the
    input, the output rounded to ``dtype``) and through ``kernel(x, weight, bias, eps)`` on the
    ``dtype`` input with the fp32 weights. True where the kernel is accepted, returns ``dtype``
    outputs and input gradients within one ulp of the island's (or, near zero, within 1e-6 of
    the largest: another order of the same fp32 operations), and fp32 weight and bias gradients
    within fp32 rounding (1e-5 of the largest) of the island's. A ``compiled`` kernel that
    cannot be built or computes otherwise is logged. One host sync."""
    gen = torch.Generator().manual_seed(0)
    shape = (_PROBE_ROWS, _PROBE_WIDTH)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(device, dtype)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    w0 = (torch.randn(_PROBE_WIDTH, generator=gen) * 0.5 + 1).to(device)
    b0 = torch.randn(_PROBE_WIDTH, generator=gen).to(device)

    def run(direct: bool):
        xi = x.detach().clone().requires_grad_()
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = (kernel if direct else _island_layer_norm)(xi, w, b, 1e-5)
        y.backward(dy)
        return y, xi.grad, w.grad, b.grad

    with torch.inference_mode(False), torch.enable_grad():
        ref = run(direct=False)
        try:
            got = run(direct=True)
        except Exception as e:  # a kernel that reads the weights in the input's dtype (CUDA),
            # or torch.compile without a C++ compiler
            if compiled:
                logger.warning("LayerNorm islands: torch.compile cannot build their fused kernel "
                               "here (%s: %s); they cast their inputs", type(e).__name__,
                               (str(e).splitlines() or [""])[0])
            return False
        if [t.dtype for t in got] != [dtype, dtype, torch.float32, torch.float32]:
            return False
        checks = [within_one_ulp(got[i], ref[i], dtype, scale_slack=1e-6) for i in (0, 1)]
        for g, r in zip(got[2:], ref[2:]):
            checks.append(((g - r).abs().max() <= 1e-5 * r.abs().max()))
        same = bool(torch.stack(checks).all())
    if compiled and not same:
        logger.warning("LayerNorm islands: their compiled kernel gives other results than the "
                       "island on this machine (%s); they cast their inputs", dtype)
    return same


def direct_half_layer_norm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a ``LayerNorm`` island on ``device`` calls ``layer_norm`` on its ``dtype``
    input with the fp32 weights directly, without the casts: torch's kernel there must give
    the island's results (:func:`_probe_layer_norm`, run once per device type and
    dtype; never while ``torch.compile`` traces)."""
    key = (torch.device(device).type, dtype)
    known = _DIRECT_NORM.get(key)
    if known is None:
        if torch.compiler.is_compiling():
            return False
        known = _DIRECT_NORM[key] = _probe_layer_norm(torch.device(device), dtype,
                                                      _layer_norm_of_half_input)
    return known


#: the fewest elements for which a CPU LayerNorm island runs compiled: a compiled call costs
#: some 0.17 ms forward and backward whatever the size, the casts it saves about 0.4 ns an
#: element (2-core EPYC: 0.11 against 0.19 ms at 2**15 elements, 6.1 against 2.4 ms at 2**21)
COMPILED_NORM_MIN_NUMEL = 1 << 18
#: dtype -> whether the compiled island computes as the eager one on the CPU
_COMPILED_NORM: Dict[torch.dtype, bool] = {}


@functools.lru_cache(maxsize=None)
def _compiled_island_layer_norm():
    return compile_dynamic(_island_layer_norm)


def _compiled_layer_norm(x, weight, bias, eps):
    return _compiled_island_layer_norm()(x, weight, bias, eps)


def compiled_half_layer_norm(dtype: torch.dtype) -> bool:
    """Whether a CPU ``LayerNorm`` island of a ``dtype`` input runs compiled: torch.compile
    builds the island's definition here and it gives the island's results
    (:func:`_probe_layer_norm`, run once per dtype; never while torch.compile traces or under a
    dispatch mode, where the eager island runs)."""
    if torch.compiler.is_compiling() or dispatch_mode_active():
        return False
    known = _COMPILED_NORM.get(dtype)
    if known is None:
        known = _COMPILED_NORM[dtype] = _probe_layer_norm(torch.device("cpu"), dtype,
                                                          _compiled_layer_norm, compiled=True)
    return known


class _Fp32IslandMixin:
    """Mixed into a module's class: fp32 params, fp32 forward."""

    _fp32_island = True
    #: dtype the rest of the model was cast to (None while it is fp32); the
    #: output takes it when no input tells (e.g. an embedding's token ids).
    _island_model_dtype = None
    #: torch's own LayerNorm.forward: one layer_norm call, which may take the half input
    _direct_layer_norm = False

    def forward(self, *args, **kwargs):
        dtype = _first_half_dtype(args, kwargs) or self._island_model_dtype
        if dtype is None:
            return super().forward(*args, **kwargs)
        if self._direct_layer_norm and len(args) == 1 and not kwargs and args[0].dtype == dtype:
            x = args[0]
            if direct_half_layer_norm(x.device, dtype):
                return super().forward(x)  # statistics and affine in fp32, the output in dtype
            if (x.device.type == "cpu" and x.numel() >= COMPILED_NORM_MIN_NUMEL
                    and torch.is_grad_enabled() and self.weight is not None
                    and self.bias is not None and len(self.normalized_shape) == 1
                    and compiled_half_layer_norm(dtype)):
                # as rows of a matrix: one compiled graph for inputs of any rank
                rows = x.reshape(-1, x.shape[-1])
                return _compiled_layer_norm(rows, self.weight, self.bias, self.eps).view(x.shape)
        out = super().forward(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})
        return _to_dtype(out, dtype)

    def _apply(self, fn, recurse=True):
        self._island_model_dtype = _target_dtype(fn, self._island_model_dtype)

        def keep_fp32(t):
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype in _HALF:
                return t.to(device=out.device)  # device moves only
            return out

        return super()._apply(keep_fp32, recurse)


def _target_dtype(fn, current):
    """The dtype a ``Module._apply`` function casts the model to (probed on scalars).

    ``model.half()`` gives fp16, ``model.to(torch.bfloat16)`` bf16, ``model.float()``
    None (fp32 model); a device move keeps ``current``.
    """
    try:
        from_fp32 = fn(torch.zeros(())).dtype
        from_half = fn(torch.zeros((), dtype=torch.float16)).dtype
    except Exception:  # an _apply function that only takes parameters
        return current
    if from_fp32 in _HALF:
        return from_fp32
    if from_half == torch.float32:
        return None
    return current


def is_fp32_island(module: nn.Module) -> bool:
    return bool(getattr(module, "_fp32_island", False))


def keep_in_fp32(module: nn.Module) -> nn.Module:
    """Make ``module`` an fp32 island in place (idempotent); returns it."""
    if is_fp32_island(module):
        return module
    cls = module.__class__
    island = _island_classes.get(cls)
    if island is None:
        direct = issubclass(cls, nn.LayerNorm) and cls.forward is nn.LayerNorm.forward
        island = type(f"Fp32{cls.__name__}", (_Fp32IslandMixin, cls), {"_direct_layer_norm": direct})
        island.__module__ = cls.__module__
        _island_classes[cls] = island
    module.__class__ = island
    module.float()
    return module


def apply_fp32_islands(
    model: nn.Module, fp32_modules: Optional[str] = None, norm_types=None
) -> List[str]:
    """Turn normalisation layers and modules matching ``fp32_modules`` into islands.

    Args:
        model: the model, before it is cast to half.
        fp32_modules: a regular expression matched (``re.search``) against
            qualified module names (``--fp32-modules``), or ``None``.

    Returns:
        The names of the modules made islands by the regular expression
        (an empty list tells the caller that it matched nothing).

    Raises:
        ValueError: if ``fp32_modules`` is not a valid regular expression.
    """
    pattern = None
    if fp32_modules:
        try:
            pattern = re.compile(fp32_modules)
        except re.error as e:
            raise ValueError(
                f"--fp32-modules is not a valid regular expression: {fp32_modules!r} ({e})"
            ) from None
    norm_types = norm_types or default_norm_types()
    matched = []
    for name, module in model.named_modules():
        if pattern is not None and name and pattern.search(name):
            keep_in_fp32(module)
            matched.append(name)
        elif isinstance(module, norm_types):
            keep_in_fp32(module)
    # A parameter shared with an island (tied embeddings and output projection)
    # stays fp32, so every module holding it must be an island too.
    island_params = {id(p) for m in model.modules() if is_fp32_island(m) for p in m.parameters()}
    for module in model.modules():
        if not is_fp32_island(module) and any(
            id(p) in island_params for p in module.parameters(recurse=False)
        ):
            keep_in_fp32(module)
    return matched
