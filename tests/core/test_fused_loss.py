"""The fused loss against fairseq's log_softmax + label_smoothed_nll_loss: values, gradients, memory."""

import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from torch.profiler import ProfilerActivity, profile

from fairseq_fp16.core import fused_loss
from fairseq_fp16.core.fused_loss import (CPU_COMPILED_MIN_NUMEL, PATHS, chunk_rows, default_path,
                                             label_smoothed_nll_from_logits)
from fairseq_fp16_tools.bench.op_census import OpCensus

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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_same_loss_and_gradient_as_fairseq(dtype, eps, path):
    logits, target = inputs(dtype)
    ref = loss_and_grad(fairseq_loss, logits, target, eps, ignore_index=PAD)
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, eps, ignore_index=PAD,
                        path=path, rows=40)
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


@pytest.mark.parametrize("path", PATHS)
def test_gradient_of_both_outputs(path):
    """fairseq logs the NLL; a caller that backpropagates through it gets its gradient too."""
    logits, target = inputs(torch.float32)
    ref = loss_and_grad(fairseq_loss, logits, target, 0.1, weights=(2.0, 3.0))
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, weights=(2.0, 3.0),
                        ignore_index=PAD, path=path)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_without_ignore_index_every_row_counts(path):
    logits, target = inputs(torch.float16)
    ref = loss_and_grad(fairseq_loss, logits, target, 0.1, ignore_index=None)
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, path=path)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
    ulp = torch.finfo(torch.float16).eps * ref[2].float().abs().clamp_min(1e-4)
    assert ((got[2].float() - ref[2].float()).abs() <= ulp).all()
    assert (got[2][target == PAD] != 0).any()  # padding rows count here
    assert got[0] > label_smoothed_nll_from_logits(logits, target, 0.1, ignore_index=PAD)[0]


@pytest.mark.parametrize("path", PATHS)
def test_chunking_does_not_change_a_bit(path):
    logits, target = inputs(torch.bfloat16)
    results = [loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD,
                             rows=rows, path=path) for rows in (1, 7, N)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)

