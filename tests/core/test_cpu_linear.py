"""CPU half linear layers with the bias inside oneDNN's product: F.linear's bits forward and
backward, F.linear itself where the call does not fit, and a training run's losses unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_fp16.core.cpu_linear import bias_in_product, bias_in_product_available

HALF = [pytest.param(d, marks=pytest.mark.skipif(not bias_in_product_available(d), reason=f"no oneDNN {d} linear"))
        for d in (torch.bfloat16, torch.float16)]


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _layer(dtype, i=64, o=96):
    torch.manual_seed(0)
    layer = torch.nn.Linear(i, o).to(dtype)
    reference = copy.deepcopy(layer)
    assert bias_in_product(torch.nn.Sequential(layer), dtype) == 1
    return layer, reference


@pytest.mark.parametrize("dtype", HALF)
def test_outputs_and_gradients_have_f_linears_bits(dtype):
    layer, reference = _layer(dtype)
    x = torch.randn(7, 5, 64).to(dtype)  # (time, batch, channels), as fairseq's layers take it
    grad = torch.randn(7, 5, 96).to(dtype)
    results = []
    for module in (layer, reference):
        xi = x.clone().requires_grad_()
        with Ops() as ops:
            out = module(xi)
            out.backward(grad)
        results.append((out, xi.grad, module.weight.grad, module.bias.grad, ops.names))
    (out, gx, gw, gb, fused_ops), (ref, rx, rw, rb, ref_ops) = results
    assert "_linear_pointwise" in fused_ops and "addmm" not in fused_ops and "addmm" in ref_ops
    for a, b in ((out, ref), (gx, rx), (gw, rw), (gb, rb)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert gw.is_contiguous()  # as addmm's backward gives it


@pytest.mark.parametrize("dtype", HALF)
def test_calls_it_does_not_fit_run_f_linear(dtype):
    layer, reference = _layer(dtype)
    cases = {
        "fp32 input": lambda: layer.float()(torch.randn(3, 64)),
        "non-contiguous input": lambda: layer.to(dtype)(torch.randn(64, 3).to(dtype).t()),
        "autocast": lambda: _under_autocast(layer.float()),
    }
    for name, call in cases.items():
        with Ops() as ops:
            call()
        assert "_linear_pointwise" not in ops.names and "addmm" in ops.names, name
    layer.to(dtype)
    x = torch.randn(64, 3).to(dtype).t()
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)


def _under_autocast(layer):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return layer(torch.randn(3, 64))


@pytest.mark.parametrize("dtype", HALF)
def test_a_deep_copy_runs_its_own_weights(dtype):
    """fairseq's EMA model is a deep copy of the model: its layers must not run the original's
    weights through a forward bound to the original."""
    layer, _ = _layer(dtype)
    ema = copy.deepcopy(layer)
    with torch.no_grad():
        ema.weight.mul_(2)
    x = torch.randn(4, 64).to(dtype)
    assert torch.equal(ema(x), F.linear(x, ema.weight, ema.bias))
    assert not torch.equal(ema(x), layer(x))


def test_only_half_dtypes_and_biased_plain_linears_are_changed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    assert bias_in_product(model, torch.float32) == 0 and bias_in_product(model, None) == 0
    assert "forward" not in vars(model[0])
    expected = int(bias_in_product_available(torch.bfloat16))
    assert bias_in_product(model, torch.bfloat16) == expected
    assert bias_in_product(model, torch.bfloat16) == expected  # again: unchanged, counted
    assert "forward" not in vars(model[1])


@pytest.mark.parametrize("dtype", HALF)
def test_a_training_run_has_the_losses_of_f_linear(dtype, toy_data, tmp_path, monkeypatch):
    """fairseq-train with native half products: the linear layers take the fused bias, and the
    run's losses are those of the same run on F.linear, update for update, exactly; under
    --half-matmul fp32-accumulate (whose function mode must see F.linear) no layer takes it."""
    from conftest import TINY_MODEL, TRAIN, USER_DIR
    from inprocess import fairseq_train

    from fairseq_fp16.core import cpu_linear

    flag = "--bf16" if dtype == torch.bfloat16 else "--fp16"
    common = [toy_data, *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR, "--no-save", "--disable-validation",
              "--max-update", "6", flag, "--half-matmul"]
    runs = {}
    # an encoder and a decoder layer: q, k, v and out of 1 + 2 attentions, 2 fc each
    for name, matmul, expected in (("fused", "native", 16), ("fp32-accumulate", "fp32-accumulate", 0),
                                   ("f.linear", "native", 0)):
        if name == "f.linear":
            monkeypatch.setattr(cpu_linear, "bias_in_product_available", lambda dtype: False)
        losses = runs[name] = []
        fused = []

        def on_load(trainer, extra_state, losses=losses, fused=fused):
            fused.append(sum("forward" in vars(m) for m in trainer.model.modules()
                             if isinstance(m, torch.nn.Linear)))
            step = trainer.task.train_step

            def train_step(sample, *args, **kwargs):
                loss, sample_size, logging_output = step(sample, *args, **kwargs)
                losses.append(float(loss) / sample_size)
                return loss, sample_size, logging_output

            trainer.task.train_step = train_step

        fairseq_train([*common, matmul, "--save-dir", tmp_path / name], on_load=on_load)
        assert fused == [expected], name
    assert len(runs["fused"]) == 6 and runs["fused"] == runs["f.linear"]
