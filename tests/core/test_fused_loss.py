"""The fused loss against fairseq's log_softmax + label_smoothed_nll_loss: values, gradients, memory."""

import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_fp16.core.fused_loss import chunk_rows, label_smoothed_nll_from_logits

PAD = 1
N, V = 96, 500


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype)
    target = torch.randint(4, V, (N,), generator=g)
    target[-9:] = PAD  # padding rows
    return logits, target


def fairseq_loss(logits, target, eps, ignore_index=PAD):
    """What fairseq's criterion computes: log-softmax in fp32, then the smoothed NLL."""
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    return label_smoothed_nll_loss(lprobs, target, eps, ignore_index=ignore_index, reduce=True)


def loss_and_grad(fn, logits, target, eps, weights=(1.0, 0.0), **kw):
    x = logits.clone().requires_grad_()
    loss, nll = fn(x, target, eps, **kw)
    (weights[0] * loss + weights[1] * nll).backward()
    return loss.detach(), nll.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_same_loss_and_gradient_as_fairseq(dtype, eps):
    logits, target = inputs(dtype)
    ref = loss_and_grad(fairseq_loss, logits, target, eps, ignore_index=PAD)
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, eps, ignore_index=PAD)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == dtype
    # fp32 arithmetic on the same upcast values: only the order of additions differs
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-6, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=2e-6)
    else:  # both round an fp32 gradient to half: at most one unit in the last place apart
        ulp = torch.finfo(dtype).eps * ref[2].float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got[2].float() - ref[2].float()).abs() <= ulp).all()
        assert (got[2] != ref[2]).float().mean() < 0.01
    assert (got[2][target == PAD] == 0).all()


def test_gradient_of_both_outputs():
    """fairseq logs the NLL; a caller that backpropagates through it gets its gradient too."""
    logits, target = inputs(torch.float32)
    ref = loss_and_grad(fairseq_loss, logits, target, 0.1, weights=(2.0, 3.0))
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, weights=(2.0, 3.0),
                        ignore_index=PAD)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)


def test_without_ignore_index_every_row_counts():
    logits, target = inputs(torch.float16)
    ref = fairseq_loss(logits, target, 0.1, ignore_index=None)
    got = label_smoothed_nll_from_logits(logits, target, 0.1)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
    assert got[0] > label_smoothed_nll_from_logits(logits, target, 0.1, ignore_index=PAD)[0]


def test_chunking_does_not_change_a_bit():
    logits, target = inputs(torch.bfloat16)
    results = [loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD,
                             rows=rows) for rows in (1, 7, N)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    assert chunk_rows(8000, torch.device("cpu")) == 65 and chunk_rows(10**9, torch.device("cpu")) == 1
    # CUDA: 4 chunks for 16k tokens of a 32k vocabulary (launches, not cache, bound a GPU update)
    assert -(-16384 // chunk_rows(32768, torch.device("cuda"))) == 4


def test_non_finite_logits_give_a_non_finite_loss():
    """An overflowed logit must reach the loss scaler as an overflow, as it does in fairseq."""
    logits, target = inputs(torch.float16)
    logits[3, 10] = float("inf")
    assert not torch.isfinite(fairseq_loss(logits, target, 0.1)[0])
    assert not torch.isfinite(label_smoothed_nll_from_logits(logits, target, 0.1, PAD)[0])


def saved_bytes(fn, logits, target):
    """Bytes autograd keeps for the backward pass of fn's loss (the output projection's own
    saved tensors are not included: the logits here are a leaf)."""
    total = []

    def pack(t):
        total.append(t.untyped_storage().nbytes())
        return t

    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, target)
    return sum(total)


def test_keeps_the_half_logits_not_fp32_log_probabilities():
    logits, target = inputs(torch.float16)
    stock = saved_bytes(lambda x, t: fairseq_loss(x, t, 0.1), logits, target)
    fused = saved_bytes(lambda x, t: label_smoothed_nll_from_logits(x, t, 0.1, PAD), logits, target)
    half_logits = N * V * 2
    assert stock >= 2 * half_logits  # fp32 log-probabilities: twice the half logits
    # the half logits themselves, then per row: target (int64), log-sum-exp (fp32), kept (bool)
    assert fused == half_logits + N * (8 + 4 + 1)


def test_bad_arguments_name_what_is_wrong():
    logits, target = inputs(torch.float16)
    shapes = r"logits must be \(N, V\) and target \(N,\); got \(96, 500\) and \(95,\)"
    with pytest.raises(ValueError, match=shapes):
        label_smoothed_nll_from_logits(logits, target[1:], 0.1)
    with pytest.raises(ValueError, match=r"label smoothing must be in \[0, 1\), got 1.0"):
        label_smoothed_nll_from_logits(logits, target, 1.0)
    with pytest.raises(ValueError, match="logits must be floating point, got torch.int64"):
        label_smoothed_nll_from_logits(target[:, None].expand(N, 3), target, 0.1)
