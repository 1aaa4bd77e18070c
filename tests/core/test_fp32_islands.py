"""fp32 islands survive model.half()/bfloat16 and compute in fp32."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairseq_fp16.core.fp32_islands import apply_fp32_islands, is_fp32_island, keep_in_fp32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.layer_norm = nn.LayerNorm(8)
        self.output_projection = nn.Linear(8, 5)

    def forward(self, x):
        return self.output_projection(self.layer_norm(self.fc(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_stay_fp32_and_exact_through_half_cast(dtype):
    torch.manual_seed(0)
    m = Block()
    with torch.no_grad():
        m.layer_norm.weight.add_(torch.randn(8) * 1e-3)  # not representable in half
    w32 = m.layer_norm.weight.detach().clone()
    assert apply_fp32_islands(m) == []
    m.to(dtype)
    assert m.fc.weight.dtype == dtype and m.output_projection.weight.dtype == dtype
    assert m.layer_norm.weight.dtype == torch.float32
    assert torch.equal(m.layer_norm.weight, w32)  # not rounded through half
    x = torch.randn(3, 8).to(dtype)
    h = m.fc(x)
    out = m.layer_norm(h)
    assert out.dtype == dtype
    ref = nn.functional.layer_norm(h.float(), (8,), w32, m.layer_norm.bias).to(dtype)
    assert torch.equal(out, ref)
    assert m(x).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_weight_gradients_are_fp32_sums(dtype):
    # The island upcasts its input. torch's CPU layer_norm also takes a half input with fp32
    # weights directly, without the copies, but sums the weight gradient at lower precision:
    # measured with these tensors, 0.26 off (of up to 23) in bf16 and 0.03 in fp16.
    torch.manual_seed(0)
    norm = keep_in_fp32(nn.LayerNorm(256))
    with torch.no_grad():
        norm.weight.normal_()
    norm.to(dtype)
    x = (torch.randn(64, 256) * 3 + 1).to(dtype)
    g = torch.randn(64, 256).to(dtype)
    norm(x).backward(g)
    xd = x.double()
    xhat = (xd - xd.mean(-1, keepdim=True)) / (xd.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    exact_w, exact_b = (g.double() * xhat).sum(0), g.double().sum(0)
    assert norm.weight.grad.dtype == torch.float32
    assert (norm.weight.grad.double() - exact_w).abs().max() < 1e-4 * exact_w.abs().max()
    assert (norm.bias.grad.double() - exact_b).abs().max() < 1e-4 * exact_b.abs().max()


def test_regex_keeps_more_modules_in_fp32_and_reports_them():
    m = Block()
    assert apply_fp32_islands(m, "output_proj") == ["output_projection"]
    m.half()
    assert m.output_projection.weight.dtype == torch.float32
    assert m(torch.randn(2, 8).half()).dtype == torch.float16


def test_invalid_regex_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--fp32-modules is not a valid regular expression: '\(unclosed'"):
        apply_fp32_islands(Block(), "(unclosed")


def test_keep_in_fp32_is_idempotent_and_survives_device_moves_and_deepcopy():
    import copy

    ln = keep_in_fp32(keep_in_fp32(nn.LayerNorm(4)))
    assert type(ln).__name__ == "Fp32LayerNorm" and is_fp32_island(ln)
    ln2 = copy.deepcopy(ln).half().to("cpu")
    assert ln2.weight.dtype == torch.float32 and is_fp32_island(ln2)
    assert isinstance(ln2, nn.LayerNorm)


def test_tied_embedding_and_projection_become_islands_together():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 4)
            self.output_projection = nn.Linear(4, 10, bias=False)
            self.output_projection.weight = self.embed_tokens.weight

        def forward(self, tokens):
            return self.output_projection(self.fc(self.embed_tokens(tokens)))

    m = Tied()
    assert apply_fp32_islands(m, "output_projection") == ["output_projection"]
    assert is_fp32_island(m.embed_tokens)
    m.half().to("cpu")  # a device move after the cast keeps the model's dtype
    assert m.embed_tokens.weight.dtype == torch.float32 and m.fc.weight.dtype == torch.float16
    assert m.embed_tokens(torch.tensor([1, 2])).dtype == torch.float16  # back to the model's dtype
    assert m(torch.tensor([1, 2])).dtype == torch.float16
    m.float()
    assert m.embed_tokens(torch.tensor([1])).dtype == torch.float32


def test_rms_norm_and_apex_fused_norms_are_islands(monkeypatch):
    import sys
    import types

    class FusedLayerNorm(torch.nn.Module):  # apex.normalization's, as fairseq's LayerNorm() returns it
        def __init__(self, n):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.ones(n)), torch.nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias)

    apex = types.ModuleType("apex")
    apex.normalization = types.ModuleType("apex.normalization")
    apex.normalization.FusedLayerNorm = FusedLayerNorm
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", apex.normalization)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8), FusedLayerNorm(8))
    apply_fp32_islands(model, norm_types=None)
    model.half()
    assert [p.dtype for p in model[1].parameters()] == [torch.float32]
    assert {p.dtype for p in model[2].parameters()} == {torch.float32}
    out = model(torch.randn(3, 8).half())
    assert out.dtype == torch.float16


def test_a_module_returning_a_dict_of_lists_is_an_island_at_its_edge():
    class Encoder(torch.nn.Module):  # fairseq's encoders return {"encoder_out": [T x B x C], ...}
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return {"encoder_out": [self.proj(x)], "encoder_padding_mask": [x[..., 0] > 0], "src_lengths": []}

    model = torch.nn.ModuleDict({"encoder": Encoder(), "decoder": torch.nn.Linear(4, 2)})
    assert apply_fp32_islands(model, "^encoder$") == ["encoder"]
    model.half()
    out = model["encoder"](torch.randn(5, 4).half())
    assert out["encoder_out"][0].dtype == torch.float16 and out["encoder_padding_mask"][0].dtype == torch.bool
    assert model["decoder"](out["encoder_out"][0]).dtype == torch.float16
    assert model["encoder"].proj.weight.dtype == torch.float32


def _layer_norm_grads(fn, x, dy, weight, bias):
    """(output, input, weight and bias gradients) of ``fn(x, weight, bias)`` on leaf copies."""
    x = x.detach().clone().requires_grad_()
    w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def _exact_weight_grads(x, dy, eps=1e-5):
    xd = x.double()
    xhat = (xd - xd.mean(-1, keepdim=True)) / (xd.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    return (dy.double() * xhat).sum(0), dy.double().sum(0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_layer_norm_on_the_half_input_against_the_island(dtype):
    """torch's CPU layer_norm takes the half input with the fp32 weights: its outputs and input
    gradients are within one half-precision ulp of the island's (not bit for bit: it rounds
    elsewhere), but it sums the weights' gradients at lower precision (0.3% off in fp16, 1.5%
    in bf16, against under 3e-7 for the island's), so the CPU islands keep their casts."""
    from fairseq_fp16.core.fp32_islands import direct_half_layer_norm, within_one_ulp

    torch.manual_seed(0)
    island = keep_in_fp32(nn.LayerNorm(64))
    with torch.no_grad():
        island.weight.normal_(1.0, 0.5)
        island.bias.normal_()
    island.to(dtype)
    x = (torch.randn(256, 64) * 3 + 1).to(dtype)
    dy = torch.randn(256, 64).to(dtype)

    def direct(xi, w, b):
        return F.layer_norm(xi, (64,), w, b)

    y, dx, dw, db = _layer_norm_grads(direct, x, dy, island.weight, island.bias)
    xi = x.detach().clone().requires_grad_()
    y_island = island(xi)
    y_island.backward(dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, torch.float32)
    assert within_one_ulp(y, y_island, dtype)
    assert within_one_ulp(dx, xi.grad, dtype)
    exact_w, exact_b = _exact_weight_grads(x, dy)
    for grad, island_grad, exact in ((dw, island.weight.grad, exact_w), (db, island.bias.grad, exact_b)):
        assert (island_grad.double() - exact).abs().max() < 1e-6 * exact.abs().max()
        assert (grad.double() - exact).abs().max() > 1e-3 * exact.abs().max()
    assert direct_half_layer_norm(torch.device("cpu"), dtype) is False


