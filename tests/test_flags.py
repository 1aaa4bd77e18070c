"""Every refused flag names itself and its valid values (real fairseq-train runs)."""

import pytest

from conftest import train

pytestmark = pytest.mark.slow

CASES = [
    (["--fp16", "--bf16"], r"fairseq-train: error: --fp16 and --bf16 are exclusive: pick one precision"),
    (["--fp16", "--memory-efficient-bf16"],
     r"fairseq-train: error: --fp16 and --memory-efficient-bf16 are exclusive: pick one precision"),
    (["--memory-efficient-fp16", "--bf16"],
     r"fairseq-train: error: --memory-efficient-fp16 and --bf16 are exclusive: pick one precision"),
    (["--memory-efficient-bf16", "--memory-efficient-fp16"],
     r"fairseq-train: error: --memory-efficient-fp16 and --memory-efficient-bf16 are exclusive: pick one "
     r"precision"),
    (["--fp16", "--max-consecutive-overflows", "-1"],
     r"--max-consecutive-overflows must be an integer >= 0 \(0 = never stop\), got -1"),
    (["--fp16", "--loss-scale", "-4"], r"--loss-scale must be 0 \(dynamic\) or a positive power of two"),
    (["--fp16", "--loss-scale", "100"], r"--loss-scale must be 0 \(dynamic\) or a positive power of two .*got '100'"),
    (["--fp16", "--loss-scale", "abc"], r"--loss-scale must be 0 \(dynamic\) or a positive power of two.*got 'abc'"),
    (["--fp16", "--loss-scale-hysteresis", "0"], r"--loss-scale-hysteresis must be an integer >= 1"),
    (["--fp16", "--fp32-modules", "(bad"], r"--fp32-modules is not a valid regular expression: '\(bad'"),
    (["--fp16", "--adam-betas", "(0.9,)"], r"--adam-betas must be two numbers like '\(0.9, 0.98\)'"),
    (["--fp16", "--adam-backend", "apex"], r"--adam-backend apex needs NVIDIA apex"),
    (["--bf16", "--cpu-kernel-cache", "0"],
     r"--cpu-kernel-cache must be auto or an integer >= 1 \(kernels kept per cache; torch's default is 1024\), "
     r"got '0'"),
    (["--bf16", "--cpu-length-multiple", "0"],
     r"--cpu-length-multiple must be auto or an integer >= 1 \(1 = lengths as they are\), got '0'"),
    (["--fp16", "--precision-divergence-interval", "-2"],
     r"--precision-divergence-interval must be >= 0 \(0 = off\), got -2"),
    (["--fp16", "--precision-stats-interval", "-1"], r"--precision-stats-interval must be >= 0 \(0 = off\), got -1"),
    (["--fp16", "--fp16-init-scale", "0"],
     r"--fp16-init-scale must be an integer >= 1 \(the dynamic loss scale's first value; fairseq's default "
     r"128\), got 0"),
    (["--fp16", "--fp16-init-scale", str(2**200)],
     r"--fp16-init-scale must be at most 2\*\*127 \(the largest power of two fp32 holds; the scale is kept "
     rf"in fp32\), got {2**200}"),
    (["--fp16", "--loss-scale", str(2.0**200)],
     r"--loss-scale must be at most 2\*\*127 \(the largest power of two fp32 holds; the scale is kept in "
     r"fp32\), got '1\.6\d+e\+60'"),
    (["--fp16", "--loss-scale", str(2.0**-130)],
     r"--loss-scale must be at least 2\*\*-126 \(the smallest normal power of two of fp32; the scale is "
     r"kept in fp32\), got '7\.3\d+e-40'"),
    (["--fp16", "--fp16-scale-window", "0"],
     r"--fp16-scale-window must be an integer >= 1 \(clean updates before the dynamic loss scale grows; "
     r"unset: 2\*\*14 / \(world size x update-freq\)\), got 0"),
    (["--fp16", "--scale-trace", "."], r"--scale-trace must name a file \(it is written as JSON lines\), "
     r"got the directory '\.'"),
    (["--fp16", "--half-matmul", "fast"],
     r"argument --half-matmul: invalid choice: 'fast' \(choose from '?auto'?, '?native'?, '?fp32-accumulate'?\)"),
    (["--fp16", "--attention-path", "flash"],
     r"argument --attention-path: invalid choice: 'flash' \(choose from '?auto'?, '?torch'?, '?fairseq'?\)"),
]


