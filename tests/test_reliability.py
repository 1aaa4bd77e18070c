"""Reliability: poisoned batches, runs that cannot heal, crashes, bad checkpoint files.

Faults are injected with the test plugin ``tests/fault_plugin`` (a --user-dir
that loads fairseq_fp16 and adds a criterion that poisons chosen updates).
"""

import copy
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess

import pytest
import torch

import fairseq_fp16  # noqa: F401
from fairseq_fp16.core.master_weights import tag_param_names

from conftest import BIN, ROOT, TINY_MODEL, TRAIN, parse_json_records, plugin_optimizer
from test_diagnostics import fairseq_cfg

FAULT_DIR = str(ROOT / "tests" / "fault_plugin")
FAULTY = ["--criterion", "faulty_label_smoothed_cross_entropy"]


def fault_args(data, save_dir, *extra):
    args = [data, *TINY_MODEL, *TRAIN, "--save-dir", save_dir, "--user-dir", FAULT_DIR, *FAULTY, *extra]
    return [str(a) for a in args]


def train_faulty(data, save_dir, *extra, env=None, check=True):
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run([str(BIN / "fairseq-train"), *fault_args(data, save_dir, *extra)],
                          capture_output=True, text=True, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"fairseq-train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc, parse_json_records(proc.stdout + proc.stderr)["train_inner"]


# ------------------------------------------------------------ poisoned batches
def _tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).half()
    tag_param_names(model.named_parameters())
    return model


def _loss(model, poison=False):
    x = torch.randn(32, 8).to(next(model.parameters()).dtype)
    loss = model(x).float().pow(2).mean()
    return loss * float("nan") if poison else loss


def _snapshot(opt, model):
    state = copy.deepcopy(opt.state_dict())
    scaler = state.pop("scaler")
    return state, scaler, [p.detach().clone() for p in model.parameters()]


def _assert_bitwise_equal(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_nan_loss_update_leaves_masters_and_optimizer_state_bit_identical(precision):
    model = _tiny_model().to(torch.float16 if precision == "fp16" else torch.bfloat16)
    opt = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=10), list(model.parameters()),
                           precision)
    for _ in range(3):  # Adam moments and step counts are non-trivial
        opt.zero_grad()
        opt.backward(_loss(model))
        opt.clip_grad_norm(0.0)
        opt.step()
    before_state, before_scaler, before_weights = _snapshot(opt, model)
    opt.zero_grad()
    opt.backward(_loss(model, poison=True))
    expected = "64" if precision == "fp16" else "1"  # fp16 backs off; bf16 has no scale to lower
    with pytest.raises(OverflowError, match=f"setting loss scale to: {expected}$"):
        opt.clip_grad_norm(0.0)
    opt.zero_grad()
    after_state, after_scaler, after_weights = _snapshot(opt, model)
    _assert_bitwise_equal(before_state["master_params"], after_state["master_params"], "masters")
    _assert_bitwise_equal(before_state["optimizer"], after_state["optimizer"], "optimizer")
    _assert_bitwise_equal(before_weights, after_weights, "model")
    assert after_scaler["num_overflows"] == before_scaler["num_overflows"] + 1
    assert opt.overflow.skipped == 1 and opt.overflow.consecutive == 1
    # the next clean update steps normally and resets the run of overflows
    opt.backward(_loss(model))
    opt.clip_grad_norm(0.0)
    opt.step()
    assert opt.overflow.consecutive == 0
    assert not torch.equal(model[0].weight, after_weights[0])


def test_consecutive_overflow_count_survives_a_checkpoint():
    model = _tiny_model()
    opt = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=5), list(model.parameters()), "fp16")
    for _ in range(2):
        opt.zero_grad()
        opt.backward(_loss(model, poison=True))
        with pytest.raises(OverflowError):
            opt.clip_grad_norm(0.0)
    state = opt.state_dict()
    again = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=5), list(model.parameters()), "fp16")
    again.load_state_dict(state)
    assert (again.overflow.consecutive, again.overflow.skipped, again.loss_scaler.loss_scale) == (2, 2, 32.0)


