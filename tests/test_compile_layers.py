"""--compile-layers in a real fairseq-train run: one set of graphs serves every batch length and
every layer of a kind."""

import os
import re
import subprocess
import sys

import pytest

from conftest import TRAIN, USER_DIR

MODEL = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "3",
         "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", [
    [], ["--fp16", "--half-matmul", "fp32-accumulate", "--fp16-init-scale", "1048576"]],
    ids=["fp32", "fp16-fp32acc-overflows"])
def test_compiled_layers_do_not_recompile_per_batch_length_or_layer(toy_data, tmp_path, precision):
    """The first encoder layer gets a transposed view and the others contiguous tensors; before
    the compiled forward took contiguous inputs, every new batch length recompiled and after 8
    the layers ran eagerly for the rest of the run. Each decoder layer's attention has its own
    random incremental-state id; before the lookup stopped reading it without a state, each
    decoder layer compiled graphs of its own. A CPU half run under fp32 accumulation checks its
    first step's products under a dispatch mode; before the layers ran that step eagerly, they
    were never compiled at all. Its first updates overflow (the scale starts at 2**20) and arm
    the non-finite watch; before the armed watch held the layers to their own forward, each
    arming's hooks recompiled them."""
    cmd = [sys.executable, "-m", "fairseq_cli.train", str(toy_data), *MODEL, *TRAIN,
           "--user-dir", USER_DIR, "--save-dir", str(tmp_path), "--no-save", "--compile-layers",
           "--fused-loss", "on", *precision,
           "--max-update", "30", "--disable-validation"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TORCH_LOGS": "recompiles"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "the training forward of 5 transformer layers is compiled" in log
    assert "recompile_limit" not in log
    assert "in fp32 chunks (the compiled path)" in log  # compiled layers take the compiled loss
    lengths = set(re.findall(r"train_inner.*?\"wpb\": \"?([0-9.]+)", log))
    assert len(lengths) > 8  # batches of more sizes than torch's limit of recompiles (8)
    recompiles = re.findall(r"Recompiling function forward in \S+transformer_layer\.py:(\d+)", log)
    # the variants only: padding masks present or None, and the decoder's last layer's attention
    assert "_incremental_state_id" not in log and "_forward_hooks" not in log
    if precision:
        assert int(re.findall(r'"skipped": "([0-9]+)"', log)[-1]) >= 5  # the watch was armed
    assert 1 <= len(recompiles) <= 6, recompiles  # 0: the layers were never compiled
