"""Dropout on the CPU: torch's masks against the plugin's counter-based ones.

    python scripts/bench_dropout.py [--sizes 4096,32768,262144,2097152,8388608] [--repeats 50]

For each size and dtype (fp32, bf16), in one process: the median time of a training-mode
dropout (p = 0.1) forward and of a forward and backward, through ``F.dropout`` (torch's
``bernoulli_`` mask) and :func:`fairseq_fp16.core.dropout.counter_dropout`, and of a plain
elementwise multiplication (``x * x``: one read and one write pass, the floor of any dropout),
with their ratios. The counter-based kernel is compiled first by the availability check, as in a
training run. Prints a table and, as its last line, one JSON object with the ``machine``
and the ``provenance`` of the code and software measured (fairseq_fp16_tools/provenance.py).
"""

import argparse
import json

import torch
import torch.nn.functional as F

from fairseq_fp16.core.dropout import counter_dropout, counter_dropout_available

from ..provenance import describe
from .run_stats import machine
from .timing import median_ms

P = 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def forward_backward(dropout, x, grad):
    def step():
        dropout(x).backward(grad)
        x.grad = None

    return step


def bench(numel: int, dtype: torch.dtype, repeats: int) -> dict:
    x = torch.randn(numel).to(dtype).requires_grad_()
    grad = torch.randn(numel).to(dtype)
    torch_drop = lambda t: F.dropout(t, P, True)  # noqa: E731
    counter = lambda t: counter_dropout(t, P)  # noqa: E731
    with torch.no_grad():
        row = {"numel": numel,
               "torch_fwd_ms": median_ms(lambda: torch_drop(x), repeats),
               "counter_fwd_ms": median_ms(lambda: counter(x), repeats),
               "mul_ms": median_ms(lambda: x * x, repeats)}
    row["torch_fwd_bwd_ms"] = median_ms(forward_backward(torch_drop, x, grad), repeats)
    row["counter_fwd_bwd_ms"] = median_ms(forward_backward(counter, x, grad), repeats)
    row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    row["speedup_fwd"] = round(row["torch_fwd_ms"] / row["counter_fwd_ms"], 2)
    row["speedup_fwd_bwd"] = round(row["torch_fwd_bwd_ms"] / row["counter_fwd_bwd_ms"], 2)
    row["counter_fwd_over_mul"] = round(row["counter_fwd_ms"] / row["mul_ms"], 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,32768,262144,2097152,8388608",
                    help="comma-separated element counts")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args(argv)
    sizes = [int(float(s)) for s in a.sizes.split(",") if s]
    if not sizes or min(sizes) < 1 or a.repeats < 1:
        ap.error("--sizes needs element counts >= 1 and --repeats a count >= 1")
    # as a training run does: the kernel is first compiled by the availability check
    if not all(counter_dropout_available(dtype) for dtype in DTYPES.values()):
        raise SystemExit("torch.compile cannot build the counter-based mask here (logged above)")
    results = {name: [bench(n, dtype, a.repeats) for n in sizes] for name, dtype in DTYPES.items()}
    print(f"{'dtype':5} {'elements':>10} {'torch fwd':>10} {'counter':>9} {'x':>6} {'torch f+b':>10} "
          f"{'counter':>9} {'x':>6} {'mul':>8}  (ms)")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:5} {r['numel']:>10,} {r['torch_fwd_ms']:>10.3f} {r['counter_fwd_ms']:>9.3f} "
                  f"{r['speedup_fwd']:>6.1f} {r['torch_fwd_bwd_ms']:>10.3f} {r['counter_fwd_bwd_ms']:>9.3f} "
                  f"{r['speedup_fwd_bwd']:>6.1f} {r['mul_ms']:>8.3f}")
    print(json.dumps({"p": P, "threads": torch.get_num_threads(), "results": results,
                      "machine": machine(["--cpu"]), "provenance": describe()}))
    return 0