@pytest.mark.parametrize("loss_scale,counted", [(None, [0, 0, 1]), ("8", [1, 2, 3])])
def test_only_overflows_a_smaller_scale_cannot_fix_are_counted(loss_scale, counted):
    """Dynamic scale: gradient-only overflows are the scale search; a NaN loss counts. Static: all count."""
    model = _tiny_model()
    opt = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=10, loss_scale=loss_scale),
                           list(model.parameters()), "fp16")
    seen = []
    for poison in (False, False, True):
        opt.zero_grad()
        loss = _loss(model, poison=poison)
        opt.backward(loss * 2.0**100 if not poison else loss)  # finite loss, overflowing fp16 gradients
        with pytest.raises(OverflowError):
            opt.clip_grad_norm(0.0)
        seen.append(opt.overflow.consecutive)
    assert seen == counted


def test_a_static_scale_too_high_is_named_as_the_cause():
    """--loss-scale 1048576 under fp16: finite losses, every gradient overflows; the stop says
    the static scale is the cause and how to lower it."""
    model = _tiny_model()
    opt = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=2, loss_scale="1048576"),
                           list(model.parameters()), "fp16")
    opt.zero_grad()
    opt.backward(_loss(model))
    with pytest.raises(OverflowError, match="setting loss scale to: 1048576$"):
        opt.clip_grad_norm(0.0)
    opt.zero_grad()
    opt.backward(_loss(model))
    with pytest.raises(FloatingPointError, match=(
            r"2 consecutive updates skipped .* \(--max-consecutive-overflows 2; loss scale now 1\.04858e\+06\): "
            r"the forward pass and loss are finite, but the gradients overflow fp16 at the static loss scale "
            r"1048576, which is too high for them \(in: [0-9.a-z, ]+\); lower --loss-scale, or use "
            r"--loss-scale 0 \(dynamic: the scale backs off until the gradients fit\)$")):
        opt.clip_grad_norm(0.0)


def test_a_norm_that_overflows_with_finite_gradients_is_named_as_the_cause(caplog):
    """bf16 gradients of 1e38 are finite, the sum of their squares is not: no parameter is to
    blame, and the message says so instead of naming none."""
    caplog.set_level(logging.INFO, logger="fairseq_fp16.optim.mixed_precision")
    model = _tiny_model().bfloat16()
    opt = plugin_optimizer(fairseq_cfg(max_consecutive_overflows=2), list(model.parameters()),
                           "bf16")
    for attempt in (1, 2):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e38)
        if attempt == 1:
            with pytest.raises(OverflowError):
                opt.clip_grad_norm(0.0)
    with pytest.raises(FloatingPointError, match=(
            r"\(--max-consecutive-overflows 2; loss scale now 1\): the gradient norm overflowed although "
            r"every gradient is finite \(the sum of their squares exceeds the fp32 range\): the gradients "
            r"have grown enormous; lower --lr, and clip with --clip-norm so that the updates stay bounded$")):
        opt.clip_grad_norm(0.0)
    assert caplog.messages.count("gradient norm overflow: every gradient is finite, the sum of their "
                                 "squares is not") == 2


