"""SAVE_DIR/run_info.json: what a run used, for the comparison tools (which read it instead of
the log)."""

import json

import pytest
import torch

from conftest import train
from fairseq_fp16.core.half_matmul import cpu_has_native_half

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flags", [[], ["--fp16"], ["--bf16", "--fused-loss", "off"]])
def test_run_info_says_what_the_run_used(toy_data, tmp_path, flags):
    train(toy_data, tmp_path, *flags, "--max-update", "2")
    info = json.loads((tmp_path / "run_info.json").read_text())
    name = {"--fp16": "fp16", "--bf16": "bf16"}.get(flags[0] if flags else None, "fp32")
    assert info["precision"] == name and info["device"] == "cpu"
    assert info["fused_loss"] is (name == "fp16")
    assert info["attention"] == ("torch" if name == "fp32" else "fairseq")
    assert info["compile_layers"] is False
    if name == "fp32":
        assert info["half_matmul"] is None and info["native_half_products"] is None
        return
    native = cpu_has_native_half(torch.float16 if name == "fp16" else torch.bfloat16)
    path = "native kernels" if native else "fp32 accumulation, rounded to half"
    assert info["half_matmul"] == f"{path} (--half-matmul auto)"
    assert info["native_half_products"] == (None if native else 0)


def test_no_run_info_without_checkpoints(toy_data, tmp_path):
    train(toy_data, tmp_path / "ck", "--fp16", "--max-update", "1", "--no-save")
    assert not (tmp_path / "ck" / "run_info.json").exists()
