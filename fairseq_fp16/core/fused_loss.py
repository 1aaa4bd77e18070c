"""Label-smoothed cross-entropy from half-precision logits, in fp32, without an fp32 copy.

fairseq computes the loss of a half model in fp32 by taking ``log_softmax(logits,
dtype=float32)``: an fp32 tensor of log-probabilities, twice the size of the half
logits, is kept for the backward pass, and the backward pass makes more tensors of
that size (the gradients of the gather and of the sum, then of the log-softmax)
before the logits' gradient is rounded to half. With an 8k-32k vocabulary these
are the largest tensors of a translation step. apex's ``xentropy`` extension
(``SoftmaxCrossEntropyLoss``, half inputs, fp32 math) was NVIDIA's answer; this is
the same idea in torch operations:

* the forward pass works through the rows in chunks: each chunk is upcast to fp32,
  its log-sum-exp, target log-probability and log-probability sum are taken, and
  the chunk is dropped. It keeps the logits as they are (half) and one fp32 number
  per row;
* the backward pass recomputes each chunk's softmax in fp32 from the kept logits,
  forms the gradient in closed form and rounds it to the logits' dtype once, as the
  stock path does at its last cast.

Three ways through the chunks (``path``); by default CUDA takes ``stream``, the CPU
``compiled`` for logits of :data:`CPU_COMPILED_MIN_NUMEL` elements or more and ``cache`` for
smaller ones or where torch.compile cannot build the kernels (tried once, on the first logits
that would take them; the run logs why and goes on with ``cache``):

* ``cache``: chunks small enough to stay in a core's L2 cache, worked on in
  place in fp32 (upcast, log-sum-exp, subtract, exponentiate, scale), so each pass costs
  cache bandwidth, not memory bandwidth;
* ``stream`` (CUDA's): a few large chunks through as few passes over memory as torch's
  kernels allow: the forward pass is ``log_softmax(chunk, dtype=float32)`` (one kernel that
  reads the half logits, on CUDA) with a gather and a row sum; the backward pass is
  ``softmax(chunk, dtype=float32)`` and one ``addcmul`` that writes the half gradient, the
  target entries set from the gathered probabilities. About 30 bytes move per logit where
  the ``cache`` steps would move about 90 (``tests/core/test_fused_loss.py`` counts them);
* ``compiled``: the same arithmetic as the cache path, each pass compiled with
  ``torch.compile`` into kernels that read the half logits and write only per-row numbers
  (forward) or the half gradient (backward). No fp32 chunk exists (the tests check the
  largest allocation), so one chunk takes all the rows. The first batch pays the compilation
  (CPU: a C++ compiler); after it, fewer passes make it the CPU's faster path.

The numbers are fairseq's ``label_smoothed_nll_loss`` (``epsilon = 0``: the plain
negative log-likelihood of ``cross_entropy``): the same fp32 arithmetic on the same
upcast values, up to the order of fp32 additions.
"""

import logging
from typing import List, Optional, Tuple

import torch

from .compile import dispatch_mode_active

__all__ = ["CPU_COMPILED_MIN_NUMEL", "PATHS", "label_smoothed_nll_from_logits", "chunk_rows",
           "default_path"]

logger = logging.getLogger(__name__)

PATHS = ("cache", "stream", "compiled")

# fp32 elements upcast at a time: for the cache path a chunk that stays in a CPU core's L2
# cache; for the stream path few chunks: each costs 8 kernel launches (forward and backward),
# and a transformer update on a fast GPU is bound by the host's launches. 2**27 elements
# (512 MB of fp32) is 4 chunks for 16k target tokens and a 32k vocabulary.
CPU_CHUNK_ELEMENTS = 1 << 19
CUDA_CHUNK_ELEMENTS = 1 << 27
# the compiled path keeps no fp32 chunk; its chunks only keep kernels' element offsets in int32
COMPILED_CHUNK_ELEMENTS = 1 << 30


#: the fewest logits the CPU compiles by default: below, the compile's seconds buy little
CPU_COMPILED_MIN_NUMEL = 1 << 20
#: whether torch.compile built the compiled path here (tried once; empty: not tried yet)
_BUILDS: List[bool] = []


