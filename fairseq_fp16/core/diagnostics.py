"""Mixed-precision diagnostics (pure torch): what overflowed, what underflows, what is lost.

* :func:`attribute_overflow` names the parameters whose gradients hold inf/nan,
  with counts. It reads the device (one sync), so callers run it only on the
  overflow step they have already detected.
* :func:`gradient_precision_stats` measures, per layer, how the scaled half
  gradients sit in the half format: the fraction of elements that are zero,
  the fraction that are subnormal (below the smallest normal, 2^-14 in fp16)
  and the headroom ``log2(max_finite / max|g|)`` left before overflow.
* :class:`LostUpdateMonitor` measures the fraction of fp32 master-weight
  updates smaller than half a half-precision ulp of the weight: the updates
  that would vanish if the weights were kept in half precision (the reason the
  recipe keeps fp32 masters; Micikevicius et al., *Mixed Precision Training*,
  2018).
* :class:`NonFiniteWatch` finds the first module whose forward output holds
  inf/nan, with forward hooks that check only while armed (after a step that
  overflowed), so a healthy run pays nothing.

Layers are parameter names without their last component
(``decoder.layers.0.fc1.weight`` -> ``decoder.layers.0.fc1``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch

from .compile import hold_eager, release_eager
from .master_weights import param_name

__all__ = [
    "attribute_overflow",
    "gradient_precision_stats",
    "LostUpdateMonitor",
    "layer_of",
    "NonFiniteWatch",
]


def layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def _named(params: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    return [(param_name(p, f"param{i}"), p) for i, p in enumerate(params)]


def attribute_overflow(params: Sequence[torch.Tensor], top: int = 5) -> List[Dict]:
    """Parameters with non-finite gradients, most non-finite elements first.

    Returns ``[{"param", "nonfinite", "numel"}]`` (at most ``top``). One host sync.
    """
    named = [(n, p) for n, p in _named(params) if p.grad is not None]
    if not named:
        return []
    counts = torch.stack([(~torch.isfinite(p.grad)).sum() for _, p in named]).tolist()
    hits = [
        {"param": n, "nonfinite": int(c), "numel": p.grad.numel()}
        for (n, p), c in zip(named, counts)
        if c > 0
    ]
    hits.sort(key=lambda h: (-h["nonfinite"], h["param"]))
    return hits[:top]


def gradient_precision_stats(params: Sequence[torch.Tensor], dtype: torch.dtype) -> Dict[str, Dict]:
    """Per layer: zero and subnormal fractions and headroom of the gradients in ``dtype``.

    The gradients are taken as they are (the scaled half gradients of the
    model); fp32 gradients (fp32 islands) are measured as if cast to ``dtype``.
    One host sync for all layers.
    """
    info = torch.finfo(dtype)
    tiny, fmax = info.tiny, info.max  # smallest normal, largest finite
    groups: "OrderedDict[str, list]" = OrderedDict()
    for name, p in _named(params):
        if p.grad is not None:
            groups.setdefault(layer_of(name), []).append(p.grad)
    if not groups:
        return {}
    rows = []
    for grads in groups.values():
        stats = []
        for g in grads:
            a = g.detach().to(dtype).float().abs()
            stats.append(torch.stack([(a == 0).sum().float(), ((a > 0) & (a < tiny)).sum().float(), a.max()]))
        st = torch.stack(stats)
        rows.append(torch.stack([st[:, 0].sum(), st[:, 1].sum(), st[:, 2].max()]))
    values = torch.stack(rows).tolist()  # the one sync
    out = {}
    for (layer, grads), (zeros, sub, amax) in zip(groups.items(), values):
        total = sum(g.numel() for g in grads)
        if amax == 0:
            headroom = float("inf")
        elif amax == float("inf") or amax != amax:
            headroom = float("-inf")
        else:
            headroom = math.log2(fmax / amax)
        out[layer] = {
            "zero_frac": zeros / total,
            "subnormal_frac": sub / total,
            "max_abs": amax,
            "headroom_log2": headroom,
            "numel": total,
        }
    return out


class LostUpdateMonitor:
    """Fraction of master-weight updates below half a half-precision ulp.

    Call :meth:`before_step` with the fp32 masters, then :meth:`after_step`
    once the optimizer has updated them; it returns, per layer, the fraction of
    elements whose (nonzero) update is smaller than half the ``dtype`` ulp of
    the weight, i.e. would be rounded away by a half-precision weight.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.eps = torch.finfo(dtype).eps  # ulp of 1.0
        self.tiny_ulp = torch.finfo(dtype).tiny * self.eps  # ulp of subnormals
        self._before: List[torch.Tensor] = []
        self._params: List[torch.Tensor] = []

    def before_step(self, masters: Sequence[torch.Tensor]) -> None:
        self._params = list(masters)
        self._before = [m.detach().clone() for m in self._params]

    def ulp(self, w: torch.Tensor) -> torch.Tensor:
        """The ``dtype`` spacing at ``|w|``: ``eps * 2^(e-1)`` for ``w = m * 2^e``."""
        _, e = torch.frexp(w.abs())
        return torch.clamp(torch.ldexp(torch.full_like(w, self.eps), e - 1), min=self.tiny_ulp)

    def after_step(self) -> Dict[str, float]:
        groups: "OrderedDict[str, list]" = OrderedDict()
        for name, (p, b) in zip((param_name(p, f"param{i}") for i, p in enumerate(self._params)),
                                zip(self._params, self._before)):
            delta = (p.detach() - b).abs()
            lost = ((delta > 0) & (delta < 0.5 * self.ulp(b))).sum()
            moved = (delta > 0).sum()
            groups.setdefault(layer_of(name), []).append(torch.stack([lost, moved]))
        self._before, self._params = [], []
        if not groups:
            return {}
        sums = torch.stack([torch.stack(v).sum(0) for v in groups.values()]).tolist()  # one sync
        return {layer: (lost / moved if moved else 0.0) for layer, (lost, moved) in zip(groups, sums)}


