"""CPU fp32-accumulate matrix products: bit-for-bit GPU tensor-core numerics, overflow kept.

Both implementations are held to the same numbers: the dispatch mode (below
autograd) and the function mode the task uses (above autograd).
"""

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fairseq_fp16.core.half_matmul import (
    Fp32AccumulateFunctions,
    Fp32AccumulateMatmul,
    NativeHalfProducts,
    cpu_has_native_half,
    resolve_half_matmul,
)

from conftest import allocation_bytes

DTYPES = [torch.float16, torch.bfloat16]
MODES = [Fp32AccumulateMatmul, Fp32AccumulateFunctions]


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("mode_cls", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_product_equals_fp32_product_rounded(dtype, mode_cls):
    a, b, c = rand(7, 33, dtype=dtype), rand(33, 9, dtype=dtype, seed=1), rand(7, 9, dtype=dtype, seed=2)
    ba, bb, bc = rand(3, 7, 33, dtype=dtype), rand(3, 33, 9, dtype=dtype, seed=1), rand(3, 7, 9, dtype=dtype, seed=2)
    cases = {
        "mm": (lambda: torch.mm(a, b), lambda: (a.float() @ b.float())),
        "addmm": (lambda: torch.addmm(c, a, b), lambda: torch.addmm(c.float(), a.float(), b.float())),
        "bmm": (lambda: torch.bmm(ba, bb), lambda: torch.bmm(ba.float(), bb.float())),
        "baddbmm": (lambda: torch.baddbmm(bc, ba, bb, alpha=0.5),
                    lambda: torch.baddbmm(bc.float(), ba.float(), bb.float(), alpha=0.5)),
        "linear": (lambda: F.linear(a, b.t(), c[0]), lambda: F.linear(a.float(), b.t().float(), c[0].float())),
        "linear 3-d": (lambda: F.linear(ba, b.t()), lambda: F.linear(ba.float(), b.t().float())),
        "matmul": (lambda: ba @ b, lambda: ba.float() @ b.float()),
        "einsum": (lambda: torch.einsum("bij,jk->bik", ba, b), lambda: torch.einsum("bij,jk->bik", ba.float(), b.float())),
        "addbmm": (lambda: torch.addbmm(c, ba, bb), lambda: torch.addbmm(c.float(), ba.float(), bb.float())),
        "mv": (lambda: torch.mv(a, b[:, 0]), lambda: torch.mv(a.float(), b[:, 0].float())),
        "addmv": (lambda: torch.addmv(c[:, 0], a, b[:, 0], beta=0.5),
                  lambda: torch.addmv(c[:, 0].float(), a.float(), b[:, 0].float(), beta=0.5)),
        "matmul by a vector": (lambda: a @ b[:, 0], lambda: a.float() @ b[:, 0].float()),
        "dot": (lambda: torch.dot(a[0], b[:, 0]), lambda: torch.dot(a[0].float(), b[:, 0].float())),
        "vdot": (lambda: torch.vdot(a[0], b[:, 0]), lambda: torch.vdot(a[0].float(), b[:, 0].float())),
        "inner": (lambda: torch.inner(a, b.t()), lambda: torch.inner(a.float(), b.t().float())),
        # (a @ b) @ b^T, the cheaper order, the intermediate rounded to half as on a GPU
        "multi_dot": (lambda: torch.linalg.multi_dot([a, b, b.t()]),
                      lambda: (a.float() @ b.float()).to(dtype).float() @ b.t().float()),
    }
    for name, (op, ref) in cases.items():
        with mode_cls() as mode:
            out = op()
        assert mode.calls >= 1, name
        assert out.dtype == dtype, name
        assert torch.equal(out, ref().to(dtype)), name


@pytest.mark.parametrize("mode_cls", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_convolutions_multiply_in_fp32_forward_and_backward(dtype, mode_cls):
    # F.conv1d/conv2d/conv_transpose1d and fairseq's ConvTBC op (function mode): the output and
    # every gradient equal fp32's rounded to half, as on a GPU
    x1, w1, b = rand(2, 6, 11, dtype=dtype), rand(5, 6, 3, dtype=dtype, seed=1), rand(5, dtype=dtype, seed=2)
    x2, w2 = rand(2, 6, 7, 7, dtype=dtype, seed=3), rand(5, 6, 3, 3, dtype=dtype, seed=4)
    xt, wt = rand(11, 2, 6, dtype=dtype, seed=5), rand(3, 6, 5, dtype=dtype, seed=6)
    cases = {
        "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), (x1, w1, b)),
        "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2), (x2, w2, b)),
        "conv_transpose1d": (lambda x, w, b: F.conv_transpose1d(x, w, b), (rand(2, 5, 9, dtype=dtype, seed=7),
                                                                            w1, rand(6, dtype=dtype, seed=8))),
    }
    if mode_cls is Fp32AccumulateFunctions:  # aten decomposes conv_tbc's backward below autograd
        cases["conv_tbc"] = (lambda x, w, b: torch.conv_tbc(x, w, b, 1), (xt, wt, b))
    for name, (op, inputs) in cases.items():
        half = [t.clone().requires_grad_() for t in inputs]
        full = [t.float().requires_grad_() for t in inputs]
        ref = op(*full)
        with mode_cls() as mode:
            out = op(*half)
            grad = rand(*out.shape, dtype=dtype, seed=9)
            out.backward(grad)
        ref.backward(grad.float())
        assert mode.calls >= 1 and out.dtype == dtype, name
        assert torch.equal(out, ref.to(dtype)), name
        for h, f in zip(half, full):
            assert h.grad.dtype == dtype and torch.equal(h.grad, f.grad.to(dtype)), name


@pytest.mark.parametrize("mode_cls", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_is_fp32_inside(dtype, mode_cls):
    q, k, v = (rand(2, 4, 6, 8, dtype=dtype, seed=s) for s in range(3))
    with mode_cls() as mode:
        out = F.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    assert mode.calls == 1 and out.dtype == dtype
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode_cls,calls", [(Fp32AccumulateMatmul, 3), (Fp32AccumulateFunctions, 1)])
def test_backward_products_are_covered_and_weight_grads_stay_half(mode_cls, calls):
    lin = torch.nn.Linear(16, 8).half()
    x = rand(4, 16, dtype=torch.float16).requires_grad_()
    with mode_cls() as mode:
        lin(x).float().sum().backward()
    # the dispatch mode sees the forward addmm and both backward mm; the function mode one F.linear
    assert mode.calls == calls
    assert lin.weight.grad.dtype == torch.float16 and x.grad.dtype == torch.float16
    ref = (torch.ones(4, 8).t() @ x.detach().float()).half()
    assert torch.equal(lin.weight.grad, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_reuse_their_fp32_copies_within_a_step(dtype, tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 256)).to(dtype)
    x = rand(512, 256, dtype=dtype).requires_grad_()
    q = rand(16, 64, 32, dtype=dtype)

    def step():
        (mlp(x).float().sum() + torch.bmm(q, q.transpose(1, 2)).float().sum()).backward()

    grads, allocated = {}, {}
    for reuse in (True, False):
        with Fp32AccumulateFunctions() as mode:
            if not reuse:
                mode.buffers = None  # each product makes its own fp32 copies
            step()  # the buffers grow to the products' sizes
            allocated[reuse] = sum(b for b in allocation_bytes(step, tmp_path) if b > 0)
        grads[reuse] = [p.grad.clone() for p in (x, *mlp.parameters())]
        for p in (x, *mlp.parameters()):
            p.grad = None
    # without reuse the products' fp32 copies and results are over two thirds of what the step
    # allocates (19.5 of 26.9 MB); with it, the step allocates its half results and gradients
    assert allocated[False] > 3 * allocated[True]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("mode_cls", MODES)
def test_overflow_still_overflows_like_half(mode_cls):
    a = torch.full((2, 64), 64.0, dtype=torch.float16)
    b = torch.full((64, 2), 32.0, dtype=torch.float16)  # 64 * 64 * 32 = 131072 > 65504
    with mode_cls():
        out = a @ b
    assert torch.isinf(out).all()
    # and a gradient that overflows fp16 is inf in the weight's gradient
    lin = torch.nn.Linear(64, 1, bias=False).half()
    x = torch.full((64, 64), 100.0, dtype=torch.float16)
    with mode_cls():
        (lin(x).float() * 20.0).sum().backward()
    assert torch.isinf(lin.weight.grad).all()


@pytest.mark.parametrize("mode_cls", MODES)
def test_fp32_and_cuda_free_paths_untouched(mode_cls):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with mode_cls() as mode:
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


def _fp32_context():
    """A run context with the flags' defaults (what the task state of a real task holds)."""
    from fairseq_fp16.context import RunContext
    from fairseq_fp16.flags import PrecisionFlags
    from fairseq_fp16.precision import Precision

    return RunContext(Precision(), PrecisionFlags())


def test_task_steps_run_in_the_mode_exactly_during_their_call(monkeypatch):
    # fairseq_fp16.patches.tasks wraps FairseqTask's steps for every task
    from types import SimpleNamespace

    from fairseq_fp16.patches import REGISTRY
    from fairseq_fp16.patches import tasks as task_patches

    seen, checks = {}, []

    def step(*args, _n, **kwargs):
        seen[_n] = _get_current_function_mode()
        checks.append((_n, type(_get_current_dispatch_mode()).__name__))

    for name in ("train_step", "valid_step", "inference_step"):
        patch = REGISTRY.get(f"fairseq.tasks.fairseq_task:FairseqTask.{name}")
        monkeypatch.setattr(patch, "original", functools.partial(step, _n=name))
    task = SimpleNamespace(cfg=SimpleNamespace(precision_divergence_interval=0))
    state = SimpleNamespace(fp32_accumulate=True, checked_steps=set(), divergence_done=None,
                            context=_fp32_context())
    task._fairseq_fp16_state = state
    for _ in range(2):
        task_patches._train_step(task, None, None, None, None, 0)
        task_patches._valid_step(task, None, None, None)
        task_patches._inference_step(task, None, None, None)
    assert all(isinstance(m, Fp32AccumulateFunctions) for m in seen.values()) and len(seen) == 3
    # the first training and generation steps count the products that escape the mode
    assert checks == [("train_step", "NativeHalfProducts"), ("valid_step", "NoneType"),
                      ("inference_step", "NativeHalfProducts"), ("train_step", "NoneType"),
                      ("valid_step", "NoneType"), ("inference_step", "NoneType")]
    assert _get_current_function_mode() is None and _get_current_dispatch_mode() is None
    state.fp32_accumulate = False
    seen.clear()
    task_patches._train_step(task, None, None, None, None, 0)
    assert seen["train_step"] is None


def test_native_half_products_counts_what_escapes_the_modes():
    # routed functions (linear, bmm, an LSTM cell, a convolution), forward and backward: nothing escapes;
    # an aten op called directly (torch.ops.aten.mm) is below the function mode: it and its two
    # gradient products escape
    w = rand(16, 16, dtype=torch.float16).requires_grad_()
    x = rand(4, 16, dtype=torch.float16, seed=1).requires_grad_()
    cell = torch.nn.LSTMCell(16, 16).half()
    conv = torch.nn.Conv1d(4, 4, 3).half()

    def routed():
        return (F.linear(x, w).sum() + torch.bmm(x[None], w[None]).sum() + cell(x)[0].sum()
                + conv(x[None]).sum())

    def escaping():
        return torch.ops.aten.mm(x, w).sum()

    for fn, expected in ((routed, {}), (escaping, None)):
        with NativeHalfProducts() as check, Fp32AccumulateFunctions():
            fn().float().backward()
        if expected is None:  # the forward's site: the line of escaping() that called aten.mm
            site = f"{__file__}:{escaping.__code__.co_firstlineno + 1} (escaping)"
            expected = {("mm", site): 1, ("mm", "backward pass"): 2}
        assert dict(check.counts) == expected, fn.__name__
    assert check.summary() == f"aten.mm x2 at backward pass, aten.mm x1 at {site}"
    # without a mode every half product is native; fp32 products are not counted
    with NativeHalfProducts() as check:
        F.linear(x, w)
        F.linear(x.float(), w.float())
    assert sum(check.counts.values()) == 1


def test_first_training_step_logs_the_products_that_escaped(caplog):
    from types import SimpleNamespace

    from fairseq_fp16.features import native_products_check as check

    task = SimpleNamespace(fp32_accumulate=True, checked_steps=set(), context=_fp32_context())
    x = rand(4, 16, dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="fairseq_fp16.features"):
        mm = torch.ops.aten.mm  # called directly: below the function mode
        with Fp32AccumulateFunctions(), check(task, "training step"):
            mm(mm(x, x.t()), x)
        with Fp32AccumulateFunctions(), check(task, "training step"):  # checked once only
            mm(mm(x, x.t()), x)
        with Fp32AccumulateFunctions(), check(task, "generation step"):
            F.linear(x, x)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert re.fullmatch(
        r"--half-matmul: 2 half-precision matrix products of the first training step ran on torch's "
        r"native half kernels \(on a CPU without half-precision units many times slower than "
        r"fp32\): aten\.mm x2 at .*test_half_matmul\.py:\d+ \(test_first_training_step_logs_the_"
        r"products_that_escaped\)\. The functions that issue them are not routed to fp32 accumulation "
        r"\(ROUTED_FUNCTIONS in fairseq_fp16/core/half_matmul\.py\)", caplog.records[0].getMessage())
    assert caplog.records[1].getMessage() == (
        "--half-matmul: every half-precision matrix product of the first generation step accumulated in fp32")


def grads_under(mode_cls, step, params):
    for p in params:
        p.grad = None
    with mode_cls() as mode:
        out = step()
    return out, [p.grad.clone() for p in params], mode.calls


def assert_same_numbers(step, params):
    out_d, grads_d, calls_d = grads_under(Fp32AccumulateMatmul, step, params)
    out_f, grads_f, calls_f = grads_under(Fp32AccumulateFunctions, step, params)
    assert torch.equal(out_d, out_f)
    assert all(torch.equal(a, b) for a, b in zip(grads_d, grads_f))
    assert 0 < calls_f < calls_d
    return calls_d, calls_f


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize_before", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("fused", [False, True], ids=["fairseq-attention", "fused-attention"])
def test_function_mode_trains_a_fairseq_transformer_like_the_dispatch_mode(dtype, normalize_before, fused):
    """Loss and every gradient of a fairseq transformer step (dropout on, shared
    output projection) under both modes.

    With fairseq's own attention (what translation_fp16 uses in half precision:
    linear projections and bmm): the same bits, pre- and post-norm. With torch's
    fused attention (F.multi_head_attention_forward, routed as a whole) and
    post-norm, a layer's input reaches both the attention (as query, key and
    value) and the residual sum; the function mode adds the three attention
    gradients before the residual's, the dispatch mode's graph one by one, so
    the half-precision sums can differ in the last bit of some elements.
    """
    from argparse import Namespace

    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, transformer_legacy

    from fairseq_fp16.core.fp32_islands import apply_fp32_islands

    vocab = Dictionary()
    for i in range(60):
        vocab.add_symbol(f"w{i}")
    args = Namespace(arch="transformer", encoder_layers=1, decoder_layers=1, encoder_embed_dim=32,
                     decoder_embed_dim=32, encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
                     encoder_attention_heads=2, decoder_attention_heads=2, share_all_embeddings=True,
                     dropout=0.1, attention_dropout=0.1, encoder_normalize_before=normalize_before,
                     decoder_normalize_before=normalize_before)
    transformer_legacy.base_architecture(args)
    task = Namespace(source_dictionary=vocab, target_dictionary=vocab)
    torch.manual_seed(0)
    model = TransformerModel.build_model(args, task)
    apply_fp32_islands(model)
    model.to(dtype).train()
    if not fused:
        for module in model.modules():
            if hasattr(module, "_set_skip_embed_dim_check"):
                module._set_skip_embed_dim_check()
    g = torch.Generator().manual_seed(1)
    src, tgt = (torch.randint(4, len(vocab), (3, 7), generator=g) for _ in range(2))
    params = list(model.parameters())

    def step():
        torch.manual_seed(2)  # the same dropout masks under both modes
        logits, _ = model(src, torch.full((3,), 7), tgt)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
        loss.backward()
        return loss.detach()

    loss_d, grads_d, calls_d = grads_under(Fp32AccumulateMatmul, step, params)
    loss_f, grads_f, calls_f = grads_under(Fp32AccumulateFunctions, step, params)
    assert torch.equal(loss_d, loss_f)
    assert 0 < 3 * calls_f <= calls_d  # one call per product (forward and backward) or fewer
    if normalize_before or not fused:
        assert all(torch.equal(a, b) for a, b in zip(grads_d, grads_f))
    else:
        eps = torch.finfo(dtype).eps
        differ = 0
        for a, b in zip(grads_d, grads_f):  # at most one unit in the last place of the largest
            torch.testing.assert_close(a, b, rtol=0, atol=float(a.abs().max()) * eps)
            differ += int((a != b).sum())
        assert differ < 0.2 * sum(a.numel() for a in grads_d)
    # and decoding (no graph) gives the same logits
    model.eval()
    with torch.no_grad():
        with Fp32AccumulateMatmul():
            ref, _ = model(src, torch.full((3,), 7), tgt)
        with Fp32AccumulateFunctions() as mode:
            out, _ = model(src, torch.full((3,), 7), tgt)
    assert torch.equal(ref, out) and mode.calls > 0


def backward_of(fn):
    def step():
        out = fn().float().pow(2).sum()
        out.backward()
        return out.detach()
    return step


def test_function_mode_routes_rnn_cells_and_sums_the_gradient_of_a_tensor_used_twice():
    # nn.RNNCell: one routed call a step, its products under the dispatch mode (a GPU has no
    # fused kernel for it either: products rounded to half, the rest in half)
    for cell in (torch.nn.RNNCell(8, 16), torch.nn.RNNCell(8, 16, nonlinearity="relu")):
        cell.half()
        x = rand(3, 8, dtype=torch.float16).requires_grad_()
        _, calls_f = assert_same_numbers(backward_of(lambda: cell(x, cell(x))), [x, *cell.parameters()])
        assert calls_f == 2
    # y passed twice to one routed function: both uses reach y.grad, as without the mode
    y = rand(6, 8, dtype=torch.float16).requires_grad_()
    assert_same_numbers(backward_of(lambda: torch.einsum("ij,kj->ik", y, y)), [y])
    y.grad = None
    with Fp32AccumulateFunctions():
        torch.einsum("ij,kj->ik", y, y).float().sum().backward()
    # d/dy of the sum of y y^T is twice the column sums, in every row: both uses counted
    torch.testing.assert_close(y.grad.float(), 2 * y.detach().float().sum(0).expand(6, 8),
                               rtol=1e-2, atol=1e-2)


def fp32_copy(module):
    """An fp32 module with the half module's weights (exact: every half value is an fp32 value)."""
    import copy

    return copy.deepcopy(module).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_rnns_run_in_fp32_inside_as_cudnn_runs_half_rnns(dtype, kind):
    """nn.LSTM/GRU/RNN in half under the function mode: the recurrence in fp32 (cuDNN's math
    type for half RNNs), outputs rounded to half. Output and every gradient equal those of the
    fp32 module on the same weights, rounded, bit for bit; packed sequences (fairseq's LSTM
    encoder) too. One routed call."""
    rnn = getattr(torch.nn, kind)(8, 16, num_layers=2, bidirectional=True).to(dtype)
    ref = fp32_copy(rnn)
    x = rand(5, 3, 8, dtype=dtype).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    packed = lambda t: torch.nn.utils.rnn.pack_padded_sequence(t, torch.tensor([5, 4, 2]))  # noqa: E731
    for wrap, unwrap in ((lambda t: t, lambda o: o), (packed, lambda o: o.data)):
        x.grad = x32.grad = None
        rnn.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with Fp32AccumulateFunctions() as mode:
            out = unwrap(rnn(wrap(x))[0])
        out.float().pow(2).sum().backward()
        assert mode.calls == 1 and out.dtype == dtype
        out_ref = unwrap(ref(wrap(x32))[0]).to(dtype)
        out_ref.float().pow(2).sum().backward()
        assert torch.equal(out, out_ref)
        assert torch.equal(x.grad, x32.grad.to(dtype))
        for p, q in zip(rnn.parameters(), ref.parameters()):
            assert p.grad.dtype == dtype and torch.equal(p.grad, q.grad.to(dtype))


def fused_cuda_cell(kind, x, h, c, w_ih, w_hh, b_ih, b_hh):
    """PyTorch's fused CUDA LSTM/GRU cell (aten/src/ATen/native/cuda/RNN.cu): the gate
    products in half (fp32-accumulated, no bias), then everything in fp32, outputs to half."""
    gi = torch.mm(x.float(), w_ih.float().t()).to(x.dtype).float()
    gh = torch.mm(h.float(), w_hh.float().t()).to(x.dtype).float()
    n = 4 if kind == "LSTM" else 3
    zero = torch.zeros(n * h.size(1))  # a cell without biases adds none (adding 0 is exact)
    b1, b2 = (zero if b is None else b.float() for b in (b_ih, b_hh))
    pre = [gi[:, k * gi.size(1) // n:(k + 1) * gi.size(1) // n] for k in range(n)]
    hid = [gh[:, k * gh.size(1) // n:(k + 1) * gh.size(1) // n] for k in range(n)]
    bb1, bb2 = b1.view(n, -1), b2.view(n, -1)
    if kind == "LSTM":
        ig, fg, cg, og = (pre[k] + hid[k] + bb1[k] + bb2[k] for k in range(4))
        ig, fg, cg, og = torch.sigmoid(ig), torch.sigmoid(fg), torch.tanh(cg), torch.sigmoid(og)
        cy = fg * c.float() + ig * cg
        return (og * torch.tanh(cy)).to(x.dtype), cy.to(x.dtype)
    rg = torch.sigmoid(pre[0] + hid[0] + bb1[0] + bb2[0])
    zg = torch.sigmoid(pre[1] + hid[1] + bb1[1] + bb2[1])
    ng = torch.tanh(pre[2] + bb1[2] + rg * (hid[2] + bb2[2]))
    return (ng + zg * (h.float() - ng)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_and_gru_cells_compute_like_the_fused_cuda_cells(dtype, kind, bias):
    """nn.LSTMCell/GRUCell in half under the function mode (fairseq's LSTM decoder steps an
    LSTMCell) equal the CUDA kernels' arithmetic bit for bit, forward; their gradients are
    those of that arithmetic (autograd through it), close to fp32's."""
    cell = getattr(torch.nn, f"{kind}Cell")(8, 16, bias=bias).to(dtype)
    x = rand(3, 8, dtype=dtype).requires_grad_()
    h0 = rand(3, 16, dtype=dtype, seed=1)
    c0 = rand(3, 16, dtype=dtype, seed=2)
    state = (h0, c0) if kind == "LSTM" else h0
    with Fp32AccumulateFunctions() as mode:
        out = cell(x, state)
        out2 = cell(x, out)  # a second step from the first one's state
    assert mode.calls == 2
    w = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    want = fused_cuda_cell(kind, x, h0, c0, *w)
    first = out if kind == "LSTM" else (out,)
    want = want if kind == "LSTM" else (want,)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(first, want))
    last = out2[0] if kind == "LSTM" else out2
    last.float().pow(2).sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in cell.parameters())]
    # the same arithmetic without the mode, through autograd: the same gradients
    x.grad = None
    cell.zero_grad(set_to_none=True)
    s1 = fused_cuda_cell(kind, x, h0, c0, *w)
    h1, c1 = s1 if kind == "LSTM" else (s1, None)
    s2 = fused_cuda_cell(kind, x, h1, c1, *w)
    (s2[0] if kind == "LSTM" else s2).float().pow(2).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(grads, [x.grad, *(p.grad for p in cell.parameters())]))
    # and both are close to the fp32 cell's
    ref = fp32_copy(cell)
    x32 = x.detach().float().requires_grad_()
    st = (h0.float(), c0.float()) if kind == "LSTM" else h0.float()
    o32 = ref(x32, ref(x32, st))
    (o32[0] if kind == "LSTM" else o32).pow(2).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(last.float(), (o32[0] if kind == "LSTM" else o32).detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grads[0].float(), x32.grad, rtol=5 * tol, atol=5 * tol)