def default_path(device: torch.device, numel: int = 0) -> str:
    """``stream`` on CUDA; elsewhere ``compiled`` for ``numel`` logits of at least
    :data:`CPU_COMPILED_MIN_NUMEL` unless torch.compile failed to build it here, else ``cache``."""
    if device.type == "cuda":
        return "stream"
    return "compiled" if numel >= CPU_COMPILED_MIN_NUMEL and _BUILDS != [False] else "cache"


def chunk_rows(vocab_size: int, device: torch.device, path: Optional[str] = None) -> int:
    """Rows of logits upcast to fp32 at a time."""
    path = path or default_path(device)
    elements = {"stream": CUDA_CHUNK_ELEMENTS, "compiled": COMPILED_CHUNK_ELEMENTS}.get(
        path, CPU_CHUNK_ELEMENTS)
    return max(1, elements // max(1, vocab_size))


def _loss_from_rows(nll, smooth, target, epsilon, ignore_index, vocab):
    """(loss, nll, kept-row mask or None): the sums over the kept rows, from the per-row NLL
    and negated log-probability sums."""
    keep = target.ne(ignore_index) if ignore_index is not None else None
    if keep is not None:
        nll.masked_fill_(~keep, 0.0)
        smooth.masked_fill_(~keep, 0.0)
    nll_sum, smooth_sum = nll.sum(), smooth.sum()
    eps_i = epsilon / (vocab - 1)
    return (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum, nll_sum, keep


def _row_weights(ctx, grad_loss, grad_nll, vocab):
    """(w_t, w_s, coef_p): a row's gradient is ``coef_p * p - w_s - w_t * onehot(target)``
    with ``p = softmax(x)``: d/dx of ``w_t * nll + w_s * smooth``."""
    eps_i = ctx.epsilon / (vocab - 1)
    w_t = grad_loss.float() * (1.0 - ctx.epsilon - eps_i) + grad_nll.float()
    w_s = grad_loss.float() * eps_i
    return w_t, w_s, w_t + w_s * vocab


def _finish_forward(ctx, logits, target, lse, nll, smooth, epsilon, ignore_index, rows):
    """(loss, nll): the sums over the kept rows, with what the backward pass of a path that
    keeps the rows' log-sum-exp needs saved on ``ctx``."""
    loss, nll_sum, keep = _loss_from_rows(nll, smooth, target, epsilon, ignore_index, logits.size(-1))
    ctx.save_for_backward(logits, target, lse, keep)
    ctx.epsilon, ctx.rows = epsilon, rows
    return loss, nll_sum


def _start_backward(ctx, grad_loss, grad_nll):
    """(logits, target, lse, keep, (w_t, w_s, coef_p)) of :func:`_finish_forward`'s ``ctx``."""
    logits, target, lse, keep = ctx.saved_tensors
    return logits, target, lse, keep, _row_weights(ctx, grad_loss, grad_nll, logits.size(-1))


class _CacheChunks(torch.autograd.Function):
    """(loss, nll) summed over the rows not equal to ``ignore_index``, both fp32; the
    ``cache`` path."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, rows):
        n = logits.size(0)
        lse = logits.new_empty(n, dtype=torch.float32)
        nll = logits.new_empty(n, dtype=torch.float32)
        smooth = logits.new_empty(n, dtype=torch.float32)
        for start in range(0, n, rows):
            chunk = logits[start:start + rows]
            x = chunk.float()
            row_lse = torch.logsumexp(x, dim=-1)
            # log-probabilities, as fairseq's loss sees them; in place unless x is the input
            lprobs = x.sub_(row_lse[:, None]) if x is not chunk else x - row_lse[:, None]
            lse[start:start + rows] = row_lse
            picked = lprobs.gather(-1, target[start:start + rows, None]).squeeze(-1)
            nll[start:start + rows] = picked.neg_()
            smooth[start:start + rows] = lprobs.sum(-1).neg_()
        return _finish_forward(ctx, logits, target, lse, nll, smooth, epsilon, ignore_index, rows)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, lse, keep, (w_t, w_s, coef_p) = _start_backward(ctx, grad_loss, grad_nll)
        n = logits.size(0)
        grad = torch.empty_like(logits)
        for start in range(0, n, ctx.rows):
            chunk = logits[start:start + ctx.rows]
            rows = chunk.size(0)
            x, row_lse = chunk.float(), lse[start:start + rows, None]
            g = (x.sub_(row_lse) if x is not chunk else x - row_lse).exp_()  # softmax, fp32
            g.mul_(coef_p).sub_(w_s)
            g.scatter_add_(-1, target[start:start + rows, None], (-w_t).expand(rows, 1))
            if keep is not None:
                g.mul_(keep[start:start + rows, None])
            grad[start:start + rows] = g  # one rounding to the logits' dtype
        return grad, None, None, None, None


class _StreamChunks(torch.autograd.Function):
    """As :class:`_CacheChunks`, the ``stream`` path."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, rows):
        n, vocab = logits.shape
        nll = logits.new_empty(n, 1, dtype=torch.float32)
        smooth = logits.new_empty(n, dtype=torch.float32)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            lprobs = torch.log_softmax(logits[start:stop], -1, dtype=torch.float32)
            torch.gather(lprobs, -1, target[start:stop, None], out=nll[start:stop])
            torch.sum(lprobs, -1, out=smooth[start:stop])
        nll, smooth = nll.view(n).neg_(), smooth.neg_()
        loss, nll_sum, keep = _loss_from_rows(nll, smooth, target, epsilon, ignore_index, vocab)
        ctx.save_for_backward(logits, target, keep)
        ctx.epsilon, ctx.rows = epsilon, rows
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, keep = ctx.saved_tensors
        n, vocab = logits.shape
        w_t, w_s, coef_p = _row_weights(ctx, grad_loss, grad_nll, vocab)
        # per row (padding rows weigh nothing): grad = coef * p - w_s, target entry - w_t
        coef, neg_w_s, neg_w_st = coef_p.view(1, 1), -w_s.view(1, 1), -(w_s + w_t).view(1, 1)
        if keep is not None:
            kept = keep[:, None].float()
            coef, neg_w_s, neg_w_st = coef * kept, neg_w_s * kept, neg_w_st * kept
        grad = torch.empty_like(logits)
        at_target = logits.new_empty(n, 1)
        for start in range(0, n, ctx.rows):
            stop = min(n, start + ctx.rows)
            rows = slice(start, stop) if keep is not None else slice(None)
            p = torch.softmax(logits[start:stop], -1, dtype=torch.float32)
            t = target[start:stop, None]
            # each entry rounded to the logits' dtype once
            torch.addcmul(neg_w_st[rows], p.gather(-1, t), coef[rows], out=at_target[start:stop])
            torch.addcmul(neg_w_s[rows], p, coef[rows], out=grad[start:stop])
            grad[start:stop].scatter_(-1, t, at_target[start:stop])
        return grad, None, None, None, None


def _rows_forward(x, target):
    """(lse, nll, smooth) of each row of ``x``, in fp32: the cache path's arithmetic."""
    lse = torch.logsumexp(x.float(), dim=-1)
    lprobs = x.float() - lse[:, None]
    return lse, lprobs.gather(-1, target[:, None]).squeeze(-1).neg(), lprobs.sum(-1).neg()


def _rows_backward(x, target, lse, coef, w_s, w_t):
    """The gradient rows ``coef * p - w_s - w_t * onehot(target)``, rounded to ``x.dtype`` once."""
    g = torch.exp(x.float() - lse[:, None]) * coef[:, None] - w_s[:, None]
    hit = torch.arange(x.size(-1), device=x.device)[None, :] == target[:, None]
    return torch.where(hit, g - w_t[:, None], g).to(x.dtype)


_compiled = {}


def _run_compiled(fn, *args):
    """``fn`` compiled (once); eagerly under a Python dispatch mode, where torch.compile
    compiles nothing and would run ``fn`` eagerly from then on (:mod:`.compile`). Past torch's
    recompile limit (a process asking for many dtypes and shapes) torch runs ``fn`` eagerly."""
    if dispatch_mode_active():
        return fn(*args)
    if fn not in _compiled:
        # not compile_dynamic: threads chosen per call would split a few rows' vocabulary sums
        # across cores, and a row's bits would depend on its chunk; compiled for the first real
        # logits (under ``auto``, at least CPU_COMPILED_MIN_NUMEL elements; a forced ``compiled``
        # compiles for whatever size comes first) the loops run over rows on every core
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn](*args)


def _compiled_builds(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether torch.compile builds the compiled path's forward and backward here: tried once,
    on the first logits given (compiled code is sized by its first inputs), and logged where
    it fails. True under a Python dispatch mode, where the path runs eagerly (untried)."""
    if _BUILDS or dispatch_mode_active():
        return _BUILDS != [False]
    try:
        with torch.no_grad():
            lse = _run_compiled(_rows_forward, logits, target)[0]
            _run_compiled(_rows_backward, logits, target, lse, lse, lse, lse)
        _BUILDS.append(True)
    except Exception as e:  # no C++ compiler, or inductor cannot build the kernels here
        _BUILDS.append(False)
        logger.warning("fused loss: torch.compile cannot build its compiled path here (%s: %s); "
                       "the cache path is used", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return _BUILDS[0]


class _CompiledChunks(torch.autograd.Function):
    """As :class:`_CacheChunks`, the ``compiled`` path."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, rows):
        parts = [_run_compiled(_rows_forward, logits[start:start + rows], target[start:start + rows])
                 for start in range(0, logits.size(0), rows)]
        lse, nll, smooth = (torch.cat(p) if len(parts) > 1 else p[0] for p in zip(*parts))
        return _finish_forward(ctx, logits, target, lse, nll, smooth, epsilon, ignore_index, rows)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, lse, keep, (w_t, w_s, coef_p) = _start_backward(ctx, grad_loss, grad_nll)
        n = logits.size(0)
        kept = keep.float() if keep is not None else lse.new_ones(n)
        coef, w_s, w_t = coef_p * kept, w_s * kept, w_t * kept  # per row: padding weighs nothing
        grads = [_run_compiled(_rows_backward, logits[rows], target[rows], lse[rows], coef[rows],
                               w_s[rows], w_t[rows])
                 for rows in (slice(start, start + ctx.rows) for start in range(0, n, ctx.rows))]
        return torch.cat(grads) if len(grads) > 1 else grads[0], None, None, None, None


_FUNCTIONS = {"cache": _CacheChunks, "stream": _StreamChunks, "compiled": _CompiledChunks}


def label_smoothed_nll_from_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    epsilon: float,
    ignore_index: Optional[int] = None,
    rows: Optional[int] = None,
    path: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """fairseq's ``label_smoothed_nll_loss(log_softmax(logits), ...)`` with ``reduce=True``.

    Args:
        logits: ``(N, V)``, any floating dtype (fp16/bf16 stay as they are).
        target: ``(N,)`` class indices.
        epsilon: label smoothing (0: the negative log-likelihood).
        ignore_index: rows whose target equals it count for nothing (fairseq's padding).
        rows: rows upcast to fp32 at a time (default: :func:`chunk_rows`).
        path: one of :data:`PATHS` (default: :func:`default_path`, by the logits' device and
            size; ``cache`` where the compiled path it picks does not build).

    Returns:
        ``(loss, nll_loss)``, fp32 scalars summed over the rows; ``loss`` is
        differentiable with respect to ``logits``, its gradient in ``logits.dtype``.

    Raises:
        ValueError: if the shapes or the dtype do not fit, ``epsilon`` is outside [0, 1) or
            ``path`` is not one of :data:`PATHS`.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (N, V) and target (N,); got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {epsilon}")
    if path is not None and path not in _FUNCTIONS:
        raise ValueError(f"fused loss path must be one of {', '.join(PATHS)}, got {path!r}")
    logits, target = logits.contiguous(), target.contiguous()
    if path is None:
        path = default_path(logits.device, logits.numel())
        if path == "compiled" and not _compiled_builds(logits, target):
            path = "cache"
    rows = rows or chunk_rows(logits.size(-1), logits.device, path)
    return _FUNCTIONS[path].apply(logits, target, float(epsilon), ignore_index, int(rows))
