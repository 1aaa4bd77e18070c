"""counter_dropout: fairseq's dropout expectation (keep probability, scaling) from a counter-based
mask, reproducible under torch's seeding, the same bits compiled and eager."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_fp16.core import dropout
from fairseq_fp16.core.dropout import counter_dropout, counter_dropout_available, keep_mask
from fairseq_fp16.core.half_matmul import half_matmul_context

N = 1 << 20


def within_sigmas(count: int, n: int, prob: float, sigmas: float = 5.0) -> bool:
    """``count`` of ``n`` Bernoulli(``prob``) trials lies within ``sigmas`` standard deviations."""
    return abs(count - n * prob) <= sigmas * math.sqrt(n * prob * (1 - prob))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_elements_are_kept_with_probability_one_minus_p_and_scaled_by_its_inverse(p):
    torch.manual_seed(0)
    x = torch.randn(N)
    y = counter_dropout(x, p)
    kept = y != 0
    assert within_sigmas(int(kept.sum()), N, 1 - p)
    # kept elements are x / (1 - p) (fp32 arithmetic), dropped ones 0: E[y] = x
    torch.testing.assert_close(y[kept], (x * torch.tensor(1 / (1 - p)))[kept], rtol=0, atol=0)
    ones = counter_dropout(torch.ones(N), p)
    assert abs(float(ones.double().mean()) - 1.0) <= 5 * math.sqrt(p / (1 - p) / N)


def test_decisions_are_independent_of_their_neighbours_and_of_the_previous_call():
    torch.manual_seed(1)
    p = 0.5
    first, second = keep_mask(N, p, dropout._seed()), keep_mask(N, p, dropout._seed())
    for lag in (1, 2, 16, 17, 1000):  # neighbours in a vector and across vectors
        assert within_sigmas(int((first[lag:] & first[:-lag]).sum()), N - lag, (1 - p) ** 2)
    assert within_sigmas(int((first & second).sum()), N, (1 - p) ** 2)
    # seeds that differ in their offset alone (by less than the multiplier), or in their
    # multiplier alone: neither call repeats the other's decisions shifted
    a = keep_mask(N, p, torch.tensor([100, 7], dtype=torch.int32))
    for other in ([101, 7], [100, 9]):
        b = keep_mask(N, p, torch.tensor(other, dtype=torch.int32))
        for shift in (0, 1):
            assert within_sigmas(int((a[shift:] & b[:N - shift]).sum()), N - shift, (1 - p) ** 2)


def test_masks_follow_torch_manual_seed_and_each_call_draws_a_new_one():
    x = torch.randn(4096)
    torch.manual_seed(7)
    a, b = counter_dropout(x, 0.1), counter_dropout(x, 0.1)
    torch.manual_seed(7)
    assert torch.equal(counter_dropout(x, 0.1), a) and torch.equal(counter_dropout(x, 0.1), b)
    assert not torch.equal(a != 0, b != 0)
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(8)
    assert torch.equal(counter_dropout(x, 0.1, generator=gen), a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_kernel_gives_the_eager_definitions_bits(dtype):
    assert counter_dropout_available(dtype)
    seed, (threshold, scale) = torch.tensor([-5, 99], dtype=torch.int32), dropout._constants(0.1)
    for n in (1, 15, 16, 17, 1000, 65537):
        x = torch.randn(n).to(dtype)
        assert torch.equal(dropout._compiled()(x, seed, threshold, scale),
                           dropout._masked(x, seed, threshold, scale))


def test_the_output_is_rounded_once_from_fp32():
    torch.manual_seed(3)
    x = (torch.rand(N) + 0.5).to(torch.bfloat16)
    y = counter_dropout(x, 0.1)
    kept = y != 0
    expected = (x.float() * torch.tensor(1 / 0.9)).to(torch.bfloat16)
    assert torch.equal(y[kept], expected[kept])
    # torch's CPU dropout scales by 1/(1-p) rounded to bf16 first (1.109375 for 1.1111): a
    # biased expectation that the single rounding avoids
    assert abs(float(y.double().sum() / x.double().sum()) - 1.0) < 1e-3


def test_backward_masks_the_gradient_as_the_forward_masked_the_input():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    y = counter_dropout(x, 0.25)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(y != 0, g / 0.75, 0.0))
    torch.manual_seed(5)
    assert torch.autograd.gradcheck(lambda t: counter_dropout(t, 0.25, torch.Generator().manual_seed(1)),
                                    (torch.randn(40, dtype=torch.float64, requires_grad=True),))


def test_no_mask_is_kept_for_the_backward_pass():
    x = torch.randn(4096, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        counter_dropout(x, 0.1)
    assert sum(t.numel() for t in saved) <= 4  # the seed, threshold and scale only
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.dropout(x, 0.1, True)
    assert sum(t.numel() for t in saved) >= x.numel()  # torch's: a mask of the input's size


class _Watching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_same_bits_under_a_dispatch_mode_and_a_function_mode():
    x = torch.randn(5000).to(torch.bfloat16)
    torch.manual_seed(9)
    reference = counter_dropout(x, 0.2)
    torch.manual_seed(9)
    with _Watching():
        assert torch.equal(counter_dropout(x, 0.2), reference)
    torch.manual_seed(9)
    with half_matmul_context(True):  # --half-matmul fp32-accumulate's function mode
        assert torch.equal(counter_dropout(x, 0.2), reference)


def test_bad_probabilities_are_refused_and_zero_is_the_identity():
    x = torch.randn(8)
    assert counter_dropout(x, 0.0) is x
    for p in (1.0, -0.1):
        with pytest.raises(ValueError, match=rf"dropout probability must be in \[0, 1\), got {p}"):
            counter_dropout(x, p)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to spread over")
def test_the_kernel_the_availability_check_compiles_runs_on_every_thread(monkeypatch):
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    # the check compiles the kernel on tensors too small for inductor to parallelise by their
    # size; the kernel then serves every size
    monkeypatch.setattr(dropout, "_AVAILABLE", {})
    dropout._compiled.cache_clear()
    with config.patch(force_disable_caches=True):
        available, code = run_and_get_code(counter_dropout_available, torch.bfloat16)
    assert available and code
    assert all("#pragma omp parallel" in c for c in code)
