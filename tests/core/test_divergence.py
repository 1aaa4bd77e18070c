"""forward_divergence: each module's half-precision output against fp32's, the model untouched."""

import copy
import threading

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


class Cached(torch.nn.Module):
    """A layer like fairseq's: a half buffer used in forward, a tensor cache set by forward in
    its input's dtype (as TransformerDecoder's _future_mask), and a lock (the model cannot be
    deep-copied, as a model holding a process group or a file handle cannot)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.lock = None

    def forward(self, x):
        self._cache = torch.ones(1, dtype=x.dtype)
        return self.lin(x) * self.scale * self._cache


def test_the_fp32_pass_runs_in_place_and_leaves_parameters_buffers_and_caches_as_they_were():
    torch.manual_seed(0)
    fp32 = torch.nn.Sequential(Cached())
    half = copy.deepcopy(fp32).half()
    fp32[0].lock = half[0].lock = threading.Lock()
    params = {name: (p, p.data_ptr()) for name, p in half.named_parameters()}
    # the nodes that accumulate each parameter's gradient, where DDP's reducer hooks in: setting
    # a parameter's .data to fp32 and back would replace them (and lose such hooks)
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in half.parameters()]
    buf = half[0].scale
    x = x_for(torch.float16)
    masters = {id(p): m.detach() for p, m in zip(half.parameters(), fp32.parameters())}
    errors = forward_divergence(half, masters, {"input": x})
    # the same parameter objects, storage and dtype; the same buffer; the cache left in half
    # (the fp32 pass set it in fp32)
    assert {name: (p, p.data_ptr()) for name, p in half.named_parameters()} == params
    assert all(p.dtype == torch.float16 for p in half.parameters())
    assert all(p.view_as(p).grad_fn.next_functions[0][0] is acc
               for p, acc in zip(half.parameters(), accumulators))
    assert half[0].scale is buf and buf.dtype == torch.float16
    assert half[0]._cache.dtype == torch.float16
    # the reference is the fp32 model (its weights the masters, its buffer fp32): the errors
    # are those measured by hand
    with torch.no_grad():
        by_hand = {"0.lin": (half[0].lin(x), fp32[0].lin(x.float())), "0": (half(x), fp32(x.float()))}
    assert list(errors) == ["0.lin", "0"]
    for name, (got, ref) in by_hand.items():
        assert errors[name] == pytest.approx(float((got.float() - ref).norm() / ref.norm()), rel=1e-5)
        assert 0 < errors[name] < torch.finfo(torch.float16).eps


def test_a_data_parallel_wrapper_measures_the_wrapped_model_on_this_rank_alone(tmp_path):
    fp32, half, masters = half_model(torch.float16)
    plain = forward_divergence(half, masters, {"x": x_for(torch.float16)})
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(half)
        errors = forward_divergence(wrapped, masters, {"x": x_for(torch.float16)})
    finally:
        torch.distributed.destroy_process_group()
    assert errors == plain  # the wrapped model's names ("inp", not "module.inp"), same numbers
    assert list(errors) == ["inp", "norm", "out"]
