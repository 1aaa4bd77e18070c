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
  overflowed), so a healthy run pays nothing, and an armed forward a few
  multi-tensor launches.

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
    "is_dense",
    "peak_magnitudes",
    "LostUpdateMonitor",
    "layer_of",
    "NonFiniteWatch",
]


def layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def _named(params: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    return [(param_name(p, f"param{i}"), p) for i, p in enumerate(params)]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its storage span without gaps or overlaps, in any dimension order
    (torch's ``is_non_overlapping_and_dense``): the condition under which torch's CUDA
    multi-tensor kernels take a tensor (a slice does not qualify)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> "OrderedDict[tuple, List[int]]":
    groups: "OrderedDict[tuple, List[int]]" = OrderedDict()
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype, is_dense(t)), []).append(i)
    return groups


def peak_magnitudes(tensors: Sequence[torch.Tensor]) -> List[tuple]:
    """The largest magnitude of each tensor (NaN where it holds a NaN, inf where an inf), as
    ``[(indices, fp32 peaks)]`` on the tensors' devices, no host sync.

    One multi-tensor launch (``torch._foreach_norm(..., inf)``, which propagates NaN) and one
    ``stack`` per device and dtype: torch's CUDA kernel takes a list of dense tensors of one
    dtype and device in a single launch; a tensor that is not dense (a slice) gets its own.
    """
    out = []
    for (_, dtype, dense), indices in _by_device_and_dtype(tensors).items():
        group = [tensors[i] for i in indices]
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # exact for half
        if dense:
            out.append((indices, torch.stack(torch._foreach_norm(group, float("inf"), dtype=wide))))
        else:
            for i, t in zip(indices, group):
                out.append(([i], torch.linalg.vector_norm(t, float("inf"), dtype=wide).reshape(1)))
    return out


def _read_by_index(parts: Sequence[tuple], n: int) -> List[float]:
    """``[(indices, 1-D tensor)]`` parts as Python floats in index order (one host sync per
    device)."""
    values = [0.0] * n
    by_device: "OrderedDict[torch.device, list]" = OrderedDict()
    for indices, peaks in parts:
        by_device.setdefault(peaks.device, []).append((indices, peaks))
    for device_parts in by_device.values():
        flat = device_parts[0][1] if len(device_parts) == 1 else torch.cat([p for _, p in device_parts])
        read = flat.cpu().tolist()  # the sync
        k = 0
        for indices, peaks in device_parts:
            for i in indices:
                values[i] = read[k]
                k += 1
    return values


#: elements of the culprits' gradients whose non-finite elements are counted at once (a copy of
#: them and a byte each of temporary memory, on the overflow step, after the activations are freed)
COUNT_CHUNK = 1 << 27


