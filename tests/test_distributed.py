"""Multi-process training on the CPU (gloo): torchrun and fairseq's own spawn, with the plugin.

Stock fairseq 0.12 cannot do either off CUDA; see fairseq_fp16/patches/distributed.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from fairseq.dataclass.configs import FairseqConfig
from fairseq.distributed import utils as distributed_utils
from omegaconf import OmegaConf

from conftest import BIN, parse_json_records
from fairseq_fp16.patches.distributed import _free_port
from test_reliability import fault_args

pytestmark = pytest.mark.slow

# no dropout: one process with --update-freq 2 and two processes see the same global batches,
# and without dropout the same arithmetic up to the order of the gradient sums
BASE = ["--fp16", "--dropout", "0", "--fp16-scale-window", "4"]


def run(cmd, env=None, check=True):
    # a crash prints the Python stacks; fairseq logs to stdout, so its tail says how far it got
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1", **(env or {}))
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=full_env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd[0]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, parse_json_records(proc.stdout + proc.stderr)["train_inner"]


def torchrun(data, save_dir, *extra, env=None, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _free_port(),
           BIN / "fairseq-train", *fault_args(data, save_dir, *BASE, *extra)]
    return run(cmd, env, check)


def single(data, save_dir, *extra, env=None):
    return run([BIN / "fairseq-train", *fault_args(data, save_dir, *BASE, *extra)], env)


def by_update(recs):
    return {int(r["num_updates"]): r for r in recs}


@pytest.fixture(scope="module")
def one_process(toy_data, tmp_path_factory):
    _, recs = single(toy_data, tmp_path_factory.mktemp("one"), "--update-freq", "2", "--max-update", "12",
                     "--no-save")
    return by_update(recs)


def _assert_same_trajectory(got, ref, tol=0.01):
    """Equal losses and scales wherever the global batch is the same one.

    The toy epoch has 19 batches: one process groups them in pairs for --update-freq 2, two
    processes deal them out alternately and pad the odd one, so updates 9-10 (the end of the
    epoch) see the batches in another grouping; every other update sees the same global batch.
    """
    assert sorted(got) == sorted(ref)
    same = [u for u in ref if (got[u]["wpb"], got[u]["bsz"]) == (ref[u]["wpb"], ref[u]["bsz"])]
    assert len(same) >= len(ref) - 2, same
    for u in same:
        assert got[u]["loss"] == pytest.approx(ref[u]["loss"], abs=tol), u
    for u in range(1, min(set(ref) - set(same), default=max(ref) + 1)):  # until the groupings part
        assert got[u]["loss_scale"] == ref[u]["loss_scale"], u


def test_each_process_destroys_its_process_group_when_training_returns():
    """fairseq 0.12 never destroys its process groups and keeps its global group cached on
    ``get_global_group``; both are gone once its distributed_main returned."""
    cfg = OmegaConf.structured(FairseqConfig())
    cfg.model = {}
    cfg.common.cpu = True
    dt = cfg.distributed_training
    dt.distributed_world_size, dt.distributed_rank = 1, 0
    dt.distributed_init_method = f"tcp://localhost:{_free_port()}"
    during = []

    def main(cfg):
        during.append(torch.distributed.get_backend(distributed_utils.get_global_group()))

    try:
        distributed_utils.distributed_main(0, main, cfg, {})
        assert during == ["gloo"]
        assert not torch.distributed.is_initialized()
        assert not hasattr(distributed_utils.get_global_group, "_global_group")  # fairseq's cache
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_torchrun_two_cpu_processes_match_one_process(toy_data, tmp_path, one_process):
    """torchrun without --distributed-world-size: one job of two processes (gloo)."""
    proc, recs = torchrun(toy_data, tmp_path, "--max-update", "12", "--no-save")
    text = proc.stdout + proc.stderr
    assert "distributed init (rank 1): env://" in text and "backend gloo instead of nccl" in text
    _assert_same_trajectory(by_update(recs), one_process)


def test_cpu_world_size_spawns_the_processes(toy_data, tmp_path, one_process):
    """fairseq-train --cpu --distributed-world-size 2, no launcher (stock: AssertionError, 0 GPUs).
    Rank 0 also measures the forward divergence every 4 updates, on the model inside the
    data-parallel wrapper and alone (a collective on one rank would hang the run). The spawned
    processes leave with os._exit after their atexit handlers: the fault plugin's dumps."""
    div, dump = tmp_path / "div.jsonl", tmp_path / "dump"
    dump.mkdir()
    proc, recs = run([BIN / "fairseq-train", *fault_args(toy_data, tmp_path, *BASE, "--distributed-world-size",
                                                          "2", "--max-update", "12", "--no-save",
                                                          "--precision-divergence-interval", "4",
                                                          "--precision-divergence", div)],
                     env={"FAULT_DUMP_DIR": str(dump)})
    hashes = [json.loads((dump / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert hashes[0]["sha256"] == hashes[1]["sha256"]
    assert hashes[0]["forwards"] == hashes[1]["forwards"] == 13  # 12 updates + 1 skipped
    assert "distributed init (rank 1): tcp://localhost:" in proc.stdout + proc.stderr
    _assert_same_trajectory(by_update(recs), one_process)
    lines = [json.loads(line) for line in div.read_text().splitlines()]
    assert [r["update"] for r in lines] == [0, 4, 8]  # once per update: rank 0 only
    assert "decoder.output_projection" in lines[0]["modules"]  # not "module.decoder..."


def test_overflow_on_one_rank_makes_every_rank_skip_and_back_off(toy_data, tmp_path):
    trace, dump = tmp_path / "trace.jsonl", tmp_path / "dump"
    dump.mkdir()
    _, recs = torchrun(toy_data, tmp_path, "--max-update", "10", "--no-save", "--scale-trace", trace,
                       "--fp16-scale-window", "1000", "--fault", "grad-overflow", "--fault-at", "4",
                       "--fault-rank", "1", env={"FAULT_DUMP_DIR": str(dump)})
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    # rank 0 writes the trace (the ranks hold the same all-reduced gradients): 10 updates + 1 skipped
    assert [l["rank"] for l in lines] == [0] * 11 and [l["update"] for l in lines] == list(range(1, 12))
    assert [l["update"] for l in lines if l["skipped"]] == [4]
    assert [l["loss_scale"] for l in lines[2:5]] == [128.0, 64.0, 64.0]
    assert recs[-1]["skipped"] == 1.0
    hashes = [json.loads((dump / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert hashes[0]["forwards"] == hashes[1]["forwards"] == 11
    assert hashes[0]["sha256"] == hashes[1]["sha256"]  # the replicas did not drift


def test_distributed_resume_continues_like_an_uninterrupted_run(toy_data, tmp_path):
    flags = ["--save-interval-updates", "5", "--fp16-init-scale", "4096", "--fp16-scale-window", "3"]
    _, full = torchrun(toy_data, tmp_path / "full", *flags, "--max-update", "15")
    torchrun(toy_data, tmp_path / "cut", *flags, "--max-update", "5")
    proc, rest = torchrun(toy_data, tmp_path / "cut", *flags, "--max-update", "15")
    assert "Loaded checkpoint" in proc.stdout + proc.stderr
    ref, got = by_update(full), by_update(rest)
    assert sorted(got) == list(range(6, 16))
    for u in got:
        assert got[u]["loss"] == pytest.approx(ref[u]["loss"], abs=2e-3), u
        assert got[u]["loss_scale"] == ref[u]["loss_scale"] and got[u]["skipped"] == ref[u]["skipped"], u
    assert len({r["loss_scale"] for r in full}) > 1  # the scale moved


def test_a_rank_whose_loss_is_not_finite_stops_every_rank_with_one_message(toy_data, tmp_path):
    """--max-consecutive-overflows decides over all ranks: rank 1 alone gets NaN losses from
    update 3 on; both ranks count the updates, stop together and name the same cause (a rank
    stopping alone would leave the other waiting in the next all-reduce)."""
    proc, _ = torchrun(toy_data, tmp_path, "--max-update", "20", "--no-save", "--max-consecutive-overflows", "3",
                       "--fault", "nan-loss", "--fault-at", "3", "--fault-every", "1", "--fault-rank", "1",
                       check=False)
    assert proc.returncode != 0
    stops = [line for line in proc.stderr.splitlines()
             if "FloatingPointError: fairseq_fp16: 3 consecutive updates skipped" in line]
    assert len(stops) >= 2 and len({s.split("FloatingPointError: ", 1)[1] for s in stops}) == 1, stops
    assert "the forward pass is finite up to the model's output but the loss is not" in stops[0]