def test_each_device_its_path_and_chunks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_path(cuda, 10**9) == "stream" and default_path(cuda) == "stream"
    assert default_path(cpu, 2**20) == "compiled" and default_path(cpu, 2**20 - 1) == "cache"
    assert chunk_rows(8000, cpu) == 65 and chunk_rows(10**9, cpu) == 1
    # CUDA: 4 chunks for 16k tokens of a 32k vocabulary (launches, not cache, bound a GPU update)
    assert -(-16384 // chunk_rows(32768, cuda)) == 4
    assert chunk_rows(32768, cpu, "stream") == chunk_rows(32768, cuda)
    # the compiled path keeps no fp32 chunk: 32k tokens of a 32k vocabulary are one chunk
    assert chunk_rows(32768, cuda, "compiled") == 32768


def traffic(path, rows=N, dtype=torch.float16):
    """(kernel launches, bytes moved per logit) of one forward and backward (op census)."""
    logits, target = inputs(dtype)
    x = logits.clone().requires_grad_()
    census = OpCensus()
    with census:
        label_smoothed_nll_from_logits(x, target, 0.1, PAD, rows=rows, path=path)[0].backward()
    summary = census.summary(1)
    return summary["launches"], summary["mb"] * 2**20 / (N * V)


def test_the_stream_path_moves_fewer_bytes_in_fewer_launches():
    """On a GPU the loss is bound by memory traffic: the stream path's passes over the logits.
    The CPU counts a cast before each half-to-fp32 softmax that CUDA's kernels do inside
    (2 + 4 bytes a logit, twice)."""
    stream_bytes, cache_bytes = traffic("stream")[1], traffic("cache")[1]
    assert cache_bytes > 70
    assert stream_bytes - 2 * 6 < 28
    # launches a chunk (forward and backward): 3 more chunks at N / 4 rows a chunk
    per_chunk = {path: (traffic(path, rows=N // 4)[0] - traffic(path)[0]) / 3
                 for path in ("stream", "cache")}
    assert per_chunk["stream"] - 2 <= 8 < 16 <= per_chunk["cache"]


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_logits_give_a_non_finite_loss(path):
    """An overflowed logit must reach the loss scaler as an overflow, as it does in fairseq."""
    logits, target = inputs(torch.float16)
    logits[3, 10] = float("inf")
    assert not torch.isfinite(fairseq_loss(logits, target, 0.1)[0])
    assert not torch.isfinite(label_smoothed_nll_from_logits(logits, target, 0.1, PAD, path=path)[0])


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


@pytest.mark.parametrize("path, per_row", [("cache", 8 + 4 + 1), ("stream", 8 + 1),
                                           ("compiled", 8 + 4 + 1)])
def test_keeps_the_half_logits_not_fp32_log_probabilities(path, per_row):
    logits, target = inputs(torch.float16)
    stock = saved_bytes(lambda x, t: fairseq_loss(x, t, 0.1), logits, target)
    fused = saved_bytes(lambda x, t: label_smoothed_nll_from_logits(x, t, 0.1, PAD, path=path),
                        logits, target)
    half_logits = N * V * 2
    assert stock >= 2 * half_logits  # fp32 log-probabilities: twice the half logits
    # the half logits themselves, then per row: target (int64), kept (bool) and for the
    # cache path the log-sum-exp (fp32)
    assert fused == half_logits + N * per_row


def test_bad_arguments_name_what_is_wrong():
    logits, target = inputs(torch.float16)
    shapes = r"logits must be \(N, V\) and target \(N,\); got \(96, 500\) and \(95,\)"
    with pytest.raises(ValueError, match=shapes):
        label_smoothed_nll_from_logits(logits, target[1:], 0.1)
    with pytest.raises(ValueError, match=r"label smoothing must be in \[0, 1\), got 1.0"):
        label_smoothed_nll_from_logits(logits, target, 1.0)
    with pytest.raises(ValueError, match="logits must be floating point, got torch.int64"):
        label_smoothed_nll_from_logits(target[:, None].expand(N, 3), target, 0.1)
    with pytest.raises(ValueError, match="fused loss path must be one of cache, stream, compiled, "
                                         "got 'gpu'"):
        label_smoothed_nll_from_logits(logits, target, 0.1, path="gpu")


def test_the_compiled_path_keeps_no_fp32_chunk():
    """The compiled kernels read the half logits and write per-row numbers or the half
    gradient: no allocation of the forward and backward passes is larger than the half
    gradient, where the stream and cache paths' fp32 chunks are twice its size."""
    logits, target = inputs(torch.float16)
    big = torch.cat([logits] * 20)  # 1,920 rows: 1.9 MB of half logits
    tgt = torch.cat([target] * 20)
    loss_and_grad(label_smoothed_nll_from_logits, big, tgt, 0.1, ignore_index=PAD, path="compiled")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_and_grad(label_smoothed_nll_from_logits, big, tgt, 0.1, ignore_index=PAD,
                      path="compiled")
    # the largest single allocation (operators that call no other)
    largest = max(e.cpu_memory_usage for e in prof.events() if not e.cpu_children)
    assert largest == big.numel() * 2  # the half gradient; an fp32 chunk would be twice that


def large_inputs(dtype, numel):
    """Logits of at least ``numel`` elements (rows of the small inputs repeated)."""
    logits, target = inputs(dtype)
    copies = -(-numel // logits.numel())
    return torch.cat([logits] * copies), torch.cat([target] * copies)


def spy_on_paths(monkeypatch):
    """The paths :func:`label_smoothed_nll_from_logits` takes, in order, as it takes them."""
    taken = []
    for path, function in list(fused_loss._FUNCTIONS.items()):
        def apply(*args, _path=path, _function=function):
            taken.append(_path)
            return _function.apply(*args)
        monkeypatch.setitem(fused_loss._FUNCTIONS, path, type(path, (), {"apply": staticmethod(apply)}))
    return taken


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_cpu_compiles_large_losses_and_chunks_small_ones(dtype, monkeypatch):
    """By default the CPU computes a loss of 2**20 logits or more with the compiled path and
    a smaller one in cache-sized chunks: the same bits as asking for each path by name."""
    # a process's first try, as a run's: other tests compiled these functions for other
    # dtypes and shapes, up to torch's recompile limit
    torch._dynamo.reset()
    monkeypatch.setattr(fused_loss, "_BUILDS", [])
    monkeypatch.setattr(fused_loss, "_compiled", {})
    taken = spy_on_paths(monkeypatch)
    large, small = large_inputs(dtype, CPU_COMPILED_MIN_NUMEL), inputs(dtype)
    for (logits, target), path in ((large, "compiled"), (small, "cache")):
        got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD)
        named = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1,
                              ignore_index=PAD, path=path)
        assert all(torch.equal(a, b) for a, b in zip(got, named))
    assert taken == ["compiled", "compiled", "cache", "cache"]


def test_past_the_recompile_limit_the_compiled_path_runs_eagerly(monkeypatch):
    """A process that asks the compiled path for more dtypes and shapes than torch's recompile
    limit allows graphs gets the same losses from the functions run eagerly, not an error."""
    torch._dynamo.reset()
    monkeypatch.setattr(fused_loss, "_compiled", {})
    # torch's config module, not monkeypatch: undoing a setattr there deletes the setting
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype in (torch.bfloat16, torch.float16):  # the second is past the limit of one graph
            logits, target = inputs(dtype)
            got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1,
                                ignore_index=PAD, path="compiled")
            ref = loss_and_grad(fairseq_loss, logits, target, 0.1)
            torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
            assert got[2].dtype == dtype
    torch._dynamo.reset()


def test_where_torch_compile_fails_the_cpu_keeps_the_cache_path(monkeypatch, caplog):
    """A machine where torch.compile cannot build the kernels (no C++ compiler) trains on:
    the first large loss logs why and every loss takes the cache path from then on."""
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Compiler: g++ is not found\nmore lines")

    monkeypatch.setattr(fused_loss, "_BUILDS", [])
    monkeypatch.setattr(fused_loss, "_compiled", {})
    monkeypatch.setattr(torch, "compile", no_compiler)
    taken = spy_on_paths(monkeypatch)
    logits, target = large_inputs(torch.bfloat16, CPU_COMPILED_MIN_NUMEL)
    with caplog.at_level("WARNING", logger=fused_loss.__name__):
        got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD)
        got_again = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1,
                                  ignore_index=PAD)
    cache = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD,
                          path="cache")
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, got_again, cache))
    assert caplog.messages == ["fused loss: torch.compile cannot build its compiled path here "
                               "(RuntimeError: Compiler: g++ is not found); the cache path is used"]
    assert taken == ["cache"] * 3 and default_path(torch.device("cpu"), 10**9) == "cache"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["stream", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_the_stream_and_compiled_paths_match_fairseq(dtype, path):
    """CUDA's half-to-fp32 softmax kernels (the default path there) and the kernels compiled
    for the GPU against fairseq's loss."""
    logits, target = (t.cuda() for t in inputs(dtype))
    ref = loss_and_grad(fairseq_loss, logits, target, 0.1, ignore_index=PAD)
    got = loss_and_grad(label_smoothed_nll_from_logits, logits, target, 0.1, ignore_index=PAD,
                        path=path)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
    ulp = torch.finfo(dtype).eps * ref[2].float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got[2].float() - ref[2].float()).abs() <= ulp).all()
    assert (got[2][target == PAD] == 0).all()
