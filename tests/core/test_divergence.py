"""forward_divergence: each module's half-precision output against fp32's, the model untouched."""

import copy

import pytest
import torch

from fairseq_fp16.core.divergence import forward_divergence, summarize_divergence
from fairseq_fp16.core.fp32_islands import apply_fp32_islands


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.drop = torch.nn.Dropout(0.5)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.out(self.norm(self.drop(torch.relu(self.inp(x)))))


def half_model(dtype, seed=0):
    torch.manual_seed(seed)
    fp32 = Net()
    half = copy.deepcopy(fp32)
    apply_fp32_islands(half)
    half.to(dtype)
    masters = {id(p): m.detach() for p, m in zip(half.parameters(), fp32.parameters()) if p.dtype == dtype}
    return fp32, half, masters


def x_for(dtype):
    return torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_errors_are_the_half_rounding_and_the_model_is_left_as_it_was(dtype):
    fp32, half, masters = half_model(dtype)
    half.train()
    before = [p.detach().clone() for p in half.parameters()]
    hook_calls = []
    half.out.register_forward_hook(lambda *a: hook_calls.append(1))
    errors = forward_divergence(half, masters, {"x": x_for(dtype)})
    # nothing about the model changed: mode, weights, its own hooks (called once, by the half pass)
    assert half.training and hook_calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, half.parameters()))
    # forward order; the dropout (its input, in eval mode) left out
    assert list(errors) == ["inp", "norm", "out"]
    # the output error equals the one measured by hand: fp32 model, eval mode, on the same input
    with torch.no_grad():
        ref = fp32.eval()(x_for(dtype).float())
        got = half.eval()(x_for(dtype)).float()
    half.train()
    assert errors["out"] == pytest.approx(float((got - ref).norm() / ref.norm()), rel=1e-5)
    eps = torch.finfo(dtype).eps  # fp16 2^-10, bf16 2^-7: the errors are fractions of it
    assert all(0.1 * eps < e < eps for e in errors.values()), errors  # measured: 0.28-0.50 eps
    assert errors["inp"] < errors["norm"] < errors["out"]  # the error grows through the layers


def test_master_weights_count_and_non_finite_outputs_are_inf():
    fp32, half, masters = half_model(torch.float16)
    x = {"x": x_for(torch.float16)}
    # masters equal to the half weights: only the activations' rounding is left
    rounded = {k: p.detach().float() for k, p in zip(masters, (p for p in half.parameters()
                                                               if p.dtype == torch.float16))}
    assert forward_divergence(half, rounded, x)["inp"] < forward_divergence(half, masters, x)["inp"]
    with torch.no_grad():
        half.inp.weight[0, 0] = 60000.0  # overflows fp16 in the product
    errors = forward_divergence(half, rounded, {"x": torch.full((2, 16), 8.0, dtype=torch.float16)})
    assert errors["inp"] == float("inf")
    assert summarize_divergence({"a": 1e-3, "b": 5e-3, "c": 2e-4, "d": 0.0}, top=2) == \
        "b 5.0e-03, a 1.0e-03 (of 4 modules)"


def test_weight_norm_weights_come_from_the_masters():
    # fairseq's fconv layers use weight_norm, whose forward pre-hook makes the weight from g and
    # v: the fp32 copy keeps it, so a master g twice the half one doubles the reference output
    lin = torch.nn.utils.weight_norm(torch.nn.Linear(16, 8)).half()
    net = torch.nn.Sequential(lin)
    masters = {id(p): p.detach().float() * (2 if name == "0.weight_g" else 1)
               for name, p in net.named_parameters()}
    masters[id(lin.bias)] = lin.bias.detach().float() * 2
    errors = forward_divergence(net, masters, {"input": x_for(torch.float16)})
    assert errors["0"] == pytest.approx(0.5, abs=2e-3)  # ||y - 2y|| / ||2y||