def _count_non_finite(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The non-finite elements of each of ``grads`` (one device and dtype, dense) as an fp64
    vector, in four multi-tensor launches and a ``stack``: ``g * 0`` is NaN exactly where
    ``g`` is not finite, NaN converts to True, True back to 1, and the 1-norm sums them
    (fp64, so that no count rounds)."""
    marks = torch._foreach_mul(grads, 0.0)
    flags = [torch.empty_like(m, dtype=torch.bool) for m in marks]
    torch._foreach_copy_(flags, marks)
    torch._foreach_copy_(marks, flags)
    return torch.stack(torch._foreach_norm(marks, 1, dtype=torch.float64))


def attribute_overflow(params: Sequence[torch.Tensor], top: int = 5) -> List[Dict]:
    """Parameters with non-finite gradients, most non-finite elements first.

    Returns ``[{"param", "nonfinite", "numel"}]`` (at most ``top``). Run on an overflow step,
    it costs a few launches and two host syncs, however many gradients overflowed: each
    gradient's peak magnitude in one multi-tensor launch per dtype (:func:`peak_magnitudes`),
    read with one sync; then the culprits' non-finite elements counted, a few multi-tensor
    launches per dtype and :data:`COUNT_CHUNK` elements, read with the second.
    """
    named = [(n, p) for n, p in _named(params) if p.grad is not None]
    if not named:
        return []
    grads = [p.grad.detach() for _, p in named]
    peaks = _read_by_index(peak_magnitudes(grads), len(grads))
    culprits = [i for i, peak in enumerate(peaks) if not math.isfinite(peak)]
    if not culprits:
        return []
    parts = []
    for (_, _, dense), members in _by_device_and_dtype([grads[i] for i in culprits]).items():
        chunk: List[int] = []
        size = 0
        for k in members + [None]:
            numel = grads[culprits[k]].numel() if k is not None else 0
            if chunk and (k is None or not dense or size + numel > COUNT_CHUNK):
                parts.append((chunk, _count_non_finite([grads[culprits[j]] for j in chunk])))
                chunk, size = [], 0
            if k is not None:
                chunk.append(k)
                size += numel
    counts = _read_by_index(parts, len(culprits))
    hits = [
        {"param": named[i][0], "nonfinite": int(c), "numel": grads[i].numel()}
        for i, c in zip(culprits, counts)
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
    records its module's floating-point outputs and keeps a reference to them;
    the outputs held are reduced together, their peak magnitudes taken in one
    multi-tensor launch per dtype (:func:`peak_magnitudes`: NaN if an output has
    a NaN, inf if it has an inf), when a child of the model (fairseq's encoder,
    decoder) returns, when :data:`MAX_HELD` outputs or :data:`MAX_HELD_BYTES`
    are held, and when :attr:`first` is read. An armed forward therefore costs
    a few launches, not one per module output, and no host sync; the first read
    of :attr:`first` looks through the peaks with one sync for the first
    non-finite output, recorded as ``{"module", "type", "dtype", "kind",
    "shape"}``. Hooks fire when a module's forward returns, so
    inner modules are seen before the blocks that contain them.

    An output is reduced after its module returned, so one that a later module
    changes in place (fairseq's attention scales its query projection in place)
    is seen as changed: a non-finite value written into it later is attributed to
    it. Holding the outputs keeps alive those the backward pass would not have kept, until
    they are reduced: at most :data:`MAX_HELD_BYTES` beyond the forward's own memory. The
    armed forward follows an overflow, which a dynamic loss scale meets early in every fp16
    run, so this bound is part of such a run's peak memory (with 1 GiB held, a transformer
    base fp16 run on the CPU peaked at 4.1 GB resident, 0.9 GB above its other updates).

    The optimizer arms the watch after an update that overflowed and disarms
    it after a finite one; :meth:`remove` takes the hooks off. Armed, it holds
    ``--compile-layers``' compiled layers to their own forward (:func:`.compile.hold_eager`).
    """

    #: outputs held before they are reduced, and the bytes they may hold (64 MiB: a few
    #: reductions per forward of a large model, each one launch per dtype)
    MAX_HELD = 1024
    MAX_HELD_BYTES = 1 << 26
    #: records kept before their peaks are looked through (one sync), to bound their memory
    MAX_RECORDS = 1 << 16

    def __init__(self, model: torch.nn.Module) -> None:
        self.armed = False
        self._model: torch.nn.Module | None = model
        self._first: Dict | None = None
        self._records: List[tuple] = []  # (module name, type, dtype, shape), in hook order
        self._held: List[tuple] = []  # (record index, output) not yet reduced
        self._held_bytes = 0
        self._peaks: List[tuple] = []  # (record indices, their peaks on the device)
        self._handles: List = []

    def _forget(self) -> None:
        self._records, self._held, self._peaks = [], [], []
        self._held_bytes = 0

    def _hook(self, name: str, module: torch.nn.Module):
        kind = type(module).__name__
        top = "." not in name  # a child of the model (fairseq's encoder, decoder)

        def hook(_module, _inputs, output):
            if self._first is not None:
                return
            for t in _float_tensors(output):
                if t.numel() and t.layout == torch.strided:
                    self._held.append((len(self._records), t.detach()))
                    self._records.append((name, kind, t.dtype, list(t.shape)))
                    self._held_bytes += t.numel() * t.element_size()
            if top or len(self._held) >= self.MAX_HELD or self._held_bytes >= self.MAX_HELD_BYTES:
                self._reduce()
            if len(self._records) >= self.MAX_RECORDS:
                self._resolve()

        return hook

    def _reduce(self) -> None:
        """Take the peaks of the outputs held (a few launches, no sync) and let them go."""
        held, self._held, self._held_bytes = self._held, [], 0
        if held:
            for positions, peaks in peak_magnitudes([t for _, t in held]):
                self._peaks.append(([held[k][0] for k in positions], peaks))

    def _resolve(self) -> None:
        """Find the first non-finite output among those recorded (one host sync)."""
        self._reduce()
        records, peaks = self._records, self._peaks
        self._forget()
        if self._first is not None or not records:
            return
        # the parts' indices are record indices: read them in record order
        values = _read_by_index(peaks, len(records))
        for (name, kind, dtype, shape), peak in zip(records, values):
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
        self._forget()
        if self._model is not None and not self._handles:
            self._handles = [
                module.register_forward_hook(self._hook(name, module))
                for name, module in self._model.named_modules()
                if name
            ]
            # the compiled layers run their own forward, which fires the hooks
            hold_eager(self, self._model)

    def disarm(self) -> None:
        """Stop checking (hooks off); forget the finding."""
        self.armed = False
        self._first = None
        self._forget()
        self._remove_hooks()

    def remove(self) -> None:
        """Take the hooks off for good: a later :meth:`arm` checks nothing."""
        self._remove_hooks()
        self._model = None

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._model is not None:
            release_eager(self, self._model)
