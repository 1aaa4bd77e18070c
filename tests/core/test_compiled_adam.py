"""--compile-step's update (core.compiled_adam) against the eager mixed-precision step."""

import pytest
import torch
from torch._dynamo.utils import counters

from fairseq_fp16.core import compiled_adam
from fairseq_fp16.core.adam import build_adam
from fairseq_fp16.core.loss_scaler import LossScaler
from fairseq_fp16.core.master_weights import MixedPrecisionOptimizer

HP = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
# large half tensors (the compiled loop: thirteen of one size, stepped four to a call and their
# squares summed eight and four to a call, and one of another size), small ones (torch's passes)
# and an fp32 island
SHAPES = ((160, 128),) * 13 + ((130, 128), (64, 32), (32,), (7, 5, 3))
SMALL = SHAPES.index((64, 32))


def build(dtype, compile_step, backend="fused", scale=1024.0):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(48, generator=g)))  # fp32 island
    opt = MixedPrecisionOptimizer(params, lambda ps: build_adam(ps, backend=backend, **HP),
                                  LossScaler(scale, scale_window=3), compile_step=compile_step)
    return params, opt


def set_grads(params, step, scale):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def train(dtype, compile_step, steps=8, overflow_at=4):
    """Steps with clipping every other step, a multiplied gradient and one overflow; returns
    the optimizer, the model's parameters and whether each step ran compiled."""
    params, opt = build(dtype, compile_step)
    compiled = []
    for step in range(steps):
        opt.zero_grad()
        set_grads(params, step, opt.scaler.loss_scale)
        if step == overflow_at:
            params[0].grad[3, 3] = float("inf")
        opt.multiply_grads(0.5)
        opt.clip_grad_norm(1.0 if step % 2 else 0.0)
        compiled.append(opt._one_pass)
        opt.step()
    return opt, params, compiled


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_step_tracks_the_eager_step_with_clipping_and_an_overflow(dtype):
    eager, eager_params, _ = train(dtype, False)
    opt, params, compiled = train(dtype, True)
    # the first step is torch's (it makes the optimizer state); every later one runs compiled
    assert compiled == [False] + [True] * 7
    for m, ref in zip(opt.master_params, eager.master_params):
        torch.testing.assert_close(m, ref, rtol=1e-5, atol=1e-7)
    for p, m in zip(params, opt.master_params):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))  # the model holds the masters rounded
    for m, ref in zip(opt.master_params, eager.master_params):
        st, ref_st = opt.optimizer.state[m], eager.optimizer.state[ref]
        assert st["step"].item() == ref_st["step"].item() == 7.0  # the overflow skipped one
        torch.testing.assert_close(st["exp_avg_sq"], ref_st["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert opt.scaler.loss_scale == eager.scaler.loss_scale
    # tensors of one size stepped four to a call, their squares summed eight and four to a
    # call; the thirteenth and the one of another size alone
    (group,) = opt._compiled._groups
    assert group.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert group.norm_batches == [list(range(8)), [8, 9, 10, 11]]
    assert group.singles == group.norm_singles == [12, 13]


def test_the_training_steps_compile_nothing_after_the_warm_up():
    build(torch.bfloat16, True)  # compiles the kernels on a tensor of 2**20 elements
    graphs = counters["stats"]["unique_graphs"]
    train(torch.bfloat16, True)  # another optimizer, the same functions: tensors of other sizes
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_norm_is_the_eager_one_and_no_fp32_gradient_is_made_for_large_tensors():
    params, opt = build(torch.bfloat16, True)
    set_grads(params, 0, 1.0)
    opt.step()  # torch's first step: the state exists
    opt.zero_grad()
    set_grads(params, 1, 1.0)
    norms = torch.stack([p.grad.float().norm() for p in params])
    expected = torch.linalg.vector_norm(norms) / opt.scaler.loss_scale  # returned unscaled
    torch.testing.assert_close(opt.clip_grad_norm(0.0), expected)
    opt.step()
    assert opt.master_params[0].grad is None  # the large tensor's update read the half gradient
    assert opt.master_params[SMALL].grad is not None  # a small one went through torch's passes


def test_an_overflow_leaves_masters_moments_and_step_counts_bit_for_bit():
    params, opt = build(torch.float16, True)
    set_grads(params, 0, 1.0)
    opt.step()
    before = [(m.detach().clone(), {k: v.clone() for k, v in opt.optimizer.state[m].items()})
              for m in opt.master_params]
    opt.zero_grad()
    set_grads(params, 1, 1.0)
    params[0].grad[0, 0] = float("inf")
    assert not torch.isfinite(opt.clip_grad_norm(0.0)) and opt._one_pass
    opt.step()
    for m, (value, state) in zip(opt.master_params, before):
        assert torch.equal(m, value)
        for k, v in opt.optimizer.state[m].items():
            assert torch.equal(v, state[k]), k
    assert opt.scaler.loss_scale == 512.0


def test_another_optimizer_or_experts_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--compile-step compiles torch's fused AdamW update: use "
                                         r"--optimizer fp16_adam"):
        build(torch.bfloat16, True, backend="foreach")
    params = [torch.nn.Parameter(torch.randn(4).half())]
    params[0].expert = True
    with pytest.raises(ValueError, match=r"--compile-step steps parameters of one device, none of "
                                         r"them experts"):
        MixedPrecisionOptimizer(params, lambda ps: build_adam(ps, **HP), LossScaler(1.0),
                                compile_step=True)


def test_a_machine_where_torch_compile_fails_is_refused_before_training(monkeypatch):
    def no_compiler(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no C++ compiler found\nsecond line")
        return compiled

    monkeypatch.setattr(compiled_adam.torch, "compile", no_compiler)
    with pytest.raises(ValueError, match=r"--compile-step: torch.compile cannot build the AdamW "
                                         r"update on this machine \(RuntimeError: no C\+\+ compiler "
                                         r"found\); run without --compile-step"):
        build(torch.bfloat16, True)
