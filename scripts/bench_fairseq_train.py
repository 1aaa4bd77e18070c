#!/usr/bin/env python
"""Time per update of real fairseq-train runs, per precision, on the same model and data.

    python scripts/bench_fairseq_train.py [DATA_BIN] [--updates 30] [--modes ...] [--model "..."]

Without DATA_BIN the synthetic corpus (scripts/make_toy_corpus.py) is built in a
temporary folder. Each mode runs ``fairseq-train --cpu`` (or on CUDA with
--cuda) for --updates updates without validation or checkpoints; ms/update is
the mean of fairseq's per-interval rate over the intervals after the first.
The modes run interleaved --repeats times; each reports its median. Prints a
table and, as its last line, one JSON object.
"""

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

MODES = {
    "fp32": [],
    "fp16": ["--fp16"],
    "fp16-native": ["--fp16", "--half-matmul", "native"],
    "fp16-fp32acc": ["--fp16", "--half-matmul", "fp32-accumulate"],
    "bf16": ["--bf16"],
    "bf16-native": ["--bf16", "--half-matmul", "native"],
    "bf16-fp32acc": ["--bf16", "--half-matmul", "fp32-accumulate"],
}
MODEL = ("--arch transformer --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 "
         "--decoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 "
         "--encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings --max-tokens 2048")


def run(data, flags, updates, model, device):
    cmd = [str(Path(sys.executable).parent / "fairseq-train"), str(data), "--user-dir", str(ROOT / "fairseq_fp16"),
           "--task", "translation_fp16", "--optimizer", "fp16_adam", "--lr", "1e-3",
           *shlex.split(model), "--max-update", str(updates), "--log-format", "simple",
           "--log-interval", "5", "--no-save", "--disable-validation", "--seed", "1", *device, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"fairseq-train {' '.join(flags)} failed:\n{out.stderr[-2000:]}")
    ups = [float(x) for x in re.findall(r"\| train_inner \|.* ups=([0-9.]+)", out.stdout + out.stderr)]
    steady = ups[1:] or ups
    return 1000.0 / (sum(steady) / len(steady))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", help="data-bin directory (default: the synthetic corpus)")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--modes", default="fp32,fp16,fp16-native,bf16,bf16-native,bf16-fp32acc")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--cuda", action="store_true", help="train on the GPU instead of --cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--native-updates", type=int, default=10,
                    help="updates for fp16-native on a CPU without fp16 units (very slow)")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; valid: {', '.join(MODES)}")
    data = a.data
    if data is None:
        from make_toy_corpus import write_corpus

        data = write_corpus(Path(tempfile.mkdtemp(prefix="bench_toy_")))
    device = [] if a.cuda else ["--cpu"]
    from fairseq_fp16.core.half_matmul import cpu_has_native_half
    import torch

    import statistics

    runs = {m: [] for m in modes}
    for _ in range(a.repeats):
        for mode in modes:
            slow = mode == "fp16-native" and not a.cuda and not cpu_has_native_half(torch.float16)
            if slow and runs[mode]:
                continue  # once is enough for the slow one
            runs[mode].append(run(data, MODES[mode], a.native_updates if slow else a.updates, a.model, device))
    ms = {m: statistics.median(v) for m, v in runs.items()}
    for mode in modes:
        print(f"{mode:14s} {ms[mode]:9.1f} ms/update  x{ms[mode] / ms[modes[0]]:.2f} of {modes[0]}  "
              f"(runs: {', '.join(f'{v:.0f}' for v in runs[mode])})", flush=True)
    print(json.dumps({
        "model": a.model, "device": "cuda" if a.cuda else "cpu", "updates": a.updates,
        "repeats": a.repeats, "statistic": "median",
        "cpu_native_fp16": cpu_has_native_half(torch.float16),
        "cpu_native_bf16": cpu_has_native_half(torch.bfloat16),
        "ms_per_update": {k: round(v, 1) for k, v in ms.items()},
        "ratio_to_first": {k: round(v / ms[modes[0]], 3) for k, v in ms.items()},
    }))


if __name__ == "__main__":
    main()