def _float_tensors(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _float_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _float_tensors(o)]
    return []


class NonFiniteWatch:
    """Names the first module whose forward output is not finite.

    Forward hooks on every submodule of ``model`` while armed; disarmed (the
    default) the model has none, so its modules keep ``nn.Module``'s fast call
    path (a module with hooks pays for them on every call). Armed, each hook
    takes the largest magnitude of each of its module's floating-point outputs
    (one reduction kernel, no host sync: NaN if the output has a NaN, inf if it
    has an inf), and the first read of :attr:`first` looks through them with
    one host sync for the first non-finite one, recorded as ``{"module",
    "type", "dtype", "kind", "shape"}``. Hooks fire when a module's forward
    returns, so inner modules are seen before the blocks that contain them.

    The optimizer arms the watch after an update that overflowed and disarms
    it after a finite one; :meth:`remove` takes the hooks off. Armed, it holds
    ``--compile-layers``' compiled layers to their own forward (:func:`.compile.hold_eager`).
    """

    #: records kept before they are looked through (one sync) to bound their memory
    MAX_PENDING = 4096

    def __init__(self, model: torch.nn.Module) -> None:
        self.armed = False
        self._model: torch.nn.Module | None = model
        self._first: Dict | None = None
        self._pending: List[tuple] = []  # (max magnitude, module name, type, dtype, shape)
        self._handles: List = []

    def _hook(self, name: str, module: torch.nn.Module):
        def hook(_module, _inputs, output):
            if self._first is not None:
                return
            for t in _float_tensors(output):
                if t.numel():
                    peak = torch.linalg.vector_norm(t.detach(), float("inf"))
                    self._pending.append((peak, name, type(module).__name__, t.dtype, list(t.shape)))
            if len(self._pending) >= self.MAX_PENDING:
                self._resolve()

        return hook

    def _resolve(self) -> None:
        """Find the first non-finite record among the pending ones (one host sync)."""
        pending, self._pending = self._pending, []
        if self._first is not None or not pending:
            return
        peaks = torch.stack([p[0].float() for p in pending]).cpu()  # the sync
        for (_, name, kind, dtype, shape), peak in zip(pending, peaks.tolist()):
            if not math.isfinite(peak):
                self._first = {
                    "module": name,
                    "type": kind,
                    "dtype": str(dtype).replace("torch.", ""),
                    "kind": "nan" if math.isnan(peak) else "inf",
                    "shape": shape,
                }
                return

    @property
    def first(self) -> Dict | None:
        """The first non-finite module output seen since :meth:`arm`, or None."""
        self._resolve()
        return self._first

    def arm(self) -> None:
        """Check the next forward passes (hooks on); forget the previous finding."""
        self.armed = True
        self._first = None
        self._pending = []
        if self._model is not None and not self._handles:
            self._handles = [
                module.register_forward_hook(self._hook(name, module))
                for name, module in self._model.named_modules()
                if name
            ]
            hold_eager(self)  # compiled layers run their own forward, which fires the hooks

    def disarm(self) -> None:
        """Stop checking (hooks off); forget the finding."""
        self.armed = False
        self._first = None
        self._pending = []
        self._remove_hooks()

    def remove(self) -> None:
        """Take the hooks off for good: a later :meth:`arm` checks nothing."""
        self._remove_hooks()
        self._model = None

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        release_eager(self)
