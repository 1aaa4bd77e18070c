#!/usr/bin/env python
"""make demo: fp32 vs fp16 vs bf16 on the same model, data and seed, side by side.

Builds the synthetic corpus (scripts/make_toy_corpus.py), trains a small
transformer in each precision with scripts/compare.py, and writes the report
with scripts/report.py: a table (throughput, peak memory, losses, loss scale,
skipped updates, BLEU with a paired bootstrap test against fp32) and plots.

    python scripts/demo.py [--out out/demo] [--max-update 400]
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

MODEL = (
    "--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
    "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
    "--encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --dropout 0"
)
OPTIM = (
    "--adam-betas (0.9,0.98) --lr 1e-2 --lr-scheduler inverse_sqrt --warmup-updates 40 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 1000"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    ap.add_argument("--max-update", type=int, default=400)
    ap.add_argument("--modes", default="fp32,fp16,bf16")
    a = ap.parse_args()
    from make_toy_corpus import write_corpus

    print("=== [1/3] data: synthetic word-mapping corpus (2,000 train / 100 valid / 100 test pairs)")
    data = write_corpus(a.out / "data")
    print(f"    binarised with fairseq-preprocess: {data}")
    print(f"=== [2/3] training and decoding {a.modes} ({a.max_update} updates each, CPU)")
    train_args = f"{MODEL} {OPTIM} --max-update {a.max_update} --cpu --log-interval 20 --no-epoch-checkpoints"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), str(data), "--out", str(a.out / "runs"),
                    "--modes", a.modes, "--train-args", train_args, "--gen-args", "--beam 4 --cpu"], check=True)
    print("=== [3/3] report")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(a.out / "runs")], check=True)


if __name__ == "__main__":
    main()
