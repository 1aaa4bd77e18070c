"""Real fairseq-train runs on a CUDA device, on the tiny corpus: the plugin's fp16 and bf16 against
fp32 and against stock fairseq's --fp16. Skipped where torch sees no GPU (CI); run on a GPU
machine with ``pytest -m gpu``."""

import pytest
import torch

from conftest import train

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def runs(toy_data, tmp_path_factory):
    out = {}
    for name, flags, plugin in [("fp32", [], True), ("fp16", ["--fp16"], True), ("bf16", ["--bf16"], True),
                                ("fp16-stock", ["--fp16"], False)]:
        proc, recs = train(toy_data, tmp_path_factory.mktemp(name), *flags, "--max-update", "40",
                           user_dir=plugin, cuda=True)
        out[name] = (proc.stdout + proc.stderr, recs)
    return out


def losses(recs):
    return [r["loss"] for r in recs]


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp16-stock"])
def test_trains_40_updates_on_the_gpu_and_loss_falls(runs, name):
    log, recs = runs[name]
    assert "'cpu': False" in log and "capabilities = " in log  # fairseq's CUDA banner
    assert [r["num_updates"] for r in recs] == list(range(1, 41))
    ls = losses(recs)
    assert ls[-1] < ls[0] - 1.0, ls


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp16-stock"])
def test_half_precision_tracks_fp32_update_by_update(runs, name):
    for a, b in zip(losses(runs["fp32"][1]), losses(runs[name][1])):
        assert abs(a - b) < 0.1, (name, a, b)


def test_plugin_fp16_tracks_stock_fairseq_fp16(runs):
    # the same recipe (fp16 model, fp32 masters, scaled loss) as fairseq's own FP16Optimizer
    for a, b in zip(losses(runs["fp16"][1]), losses(runs["fp16-stock"][1])):
        assert abs(a - b) < 0.05, (a, b)


def test_plugin_runs_the_fused_step_with_fp32_masters_and_logs_the_scale(runs):
    log, recs = runs["fp16"]
    assert "fp16 model, fp32 master weights" in log and "fused (no host sync) step" in log
    assert all(r["loss_scale"] == 128 and r["skipped"] == 0 for r in recs)
    assert all(r["loss_scale"] == 1 for r in runs["bf16"][1])


def test_half_runs_take_torchs_fused_attention_on_the_gpu(runs):
    # fairseq's own attention (the CPU half default) stores B*H*T^2 probabilities; on CUDA the
    # fused scaled-dot-product kernels keep the fp32 softmax inside
    for name in ("fp16", "bf16"):
        assert "attention: torch's fused multi_head_attention_forward (--attention-path auto)" in runs[name][0]
        # cuDNN's attention builds a plan per batch shape: 358 -> 108 ms an update on an H200
        assert "cuDNN's scaled-dot-product kernels off" in runs[name][0]
    assert "cuDNN's scaled-dot-product kernels off" not in runs["fp32"][0]


def test_compiled_layers_track_the_eager_run(runs, toy_data, tmp_path):
    proc, recs = train(toy_data, tmp_path, "--fp16", "--compile-layers", "--max-update", "40", cuda=True)
    assert "the training forward of 2 transformer layers is compiled" in proc.stdout + proc.stderr
    assert [r["num_updates"] for r in recs] == list(range(1, 41))
    for a, b in zip(losses(runs["fp16"][1]), losses(recs)):
        assert abs(a - b) < 0.05, (a, b)
