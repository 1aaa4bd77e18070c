"""fp32 islands survive model.half()/bfloat16 and compute in fp32."""

import pytest
import torch
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
