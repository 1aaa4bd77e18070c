"""On a CUDA device: fp16_adam and the mixed-precision step against torch's fp32 AdamW on the CPU,
the step's host syncs, and the overflow skip. Skipped where torch sees no GPU (CI); run on a GPU
machine with ``pytest -m gpu``."""

import pytest
import torch
from test_master_weights import HP, make_params

from fairseq_fp16.core.adam import build_adam
from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.loss_scaler import LossScaler
from fairseq_fp16.core.master_weights import MixedPrecisionOptimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def scaled_half_grads(step, shapes, scale):
    """The grads a scaled fp16 backward would give: seeded on the CPU, scaled, rounded to half."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * scale).half() for s in shapes]


def mixed_on_cuda(dtype=torch.float16, init_scale=1024.0):
    half = [torch.nn.Parameter(p.detach().to(DEV, dtype)) for p in make_params()]
    scaler = LossScaler(init_scale, scale_window=1000, device=DEV)
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, no_decay_params="", **HP), scaler)
    return half, opt


def test_fp16_adam_on_cuda_is_fused_and_matches_torch_adamw_on_cpu():
    ref = make_params()
    ours = [torch.nn.Parameter(p.detach().to(DEV)) for p in ref]
    opt = build_adam(ours, no_decay_params="", **HP)  # backend auto
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for step in range(60):
        grads = scaled_half_grads(step, [p.shape for p in ref], 1.0)
        for o, r, g in zip(ours, ref, grads):
            o.grad, r.grad = g.float().to(DEV), g.float()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
    assert ours[0].cpu().sub(make_params()[0]).abs().max() > 0.1  # it did move


def test_mixed_step_on_cuda_tracks_fp32_adamw_without_host_syncs():
    half, opt = mixed_on_cuda()
    ref = [torch.nn.Parameter(p.detach().float().cpu()) for p in half]  # the masters' start
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    scale = opt.scaler.loss_scale
    syncs = []
    for step in range(20):
        for h, r, g in zip(half, ref, scaled_half_grads(step, [p.shape for p in ref], scale)):
            h.grad, r.grad = g.to(DEV), g.float() / scale
        with HostSyncCounter() as c:
            opt.multiply_grads(0.5)
            opt.clip_grad_norm(5.0)  # the grads' norm is ~20: clipped
            opt.step()
        syncs.append(c.count)
        for r in ref:
            r.grad.mul_(0.5)
        torch.nn.utils.clip_grad_norm_(ref, 5.0)
        ref_opt.step()
    assert syncs == [0] * 20
    for m, r, h in zip(opt.master_params, ref, half):
        assert m.device.type == "cuda" and m.dtype == torch.float32
        torch.testing.assert_close(m.cpu(), r, rtol=1e-5, atol=1e-6)
        assert torch.equal(h, m.detach().half())  # model = masters rounded
    assert opt.scaler.loss_scale == scale


def test_overflow_on_cuda_skips_the_update_bit_for_bit_and_backs_off():
    half, opt = mixed_on_cuda()
    shapes = [p.shape for p in half]
    for h, g in zip(half, scaled_half_grads(0, shapes, 1.0)):
        h.grad = g.to(DEV)
    opt.step()  # one real step: Adam state exists
    before = [m.detach().clone() for m in opt.master_params]
    model_before = [h.detach().clone() for h in half]
    state_before = {k: v.clone() for k, v in opt.optimizer.state[opt.master_params[0]].items()}
    for h, g in zip(half, scaled_half_grads(1, shapes, 1.0)):
        h.grad = g.to(DEV)
    half[1].grad[3] = float("inf")
    norm = opt.clip_grad_norm(1.0)
    assert not torch.isfinite(norm) and opt.found_inf.item() == 1.0
    opt.step()
    assert all(torch.equal(m, b) for m, b in zip(opt.master_params, before))
    assert all(torch.equal(h, b) for h, b in zip(half, model_before))
    for k, v in opt.optimizer.state[opt.master_params[0]].items():
        assert torch.equal(v, state_before[k]), k
    assert opt.scaler.loss_scale == 512.0


def test_bf16_model_on_cuda_keeps_fp32_masters():
    half, opt = mixed_on_cuda(torch.bfloat16, init_scale=1.0)
    for h, g in zip(half, scaled_half_grads(0, [p.shape for p in half], 1.0)):
        h.grad = g.to(DEV, torch.bfloat16)
    first = [m.detach().clone() for m in opt.master_params]
    opt.step()
    for m, h, f in zip(opt.master_params, half, first):
        assert m.dtype == torch.float32 and h.dtype == torch.bfloat16
        assert torch.equal(h, m.detach().bfloat16())
        assert 0 < (m - f).abs().max().item() < 2 * HP["lr"]  # one Adam step of size ~lr
