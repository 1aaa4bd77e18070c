"""Half-precision matrix products on CPUs without half-precision units (pure torch).

A GPU's tensor cores take fp16/bf16 operands, multiply and accumulate in fp32,
and round the result to fp16/bf16. Both classes here keep that contract on the
CPU: the half operands of a matrix product are upcast to fp32 (exact), fp32
kernels run, and the result is rounded back to the half dtype. Weights,
activations and gradients stay half; a product that exceeds the half range
still becomes ``inf``, as on the GPU. Other ops (softmax, layer norm,
elementwise) run in their own precision, as they would on the GPU.

* :class:`Fp32AccumulateMatmul` works below autograd (a ``TorchDispatchMode``):
  it sees every ``mm``/``addmm``/``bmm``/``baddbmm``/``addbmm``, ``mv``/``addmv``,
  ``dot``/``vdot``, convolution and CPU
  scaled-dot-product attention, forward and backward, whatever Python code
  issued them; but it
  costs a Python call for every aten op of the step (about 1,000 for a 2+2-layer
  transformer step), products or not.
* :class:`Fp32AccumulateFunctions` (what ``--half-matmul`` uses) works above
  autograd (a ``TorchFunctionMode``): ``F.linear``, ``torch.bmm`` and
  ``torch.conv_tbc`` (fairseq's ConvTBC, whose backward aten decomposes below
  autograd) become autograd functions that upcast in forward and backward
  themselves; RNNs (``torch.lstm``, ...) run in fp32 inside, as cuDNN runs half
  RNNs, and the LSTM and GRU cells as PyTorch's fused CUDA cells compute them; the
  other functions in :data:`ROUTED_FUNCTIONS` (attention,
  ``matmul``, ``einsum``, ``F.conv*``, ...) run, forward and backward, under
  :class:`Fp32AccumulateMatmul`. It costs a Python call per torch function
  call of the forward pass instead of one per aten op of forward and backward,
  and gives the same bits as the dispatch mode alone on fairseq's transformer
  (``tests/core/test_half_matmul.py``). A product issued by a function
  outside that list runs torch's native half kernel (right, but slow on such
  CPUs).
* :class:`NativeHalfProducts` finds those: entered around a step run under the
  modes, it counts the half products that reached a native kernel and where
  they were issued (the plugin checks every task's first training and
  generation steps).

On a CPU without fp16 arithmetic, native fp16 matrix products are many times
slower than fp32; with fp32 accumulation a half-precision step costs about what
an fp32 one does (docs/cpu-half-precision.md has the measurements).

:func:`resolve_half_matmul` turns ``--half-matmul {auto,native,fp32-accumulate}``
into a decision; ``auto`` uses fp32 accumulation for a half dtype the CPU has no
native units for (fp16: AVX512-FP16 or AMX-FP16; bf16: AVX512-BF16 or AMX-BF16).
CUDA tensors are never touched.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from typing import Dict, Iterable, Optional, Set

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "HALF_MATMUL_CHOICES",
    "Fp32AccumulateMatmul",
    "Fp32AccumulateFunctions",
    "NativeHalfProducts",
    "ROUTED_FUNCTIONS",
    "cpu_has_amx",
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
    _aten.addbmm.default,
    # matrix-vector and vector-vector products (matmul with a 1-d operand reaches these)
    _aten.mv.default,
    _aten.addmv.default,
    _aten.dot.default,
    _aten.vdot.default,
    # convolutions: F.conv1d/2d/3d and the transposed ones reach aten.convolution
    # (fairseq's ConvTBC calls conv_tbc, whose backward aten decomposes into in-place
    # products below autograd: the function mode routes it through _Fp32ConvTBC instead)
    _aten.convolution.default,
    _aten.convolution_backward.default,
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
#: /proc/cpuinfo flags of AMX tile units per dtype (oneDNN compiles a kernel per shape for them)
AMX_FLAGS = {torch.float16: "amx_fp16", torch.bfloat16: "amx_bf16"}


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


def cpu_has_amx(dtype: Optional[torch.dtype], flags: Optional[Iterable[str]] = None) -> bool:
    """Whether the CPU has AMX tile units for ``dtype`` (from /proc/cpuinfo; False where
    the flags cannot be read, and for fp32)."""
    flags = _cpu_flags() if flags is None else frozenset(flags)
    return flags is not None and AMX_FLAGS.get(dtype) in flags


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


def _same_half_cpu(*tensors) -> Optional[torch.dtype]:
    """The half dtype when every given tensor (``None`` skipped) is a CPU tensor of it."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _HALF:
            return None
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            return None
    return dtype