_OWN_LAYER_NORM = F.layer_norm


def _fake_kernels():
    """layer_norm kernels a torch might have for a half input with fp32 weights."""
    own = _OWN_LAYER_NORM

    def as_the_island(x, shape, weight=None, bias=None, eps=1e-5):
        return own(x.float(), shape, weight, bias, eps).to(x.dtype)

    def weights_rounded(x, shape, weight=None, bias=None, eps=1e-5):  # fp32 statistics only
        return own(x, shape, weight.to(x.dtype), bias.to(x.dtype), eps)

    def refusing(x, shape, weight=None, bias=None, eps=1e-5):
        if x.dtype != weight.dtype:
            raise RuntimeError("expected scalar type Half but found Float")
        return own(x, shape, weight, bias, eps)

    return {"as the island": as_the_island, "weights rounded": weights_rounded, "refusing": refusing}


@pytest.mark.parametrize("kernel,direct", [("as the island", True), ("weights rounded", False),
                                           ("refusing", False)])
def test_the_probe_takes_only_a_kernel_that_computes_as_the_island(monkeypatch, kernel, direct):
    """A kernel that computes the half input in fp32 with the fp32 weights passes the probe and
    the island then calls it once on its half input; one that rounds the weights to half, or
    refuses them (torch's CUDA kernel), leaves the island on its casts."""
    from fairseq_fp16.core import fp32_islands

    calls = []
    fake = _fake_kernels()[kernel]

    def recording(x, shape, weight=None, bias=None, eps=1e-5):
        calls.append((x.dtype, weight.dtype))
        return fake(x, shape, weight, bias, eps)

    monkeypatch.setattr(fp32_islands, "_DIRECT_NORM", {})
    monkeypatch.setattr(F, "layer_norm", recording)
    for dtype in (torch.float16, torch.bfloat16):
        assert fp32_islands.direct_half_layer_norm(torch.device("cpu"), dtype) is direct
        island = keep_in_fp32(nn.LayerNorm(16)).to(dtype)
        x = torch.randn(4, 16).to(dtype)
        calls.clear()
        out = island(x)
        assert calls == [(dtype if direct else torch.float32, torch.float32)]
        assert out.dtype == dtype
        assert torch.equal(out, _fake_kernels()["as the island"](x, (16,), island.weight, island.bias))


