"""Shared fixtures: a tiny synthetic corpus and helpers that run the real CLIs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from compare import parse_json_records  # noqa: E402  (the comparison runner's log parser)

BIN = Path(sys.executable).parent
USER_DIR = str(ROOT / "fairseq_fp16")

TINY_MODEL = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--share-all-embeddings", "--dropout", "0.1",
]
TRAIN = [
    "--task", "translation_fp16", "--optimizer", "fp16_adam", "--adam-betas", "(0.9, 0.98)",
    "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "1000", "--cpu", "--seed", "1", "--log-format", "json",
    "--log-interval", "1", "--no-epoch-checkpoints", "--num-workers", "0",
]


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    from make_toy_corpus import write_corpus

    return write_corpus(tmp_path_factory.mktemp("toy"), train=2000, valid=100, test=100)


def run_cli(tool, args, check=True):
    # faulthandler: a crash in C++ code prints every thread's Python stack to stderr
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def train(data, save_dir, *extra, user_dir=True, model=TINY_MODEL, check=True):
    """Run fairseq-train; returns (process, per-update train_inner records)."""
    common = TRAIN
    if not user_dir:  # stock fairseq: its own task and optimizer
        common = [{"translation_fp16": "translation", "fp16_adam": "adam"}.get(a, a) for a in TRAIN]
    args = [data, *model, *common, "--save-dir", save_dir, *extra]
    if user_dir:
        args += ["--user-dir", USER_DIR]
    proc = run_cli("fairseq-train", args, check=check)
    return proc, parse_json_records(proc.stdout + proc.stderr)["train_inner"]
