"""The GPU session's pieces that run anywhere: scripts/gpu/session.sh --smoke (the same steps on
the CPU, tiny sizes), the benchmark's failed, timed-out and skipped modes and its records, the
provenance every benchmark JSON carries, and the staged fairseq's metadata."""

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, load_file

# a standalone script: it runs on the GPU machine before anything of this project is importable
build_fairseq = load_file(ROOT / "scripts" / "gpu" / "build_fairseq.py")

SMALL = ("--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
         "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
         "--encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --max-tokens 1000")


SESSION = ROOT / "scripts" / "gpu" / "session.sh"


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _in_history(commit):
    return subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"]).returncode == 0


@pytest.mark.slow
def test_session_smoke_writes_every_result(tmp_path):
    """The smoke session with MODES_A / MODES_B of its own and a mode whose limit (0.1 s) ends it
    before fairseq has loaded: that mode is recorded as timed out, the next runs, every step's
    file is written, and session.log closes with each outcome."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MODES_A": "fp32,bf16", "MODES_B": "bf16",
           "MODE_TIMEOUT": "300,fp32=0.1"}
    proc = subprocess.run(["bash", str(SESSION), "--smoke", str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:]  # 1: a mode timed out
    assert sorted(p.name for p in out.iterdir()) == [
        "optimizer.json", "session.log", "stock_resume.json", "train_1024.jsonl", "train_2048.jsonl"]
    log_tail = (out / "session.log").read_text().splitlines()[-5:]
    assert log_tail == ["train 1024 tokens: fp32 timed out, bf16 ok", "train 2048 tokens: bf16 ok",
                        "optimizer: ok", "stock checkpoint resume: ok (stock fp32 on the CPU)", "status 1"]

    header, fp32, bf16, summary = _jsonl(out / "train_1024.jsonl")
    assert (header["record"], header["modes"], header["warmup_updates"], header["updates"]) == (
        "run", ["fp32", "bf16"], 5, 10)
    assert header["mode_timeout_s"] == {"default": 300.0, "fp32": 0.1}
    commit = header["provenance"]["commit"]
    assert len(commit) == 40 and _in_history(commit) and header["provenance"]["commit_from"] == "git"
    assert (fp32["outcome"], fp32["error"]) == (
        "timed out", "fairseq-train (fp32) timed out after 0.1 s (its limit), at update 0 of 19")
    assert bf16["outcome"] == "ok" and bf16["profile"]["updates"] == 3
    assert bf16["profile"]["provenance"]["commit"] == commit
    intervals = bf16["intervals"]
    assert [i["num_updates"] for i in intervals] == [5, 10, 15]
    assert all(i["attempted"] == 5 + i["skipped"] and i["words"] > 0 and i["wall_ms"] > 0 for i in intervals)
    # resident memory, read apart from the peak: torch and fairseq loaded before the first update
    start = bf16["memory_before_first_update"]
    assert 100 < start["rss_mb"] <= start["peak_rss_mb"]
    assert all(0 < i["rss_mb"] <= i["peak_rss_mb"] for i in intervals)
    timed = intervals[1:]  # after the 5 warm-up updates
    assert bf16["ms_per_attempted_update"] == round(sum(i["wall_ms"] for i in timed)
                                                    / sum(i["attempted"] for i in timed), 2)
    assert bf16["timed_skipped_updates"] == sum(i["skipped"] for i in timed)
    assert summary["record"] == "summary" and summary["outcomes"] == {"fp32": "timed out", "bf16": "ok"}
    assert list(summary["ms_per_update"]) == ["bf16"] and summary["skipped"] == []
    assert summary["failed"] == {"fp32": fp32["error"]}
    for key in ("ms_per_attempted_update", "applied_words_per_s", "timed_skipped_updates", "recompiles"):
        assert summary[key] == {"bf16": bf16[key]}
    assert summary["provenance"] == header["provenance"]
    assert [r["mode"] for r in _jsonl(out / "train_2048.jsonl")[1:-1]] == ["bf16"]

    stock = json.loads((out / "stock_resume.json").read_text())
    assert stock["resumed_line"].startswith("resumed from stock fairseq's FairseqAdam state: Adam moments")
    assert (stock["stock_precision"], stock["stock_updates"], stock["resumed_at"], stock["last_updates"],
            stock["ok"]) == ("fp32", 4, 4, 6, True)
    optimizer = json.loads((out / "optimizer.json").read_text())
    assert [r["params"] for r in optimizer["results"]] == [100000, 1000000]
    assert optimizer["provenance"]["commit"] == commit

    # the committed files, as the docs' tables read them
    dest = tmp_path / "dest"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "collect.py"), str(out), str(dest)], check=True)
    assert sorted(p.name for p in dest.iterdir()) == [
        "optimizer.json", "profiles.json", "stock_resume.json", "train_1024.json", "train_2048.json"]
    assert json.loads((dest / "train_1024.json").read_text()) == summary
    profiles = json.loads((dest / "profiles.json").read_text())
    assert profiles == {"1024": {"bf16": bf16["profile"]}, "2048": {"bf16": _jsonl(out / "train_2048.jsonl")[1]["profile"]}}
    from fairseq_fp16_tools.render_docs import train_rows  # the GPU tables need a GPU's profile fields

    assert train_rows([summary], []).splitlines()[2].startswith(f"| bf16 | {summary['ms_per_update']['bf16']:.1f} | 1.00x |")


def _kill_session(sid):
    """SIGKILL every process of session ``sid`` (a time limit's process group included)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # the session id, after state, ppid and pgrp
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_a_session_cut_off_keeps_the_modes_that_finished(tmp_path):
    """The session killed outright (as a device call past its time is) once its first mode's
    line is written: the file parses, and its summary is made from the lines that are there."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MODES_A": "fp32,bf16", "MODES_B": "bf16",
           "SKIP": "optimizer,stock"}
    proc = subprocess.Popen(["bash", str(SESSION), "--smoke", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    results = out / "train_1024.jsonl"
    try:
        while proc.poll() is None and not (results.exists() and '"record": "mode"' in results.read_text()):
            time.sleep(0.5)
    finally:
        _kill_session(proc.pid)
        proc.wait()
    lines = results.read_text().splitlines()
    assert [json.loads(line)["record"] for line in lines] == ["run", "mode"]
    from fairseq_fp16_tools.bench.fairseq_train import summary_of

    summary = summary_of(results)
    assert summary["outcomes"] == {"fp32": "ok", "bf16": "not run"}
    assert list(summary["ms_per_update"]) == ["fp32"] and summary["ms_per_update"]["fp32"] > 0
    collect = load_file(ROOT / "scripts" / "gpu" / "collect.py")
    assert collect.outcomes(results) == "fp32 ok, bf16 not run"
    assert collect.outcomes(out / "train_2048.jsonl") == "not run (the benchmark did not start)"


def bench(data, *flags):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fairseq_train.py"), str(data),
                           "--updates", "10", "--warmup", "5", "--repeats", "1", "--model", SMALL, *flags],
                          capture_output=True, text=True)


@pytest.mark.slow
def test_a_failing_mode_is_listed_and_the_others_still_run(toy_data):
    proc = bench(toy_data, "--modes", "fp16-stock,fp32")  # stock --fp16 needs CUDA
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert list(result["ms_per_update"]) == ["fp32"] and list(result["failed"]) == ["fp16-stock"]
    assert result["outcomes"] == {"fp16-stock": "failed", "fp32": "ok"}
    assert "fairseq-train (fp16-stock) failed" in proc.stderr


def test_modes_after_the_deadline_are_skipped(toy_data, tmp_path):
    proc = bench(toy_data, "--modes", "fp32,bf16", "--deadline", "-1", "--jsonl", str(tmp_path / "t.jsonl"))
    assert proc.returncode != 0
    assert "no mode ran: failed {}, skipped ['fp32 (repeat 1)', 'bf16 (repeat 1)']" in proc.stderr
    header, *modes, summary = _jsonl(tmp_path / "t.jsonl")
    assert [(r["mode"], r["outcome"], r["reason"]) for r in modes] == [
        ("fp32", "skipped", "not started within --deadline -1 s"), ("bf16", "skipped", "not started within --deadline -1 s")]
    assert summary["outcomes"] == {"fp32": "skipped", "bf16": "skipped"} and summary["ms_per_update"] == {}


def _runs(pid):
    """The fairseq runs (scripts/run_stats.py) process ``pid`` has started."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return [c for c in children if b"run_stats.py" in Path(f"/proc/{c}/cmdline").read_bytes()]
    except OSError:
        return []


def test_sigterm_stops_the_mode_in_flight_and_the_records_are_still_written(toy_data, tmp_path):
    """What a session's time limit sends: the fairseq run in flight is killed and recorded as
    timed out, the next mode is skipped, and the summary is written."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_fairseq_train.py"), str(toy_data), "--updates", "10",
           "--repeats", "1", "--model", SMALL, "--modes", "fp32,bf16", "--jsonl", str(tmp_path / "t.jsonl")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not _runs(proc.pid):
        time.sleep(0.1)
    (run,) = _runs(proc.pid)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 1
    assert ("no mode ran: failed {'fp32': \"stopped by SIGTERM (the session's time ran out)\"}, "
            "skipped ['bf16 (repeat 1)']") in stderr
    assert not Path(f"/proc/{run}").exists()  # the fairseq run went with it
    header, fp32, bf16, summary = _jsonl(tmp_path / "t.jsonl")
    assert (fp32["outcome"], fp32["error"]) == ("timed out", "stopped by SIGTERM (the session's time ran out)")
    assert (bf16["outcome"], bf16["reason"]) == ("skipped", "the session's time ran out")
    assert summary["outcomes"] == {"fp32": "timed out", "bf16": "skipped"}


@pytest.mark.parametrize("flags,message", [
    (["--updates", "12"], "--updates must be a multiple of 5 (the log interval), at least 10; got 12"),
    (["--warmup", "7"], "--warmup must be a multiple of 5 (the log interval); got 7"),
    (["--mode-timeout", "300,fp33=1"], "--mode-timeout: unknown mode fp33; valid: fp32, tf32, "),
    (["--mode-timeout", "300,fp32=0"], "--mode-timeout: '0' is not a number of seconds above 0"),
    (["--mode-timeout", "soon"], "--mode-timeout: 'soon' is not a number of seconds above 0"),
])
def test_bad_benchmark_flags_are_refused(toy_data, flags, message):
    proc = bench(toy_data, "--modes", "fp32", *flags)
    assert proc.returncode == 2
    assert message in proc.stderr


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


def test_a_stalled_interval_does_not_move_the_benchmarks_rate():
    """A compiled mode recompiles when a new input variant first comes (a batch without padding),
    stalling one interval; the figure is the median of the intervals after the warm-up."""
    from fairseq_fp16_tools.bench.fairseq_train import RunFailed, interval_rates

    log = "".join(f"2026 | INFO | train_inner | epoch 001: loss=3.1, wps={w}, ups={u}, wpb=900, num_updates={n}\n"
                  for n, u, w in ((5, 0.5, 450), (10, 10.0, 9000), (15, 10.5, 9450), (20, 0.4, 360),
                                  (25, 9.5, 8550), (30, 1.0, 900)))
    ms, wps = interval_rates(log, after=5, upto=25)
    assert ms == pytest.approx(1000 / 9.75) and wps == pytest.approx(8775)
    with pytest.raises(RunFailed, match="no train_inner record after update 30; raise --updates"):
        interval_rates(log, after=30)


# intervals as scripts/run_stats.py records them: a warm-up interval with two overflow skips and
# the first compiles, then two timed ones, one with a skip and a recompile
INTERVALS = [
    {"num_updates": 5, "attempted": 7, "skipped": 2, "words": 500, "wall_ms": 4000.0, "compiles": 12},
    {"num_updates": 10, "attempted": 6, "skipped": 1, "words": 500, "wall_ms": 1500.0, "compiles": 1},
    {"num_updates": 15, "attempted": 5, "skipped": 0, "words": 550, "wall_ms": 1000.0, "compiles": 0},
    {"num_updates": 20, "attempted": 5, "skipped": 0, "words": 600, "wall_ms": 900.0, "compiles": 0},
]


def test_timed_figures_count_every_attempted_update_and_only_the_applied_words():
    from fairseq_fp16_tools.bench.fairseq_train import RunFailed, timed_figures

    assert timed_figures(INTERVALS, after=5, upto=15) == {
        "ms_per_attempted_update": 227.27,  # 2500 ms over 11 attempted updates
        "applied_words_per_s": 420.0,  # 1050 words in 2.5 s
        "timed_skipped_updates": 1, "recompiles": 1}
    with pytest.raises(RunFailed, match="no timed interval between updates 20 and 30"):
        timed_figures(INTERVALS, after=20, upto=30)


def _mode(mode, outcome, **figures):
    return {"record": "mode", "mode": mode, "repeat": 1, "outcome": outcome, **figures}


def test_a_benchmark_cut_off_is_summarised_from_the_lines_it_wrote(tmp_path):
    from fairseq_fp16_tools.bench.fairseq_train import JsonLines, summary_of

    header = {"record": "run", "model": SMALL, "device": "cuda", "modes": ["tf32", "fp16", "bf16", "fp32"],
              "updates": 30, "warmup_updates": 10, "repeats": 1, "cpu_native_fp16": True,
              "cpu_native_bf16": True, "provenance": {"commit": "ab" * 20, "changed": []}}
    ok = dict(updates=30, ms_per_update=80.0, words_per_s=200000.0, ms_per_attempted_update=82.5,
              applied_words_per_s=195000.0, peak_mb=13000.0, skipped_updates=3, timed_skipped_updates=0,
              recompiles=0, intervals=INTERVALS, machine={"device": "NVIDIA H200"},
              memory_before_first_update={"rss_mb": 900.0, "peak_rss_mb": 950.0})
    sink = JsonLines(str(tmp_path / "t.jsonl"))
    sink.write(header)
    sink.write(_mode("tf32", "ok", **ok))
    sink.write(_mode("fp16", "timed out", error="fairseq-train (fp16) timed out after 120 s (its limit), at update 25 of 44"))
    with open(tmp_path / "t.jsonl", "a") as f:
        f.write('{"record": "mode", "mode": "bf16", "out')  # the line the kill cut
    summary = summary_of(tmp_path / "t.jsonl")
    assert summary["outcomes"] == {"tf32": "ok", "fp16": "timed out", "bf16": "not run", "fp32": "not run"}
    assert summary["failed"] == {"fp16": "fairseq-train (fp16) timed out after 120 s (its limit), at update 25 of 44"}
    assert (summary["ms_per_update"], summary["ms_per_attempted_update"], summary["applied_words_per_s"]) == (
        {"tf32": 80.0}, {"tf32": 82.5}, {"tf32": 195000.0})
    assert (summary["skipped_updates"], summary["timed_skipped_updates"], summary["intervals"]) == (
        {"tf32": 3}, {"tf32": 0}, {"tf32": INTERVALS})
    assert summary["memory_before_first_update"] == {"tf32": {"rss_mb": 900.0, "peak_rss_mb": 950.0}}
    assert summary["peak_kind"] == "CUDA allocator peak" and summary["provenance"] == header["provenance"]
    (tmp_path / "none.jsonl").write_text("")
    with pytest.raises(ValueError, match="none.jsonl: no run header; the benchmark did not start"):
        summary_of(tmp_path / "none.jsonl")


def test_the_summary_carries_each_modes_profile_and_takes_peaks_from_unprofiled_runs():
    """The profiled run keeps its trace in memory: its peak would inflate the mode's."""
    from fairseq_fp16_tools.bench.fairseq_train import summarize

    header = {"record": "run", "model": SMALL, "device": "cpu", "modes": ["fp32", "bf16"], "updates": 10,
              "warmup_updates": 5, "repeats": 2, "cpu_native_fp16": False, "cpu_native_bf16": True,
              "provenance": {"commit": "ab" * 20, "changed": []}}
    base = dict(updates=10, ms_per_update=100.0, words_per_s=1000.0, ms_per_attempted_update=100.0,
                applied_words_per_s=1000.0, skipped_updates=0, timed_skipped_updates=0, recompiles=0,
                intervals=INTERVALS, machine={"device": "cpu"})
    records = [_mode("fp32", "ok", **base, peak_mb=6000.0, profile={"wall_ms": 101.0}),
               _mode("bf16", "ok", **base, peak_mb=5000.0, profile={"wall_ms": 51.0}),
               dict(_mode("fp32", "ok", **base, peak_mb=3800.0), repeat=2),
               dict(_mode("bf16", "ok", **base, peak_mb=2800.0), repeat=2)]
    summary = summarize(header, records)
    assert summary["peak_mb"] == {"fp32": 3800.0, "bf16": 2800.0}
    assert summary["profiles"] == {"fp32": {"wall_ms": 101.0}, "bf16": {"wall_ms": 51.0}}
    assert summarize(header, records[:2])["peak_mb"] == {"fp32": 6000.0, "bf16": 5000.0}  # only profiled runs


# -- provenance: fairseq_fp16_tools/provenance.py ------------------------------------------------

def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout


def _source_repo(root):
    """A git repository with the project's source folders in small."""
    for rel, text in {"fairseq_fp16/__init__.py": "", "fairseq_fp16/core/a.py": "A = 1\n",
                      "scripts/run.sh": "echo run\n", "setup.py": "setup()\n",
                      ".gitignore": "__pycache__/\n/.whl/\n", "README.md": "read me\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "source")
    return _git(root, "rev-parse", "HEAD").strip()


def test_provenance_from_git_names_the_commit_and_the_changed_sources(tmp_path):
    import platform

    import torch

    from fairseq_fp16_tools.provenance import describe, label

    head = _source_repo(tmp_path)
    record = describe(tmp_path)
    assert (record["commit"], record["changed"], record["commit_from"]) == (head, [], "git")
    assert (record["torch"], record["cuda"], record["python"]) == (
        torch.__version__, torch.version.cuda, platform.python_version())
    assert record["fairseq"] == importlib.metadata.version("fairseq-fixed")
    assert label(record) == head[:8]
    (tmp_path / "fairseq_fp16" / "__pycache__").mkdir()
    (tmp_path / "fairseq_fp16" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")  # not a change
    (tmp_path / "README.md").write_text("not a source\n")
    assert describe(tmp_path)["changed"] == []
    (tmp_path / "fairseq_fp16" / "core" / "a.py").write_text("A = 2\n")
    (tmp_path / "scripts" / "new.py").write_text("untracked\n")
    record = describe(tmp_path)
    assert record["changed"] == ["fairseq_fp16", "scripts"]
    assert label(record) == f"{head[:8]} plus changes to fairseq_fp16/, scripts/"


def test_without_git_the_staged_commit_holds_while_the_hashes_agree(tmp_path):
    """The GPU machine's case: the tree without .git, and .whl/source.json written by staging."""
    import shutil

    from fairseq_fp16_tools.provenance import describe, label, source_hashes, stage

    repo, copy = tmp_path / "repo", tmp_path / "copy"
    head = _source_repo(repo)
    staged = stage(repo)
    assert staged == {"commit": head, "changed": [], "source_hashes": source_hashes(repo)}
    assert json.loads((repo / ".whl" / "source.json").read_text()) == staged
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "fairseq_fp16" / "__pycache__").mkdir()
    (copy / "fairseq_fp16" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")  # what running leaves
    record = describe(copy)
    assert (record["commit"], record["changed"], record["commit_from"]) == (head, [], "staged")
    assert record["source_hashes"] == staged["source_hashes"]
    (copy / "scripts" / "run.sh").write_text("echo edited\n")
    record = describe(copy)
    assert (record["commit"], record["changed"]) == (head, ["scripts"])
    assert label(record) == f"{head[:8]} plus changes to scripts/"
    (copy / ".whl" / "source.json").unlink()
    record = describe(copy)
    assert (record["commit"], record["changed"], record["commit_from"]) == (None, None, None)
    assert label(record) == "commit unknown"
    with pytest.raises(RuntimeError, match=f"--stage needs a git checkout; {copy} is none"):
        stage(copy)


def test_the_census_json_records_its_provenance(monkeypatch, capsys):
    from fairseq_fp16_tools.bench import op_census

    def fake_census(data, mode, model, first, count):
        return {"name": mode, "launches": 10.0, "mb": 1.0, "syncs": 0.0, "ops": {},
                "by_class": {k: {"launches": 0.0, "mb": 0.0} for k, _ in op_census.CLASSES},
                "by_phase": {}, "sync_sites": {}}

    monkeypatch.setattr(op_census, "run_census", fake_census)
    monkeypatch.setattr(op_census, "describe", lambda: {"commit": "c" * 40, "changed": []})
    assert op_census.main(["DATA", "--modes", "fp32"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["provenance"] == {"commit": "c" * 40, "changed": []}
