"""CPU fp32-accumulate matrix products: bit-for-bit GPU tensor-core numerics, overflow kept."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fairseq_fp16.core.half_matmul import (
    Fp32AccumulateMatmul,
    cpu_has_native_half,
    resolve_half_matmul,
)

DTYPES = [torch.float16, torch.bfloat16]


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_product_equals_fp32_product_rounded(dtype):
    a, b, c = rand(7, 33, dtype=dtype), rand(33, 9, dtype=dtype, seed=1), rand(7, 9, dtype=dtype, seed=2)
    ba, bb, bc = rand(3, 7, 33, dtype=dtype), rand(3, 33, 9, dtype=dtype, seed=1), rand(3, 7, 9, dtype=dtype, seed=2)
    cases = {
        "mm": (lambda: torch.mm(a, b), lambda: (a.float() @ b.float())),
        "addmm": (lambda: torch.addmm(c, a, b), lambda: torch.addmm(c.float(), a.float(), b.float())),
        "bmm": (lambda: torch.bmm(ba, bb), lambda: torch.bmm(ba.float(), bb.float())),
        "baddbmm": (lambda: torch.baddbmm(bc, ba, bb, alpha=0.5),
                    lambda: torch.baddbmm(bc.float(), ba.float(), bb.float(), alpha=0.5)),
        "linear": (lambda: F.linear(a, b.t(), c[0]), lambda: F.linear(a.float(), b.t().float(), c[0].float())),
    }
    for name, (op, ref) in cases.items():
        with Fp32AccumulateMatmul() as mode:
            out = op()
        assert mode.calls >= 1, name
        assert out.dtype == dtype, name
        assert torch.equal(out, ref().to(dtype)), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_is_fp32_inside(dtype):
    q, k, v = (rand(2, 4, 6, 8, dtype=dtype, seed=s) for s in range(3))
    with Fp32AccumulateMatmul() as mode:
        out = F.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    assert mode.calls == 1 and out.dtype == dtype
    assert torch.equal(out, ref)


def test_backward_products_are_covered_and_weight_grads_stay_half():
    lin = torch.nn.Linear(16, 8).half()
    x = rand(4, 16, dtype=torch.float16).requires_grad_()
    with Fp32AccumulateMatmul() as mode:
        lin(x).float().sum().backward()
    assert mode.calls == 3  # forward addmm, grad input mm, grad weight mm
    assert lin.weight.grad.dtype == torch.float16 and x.grad.dtype == torch.float16
    ref = (torch.ones(4, 8).t() @ x.detach().float()).half()
    assert torch.equal(lin.weight.grad, ref)


def test_overflow_still_overflows_like_half():
    a = torch.full((2, 64), 64.0, dtype=torch.float16)
    b = torch.full((64, 2), 32.0, dtype=torch.float16)  # 64 * 64 * 32 = 131072 > 65504
    with Fp32AccumulateMatmul():
        out = a @ b
    assert torch.isinf(out).all()
    # and a gradient that overflows fp16 is inf in the weight's gradient
    lin = torch.nn.Linear(64, 1, bias=False).half()
    x = torch.full((64, 64), 100.0, dtype=torch.float16)
    with Fp32AccumulateMatmul():
        (lin(x).float() * 20.0).sum().backward()
    assert torch.isinf(lin.weight.grad).all()


def test_fp32_and_cuda_free_paths_untouched():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with Fp32AccumulateMatmul() as mode:
        out = a @ b
    assert mode.calls == 0 and torch.equal(out, a @ b)


def test_auto_follows_cpu_flags():
    none = []
    assert resolve_half_matmul("auto", torch.float16, none) is True
    assert resolve_half_matmul("auto", torch.float16, ["avx512_fp16"]) is False
    assert resolve_half_matmul("auto", torch.float16, ["amx_fp16"]) is False
    assert resolve_half_matmul("auto", torch.bfloat16, ["avx512_bf16"]) is False
    assert resolve_half_matmul("auto", torch.bfloat16, ["avx512f"]) is True
    assert resolve_half_matmul("native", torch.float16, none) is False
    assert resolve_half_matmul("fp32-accumulate", torch.bfloat16, ["amx_bf16"]) is True
    assert resolve_half_matmul("auto", None, none) is False  # fp32 run
    assert cpu_has_native_half(torch.float16, ["avx512_fp16"]) and not cpu_has_native_half(torch.float16, [])


def test_unknown_choice_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--half-matmul must be one of auto, native, fp32-accumulate, got 'fast'"):
        resolve_half_matmul("fast", torch.float16)


def test_task_activates_the_mode_exactly_during_its_steps(monkeypatch):
    from fairseq.tasks.translation import TranslationTask

    from fairseq_fp16.tasks.translation_fp16 import TranslationFP16Task

    seen = {}
    for name in ("train_step", "valid_step", "inference_step"):
        monkeypatch.setattr(TranslationTask, name,
                            lambda self, *a, _n=name, **k: seen.setdefault(_n, _get_current_dispatch_mode()))
    task = TranslationFP16Task.__new__(TranslationFP16Task)
    task.fp32_accumulate = True
    task.train_step(None, None, None, None, 0)
    task.valid_step(None, None, None)
    task.inference_step(None, None, None)
    assert all(isinstance(m, Fp32AccumulateMatmul) for m in seen.values()) and len(seen) == 3
    assert _get_current_dispatch_mode() is None
    task.fp32_accumulate = False
    seen.clear()
    task.train_step(None, None, None, None, 0)
    assert seen["train_step"] is None
