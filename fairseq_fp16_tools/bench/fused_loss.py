"""The fused loss's paths on one device, against fairseq's loss, forward and backward.

    python scripts/bench_fused_loss.py [--shapes 1024x8000,4096x8000,4096x32000] [--repeats 5]

For each shape (target tokens x vocabulary) and half dtype, in one process: the median time of
a label-smoothed loss (epsilon 0.1, fairseq's padding index) and its backward pass from half
logits, through fairseq's loss (``log_softmax(logits, dtype=float32)`` and
``label_smoothed_nll_loss``) and each path of
:func:`fairseq_fp16.core.fused_loss.label_smoothed_nll_from_logits`, the path the device takes
by default, and a read-and-write pass over the logits (``x * x``: the floor of a pass). The
compiled path is compiled before it is timed. Prints a table and, as its last line, one JSON
object with the ``machine`` and the ``provenance`` of the code measured.
"""

import argparse
import json

import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_fp16.core.fused_loss import PATHS, default_path, label_smoothed_nll_from_logits

from ..provenance import describe
from .run_stats import machine
from .timing import median_ms

EPSILON, PAD = 0.1, 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fairseq_loss(logits, target):
    lprobs = torch.log_softmax(logits, -1, dtype=torch.float32)
    return label_smoothed_nll_loss(lprobs, target[:, None], EPSILON, ignore_index=PAD)


def forward_backward(loss_fn, logits, target):
    def step():
        x = logits.detach().requires_grad_()
        loss_fn(x, target)[0].backward()

    return step


def bench(rows: int, vocab: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    target = torch.randint(4, vocab, (rows,), generator=g).to(device)
    target[-rows // 10:] = PAD  # a batch's padding
    timed = lambda fn: median_ms(fn, repeats, warmup=1)  # noqa: E731 (the compile in the warm-up)
    result = {"rows": rows, "vocab": vocab, "default": default_path(device, logits.numel()),
              "fairseq_ms": timed(forward_backward(fairseq_loss, logits, target))}
    for path in PATHS:
        loss = lambda x, t, p=path: label_smoothed_nll_from_logits(x, t, EPSILON, PAD, path=p)  # noqa: E731
        result[f"{path}_ms"] = timed(forward_backward(loss, logits, target))
    with torch.no_grad():
        result["pass_ms"] = timed(lambda: logits * logits)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    result["default_over_fairseq"] = round(result[f"{result['default']}_ms"] / result["fairseq_ms"], 3)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1024x8000,4096x8000,4096x32000",
                    help="comma-separated TOKENSxVOCAB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cuda", action="store_true", help="on the GPU instead of the CPU")
    a = ap.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",") if s]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes) or a.repeats < 1:
        ap.error("--shapes needs TOKENSxVOCAB pairs of counts >= 1 and --repeats a count >= 1")
    device = torch.device("cuda" if a.cuda else "cpu")
    results = {name: [bench(r, v, dtype, device, a.repeats) for r, v in shapes]
               for name, dtype in DTYPES.items()}
    print(f"{'dtype':5} {'shape':>12} {'fairseq':>9} " + " ".join(f"{p:>9}" for p in PATHS)
          + f" {'default':>9} {'x fairseq':>9} {'x * x':>7}  (ms)")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:5} {r['rows']:>6}x{r['vocab']:<5} {r['fairseq_ms']:>9.1f} "
                  + " ".join(f"{r[p + '_ms']:>9.1f}" for p in PATHS)
                  + f" {r['default']:>9} {r['default_over_fairseq']:>9.2f} {r['pass_ms']:>7.2f}")
    print(json.dumps({"epsilon": EPSILON, "threads": torch.get_num_threads(), "results": results,
                      "machine": machine(["--cuda"] if a.cuda else ["--cpu"]),
                      "provenance": describe()}))
    return 0
