"""The passes of a bf16 CPU update around its matrix products: against the memory's speed, and
against what else torch offers for the same work.

    python scripts/bench_cpu_passes.py [--length 9] [--batch 448] [--width 512] [--ffn 2048]
        [--heads 8] [--repeats 20]

At one transformer layer's shapes (``--length`` x ``--batch`` tokens, time-major as fairseq's
layers take them; the defaults are transformer base's at 4,096 tokens of the short corpus), each
pass as the plugin runs it in a bf16 training step:

* ``dropout+add+norm``: the residual branch's end, forward and backward: the counter-based
  dropout (p = 0.1), the residual add and the LayerNorm island (compiled from 2**18
  elements, as the plugin runs it);
* ``relu``: the feed-forward activation, forward and backward;
* ``bias grad``: a linear layer's bias gradient, the column sum of its output's gradient;
* ``head copy``: a (time, batch x heads, head) view made contiguous, as the attention's
  batched products need their operands;
* ``attention``: the attention's core (scores, fp32 softmax, weighted values, key padding
  masked) as fairseq computes it, forward and backward.

Each pass's ``mb``: every tensor it reads counted once and every tensor it writes once;
``floor_ms``: those bytes at the speed of a ``copy_`` of a tensor of the pass's size (read once,
written once), timed in the same rounds; ``over_floor``: its time over that floor (1.0: the
pass is as fast as the memory lets any pass be); ``page_faults``: the minor page faults a call
takes (fresh memory the C allocator maps for its new tensors, which the kernel zeroes page by
page; the copy writes into a tensor it keeps). Each ``alternative`` is another way torch
computes the same result (``x_current``: its time over the plugin's pass):

* ``compiled as one``: dropout, add and LayerNorm as one ``torch.compile`` graph;
* ``torch layer_norm``: torch's own kernel on the bf16 input with the fp32 weights (the
  plugin's probe refuses it where its results are not the island's: on the CPU it sums the
  weights' gradients in half precision);
* ``contiguous operands``: fairseq's attention with its batched products' operands made
  contiguous (or transposed-contiguous) first;
* ``sdpa``: torch's ``scaled_dot_product_attention`` (the fused kernel it picks on the CPU).

Every function is timed once a round, in turn, for ``--repeats`` rounds (medians; a virtual
machine's speed drifts between minutes, not within a round), each time right after an untimed
call of itself: its tensors are in the caches, as a pass finds the tensor the pass before it
wrote. Prints a table and, as its last line, one JSON object with the ``machine`` and the
``provenance``.
"""

import argparse
import json
import resource
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from fairseq_fp16.core import dropout as counter
from fairseq_fp16.core.compile import compile_dynamic
from fairseq_fp16.core.fp32_islands import COMPILED_NORM_MIN_NUMEL, _compiled_layer_norm, _island_layer_norm

from ..provenance import describe
from .run_stats import machine

DTYPE = torch.bfloat16
P = 0.1
EPS = 1e-5


