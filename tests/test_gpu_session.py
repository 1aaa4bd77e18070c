"""The GPU session's pieces that run anywhere: scripts/gpu/session.sh --smoke (the same steps on
the CPU, tiny sizes), the benchmark's failed and skipped modes, and the staged fairseq's
metadata."""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_file

# a standalone script: it runs on the GPU machine before anything of this project is importable
build_fairseq = load_file(ROOT / "scripts" / "gpu" / "build_fairseq.py")

SMALL = ("--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
         "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
         "--encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --max-tokens 1000")


@pytest.mark.slow
def test_session_smoke_writes_every_result(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "session.sh"), "--smoke", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "optimizer.json", "profiles.json", "session.log", "train_1024.json", "train_2048.json"]
    for name, modes in [("train_1024.json", ["fp32", "fp16"]), ("train_2048.json", ["fp32", "bf16"])]:
        result = json.loads((out / name).read_text())
        assert list(result["ms_per_update"]) == modes and result["failed"] == {} and result["skipped"] == []
        assert all(v > 0 for v in result["words_per_s"].values())
        assert set(result["skipped_updates"]) == set(modes)
        assert all(isinstance(n, int) and n >= 0 for n in result["skipped_updates"].values())
    profiles = json.loads((out / "profiles.json").read_text())
    assert {k: sorted(v) for k, v in profiles.items()} == {"1024": ["fp16", "fp32"], "2048": ["bf16", "fp32"]}
    assert all(p["updates"] == 3 and p["wall_ms"] > 0 for v in profiles.values() for p in v.values())
    assert [r["params"] for r in json.loads((out / "optimizer.json").read_text())["results"]] == [100000, 1000000]
    assert "=== [" in (out / "session.log").read_text()


def bench(data, *flags):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fairseq_train.py"), str(data),
                           "--updates", "10", "--repeats", "1", "--model", SMALL, *flags],
                          capture_output=True, text=True)


@pytest.mark.slow
def test_a_failing_mode_is_listed_and_the_others_still_run(toy_data):
    proc = bench(toy_data, "--modes", "fp16-stock,fp32")  # stock --fp16 needs CUDA
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert list(result["ms_per_update"]) == ["fp32"] and list(result["failed"]) == ["fp16-stock"]
    assert "fairseq-train (fp16-stock) failed" in proc.stderr


def test_modes_after_the_deadline_are_skipped(toy_data):
    proc = bench(toy_data, "--modes", "fp32,bf16", "--deadline", "-1")
    assert proc.returncode != 0
    assert "no mode ran: failed {}, skipped ['fp32 (repeat 1)', 'bf16 (repeat 1)']" in proc.stderr


def test_updates_must_fill_whole_log_intervals(toy_data):
    proc = bench(toy_data, "--modes", "fp32", "--updates", "12")
    assert proc.returncode == 2
    assert "--updates must be a multiple of 5 (the log interval), at least 10; got 12" in proc.stderr


def test_staged_fairseq_has_its_version_and_console_scripts(tmp_path):
    (tmp_path / "fairseq").mkdir()
    (tmp_path / "fairseq" / "version.txt").write_text("0.12.3.1\n")
    build_fairseq.write_metadata(tmp_path)
    build_fairseq.write_clis(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert (dist.metadata["Name"], dist.version) == ("fairseq-fixed", "0.12.3.1")
    assert {ep.name: ep.value for ep in dist.entry_points} == {
        "fairseq-train": "fairseq_cli.train:cli_main", "fairseq-generate": "fairseq_cli.generate:cli_main",
        "fairseq-preprocess": "fairseq_cli.preprocess:cli_main"}
    script = (tmp_path / "bin" / "fairseq-train").read_text()
    assert script.startswith(f"#!{sys.executable}\n") and "from fairseq_cli.train import cli_main" in script
    assert os.access(tmp_path / "bin" / "fairseq-train", os.X_OK)


def test_the_benchmark_reads_the_overflow_skips_from_the_log():
    from fairseq_fp16_tools.bench.fairseq_train import skipped_updates

    log = ("2026 | INFO | train_inner | epoch 001:      4 / 3400 loss=19.2, ups=0.09, num_updates=2, "
           "loss_scale=32, skipped=2, train_wall=11\n"
           "2026 | INFO | train_inner | epoch 001:      9 / 3400 loss=16.0, ups=0.25, num_updates=6, "
           "loss_scale=16, skipped=3, train_wall=4\n")
    assert skipped_updates(log) == 3
    assert skipped_updates("2026 | INFO | train_inner | epoch 001: loss=3.1, ups=2.0") == 0


def test_a_stalled_interval_does_not_move_the_benchmarks_rate():
    """A compiled mode recompiles when a new input variant first comes (a batch without padding),
    stalling one interval; the figure is the median interval after the first (start-up)."""
    from fairseq_fp16_tools.bench.fairseq_train import interval_rates

    log = "".join(f"2026 | INFO | train_inner | epoch 001: loss=3.1, wps={w}, ups={u}, wpb=900\n"
                  for u, w in ((0.5, 450), (10.0, 9000), (10.5, 9450), (0.4, 360), (9.5, 8550)))
    ms, wps = interval_rates(log)
    assert ms == pytest.approx(1000 / 9.75) and wps == pytest.approx(8775)
