"""The tests' fork server (`cli_server.py`) runs fairseq's tools as a fresh process would."""

import re

import conftest
from conftest import USER_DIR, run_cli, train


def test_forked_run_logs_what_a_fresh_process_logs(toy_data, tmp_path, monkeypatch):
    flags = ("--fp16", "--fp16-init-scale", "1048576", "--max-update", "6", "--no-save")
    before = conftest.RUNS.get("forked", 0)
    forked, forked_recs = train(toy_data, tmp_path / "forked", *flags)
    assert conftest.RUNS.get("forked", 0) == before + 1  # it did run in a fork
    monkeypatch.setenv("FAIRSEQ_FP16_TEST_FRESH_PROCESS", "1")
    fresh, fresh_recs = train(toy_data, tmp_path / "fresh", *flags)
    keys = ("loss", "loss_scale", "gnorm")
    assert [[r[k] for k in keys] for r in forked_recs] == [[r[k] for k in keys] for r in fresh_recs]
    assert len(forked_recs) == 6 and any(r["loss_scale"] < 1048576 for r in forked_recs)  # overflowed


def test_forked_run_fails_with_the_status_and_message_of_a_fresh_process(toy_data, tmp_path, monkeypatch):
    flags = ("--fp16", "--loss-scale", "3", "--max-update", "1", "--no-save")
    before = conftest.RUNS.get("forked", 0)
    forked, _ = train(toy_data, tmp_path / "forked", *flags, check=False)
    assert conftest.RUNS.get("forked", 0) == before + 1
    monkeypatch.setenv("FAIRSEQ_FP16_TEST_FRESH_PROCESS", "1")
    fresh, _ = train(toy_data, tmp_path / "fresh", *flags, check=False)
    assert forked.returncode == fresh.returncode != 0
    last = fresh.stderr.strip().splitlines()[-1]
    assert "--loss-scale" in last and forked.stderr.strip().splitlines()[-1] == last


def test_forked_generate_prints_what_a_fresh_process_prints(toy_data, tmp_path, monkeypatch):
    train(toy_data, tmp_path, "--max-update", "4")
    args = [toy_data, "--path", tmp_path / "checkpoint_last.pt", "--user-dir", USER_DIR, "--cpu",
            "--beam", "1", "--max-tokens", "4000", "--gen-subset", "test"]
    before = conftest.RUNS.get("forked", 0)
    forked = run_cli("fairseq-generate", args)
    assert conftest.RUNS.get("forked", 0) == before + 1
    monkeypatch.setenv("FAIRSEQ_FP16_TEST_FRESH_PROCESS", "1")
    fresh = run_cli("fairseq-generate", args)

    def hyps(text):
        return sorted(line for line in text.splitlines() if line.startswith(("S-", "H-", "D-")))

    def streams(proc):  # the logging format and stream each tool's module set up
        return [[line.split(" | ")[1:3] if " | " in line else line.split(":")[:2]
                 for line in text.splitlines() if "INFO" in line] for text in (proc.stdout, proc.stderr)]

    n = int(re.search(r"Translated (\d+) sentences", fresh.stdout + fresh.stderr).group(1))
    assert n > 50 and len(hyps(fresh.stdout)) == 3 * n and hyps(forked.stdout) == hyps(fresh.stdout)
    assert streams(forked) == streams(fresh)