class CastBuffers:
    """fp32 buffers that the products of one step (forward and backward) cast their half
    operands into and write their fp32 results to, before the results are rounded to half.

    A product's fp32 copies live only while it runs; made afresh each time, they come and
    go between the half tensors that stay (the products' results, kept for the backward
    pass), and the C allocator keeps the memory they leave in between: a transformer base
    fp16 run on the CPU peaked near 300 MB higher for it (the fp16-memory table of
    docs/cpu-half-precision.md). Here one buffer per operand slot grows to
    the largest product's size and is reused, so the copies make no holes and touch no fresh
    pages. Not for code that ``torch.compile`` traces (its products cast as before).
    """

    def __init__(self) -> None:
        self._buffers: Dict[str, torch.Tensor] = {}

    def _take(self, slot: str, numel: int) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(slot, None)  # the smaller one goes before the larger one is made
            buf = self._buffers[slot] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel]

    def cast(self, slot: str, t: torch.Tensor) -> torch.Tensor:
        """``t.float()``, in ``slot``'s buffer where ``t`` is contiguous (same strides)."""
        if not t.is_contiguous():
            return t.float()
        return self._take(slot, t.numel()).view(t.shape).copy_(t)

    def result(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous fp32 (rows, cols) tensor for a product's result (one slot)."""
        return self._take("result", rows * cols).view(rows, cols)


def _fp32(buffers: Optional[CastBuffers], slot: str, t: torch.Tensor) -> torch.Tensor:
    return t.float() if buffers is None else buffers.cast(slot, t)


def _mm(buffers: Optional[CastBuffers], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if buffers is None:
        return a.mm(b)
    return torch.mm(a, b, out=buffers.result(a.shape[0], b.shape[1]))


class _Fp32Linear(torch.autograd.Function):
    """``F.linear`` of half CPU tensors (input of 2 or more dims) with fp32 products.

    Saves the half tensors only. It takes the route aten's ``linear`` takes,
    so the result equals :class:`Fp32AccumulateMatmul`'s bit for bit (and a
    GPU's): with a bias and a contiguous input, one ``addmm`` (the bias added
    in fp32, one rounding); otherwise ``mm`` (a non-contiguous input copied
    first), rounded to half, then the bias added in half. The weight gradient
    is ``g^T @ x``, as aten's ``mm_mat2_backward`` computes it for ``W^T``. The fp32 copies
    and results go to ``buffers`` where given (:class:`CastBuffers`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, buffers):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.buffers = bias is not None, buffers
        ctx.fused = bias is not None and (x.dim() == 2 or x.is_contiguous())
        x2 = _fp32(buffers, "a", x.reshape(-1, x.shape[-1]))
        w32 = _fp32(buffers, "b", weight).t()
        shape = (*x.shape[:-1], weight.shape[0])
        if ctx.fused:
            out = None if buffers is None else buffers.result(x2.shape[0], w32.shape[1])
            return torch.addmm(bias.float(), x2, w32, out=out).view(shape).to(x.dtype)
        y = _mm(buffers, x2, w32).view(shape).to(x.dtype)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        buffers = ctx.buffers
        with torch._C.DisableTorchFunction():  # plain tensors: skip the mode's Python call
            g2 = grad.reshape(-1, grad.shape[-1])
            g32 = _fp32(buffers, "a", g2)
            gx = gw = gb = None
            if ctx.needs_input_grad[0]:
                gx = _mm(buffers, g32, _fp32(buffers, "b", weight)).to(x.dtype).view(x.shape)
            if ctx.needs_input_grad[1]:
                x32 = _fp32(buffers, "b", x.reshape(-1, x.shape[-1]))
                gw = _mm(buffers, g32.t(), x32).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:  # summed in half, as aten sums it
                gb = g2.sum(0) if ctx.fused else grad.sum(tuple(range(grad.dim() - 1)))
        return gx, gw, gb, None


class _Fp32Bmm(torch.autograd.Function):
    """``torch.bmm`` of half CPU tensors with fp32 products; saves the half tensors only. The
    fp32 copies go to ``buffers`` where given (:class:`CastBuffers`)."""

    @staticmethod
    def forward(ctx, a, b, buffers):
        ctx.save_for_backward(a, b)
        ctx.buffers = buffers
        return torch.bmm(_fp32(buffers, "a", a), _fp32(buffers, "b", b)).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        buffers = ctx.buffers
        with torch._C.DisableTorchFunction():
            g32 = _fp32(buffers, "a", grad)
            ga = gb = None
            if ctx.needs_input_grad[0]:
                ga = g32.bmm(_fp32(buffers, "b", b).transpose(1, 2)).to(a.dtype)
            if ctx.needs_input_grad[1]:
                gb = _fp32(buffers, "b", a).transpose(1, 2).bmm(g32).to(b.dtype)
        return ga, gb, None


class _Fp32ConvTBC(torch.autograd.Function):
    """``torch.conv_tbc`` (fairseq's ConvTBC) of half CPU tensors, forward and backward in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, pad):
        ctx.save_for_backward(x, weight, bias)
        ctx.pad = pad
        return torch.conv_tbc(x.float(), weight.float(), bias.float(), pad).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        with torch._C.DisableTorchFunction():
            grads = torch.ops.aten.conv_tbc_backward(grad.float(), x.float(), weight.float(),
                                                    bias.float(), ctx.pad)
        return (*(g.to(t.dtype) for g, t in zip(grads, (x, weight, bias))), None)


class _UnderDispatchMode(torch.autograd.Function):
    """Runs ``func`` under :class:`Fp32AccumulateMatmul` in forward and in backward.

    The forward records ``func``'s own autograd graph (on detached inputs, one
    per distinct tensor, so gradients of a tensor passed twice accumulate as
    they would without the wrapper); the backward replays it under the mode.
    Saved tensors are those ``func`` saves itself.
    """

    @staticmethod
    def forward(ctx, func, spec, out_spec, *leaves):
        # one detached input per distinct tensor; a tensor passed several times gets its
        # gradient at its first position (grad_slot: the input each leaf's gradient comes from)
        inputs, index, ctx.grad_slot = [], {}, []
        for leaf in leaves:
            first = isinstance(leaf, torch.Tensor) and id(leaf) not in index
            if first:
                index[id(leaf)] = len(inputs)
                inputs.append(leaf.detach().requires_grad_(leaf.requires_grad))
            ctx.grad_slot.append(index[id(leaf)] if first else None)
        call = [inputs[index[id(x)]] if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(call, spec)
        with torch.enable_grad(), Fp32AccumulateMatmul():
            out = func(*args, **kwargs)
        outs, out_spec[0] = tree_flatten(out)
        ctx.graph = (inputs, outs)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs, outs = ctx.graph
        del ctx.graph
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        got = {}
        if pairs and wanted:
            with Fp32AccumulateMatmul():
                res = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                          allow_unused=True)
            got = {id(t): r for t, r in zip(wanted, res)}
        return (None, None, None,
                *[None if slot is None else got.get(id(inputs[slot])) for slot in ctx.grad_slot])


def _under_dispatch_mode(func, args, kwargs, flat=None):
    leaves, spec = flat or tree_flatten((args, kwargs))
    if not torch.is_grad_enabled() or not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        with Fp32AccumulateMatmul():
            return func(*args, **kwargs)
    out_spec = [None]
    outs = _UnderDispatchMode.apply(func, spec, out_spec, *leaves)
    return tree_unflatten(list(outs), out_spec[0])


def _linear(func, args, kwargs, buffers=None):
    bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if set(bound) <= {"input", "weight", "bias"} and _same_half_cpu(x, w, b):
        if x.dim() >= 2 and w.dim() == 2:
            return _Fp32Linear.apply(x, w, b, buffers)
        return _under_dispatch_mode(func, args, kwargs)  # a vector input: aten's own route
    return NotImplemented


def _bmm(func, args, kwargs, buffers=None):
    if len(args) == 2 and not kwargs and _same_half_cpu(*args):
        return _Fp32Bmm.apply(*args, buffers)
    return NotImplemented


def _conv_tbc(func, args, kwargs):
    bound = dict(zip(("input", "weight", "bias", "pad"), args), **kwargs)
    if set(bound) <= {"input", "weight", "bias", "pad"} and _same_half_cpu(
            bound.get("input"), bound.get("weight"), bound.get("bias")) and bound.get("bias") is not None:
        return _Fp32ConvTBC.apply(bound["input"], bound["weight"], bound["bias"], bound.get("pad", 0))
    return NotImplemented


def _fp32_rnn(func, args, kwargs):
    """``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (``nn.LSTM``, ...) of half CPU tensors:
    the whole recurrence in fp32, the outputs rounded to half, as on a GPU, where cuDNN runs a
    half RNN with fp32 math (PyTorch promotes its math type); fp32 also takes torch's fused
    CPU kernel instead of a step-by-step decomposition. Autograd goes through the casts."""
    dtype = _half_cpu_dtype(tree_flatten((args, kwargs))[0])
    if dtype is None:
        return NotImplemented
    out = func(*_cast(args, {dtype}, torch.float32),
               **{k: _cast(v, {dtype}, torch.float32) for k, v in kwargs.items()})
    return _cast(out, {torch.float32}, dtype)


def _cell_args(args, kwargs):
    """(input, hx, w_ih, w_hh, b_ih, b_hh, dtype) of an RNN cell call when all are half CPU
    tensors of one dtype and the input is a batch (2-d); None otherwise."""
    bound = dict(zip(("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), args), **kwargs)
    if not set(bound) <= {"input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"}:
        return None
    x, hx = bound.get("input"), bound.get("hx")
    hx = tuple(hx) if isinstance(hx, (list, tuple)) else (hx,)
    w_ih, w_hh, b_ih, b_hh = (bound.get(k) for k in ("w_ih", "w_hh", "b_ih", "b_hh"))
    dtype = _same_half_cpu(x, *hx, w_ih, w_hh, b_ih, b_hh)
    if dtype is None or x.dim() != 2 or w_ih is None or w_hh is None or (b_ih is None) != (b_hh is None):
        return None
    return x, hx, w_ih, w_hh, b_ih, b_hh, dtype


def _cell_gates(x, h, w_ih, w_hh, n):
    """The two gate products of a cell, each accumulated in fp32 and rounded to half (no bias,
    as PyTorch's CUDA cells issue them), chunked into n fp32 gate pre-activations each."""
    return (_Fp32Linear.apply(x, w_ih, None, None).float().chunk(n, 1),
            _Fp32Linear.apply(h, w_hh, None, None).float().chunk(n, 1))


def _lstm_cell(func, args, kwargs):
    """``torch.lstm_cell`` (``nn.LSTMCell``) of half CPU tensors as PyTorch's fused CUDA cell
    computes it: the two products rounded to half, then the gates, biases and states in fp32,
    ``hy`` and ``cy`` rounded to half. The backward is autograd's, in fp32 up to the casts."""
    cell = _cell_args(args, kwargs)
    if cell is None or len(cell[1]) != 2:
        return _routed(func, args, kwargs)
    x, (h, c), w_ih, w_hh, b_ih, b_hh, dtype = cell
    (xi, xf, xc, xo), (hi, hf, hc, ho) = _cell_gates(x, h, w_ih, w_hh, 4)
    if b_ih is None:
        pre = (xi + hi, xf + hf, xc + hc, xo + ho)
    else:
        (b1i, b1f, b1c, b1o), (b2i, b2f, b2c, b2o) = b_ih.float().chunk(4), b_hh.float().chunk(4)
        pre = (xi + hi + b1i + b2i, xf + hf + b1f + b2f, xc + hc + b1c + b2c, xo + ho + b1o + b2o)
    i, f, g, o = pre[0].sigmoid(), pre[1].sigmoid(), pre[2].tanh(), pre[3].sigmoid()
    cy = f * c.float() + i * g
    hy = o * cy.tanh()
    return hy.to(dtype), cy.to(dtype)


def _gru_cell(func, args, kwargs):
    """``torch.gru_cell`` (``nn.GRUCell``) of half CPU tensors as PyTorch's fused CUDA cell
    computes it: the two products rounded to half, the gates and state in fp32, ``hy``
    rounded to half."""
    cell = _cell_args(args, kwargs)
    if cell is None or len(cell[1]) != 1:
        return _routed(func, args, kwargs)
    x, (h,), w_ih, w_hh, b_ih, b_hh, dtype = cell
    (xr, xi, xn), (hr, hi, hn) = _cell_gates(x, h, w_ih, w_hh, 3)
    if b_ih is None:
        r, z = (xr + hr).sigmoid(), (xi + hi).sigmoid()
        n = xn + r * hn
    else:
        (b1r, b1i, b1n), (b2r, b2i, b2n) = b_ih.float().chunk(3), b_hh.float().chunk(3)
        r, z = (xr + hr + b1r + b2r).sigmoid(), (xi + hi + b1i + b2i).sigmoid()
        n = xn + b1n + r * (hn + b2n)
    n = n.tanh()
    return (n + z * (h.float() - n)).to(dtype)


def _routed(func, args, kwargs):
    flat = tree_flatten((args, kwargs))
    if _half_cpu_dtype(flat[0]) is None:
        return NotImplemented
    return _under_dispatch_mode(func, args, kwargs, flat)


def _routed_functions():
    table = {F.linear: _linear, torch.bmm: _bmm, torch.Tensor.bmm: _bmm, torch.conv_tbc: _conv_tbc,
             # fairseq's LSTM decoder steps an nn.LSTMCell, its encoder runs an nn.LSTM
             torch.lstm_cell: _lstm_cell, torch.gru_cell: _gru_cell}
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        table[getattr(torch, name)] = _fp32_rnn
    names = [
        (F, "multi_head_attention_forward"), (F, "scaled_dot_product_attention"), (F, "bilinear"),
        (torch, "matmul"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__"),
        (torch.Tensor, "__rmatmul__"), (torch, "mm"), (torch.Tensor, "mm"), (torch, "addmm"),
        (torch.Tensor, "addmm"), (torch, "baddbmm"), (torch.Tensor, "baddbmm"), (torch, "addbmm"),
        (torch.Tensor, "addbmm"), (torch, "mv"), (torch.Tensor, "mv"), (torch, "addmv"),
        (torch.Tensor, "addmv"), (torch, "dot"), (torch.Tensor, "dot"), (torch, "vdot"),
        (torch.Tensor, "vdot"), (torch, "inner"), (torch.Tensor, "inner"),
        (torch.linalg, "multi_dot"), (torch.linalg, "matmul"), (torch, "chain_matmul"),
        (torch, "einsum"), (torch, "tensordot"),
        # nn.RNNCell: products rounded to half, the rest in half, as on a GPU (no fused cell there)
        (torch, "rnn_tanh_cell"), (torch, "rnn_relu_cell"),
        (F, "conv1d"), (F, "conv2d"), (F, "conv3d"), (F, "conv_transpose1d"),
        (F, "conv_transpose2d"), (F, "conv_transpose3d"),
    ]
    for owner, name in names:
        fn = getattr(owner, name, None)
        if fn is not None:
            table[fn] = _routed
    return table


#: functions :class:`Fp32AccumulateFunctions` takes over for half CPU tensors
ROUTED_FUNCTIONS = _routed_functions()
#: their handlers that cast into the mode's :class:`CastBuffers`
_BUFFERED = (_linear, _bmm)


class Fp32AccumulateFunctions(TorchFunctionMode):
    """Within the block, half CPU products of :data:`ROUTED_FUNCTIONS` accumulate in fp32.

    ``F.linear`` and ``torch.bmm`` run as autograd functions that upcast
    themselves; the other routed functions run under
    :class:`Fp32AccumulateMatmul` forward and backward. ``calls`` counts the
    routed calls made eagerly (for tests and logs): inside code that ``torch.compile`` traces
    (``--compile-layers``) a count would be a guard on its value, and every step's new count
    a recompile. The linear and ``bmm`` products made eagerly cast into the mode's
    :class:`CastBuffers`, which live as long as the mode (a step, its backward included).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.buffers = CastBuffers()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = ROUTED_FUNCTIONS.get(func)
        if handler is not None:
            compiling = torch.compiler.is_compiling()
            if handler in _BUFFERED:
                out = handler(func, args, kwargs, None if compiling else self.buffers)
            else:
                out = handler(func, args, kwargs)
            if out is not NotImplemented:
                if not compiling:
                    self.calls += 1
                return out
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _issuing_site() -> str:
    """Where the running Python code issued the op: the innermost frame outside torch and
    this module as ``file:line (function)`` (an installed package's file relative to its
    site-packages), or "backward pass" inside autograd's engine."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward":
            return "backward pass"
        path = code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            _, packages, inside = path.rpartition("site-packages" + os.sep)
            return f"{inside if packages else path}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return "unknown"


class NativeHalfProducts(TorchDispatchMode):
    """Counts the half CPU matrix products that reach torch's native kernels (a check).

    Entered before :class:`Fp32AccumulateFunctions` runs a step, it sees the products
    the modes routed with fp32 operands (they upcast before calling the kernel) and
    counts those that escaped them with half operands: ``counts`` maps
    ``(op name, issuing site)`` to calls. On a CPU without half units each of those
    runs at a fraction of fp32's speed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COVERED_OPS and _half_cpu_dtype(args) is not None:
            self.counts[(func.overloadpacket.__name__, _issuing_site())] += 1
        return func(*args, **kwargs)

    def summary(self) -> str:
        """``"aten.addmm x4 at site, ..."``, most frequent first ("" when none escaped)."""
        return ", ".join(f"aten.{op} x{n} at {site}" for (op, site), n in self.counts.most_common())


def half_matmul_context(enabled: bool):
    """``Fp32AccumulateFunctions()`` when enabled, else a do-nothing context."""
    return Fp32AccumulateFunctions() if enabled else contextlib.nullcontext()