def _island_with_weights(width, dtype):
    torch.manual_seed(0)
    island = keep_in_fp32(nn.LayerNorm(width))
    with torch.no_grad():
        island.weight.normal_(1.0, 0.5)
        island.bias.normal_()
    return island.to(dtype)


def _recording_compiled(monkeypatch):
    from fairseq_fp16.core import fp32_islands

    calls, compiled = [], fp32_islands._compiled_layer_norm

    def recording(x, weight, bias, eps):
        calls.append(tuple(x.shape))
        return compiled(x, weight, bias, eps)

    monkeypatch.setattr(fp32_islands, "_compiled_layer_norm", recording)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_large_cpu_island_runs_compiled_keeping_the_half_input(monkeypatch, dtype):
    """A CPU LayerNorm island of 2**18 elements runs its definition compiled, once, on its input
    as rows: the output and input gradient within one ulp of the eager island's (or 1e-6 of the
    largest, where a sum cancels), the weights' gradients fp32 sums within 1e-5 of the exact
    ones, and the backward keeps the half input instead of an fp32 copy of it."""
    from fairseq_fp16.core.fp32_islands import COMPILED_NORM_MIN_NUMEL, within_one_ulp

    calls = _recording_compiled(monkeypatch)
    island = _island_with_weights(512, dtype)
    x = (torch.randn(64, 8, 512) * 3 + 1).to(dtype)
    dy = torch.randn(64, 8, 512).to(dtype)
    assert x.numel() == COMPILED_NORM_MIN_NUMEL
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    xi = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = island(xi)
    y.backward(dy)
    assert calls.count((512, 512)) == 1 and y.shape == x.shape and y.dtype == dtype

    def eager(xr, w, b):
        return F.layer_norm(xr.float(), (512,), w, b).to(dtype)

    ref_y, ref_dx, _, _ = _layer_norm_grads(eager, x, dy, island.weight, island.bias)
    assert within_one_ulp(y, ref_y, dtype, scale_slack=1e-6)
    assert within_one_ulp(xi.grad, ref_dx, dtype, scale_slack=1e-6)
    exact_w, exact_b = _exact_weight_grads(x.view(-1, 512), dy.view(-1, 512))
    for grad, exact in ((island.weight.grad, exact_w), (island.bias.grad, exact_b)):
        assert grad.dtype == torch.float32
        assert (grad.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    input_sized = [dt for dt, n in saved if n == x.numel()]
    assert input_sized and set(input_sized) == {dtype}


def test_small_inputs_no_grad_and_watched_runs_keep_the_eager_island(monkeypatch):
    """Below 2**18 elements, without autograd (validation, generation) and under a dispatch mode
    (an operator census) the island casts as before: bit for bit its eager definition."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = _recording_compiled(monkeypatch)
    island = _island_with_weights(512, torch.bfloat16)
    small = torch.randn(63, 8, 512).to(torch.bfloat16)
    large = torch.randn(64, 8, 512).to(torch.bfloat16)

    def eager(x):
        return F.layer_norm(x.float(), (512,), island.weight, island.bias).to(x.dtype)

    assert torch.equal(island(small), eager(small))
    with torch.no_grad():
        assert torch.equal(island(large), eager(large))
    with Watch():
        assert torch.equal(island(large), eager(large))
    assert calls == []


def test_an_island_whose_compiled_kernel_cannot_be_built_casts_and_says_why(monkeypatch, caplog):
    from fairseq_fp16.core import fp32_islands

    def no_compiler():
        def fail(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return fail

    monkeypatch.setattr(fp32_islands, "_COMPILED_NORM", {})
    monkeypatch.setattr(fp32_islands, "_compiled_island_layer_norm", no_compiler)
    island = _island_with_weights(512, torch.bfloat16)
    x = torch.randn(64, 8, 512).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger=fp32_islands.__name__):
        y = island(x.requires_grad_())
    assert torch.equal(y, F.layer_norm(x.float(), (512,), island.weight, island.bias).to(x.dtype))
    assert fp32_islands._COMPILED_NORM == {torch.bfloat16: False}
    assert "torch.compile cannot build their fused kernel here (RuntimeError: InvalidCxxCompiler" in caplog.text