def _grad_step(fn: Callable, inputs: List[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    """A forward and backward of ``fn`` on fresh leaves of ``inputs`` (views of them)."""
    def step():
        leaves = [t.detach().requires_grad_() for t in inputs]
        fn(*leaves).backward(grad)
    return step


def _residual_norm(rows, width):
    x, r = (torch.randn(rows, width).to(DTYPE) for _ in range(2))
    g = torch.randn(rows, width).to(DTYPE)
    w = torch.nn.Parameter(torch.ones(width))
    b = torch.nn.Parameter(torch.zeros(width))
    threshold, scale = counter._constants(P)

    # the island as the plugin picks it: compiled from 2**18 elements, cast around fp32 below
    island = _compiled_layer_norm if rows * width >= COMPILED_NORM_MIN_NUMEL else _island_layer_norm

    def plugin(x, r):
        return island(r + counter.counter_dropout(x, P), w, b, EPS)

    def one_graph(x, r, seed):
        dropped = counter._masked(x.reshape(-1), seed, threshold, scale).view(x.shape)
        return _island_layer_norm(r + dropped, w, b, EPS)

    compiled = compile_dynamic(one_graph)

    def torch_norm(x, r):
        return F.layer_norm(r + counter.counter_dropout(x, P), (width,), w, b, EPS)

    # forward: dropout reads x, writes x'; the add reads x', r, writes s; the norm reads s, writes y.
    # backward: the norm reads dy and s, writes ds; the dropout reads ds, writes dx
    numel = rows * width
    return {
        "pass": "dropout+add+norm", "numel": numel, "bytes": 2 * numel * (2 + 3 + 2 + 3 + 2),
        "current": _grad_step(plugin, [x, r], g),
        "alternatives": {
            "compiled as one": _grad_step(lambda x, r: compiled(x, r, counter._seed()), [x, r], g),
            "torch layer_norm": _grad_step(torch_norm, [x, r], g),
        },
    }


def _relu(rows, ffn):
    h = torch.randn(rows, ffn).to(DTYPE)
    g = torch.randn(rows, ffn).to(DTYPE)
    numel = rows * ffn
    # forward reads h, writes relu(h); backward reads dy and relu(h), writes dh
    return {"pass": "relu", "numel": numel, "bytes": 2 * numel * (2 + 3),
            "current": _grad_step(torch.relu, [h], g), "alternatives": {}}


def _bias_grad(rows, width):
    g = torch.randn(rows, width).to(DTYPE)
    return {"pass": "bias grad", "numel": rows * width, "bytes": 2 * rows * width,
            "current": lambda: g.sum(0), "alternatives": {}}


def _head_copy(length, batch, heads, head_dim):
    q = torch.randn(length, batch * heads, head_dim).to(DTYPE)
    numel = q.numel()
    return {"pass": "head copy", "numel": numel, "bytes": 2 * numel * 2,
            "current": lambda: q.transpose(0, 1).contiguous(), "alternatives": {}}


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() or t.transpose(1, 2).is_contiguous() else t.contiguous()


def _attention(length, batch, heads, head_dim):
    width = heads * head_dim
    q, k, v, g = (torch.randn(length, batch, width).to(DTYPE) for _ in range(4))
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[::3, length - max(1, length // 4):] = True  # a third of the sentences a quarter shorter

    def heads_first(t, dense=False):
        t = t.contiguous().view(length, batch * heads, head_dim).transpose(0, 1)
        return t.contiguous() if dense else t

    def fairseq(q, k, v, dense=False):
        qh, kh, vh = heads_first(q * head_dim ** -0.5, dense), heads_first(k, dense), heads_first(v, dense)
        kt = kh.transpose(1, 2)
        scores = torch.bmm(qh, kt)
        scores = scores.view(batch, heads, length, length).masked_fill(pad[:, None, None, :], float("-inf"))
        probs = F.softmax(scores.view(batch * heads, length, length), dim=-1, dtype=torch.float32).type_as(scores)
        out = torch.bmm(_dense(probs) if dense else probs, vh)
        return out.transpose(0, 1).contiguous().view(length, batch, width)

    def sdpa(q, k, v):
        def split(t):
            return t.view(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=~pad[:, None, None, :])
        return out.permute(2, 0, 1, 3).reshape(length, batch, width)

    return {
        "pass": "attention", "numel": q.numel(), "bytes": None,
        "current": _grad_step(fairseq, [q, k, v], g),
        "alternatives": {
            "contiguous operands": _grad_step(lambda q, k, v: fairseq(q, k, v, dense=True), [q, k, v], g),
            "sdpa": _grad_step(sdpa, [q, k, v], g),
        },
    }


def _copy(numel: int) -> Callable[[], torch.Tensor]:
    src, dst = torch.randn(numel).to(DTYPE), torch.empty(numel, dtype=DTYPE)
    return lambda: dst.copy_(src)


def timed_warm(fns: Dict[str, Callable], rounds: int) -> Dict[str, Tuple[float, float]]:
    """The median ms and minor page faults of each of ``fns``, each timed once a round, in
    turn, right after an untimed call of itself."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    faults: Dict[str, List[int]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {name: (statistics.median(times[name]) * 1000.0, statistics.median(faults[name])) for name in fns}


def bench(length: int, batch: int, width: int, ffn: int, heads: int, repeats: int) -> List[Dict]:
    """One row per pass (see the module docstring)."""
    if not counter.counter_dropout_available(DTYPE):
        raise SystemExit("torch.compile cannot build the counter-based dropout here (logged above)")
    rows = length * batch
    passes = [_residual_norm(rows, width), _relu(rows, ffn), _bias_grad(rows, width),
              _head_copy(length, batch, heads, width // heads), _attention(length, batch, heads, width // heads)]
    fns: Dict[str, Callable] = {}
    for p in passes:
        fns[p["pass"]] = p["current"]
        fns.update({f"{p['pass']}/{name}": fn for name, fn in p["alternatives"].items()})
    copies = {p["numel"]: _copy(p["numel"]) for p in passes if p["bytes"] is not None}
    fns.update({f"copy/{n}": fn for n, fn in copies.items()})
    timed = timed_warm(fns, repeats)
    ms = {name: t for name, (t, _) in timed.items()}
    out = []
    for p in passes:
        row = {"pass": p["pass"], "ms": round(ms[p["pass"]], 3), "page_faults": timed[p["pass"]][1],
               "mb": None, "floor_ms": None, "over_floor": None}
        if p["bytes"] is not None:
            copy_ms = ms[f"copy/{p['numel']}"]
            floor = copy_ms * p["bytes"] / (4 * p["numel"])  # a copy moves 2 bytes in, 2 out
            row.update(mb=round(p["bytes"] / 1e6, 2), floor_ms=round(floor, 3),
                       over_floor=round(ms[p["pass"]] / floor, 2),
                       copy_gbps=round(4 * p["numel"] / copy_ms / 1e6, 1))
        row["alternatives"] = {name: {"ms": round(ms[f"{p['pass']}/{name}"], 3),
                                      "x_current": round(ms[f"{p['pass']}/{name}"] / ms[p["pass"]], 2),
                                      "page_faults": timed[f"{p['pass']}/{name}"][1]}
                               for name in p["alternatives"]}
        out.append(row)
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=9, help="tokens a sentence (the batch's padded length)")
    ap.add_argument("--batch", type=int, default=448, help="sentences a batch")
    ap.add_argument("--width", type=int, default=512, help="the model's width")
    ap.add_argument("--ffn", type=int, default=2048, help="the feed-forward layer's width")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20, help="rounds; each times every function once")
    a = ap.parse_args(argv)
    if min(a.length, a.batch, a.width, a.ffn, a.heads, a.repeats) < 1 or a.width % a.heads:
        ap.error("--length, --batch, --width, --ffn, --heads and --repeats must be >= 1, and "
                 "--width a multiple of --heads")
    rows = bench(a.length, a.batch, a.width, a.ffn, a.heads, a.repeats)
    print(f"{'pass':18} {'ms':>8} {'MB':>7} {'floor ms':>9} {'x floor':>8} {'faults':>7}  alternatives (ms, x current)")
    for r in rows:
        alts = "; ".join(f"{n} {v['ms']:.3f} ({v['x_current']:.2f}x)" for n, v in r["alternatives"].items())
        print(f"{r['pass']:18} {r['ms']:>8.3f} {_fmt(r['mb'], '.2f'):>7} {_fmt(r['floor_ms'], '.3f'):>9} "
              f"{_fmt(r['over_floor'], '.2f'):>8} {r['page_faults']:>7.0f}  {alts}")
    shape = {k: getattr(a, k) for k in ("length", "batch", "width", "ffn", "heads")}
    print(json.dumps({"dtype": "bf16", "p": P, "shape": shape, "threads": torch.get_num_threads(),
                      "repeats": a.repeats, "results": rows, "machine": machine(["--cpu"]),
                      "provenance": describe()}))
    return 0
