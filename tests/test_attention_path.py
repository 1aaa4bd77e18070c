"""--attention-path: which multi-head attention each run takes, and cuDNN's attention kept out
of torch's fused path on the GPU."""

import pytest
import torch

from conftest import train
from fairseq_fp16.features import avoid_cudnn_attention
from fairseq_fp16.flags import resolve_attention_path


@pytest.mark.parametrize("choice,half,on_cpu,path", [
    ("auto", True, True, "fairseq"),   # CPU half: the fp32-accumulate products route fairseq's path
    ("auto", True, False, "torch"),    # CUDA half: fused kernels, fp32 softmax inside
    ("auto", False, True, "torch"),    # fp32: stock fairseq's choice
    ("auto", False, False, "torch"),
    ("torch", True, True, "torch"),
    ("fairseq", False, False, "fairseq"),
])
def test_resolve_attention_path(choice, half, on_cpu, path):
    assert resolve_attention_path(choice, half, on_cpu) == path


def test_unknown_attention_path_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"--attention-path must be one of auto, torch, fairseq, got 'flash'"):
        resolve_attention_path("flash", True, False)


def test_cudnn_attention_is_turned_off_once():
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert avoid_cudnn_attention() is True
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
        assert avoid_cudnn_attention() is False  # already off: nothing to do
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.slow
@pytest.mark.parametrize("flags,path", [
    (["--bf16"], "fairseq's own, softmax in fp32 (--attention-path auto)"),
    (["--bf16", "--attention-path", "torch"], "torch's fused multi_head_attention_forward (--attention-path torch)"),
    ([], "torch's fused multi_head_attention_forward (--attention-path auto)"),
])
def test_the_run_logs_the_attention_it_takes(toy_data, tmp_path, flags, path):
    proc, recs = train(toy_data, tmp_path, *flags, "--max-update", "2")
    log = proc.stdout + proc.stderr
    assert f"attention: {path}" in log
    assert "cuDNN's scaled-dot-product kernels off" not in log  # CPU runs leave torch's backends alone
    assert len(recs) == 2
