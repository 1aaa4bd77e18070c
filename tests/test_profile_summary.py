"""scripts/profile_summary.py and run_stats --profile-updates: where an update's time goes."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_MODEL, TRAIN, USER_DIR
from fairseq_fp16_tools.bench.profile_summary import classify, cpu_class, cpu_table, summarize_trace, table


def ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


# two updates in a 10 ms window: device intervals 0-2 ms and 1-3 ms overlap (3 ms busy),
# 6-7 ms; launches on the host, one 1.5 ms stream sync
TRACE = {"traceEvents": [
    ev("kernel", "sm90_xmma_gemm_f16f16_f32", 0, 2000),
    ev("kernel", "fmha_cutlassF_f16_aligned_64x64_rf_sm80", 1000, 2000),
    ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 6000, 500),
    ev("kernel", "void at::native::vectorized_elementwise_kernel<4, add>", 6500, 500),
    ev("cuda_runtime", "cudaLaunchKernel", 0, 10), ev("cuda_runtime", "cudaLaunchKernel", 5, 10),
    ev("cuda_driver", "cuLaunchKernel", 20, 10),
    ev("cuda_runtime", "cudaStreamSynchronize", 3000, 1500),
    ev("cpu_op", "aten::add", 0, 100),
    {"ph": "i", "cat": "cpu_instant_event", "name": "marker", "ts": 1},
]}


def test_a_trace_is_summarised_per_update():
    out = summarize_trace(TRACE, updates=2, window_ms=10.0, step_ms=[4.0, 4.0])
    assert out["wall_ms"] == 5.0
    assert out["gpu_busy_ms"] == pytest.approx(2.0)  # (3 + 1) ms of union over 2 updates
    assert out["gpu_idle_frac"] == pytest.approx(0.6)
    assert out["launches"] == 1.5 and out["host_sync_ms"] == 0.75 and out["host_ms"] == 4.25
    assert out["outside_step_ms"] == 1.0
    assert out["kernel_ms"] == {"optimizer": 0.0, "attention": 1.0, "matmul": 1.0, "softmax/norm": 0.0,
                                "copies": 0.25, "elementwise/other": 0.25}
    # by time, then by calls: [name, per update, ms per update]
    assert out["top_kernels"][:2] == [["sm90_xmma_gemm_f16f16_f32", 0.5, 1.0],
                                      ["fmha_cutlassF_f16_aligned_64x64_rf_sm80", 0.5, 1.0]]
    assert len(out["top_kernels"]) == 4
    assert out["top_host_ops"] == [["aten::add", 0.5, 0.05]]


@pytest.mark.parametrize("name,cat,label", [
    ("void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "kernel", "optimizer"),
    ("pytorch_flash::flash_fwd_kernel", "kernel", "attention"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_NNT", "kernel", "matmul"),
    ("triton_tem_fused_mm_0", "kernel", "matmul"),
    ("void at::native::(anonymous)::vectorized_layer_norm_kernel<c10::Half>", "kernel", "softmax/norm"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "kernel", "copies"),
    ("Memset (Device)", "gpu_memset", "copies"),
    ("triton_poi_fused_add_relu_1", "kernel", "elementwise/other"),
])
def test_kernel_classes(name, cat, label):
    assert classify(name, cat) == label


def test_a_cpu_trace_has_no_device_fields_and_an_empty_window_is_refused():
    out = summarize_trace({"traceEvents": [ev("cpu_op", "aten::mm", 0, 50)]}, 1, 2.0, [1.5])
    assert (out["gpu_busy_ms"], out["kernel_ms"], out["launches"]) == (None, None, None)
    assert out["outside_step_ms"] == 0.5
    with pytest.raises(ValueError, match="a profile needs updates >= 1 and a window > 0 ms, got 0, 2.0"):
        summarize_trace(TRACE, 0, 2.0)


def test_the_table_has_a_row_per_run_and_names_a_failed_profile():
    ok = summarize_trace(TRACE, 2, 10.0, [4.0, 4.0])
    text = table({"fp16": ok, "bf16": {"error": "RuntimeError('no trace')"}})
    rows = text.splitlines()
    assert rows[1].split()[:4] == ["fp16", "5.0", "2.0", "0.60"]
    assert rows[2] == f"{'bf16':22s} profile failed: RuntimeError('no trace')"


@pytest.mark.slow
def test_run_stats_profiles_the_updates_it_is_asked_for(toy_data, tmp_path):
    profile, stats = tmp_path / "fp16.json", tmp_path / "stats.json"
    train_args = [*TRAIN, "--log-interval", "5"]  # the last value wins
    cmd = [sys.executable, str(ROOT / "scripts" / "run_stats.py"), "--profile-updates", "6:3", str(profile),
           str(stats), "fairseq-train", str(toy_data), *TINY_MODEL, *train_args, "--user-dir", USER_DIR,
           "--save-dir", str(tmp_path / "ck"), "--no-save", "--fp16", "--max-update", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(profile.read_text())
    assert (out["name"], out["first_update"], out["updates"]) == ("fp16", 6, 3)
    assert out["wall_ms"] > 0 and 0 <= out["outside_step_ms"] < out["wall_ms"]
    stats = json.loads(stats.read_text())
    assert stats["exit_code"] == 0
    assert out["provenance"]["commit"] == stats["provenance"]["commit"] and len(out["provenance"]["commit"]) == 40
    # the profiler's own stop and start did not move the log intervals the timings come from
    assert [i["num_updates"] for i in stats["intervals"]] == [5, 10]


def test_run_stats_refuses_a_bad_profile_window(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "run_stats.py"), "--profile-updates", "0:3", "p.json",
           str(tmp_path / "s.json"), "fairseq-train", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--profile-updates FIRST:COUNT needs FIRST >= 1 and COUNT >= 1, got 0:3" in proc.stderr


def test_a_cpu_trace_is_broken_down_by_the_operators_self_time():
    """Self time is an operator's time less its callees'; the class comes from the operator and
    the ranges around it (fairseq's optimizer range, the fused loss's function)."""
    trace = {"traceEvents": [
        ev("user_annotation", "forward", 0, 1000),
        ev("cpu_op", "aten::linear", 0, 500), ev("cpu_op", "aten::addmm", 0, 400),
        ev("cpu_op", "aten::bernoulli_", 500, 200), ev("cpu_op", "aten::copy_", 700, 100),
        ev("user_annotation", "optimizer", 1000, 300), ev("cpu_op", "aten::_fused_adamw_", 1000, 300),
        ev("cpu_op", "_CacheChunks", 1300, 200), ev("cpu_op", "aten::exp", 1300, 100),
        ev("cpu_op", "aten::native_layer_norm", 1500, 50),
    ]}
    out = summarize_trace(trace, 1, 2.5, [2.0])
    assert out["cpu_ms"] == {"products": 0.4, "copies": 0.1, "dropout": 0.2, "norm/softmax": 0.05,
                             "elementwise": 0.1, "loss": 0.2, "step": 0.3, "framework": 0.65}
    assert out["products_frac"] == 0.2
    assert out["top_cpu_self"][0] == ["products", "aten::addmm", 1.0, 0.4]
    assert "framework" in cpu_table({"bf16": out}) and "20%" in cpu_table({"bf16": out})


@pytest.mark.parametrize("name, ranges, label", [
    ("mkldnn::_linear_pointwise", [], "products"),  # the CPU half linear layers (cpu_linear)
    ("aten::addmm", [], "products"),
    ("aten::add", ["optimizer"], "step"),
])
def test_cpu_classes(name, ranges, label):
    assert cpu_class(name, ranges) == label


def test_the_copies_are_attributed_to_what_asked_for_them():
    """A copy's time goes to the nearest enclosing event that is neither a copy nor a view or
    cast passing it on; a copy's own inner copies (contiguous -> clone -> copy_) count as one."""
    trace = {"traceEvents": [
        ev("cpu_op", "aten::bmm", 0, 500), ev("cpu_op", "aten::contiguous", 0, 300),
        ev("cpu_op", "aten::clone", 0, 300), ev("cpu_op", "aten::copy_", 10, 250),
        ev("cpu_op", "ViewBackward0", 500, 200), ev("cpu_op", "aten::reshape", 500, 200),
        ev("cpu_op", "aten::clone", 500, 200), ev("cpu_op", "aten::copy_", 510, 150),
        ev("user_annotation", "optimizer", 700, 300), ev("cpu_op", "aten::_foreach_copy_", 700, 100),
        ev("cpu_op", "aten::copy_", 1000, 100),
    ]}
    out = summarize_trace(trace, 1, 1.5, [1.2])
    assert out["copies_by_asker"] == [["aten::bmm", 1.0, 0.3], ["ViewBackward0", 1.0, 0.2],
                                      ["optimizer", 1.0, 0.1], ["(none)", 1.0, 0.1]]
    assert out["cpu_ms"]["copies"] == 0.6 and out["cpu_ms"]["step"] == 0.1
