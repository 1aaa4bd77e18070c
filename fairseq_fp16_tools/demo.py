"""make demo: fp32 vs fp16 vs bf16 on a real translation corpus, side by side.

1. builds the Debian en-de corpus offline (examples/translation/prepare_debian.py:
   DDTP package descriptions fetched with apt, aligned paragraph by paragraph and
   sentence by sentence, split by package family, joint sentencepiece 8k;
   training pairs of at most 40 pieces per side);
2. trains the same 2+2-layer d=256 transformer (FFN 512, 1,024-token batches:
   what learned fastest per minute here; the learning rate held at 1e-3 after
   update 400, which learns in 1,600 updates what inverse-sqrt did in 2,000)
   with the same seed and flags in fp32, fp16 and bf16 (scripts/compare.py:
   the same number of updates each),
   averages the weights of each run's last two checkpoints (updates 1,500 and
   1,600; a half run's fp32 masters: scripts/average_checkpoints.py; chosen
   on the valid split, it added 0.3-1.2 BLEU to every run), decodes the whole
   test split with the average and with the last checkpoint, beam 4 (chosen on
   the valid split; greedy decoding widened the gaps between runs), and scores
   both with sacrebleu, also on the sentences with short sources;
3. writes the report (scripts/report.py): the table with ratios to fp32 and
   the paired bootstrap test of each mixed run against fp32 (averaged
   checkpoints, then last ones), and the plots.

    python scripts/demo.py [--out out/demo] [--max-update 1600] [--lr-schedule floor] [--average-last 2] [--seed 1]
                           [--corpus debian|toy]

``--corpus toy`` runs the 2-minute version on a synthetic word-mapping corpus
(no network); so does the default when apt cannot reach Debian's archive.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from .paths import ROOT, script

#: The CPU recipe (examples/translation/README.md has the calibration runs behind it).
DEBIAN_MODEL = (
    "--arch transformer --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 256 "
    "--decoder-embed-dim 256 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 "
    "--encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings "
    "--encoder-normalize-before --decoder-normalize-before"
)
DEBIAN_ADAM = "--adam-betas (0.9,0.98)"
DEBIAN_LOSS_BATCH = "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 1024"
#: Learning-rate schedules (--lr-schedule). ``floor``, the demo's since 2026-12-02: warm-up to
#: 2e-3 over 100 updates, linear decay to 1e-3 at update 400, then 1e-3 to the end (fairseq's
#: polynomial_decay holds --end-learning-rate after --total-num-update); in the probes of
#: examples/translation/README.md it reached at 1,600 updates the validation loss and BLEU that
#: ``inverse-sqrt`` (the schedule of the earlier demo and of the longer recipe) reached at 2,000.
DEBIAN_SCHEDULES = {
    "floor": ("--lr 2e-3 --lr-scheduler polynomial_decay --warmup-updates 100 --total-num-update 400 "
              "--end-learning-rate 1e-3 --power 1"),
    "inverse-sqrt": "--lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 100",
}
DEBIAN_SCHEDULE = "floor"  # the demo's
DEBIAN_UPDATES = 1600
DEBIAN_GEN = "--beam 4 --max-len-a 1.2 --max-len-b 10 --post-process sentencepiece --max-tokens 8000"
DEBIAN_MAX_TRAIN_TOKENS = 40
SHORT_MAX_WORDS = 15
#: --average-last: the demo decodes the average of its last N checkpoints, written every
#: max(DEBIAN_AVERAGE_EVERY, updates // 16) updates: 100 apart in the demo's 1,600
#: (examples/translation/README.md has the probes that chose them on the valid split)
DEBIAN_AVERAGE, DEBIAN_AVERAGE_EVERY = 2, 100

TOY_MODEL = (
    "--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
    "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
    "--encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --dropout 0"
)
TOY_OPTIM = (
    "--adam-betas (0.9,0.98) --lr 1e-2 --lr-scheduler inverse_sqrt --warmup-updates 40 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 1000"
)


def prepare_debian(data_dir: Path, max_train_tokens: int = DEBIAN_MAX_TRAIN_TOKENS) -> Path:
    """The data-bin (length-filtered unless ``max_train_tokens`` is 0), or None when apt cannot
    fetch the corpus."""
    cmd = [sys.executable, str(ROOT / "examples" / "translation" / "prepare_debian.py"), "--lang", "de",
           "--out", str(data_dir), "--max-train-tokens", str(max_train_tokens)]
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        return None
    return data_dir / (f"bin-max{max_train_tokens}" if max_train_tokens else "bin")


def debian_args(updates: int, dropout: float, beam: int = 4, lenpen: float = 1.0,
                schedule: str = DEBIAN_SCHEDULE, average_last: int = 0):
    """compare.py's --train-args and --gen-args of the Debian recipe.

    --lenpen is only written when it is not fairseq's default 1.0, so the default demo's flags
    stay those of the committed report (a --keep-existing rerun finds them unchanged).
    ``average_last`` N > 0 saves a checkpoint every max(DEBIAN_AVERAGE_EVERY, updates // 16)
    updates and keeps the last N (fairseq validates at each save; training is unchanged).
    """
    every = max(200, updates // 8)
    save = (f"--save-interval-updates {max(DEBIAN_AVERAGE_EVERY, updates // 16)} "
            f"--keep-interval-updates {average_last}"
            if average_last else f"--save-interval-updates {every} --keep-interval-updates 1")
    train_args = (f"{DEBIAN_MODEL} --dropout {dropout} {DEBIAN_ADAM} {DEBIAN_SCHEDULES[schedule]} {DEBIAN_LOSS_BATCH} "
                  f"--max-update {updates} --cpu "
                  f"--log-interval 25 --validate-interval-updates {every} {save} "
                  "--no-epoch-checkpoints --num-workers 0")
    decode = f"--beam {beam}" + (f" --lenpen {lenpen}" if lenpen != 1.0 else "")
    return train_args, DEBIAN_GEN.replace("--beam 4", decode) + " --cpu"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    ap.add_argument("--corpus", choices=("debian", "toy"), default="debian")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "data" / "debian-ende",
                    help="where the Debian corpus is built and cached")
    ap.add_argument("--max-update", type=int, default=None,
                    help=f"updates per run (default: {DEBIAN_UPDATES} on Debian, 6-11 minutes of fp32 "
                    "on a 2-core CPU; 400 on the toy corpus)")
    ap.add_argument("--lr-schedule", choices=sorted(DEBIAN_SCHEDULES), default=DEBIAN_SCHEDULE,
                    help="Debian corpus: floor (default: 2e-3 after 100 warm-up updates, down to 1e-3 "
                    "at update 400, then constant) or inverse-sqrt (the earlier demo's and the longer "
                    "recipe's: 2e-3 after 100 warm-up updates, then 2e-3 * sqrt(100 / update))")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="Debian corpus: dropout (0 for the demo's few epochs; the longer recipe "
                    "in examples/translation/README.md uses 0.2)")
    ap.add_argument("--max-train-tokens", type=int, default=DEBIAN_MAX_TRAIN_TOKENS,
                    help="Debian corpus: train on the pairs of at most N pieces per side (0 = all "
                    f"pairs; default {DEBIAN_MAX_TRAIN_TOKENS}: short pairs learn fastest per minute)")
    ap.add_argument("--beam", type=int, default=4,
                    help="Debian corpus: beam size (default 4; 1 = greedy, the demo's until 2026-12-02)")
    ap.add_argument("--lenpen", type=float, default=1.0, help="Debian corpus: length penalty of the beam")
    ap.add_argument("--average-last", type=int, default=DEBIAN_AVERAGE, metavar="N",
                    help=f"Debian corpus: decode the average of the last N checkpoints' weights, saved "
                    f"every max({DEBIAN_AVERAGE_EVERY}, updates / 16) updates (default {DEBIAN_AVERAGE}; 0 = the "
                    "last checkpoint, the demo's until 2026-12-03); the report scores the last checkpoint "
                    "beside it")
    ap.add_argument("--seed", type=int, default=1,
                    help="the seed of the runs (scripts/compare.py's --seed; MODE@seedN runs keep their own)")
    ap.add_argument("--modes", default="fp32,fp16,bf16",
                    help="as scripts/compare.py's; add fp32@seed2 for the seed-to-seed control run")
    ap.add_argument("--keep-existing", action="store_true",
                    help="keep the runs a previous demo with the same flags finished (scripts/compare.py)")
    ap.add_argument("--redecode", action="store_true",
                    help="with --keep-existing: decode the kept runs again with this --beam and --lenpen")
    a = ap.parse_args(argv)
    start = time.time()
    data = None
    if a.corpus == "debian":
        print("=== [1/3] data: Debian package descriptions, English->German (built once, then cached)",
              flush=True)
        if a.max_train_tokens < 0:
            ap.error(f"--max-train-tokens must be >= 0 (0 = all pairs), got {a.max_train_tokens}")
        if a.beam < 1:
            ap.error(f"--beam must be >= 1, got {a.beam}")
        if a.average_last < 0:
            ap.error(f"--average-last must be >= 0 (0 = the last checkpoint), got {a.average_last}")
        data = prepare_debian(a.data_dir, a.max_train_tokens)
        if data is None:
            print("=== the Debian corpus could not be built (above); running the synthetic-corpus "
                  "demo instead", flush=True)
    if data is not None:
        updates = a.max_update or DEBIAN_UPDATES
        train_args, gen_args = debian_args(updates, a.dropout, a.beam, a.lenpen, a.lr_schedule, a.average_last)
        extra = ["--short-max-words", str(SHORT_MAX_WORDS), "--average-last", str(a.average_last)]
        out = a.out / "debian-ende"
    else:
        from .corpus import write_corpus

        print("=== [1/3] data: synthetic word-mapping corpus (2,000 train / 100 valid / 100 test pairs)")
        data = write_corpus(a.out / "toy" / "data")
        updates = a.max_update or 400
        train_args = (f"{TOY_MODEL} {TOY_OPTIM} --max-update {updates} --cpu --log-interval 20 "
                      "--no-epoch-checkpoints")
        gen_args, extra = "--beam 4 --cpu", []
        out = a.out / "toy"
    print(f"    data-bin: {data}")
    seeds = "same seed" + (" (control runs: their own)" if "@seed" in a.modes else "")
    print(f"=== [2/3] training and decoding {a.modes}: {updates} updates each on the CPU, {seeds} "
          "and flags; fairseq's progress follows", flush=True)
    subprocess.run([sys.executable, script("compare.py"), str(data), "--out", str(out / "runs"),
                    "--modes", a.modes, "--seed", str(a.seed), "--train-args", train_args,
                    "--gen-args", gen_args, *extra,
                    *(["--keep-existing"] if a.keep_existing else []),
                    *(["--redecode"] if a.redecode else [])], check=True)
    print("=== [3/3] report: table, paired bootstrap against fp32, plots", flush=True)
    subprocess.run([sys.executable, script("report.py"), str(out / "runs")], check=True)
    print(f"=== demo done in {(time.time() - start) / 60:.1f} min; report and plots in {out / 'runs'}")

