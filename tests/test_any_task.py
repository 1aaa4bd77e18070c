"""The precision features work for any fairseq task, not only translation_fp16: a language model
trained with --task language_modeling and the plugin loaded gets the same fp32 islands, CPU
matrix-product path, optimizer and log lines."""

import re
import subprocess
import sys

import pytest
import torch

from conftest import USER_DIR, parse_json_records, run_cli
from fairseq_fp16.core.half_matmul import cpu_has_native_half

pytestmark = pytest.mark.slow

LM = ["--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
      "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
      "--tokens-per-sample", "32", "--sample-break-mode", "none", "--max-tokens", "512",
      "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--seed", "1", "--log-format", "json",
      "--log-interval", "1", "--no-save", "--disable-validation", "--num-workers", "0",
      "--max-update", "6", "--user-dir", USER_DIR]


@pytest.fixture(scope="module")
def lm_data(toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    raw = toy_data.parent / "raw"
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref",
                    str(raw / "train.src"), "--validpref", str(raw / "valid.src"), "--destdir", str(out),
                    "--workers", "1"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def runs(lm_data):
    out = {}
    for name, flags in [("fp32", []), ("fp16", ["--fp16"]), ("bf16", ["--bf16"])]:
        proc = run_cli("fairseq-train", [lm_data, *LM, *flags])
        out[name] = (proc.stdout + proc.stderr, parse_json_records(proc.stdout + proc.stderr)["train_inner"])
    return out


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_language_model_gets_the_half_precision_path(runs, name, dtype):
    log, recs = runs[name]
    native = cpu_has_native_half(dtype)
    path = "native kernels" if native else "fp32 accumulation, rounded to half"
    assert f"CPU {name} matrix products: {path} (--half-matmul auto)" in log
    if not native:
        assert "every half-precision matrix product of the first training step accumulated in fp32" in log
    assert f"fairseq_fp16: {name} model, fp32 master weights" in log
    assert "attention: fairseq's own, softmax in fp32 (--attention-path auto)" in log
    assert [r["num_updates"] for r in recs] == list(range(1, 7))


def test_a_language_model_in_half_precision_tracks_fp32(runs):
    fp32 = [r["loss"] for r in runs["fp32"][1]]
    assert "fp32 master weights" not in runs["fp32"][0]
    for name in ("fp16", "bf16"):
        half = [r["loss"] for r in runs[name][1]]
        assert all(abs(a - b) < 0.05 for a, b in zip(fp32, half)), (name, fp32, half)
        assert half[-1] < half[0] - 0.2


@pytest.fixture(scope="module")
def lm_checkpoint(lm_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("lm-save")
    run_cli("fairseq-train", [lm_data, *[a for a in LM if a != "--no-save"], "--save-dir", save,
                              "--no-epoch-checkpoints"])
    return save / "checkpoint_last.pt"


def _eval_lm(lm_data, checkpoint, *flags):
    proc = run_cli("fairseq-eval-lm", [lm_data, "--path", checkpoint, "--gen-subset", "valid", "--cpu",
                                       "--tokens-per-sample", "32", "--max-tokens", "512", "--user-dir",
                                       USER_DIR, *flags])
    text = proc.stdout + proc.stderr
    return float(re.search(r"Loss \(base 2\): ([\d.]+), Perplexity", text)[1]), text


def test_eval_lm_evaluates_in_the_half_precision_asked_for(lm_data, lm_checkpoint):
    """fairseq-eval-lm casts the model for --fp16 only; with the plugin --bf16 evaluates in bf16:
    a loss near fp32's, as fp16's, but not fp32's to the last digit printed."""
    fp32, text = _eval_lm(lm_data, lm_checkpoint)
    assert "the model cast to bf16" not in text
    for name in ("fp16", "bf16"):
        loss, text = _eval_lm(lm_data, lm_checkpoint, f"--{name}")
        assert abs(loss - fp32) < 0.01 * fp32, (name, loss, fp32)
    assert loss != fp32
    assert text.count("fairseq_fp16: --bf16 inference: the model cast to bf16 (fp32 islands kept)") == 1
