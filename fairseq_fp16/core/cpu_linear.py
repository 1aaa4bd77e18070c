"""CPU half-precision linear layers with the bias added inside the product (pure torch).

torch's CPU ``F.linear`` with a bias runs ``addmm``, which first copies the bias into every row
of a new output and then accumulates the product onto it: a pass over each linear layer's
output that a transformer makes for every projection and feed-forward layer. oneDNN, which
runs the CPU's native bf16 and fp16 products, adds the bias as it writes the product out
(``torch.ops.mkldnn._linear_pointwise``), with ``F.linear``'s bits. That operator has no
backward in torch; :class:`_BiasInProduct` gives it ``addmm``'s (the two gradient products as
torch computes them, the bias's gradient a column sum), with the same bits again
(``tests/core/test_cpu_linear.py``).

:func:`bias_in_product` puts it on a model's ``nn.Linear`` modules with a bias, where the
half products run on native kernels (not under ``--half-matmul fp32-accumulate``, whose
function mode sees ``F.linear`` only). A call it does not fit (other dtypes, CUDA, a compiled
frame, autocast) runs ``F.linear`` as before. oneDNN's fused ReLU is not used: it turns a NaN
into 0, where ``F.relu`` keeps it.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F

from .swap import swap_attribute

__all__ = ["bias_in_product", "bias_in_product_available"]

_HALF = (torch.float16, torch.bfloat16)


def _linear_pointwise():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return getattr(mkldnn, "_linear_pointwise", None) if mkldnn is not None else None


class _BiasInProduct(torch.autograd.Function):
    """``F.linear(rows, weight, bias)`` on 2-d CPU half tensors, the bias added by oneDNN."""

    @staticmethod
    def forward(ctx, rows, weight, bias):
        ctx.save_for_backward(rows, weight)
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        # addmm's backward: mat1's gradient grad @ weight; a row-major weight's gradient as
        # (grad^T @ x), which keeps it row-major; the bias's the sum over the rows
        return (grad.mm(weight) if need_x else None,
                grad.t().mm(rows) if need_w else None,
                grad.sum(0) if need_b else None)


def _forward(self, input):
    weight, bias = self.weight, self.bias
    if (input.dtype in _HALF and input.dtype == weight.dtype == bias.dtype
            and input.device.type == "cpu" and input.dim() >= 2 and input.is_contiguous()
            and weight.is_contiguous() and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu")):
        # the rows in and out as views, as F.linear takes them: the caller may scale the
        # output in place (fairseq's attention scales its queries)
        out = _BiasInProduct.apply(input.view(-1, input.shape[-1]), weight, bias)
        return out.view(*input.shape[:-1], weight.shape[0])
    return F.linear(input, weight, bias)


def bias_in_product_available(dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's linear with a fused bias and it gives ``F.linear``'s
    bits for ``dtype`` (a small product tried once)."""
    op = _linear_pointwise()
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((24, 32), (16, 32), (16,)))
    try:
        return torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b))
    except RuntimeError:
        return False


def bias_in_product(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> int:
    """Run the ``nn.Linear`` modules of ``model`` that have a bias through
    :class:`_BiasInProduct` for CPU ``dtype`` inputs (see the module docstring), where it is
    available. Returns how many modules now do (0: none, or not available)."""
    if dtype not in _HALF or not bias_in_product_available(dtype):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.bias is not None:
            if getattr(vars(module).get("forward"), "__func__", None) is _forward:
                count += 1
                continue  # done before
            # a method bound to the module: a deep copy (fairseq's EMA model) binds to the copy
            swap_attribute(module, "forward", types.MethodType(_forward, module),
                           expects=["F.linear(input, self.weight, self.bias)"])
            count += 1
    return count