@pytest.mark.slow
def test_nan_batch_is_skipped_and_the_run_heals(toy_data, tmp_path):
    trace = tmp_path / "trace.jsonl"
    proc, recs = train_faulty(toy_data, tmp_path, "--fp16", "--max-update", "12", "--no-save",
                              "--fault", "nan-loss", "--fault-at", "5", "--scale-trace", trace)
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    assert [l["update"] for l in lines if l["skipped"]] == [5]
    assert [l["loss_scale"] for l in lines[3:6]] == [128.0, 64.0, 64.0]
    assert len(recs) == 12 and recs[-1]["skipped"] == 1.0
    losses = [r["loss"] for r in recs]
    assert all(l == l and l < 20 for l in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_run_that_cannot_heal_stops_naming_the_first_non_finite_module(toy_data, tmp_path):
    proc, recs = train_faulty(
        toy_data, tmp_path, "--fp16", "--max-update", "20", "--no-save", "--max-consecutive-overflows", "4",
        "--fault", "scale-module", "--fault-module", "encoder.layers.0.fc1", "--fault-factor", "1e5",
        "--fault-at", "3", check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(
        r"FloatingPointError: fairseq_fp16: 4 consecutive updates skipped for non-finite gradients "
        r"\(--max-consecutive-overflows 4; loss scale now 8\): the "
        r"forward pass is not finite: first inf in the output of encoder\.layers\.0\.fc1 "
        r"\(Linear, float16\), which loss scaling cannot fix; keep it in fp32 "
        r"\(--fp32-modules 'encoder\\\.layers\\\.0\\\.fc1'\)", last), last
    assert len(recs) == 2  # updates 1-2 trained, then four skipped attempts and the stop


@pytest.mark.slow
def test_bf16_nan_losses_stop_with_the_loss_named(toy_data, tmp_path):
    proc, recs = train_faulty(
        toy_data, tmp_path, "--bf16", "--max-update", "20", "--no-save", "--max-consecutive-overflows", "3",
        "--fault", "nan-loss", "--fault-at", "2", "--fault-every", "1", check=False)
    assert proc.returncode != 0
    assert re.search(r"FloatingPointError: fairseq_fp16: 3 consecutive updates skipped .* loss scale now 1\): "
                     r"the forward pass is finite up to the model's output but the loss is not", proc.stderr), proc.stderr[-2000:]
    assert len(recs) == 1


# ------------------------------------------------------------- crash and resume
def _losses_by_update(recs):
    return {int(r["num_updates"]): (r["loss"], r["loss_scale"]) for r in recs}


@pytest.mark.slow
def test_kill_during_checkpoint_copy_keeps_checkpoint_last_loadable(toy_data, tmp_path):
    flags = ["--fp16", "--fp16-init-scale", "4096", "--fp16-scale-window", "3",
             "--save-interval-updates", "4", "--max-update", "12"]
    _, full = train_faulty(toy_data, tmp_path / "full", *flags)
    # killed half-way through the second copy to checkpoint_last.pt (after update 8)
    proc, _ = train_faulty(toy_data, tmp_path / "cut", *flags, env={"FAULT_KILL_IN_COPY": "2"}, check=False)
    assert proc.returncode == -signal.SIGKILL
    last = torch.load(tmp_path / "cut" / "checkpoint_last.pt", weights_only=True)
    assert last["optimizer_history"][-1]["num_updates"] == 4  # the previous save, whole
    proc, rest = train_faulty(toy_data, tmp_path / "cut", *flags)
    assert "Loaded checkpoint" in proc.stdout + proc.stderr
    ref = _losses_by_update(full)
    got = _losses_by_update(rest)
    assert sorted(got) == list(range(5, 13))
    for u, (loss, scale) in got.items():
        assert loss == pytest.approx(ref[u][0], abs=2e-3) and scale == ref[u][1], u


@pytest.mark.slow
def test_a_truncated_checkpoint_last_resumes_from_the_newest_intact_one(toy_data, tmp_path):
    """What the atomic copy prevents (a kill while stock fairseq copies checkpoint_last.pt in
    place), and what a resume then does: it continues from the newest intact checkpoint with a
    warning naming both files, keeps the damaged bytes aside, and trains as an uninterrupted
    run from there."""
    flags = ["--fp16", "--save-interval-updates", "4", "--max-update", "12"]
    _, full = train_faulty(toy_data, tmp_path / "full", *flags)
    proc, _ = train_faulty(toy_data, tmp_path, *flags, env={"FAULT_KILL_IN_COPY": "2", "FAULT_STOCK_COPY": "1"},
                           check=False)
    assert proc.returncode == -signal.SIGKILL
    ckpt = tmp_path / "checkpoint_last.pt"
    damaged = ckpt.read_bytes()
    proc, rest = train_faulty(toy_data, tmp_path, *flags)
    assert re.search(rf"fairseq_fp16: {re.escape(str(ckpt))} is truncated or corrupt \(RuntimeError: "
                     r"PytorchStreamReader failed reading zip archive: failed finding central directory\); "
                     r"resumed from checkpoint_1_8\.pt \(update 8\), the intact checkpoint beside it with the most "
                     r"updates; the damaged "
                     r"file is kept as checkpoint_last\.pt\.damaged", proc.stdout + proc.stderr), proc.stdout[-2000:]
    assert (tmp_path / "checkpoint_last.pt.damaged").read_bytes() == damaged
    assert [r["num_updates"] for r in rest] == [9, 10, 11, 12]
    ref = _losses_by_update(full)
    assert _losses_by_update(rest) == {u: ref[u] for u in (9, 10, 11, 12)}


def _kill_when_logged(cmd, env, update):
    """Start fairseq-train, SIGKILL it once it logs ``update``; returns (rc, its train records)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in proc.stdout:
        seen += parse_json_records(line)["train_inner"]
        if seen and int(seen[-1]["num_updates"]) >= update:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return proc.returncode, seen


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_matches_an_uninterrupted_run(toy_data, tmp_path):
    flags = ["--fp16", "--fp16-init-scale", "4096", "--fp16-scale-window", "3",
             "--save-interval-updates", "3", "--max-update", "21"]
    _, full = train_faulty(toy_data, tmp_path / "full", *flags)
    ref = _losses_by_update(full)
    cmd = [str(BIN / "fairseq-train"), *fault_args(toy_data, tmp_path / "cut", *flags)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    kill_points = sorted(random.Random(20261130).sample(range(4, 19), 3))
    resumed_from = []
    for point in kill_points:
        rc, seen = _kill_when_logged(cmd, env, point)
        assert rc == -signal.SIGKILL and seen, point
        resumed_from.append(int(seen[0]["num_updates"]) - 1)
        for u, (loss, scale) in _losses_by_update(seen).items():  # before each kill, too
            assert loss == pytest.approx(ref[u][0], abs=2e-3) and scale == ref[u][1], (point, u)
    # each launch resumed from the last checkpoint (every 3 updates) written before the previous kill
    assert resumed_from[0] == 0
    assert all(r % 3 == 0 and p - 3 <= r <= p for r, p in zip(resumed_from[1:], kill_points))
    proc, rest = train_faulty(toy_data, tmp_path / "cut", *flags)
    got = _losses_by_update(rest)
    last = min(got) - 1
    assert max(got) == 21 and last % 3 == 0 and kill_points[-1] - 3 <= last <= kill_points[-1]
    # the last resume is in epoch 2: the batches must be composed as in the uninterrupted run
    assert (tmp_path / "cut" / f"checkpoint_2_{last}.pt").exists()
    for u, (loss, scale) in got.items():
        assert loss == pytest.approx(ref[u][0], abs=2e-3) and scale == ref[u][1], u
    final = torch.load(tmp_path / "cut" / "checkpoint_last.pt", weights_only=True)
    ref_final = torch.load(tmp_path / "full" / "checkpoint_last.pt", weights_only=True)
    assert final["last_optimizer_state"]["scaler"] == ref_final["last_optimizer_state"]["scaler"]
    for k, t in ref_final["last_optimizer_state"]["master_params"].items():
        torch.testing.assert_close(final["last_optimizer_state"]["master_params"][k], t, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------- bad files
@pytest.mark.slow
def test_bad_files_give_clear_errors_and_overwrite_nothing(toy_data, tmp_path):
    from conftest import train

    train(toy_data, tmp_path / "good", "--fp16", "--max-update", "2")
    good = tmp_path / "good" / "checkpoint_last.pt"
    # another architecture
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(good, other / "checkpoint_last.pt")
    before = (other / "checkpoint_last.pt").read_bytes()
    wider = [a if a != "32" else "48" for a in TINY_MODEL]
    proc, _ = train(toy_data, other, "--fp16", "--max-update", "4", model=wider, check=False)
    assert proc.returncode != 0
    assert "Cannot load model parameters from checkpoint" in proc.stderr
    assert "please ensure that the architectures match" in proc.stderr
    assert (other / "checkpoint_last.pt").read_bytes() == before
    # random bytes
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "checkpoint_last.pt").write_bytes(random.Random(2).randbytes(4096))  # an IndexError in torch
    proc, _ = train(toy_data, junk, "--fp16", "--max-update", "4", check=False)
    assert re.search(r"checkpoint .*junk/checkpoint_last\.pt is truncated or corrupt \(IndexError: "
                     r".*nothing was loaded or overwritten; move the file away to start over", proc.stderr)
    # a data-bin with a missing index
    data = tmp_path / "data"
    shutil.copytree(toy_data, data)
    (data / "train.src-tgt.src.idx").unlink()
    proc, _ = train(data, tmp_path / "nodata", "--fp16", "--max-update", "2", check=False)
    assert proc.returncode != 0
    assert re.search(r"FileNotFoundError: Dataset not found: train \(.*data\)", proc.stderr), proc.stderr[-1500:]
    assert not (tmp_path / "nodata" / "checkpoint_last.pt").exists()


# ------------------------------------------------------------------------ soak
def _rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.soak
def test_soak_2000_fp16_updates_with_an_overflow_every_100(toy_data, tmp_path):
    """``make soak``: the scale recovers after every injected overflow, RSS stays flat, loss falls."""
    import time

    updates, every = 2000, 100
    trace = tmp_path / "trace.jsonl"
    cmd = [str(BIN / "fairseq-train"), *fault_args(
        toy_data, tmp_path, "--fp16", "--fp16-scale-window", "20", "--max-update", str(updates),
        "--fault", "grad-overflow", "--fault-at", str(every), "--fault-every", str(every),
        "--scale-trace", trace, "--no-save", "--disable-validation", "--log-interval", "50")]
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    rss = []  # (seconds, MB)
    start = time.time()
    while proc.poll() is None:
        try:
            rss.append((time.time() - start, _rss_mb(proc.pid)))
        except FileNotFoundError:
            break
        time.sleep(0.5)
    log.close()
    text = (tmp_path / "train.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    assert lines[-1]["num_updates"] == updates
    injected = [i for i, l in enumerate(lines) if l["skipped"] and (i + 1) % every == 0]
    assert len(injected) >= updates // every - 1
    for i in injected:  # back to the scale before the overflow within the next 99 attempts
        before = lines[i - 1]["loss_scale"]
        assert lines[i]["loss_scale"] == before / 2
        assert max(l["loss_scale"] for l in lines[i + 1:i + every]) >= before, i
    # RSS: after the first quarter (allocator warm-up), flat within 5 % + 20 MB
    n = len(rss)
    mid = sorted(m for _, m in rss[n // 4:n // 2])[n // 8]
    end = sorted(m for _, m in rss[3 * n // 4:])[n // 8]
    assert end <= mid * 1.05 + 20, (mid, end)
    recs = parse_json_records(text)["train_inner"]
    losses = [r["loss"] for r in recs]
    assert sum(losses[-4:]) / 4 < sum(losses[1:5]) / 4 - 0.5
    summary = {"updates": updates, "attempts": len(lines), "skipped": sum(l["skipped"] for l in lines),
               "seconds": round(rss[-1][0], 1), "rss_mb_q2": round(mid, 1), "rss_mb_q4": round(end, 1),
               "loss_first": losses[0], "loss_last": losses[-1],
               "min_scale": min(l["loss_scale"] for l in lines), "max_scale": max(l["loss_scale"] for l in lines)}
    print("SOAK", json.dumps(summary))
