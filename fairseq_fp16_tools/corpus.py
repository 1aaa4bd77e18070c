"""Write a small synthetic parallel corpus and binarise it with fairseq-preprocess.

The "translation" is deterministic and learnable in a few hundred updates: each
source word ``wN`` maps to the target word ``vN``, in the same order. Used by the tests and by ``make demo`` until a real corpus is set up.

    python scripts/make_toy_corpus.py OUT_DIR [--train 2000 --valid 100 --test 100] [--vocab 40] \
        [--lengths 3,12]

``--vocab N`` words a side (a joined dictionary of about 2N): the tests' 40 keep
the model tiny; benchmarks use a translation-sized vocabulary, whose output layer
and loss are a real run's largest tensors. ``--lengths MIN,MAX``: words a sentence, uniform
(default 3-12, a mean of 7.5; WMT'14 en-de's sentences average about 25 words).

Writes ``OUT_DIR/raw/{train,valid,test}.{src,tgt}`` and ``OUT_DIR/bin``.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path


def make_pairs(n: int, rng: random.Random, vocab: int = 40, min_len: int = 3, max_len: int = 12):
    pairs = []
    for _ in range(n):
        words = [rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))]
        src = " ".join(f"w{w}" for w in words)
        tgt = " ".join(f"v{w}" for w in words)
        pairs.append((src, tgt))
    return pairs


def write_corpus(out: Path, train: int = 2000, valid: int = 100, test: int = 100, seed: int = 1,
                 vocab: int = 40, lengths: tuple = (3, 12)) -> Path:
    """Write the raw corpus and run fairseq-preprocess; returns the data-bin dir."""
    rng = random.Random(seed)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("valid", valid), ("test", test)):
        pairs = make_pairs(n, rng, vocab, *lengths)
        (raw / f"{split}.src").write_text("".join(s + "\n" for s, _ in pairs))
        (raw / f"{split}.tgt").write_text("".join(t + "\n" for _, t in pairs))
    dest = out / "bin"
    if not (dest / "train.src-tgt.src.bin").exists():
        subprocess.run(
            [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "src",
             "--target-lang", "tgt", "--trainpref", str(raw / "train"),
             "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"),
             "--destdir", str(dest), "--joined-dictionary", "--workers", "1"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    return dest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--valid", type=int, default=100)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=40, help="words a side")
    ap.add_argument("--lengths", default="3,12", help="MIN,MAX words a sentence (default 3,12)")
    a = ap.parse_args(argv)
    if a.vocab < 1:
        ap.error(f"--vocab must be >= 1, got {a.vocab}")
    try:
        lengths = tuple(int(x) for x in a.lengths.split(","))
    except ValueError:
        lengths = ()
    if len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]:
        ap.error(f"--lengths must be MIN,MAX with 1 <= MIN <= MAX, got {a.lengths!r}")
    print(write_corpus(a.out, a.train, a.valid, a.test, a.seed, a.vocab, lengths))