@pytest.mark.parametrize("flags,message", CASES, ids=[" ".join(c[0][1:]) for c in CASES])
def test_bad_flag_is_refused_with_its_name(toy_data, tmp_path, flags, message):
    import re

    proc, _ = train(toy_data, tmp_path, *flags, "--max-update", "1", check=False)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr[-1500:]


def test_fp32_run_warns_that_the_half_precision_diagnostics_do_nothing(toy_data, tmp_path):
    trace = tmp_path / "t.jsonl"
    proc, recs = train(toy_data, tmp_path, "--scale-trace", trace, "--precision-stats-interval", "1",
                       "--max-update", "1", "--no-save")
    text = proc.stdout + proc.stderr
    assert text.count("--scale-trace: an fp32 run has no loss scale and skips no update; nothing is "
                      "written (it traces --fp16/--bf16 runs)") == 1
    assert text.count("--precision-stats-interval: an fp32 run has no half gradients and no fp32 master "
                      "weights; nothing is measured (it measures --fp16/--bf16 runs)") == 1
    assert len(recs) == 1 and not trace.exists()


def test_a_diagnostics_file_without_its_interval_warns(toy_data, tmp_path):
    stats, div = tmp_path / "s.jsonl", tmp_path / "d.jsonl"
    proc, recs = train(toy_data, tmp_path, "--fp16", "--precision-stats", stats, "--precision-divergence", div,
                       "--max-update", "1", "--no-save")
    text = proc.stdout + proc.stderr
    assert text.count(f"--precision-stats {stats}: nothing is written without --precision-stats-interval N "
                      "(N >= 1: every N updates)") == 1
    assert text.count(f"--precision-divergence {div}: nothing is written without "
                      "--precision-divergence-interval N (N >= 1: every N updates)") == 1
    assert len(recs) == 1 and not stats.exists() and not div.exists()


def test_fp32_modules_matching_nothing_warns(toy_data, tmp_path):
    proc, recs = train(toy_data, tmp_path, "--fp16", "--fp32-modules", "no_such_module", "--max-update", "2")
    assert "--fp32-modules 'no_such_module' matched no module name" in proc.stdout + proc.stderr
    assert len(recs) == 2


def test_fp32_modules_matching_reports_them(toy_data, tmp_path):
    proc, _ = train(toy_data, tmp_path, "--fp16", "--fp32-modules", r"decoder\.output_projection", "--max-update", "2")
    assert "fp32 modules (--fp32-modules): decoder.output_projection" in proc.stdout + proc.stderr


def test_static_scale_with_bf16_warns_that_it_is_not_needed(toy_data, tmp_path):
    proc, recs = train(toy_data, tmp_path, "--bf16", "--loss-scale", "8", "--max-update", "2", "--no-save")
    assert ("--loss-scale 8 with --bf16: bf16 has fp32's exponent range and needs no loss scaling"
            in proc.stdout + proc.stderr)
    assert [r["loss_scale"] for r in recs] == [8.0, 8.0]


def test_cpu_kernel_cache_caps_both_caches_unless_the_environment_sets_them(toy_data, tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "300")
    proc, recs = train(toy_data, tmp_path, "--bf16", "--half-matmul", "native", "--cpu-kernel-cache", "16",
                       "--max-update", "2", "--no-save")
    assert ("CPU kernel caches: ONEDNN_PRIMITIVE_CACHE_CAPACITY=16, LRU_CACHE_CAPACITY=300 "
            "(--cpu-kernel-cache 16; a variable set in the environment wins)") in proc.stdout + proc.stderr
    assert len(recs) == 2
    proc, _ = train(toy_data, tmp_path / "fp16", "--fp16", "--half-matmul", "fp32-accumulate",
                    "--max-update", "1", "--no-save")
    assert "CPU kernel caches" not in proc.stdout + proc.stderr  # fp32 products: no oneDNN caches
