"""Diagnostics: overflow attribution, underflow/headroom and lost-update statistics, traces."""

import json
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

import fairseq_fp16  # noqa: F401  (registers fp16_adam)
from fairseq_fp16.core.diagnostics import (
    LostUpdateMonitor,
    NonFiniteWatch,
    attribute_overflow,
    gradient_precision_stats,
)
from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.master_weights import tag_param_names

from conftest import allocation_bytes, plugin_optimizer, train


def named_half(**shapes):
    params = {n: torch.nn.Parameter(torch.zeros(s).half()) for n, s in shapes.items()}
    tag_param_names(params.items())
    return params


def test_injected_inf_is_attributed_to_its_parameter():
    p = named_half(**{"encoder.fc1.weight": (4, 4), "decoder.fc2.weight": (8,), "decoder.fc2.bias": (2,)})
    for t in p.values():
        t.grad = torch.ones_like(t)
    p["decoder.fc2.weight"].grad[[1, 5]] = float("inf")
    p["encoder.fc1.weight"].grad[0, 0] = float("nan")
    assert attribute_overflow(list(p.values())) == [
        {"param": "decoder.fc2.weight", "nonfinite": 2, "numel": 8},
        {"param": "encoder.fc1.weight", "nonfinite": 1, "numel": 16},
    ]


def test_underflow_fractions_and_headroom_match_hand_computation():
    p = named_half(**{"l.weight": (8,), "l.bias": (2,)})
    # fp16: smallest normal 2^-14, smallest subnormal 2^-24, max 65504
    p["l.weight"].grad = torch.tensor([0.0, 2**-24, 2**-20, 2**-15, 2**-14, 1.0, 4.0, -1024.0]).half()
    p["l.bias"].grad = torch.tensor([0.0, 2.0]).half()
    s = gradient_precision_stats(list(p.values()), torch.float16)["l"]
    assert s["numel"] == 10
    assert s["zero_frac"] == pytest.approx(2 / 10)
    assert s["subnormal_frac"] == pytest.approx(3 / 10)  # 2^-24, 2^-20, 2^-15
    assert s["max_abs"] == 1024.0
    assert s["headroom_log2"] == pytest.approx(math.log2(65504 / 1024))


def test_fp32_gradients_measured_as_if_half():
    w = torch.nn.Parameter(torch.zeros(3))
    tag_param_names([("ln.weight", w)])
    w.grad = torch.tensor([1e-9, 1e-6, 1.0])  # 1e-9 rounds to 0 in fp16, 1e-6 is subnormal
    s = gradient_precision_stats([w], torch.float16)["ln"]
    assert (s["zero_frac"], s["subnormal_frac"]) == pytest.approx((1 / 3, 1 / 3))


def test_lost_update_fraction():
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1000.0, 1000.0, 3.0]))
    tag_param_names([("m.weight", w)])
    mon = LostUpdateMonitor(torch.float16)
    mon.before_step([w])
    # fp16 ulp: 2^-10 at 1.0, 0.5 at 1000; half an ulp is the rounding threshold
    w.data += torch.tensor([2**-12, 2**-9, 0.2, 0.3, 0.0])
    assert mon.after_step() == {"m": pytest.approx(2 / 4)}  # 2^-12 and 0.2 lost; 0 not counted


def test_non_finite_watch_names_the_first_module_only_while_armed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with torch.no_grad():
        model[1][0].weight.fill_(float("inf"))
    watch = NonFiniteWatch(model)

    def hooks():
        return sum(len(m._forward_hooks) for m in model.modules())

    model(torch.ones(2, 4))
    assert watch.first is None and hooks() == 0  # disarmed: no hooks, no checks, no syncs
    watch.arm()
    assert hooks() == 4  # every submodule: 0, 1, 1.0, 1.1
    with HostSyncCounter() as c:
        model(torch.ones(2, 4))
    assert c.count == 0  # armed, the checks queue reductions and wait for nothing
    with HostSyncCounter() as c:
        assert watch.first == {"module": "1.0", "type": "Linear", "dtype": "float32", "kind": "nan",
                               "shape": [2, 4]}
    assert c.count == 1  # one sync looks through every module's record
    with torch.no_grad():
        model[1][0].weight.fill_(1.0)
        model[1][0].bias.fill_(float("-inf"))
    watch.arm()
    for _ in range(3):  # a record per module output per forward, looked through in order
        model(torch.ones(2, 4))
    assert watch.first["kind"] == "inf" and watch.first["module"] == "1.0"
    watch.disarm()
    assert watch.first is None and hooks() == 0
    watch.arm()
    watch.remove()
    assert hooks() == 0
    watch.arm()
    model(torch.ones(2, 4))
    assert watch.first is None  # hooks removed


def peak_tensor_bytes(fn, tmp_path) -> int:
    """The most CPU tensor memory ``fn`` holds at once beyond what was held before it."""
    held = peak = 0
    for change in allocation_bytes(fn, tmp_path):
        held += change
        peak = max(peak, held)
    return peak


def test_an_armed_forward_holds_at_most_64_mib_of_outputs_the_forward_lets_go(tmp_path):
    # one child of 40 layers with outputs of 4 MiB; without gradients each output is freed
    # as the next one is made (the watch reduces what it holds when a child returns)
    model = torch.nn.Sequential(torch.nn.Sequential(*(torch.nn.ReLU() for _ in range(40))))
    x = torch.ones(1 << 20)
    watch = NonFiniteWatch(model)
    with torch.no_grad():
        disarmed = peak_tensor_bytes(lambda: model(x), tmp_path)
        watch.arm()
        armed = peak_tensor_bytes(lambda: model(x), tmp_path)
    assert disarmed <= 2 * 4 << 20
    # the outputs are reduced (and let go) once 64 MiB of them are held, not at the end
    assert disarmed + (16 << 20) < armed <= disarmed + (64 << 20) + (4 << 20) + 4096
    assert watch.first is None


def fairseq_cfg(**task):
    return OmegaConf.create({
        "optimizer": {"_name": "fp16_adam", "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-8,
                      "weight_decay": 0.0, "no_bias_correction": False, "no_decay_params": "bias",
                      "adam_backend": "fused", "lr": [1e-3]},
        "common": {"fp16_init_scale": 128, "fp16_scale_window": None, "fp16_scale_tolerance": 0.0,
                   "min_loss_scale": 1e-4, "threshold_loss_scale": None},
        "distributed_training": {"distributed_world_size": 1},
        "optimization": {"update_freq": [1]},
        "checkpoint": {"save_dir": task.pop("save_dir", "/tmp")},
        "task": {"loss_scale": None, "loss_scale_hysteresis": 1, **task},
    })


def step_syncs(opt, params):
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    with HostSyncCounter() as c:
        opt.multiply_grads(0.5)
        opt.clip_grad_norm(0.0)
        opt.step()
    return c.count


def test_diagnostics_off_cost_no_extra_host_sync(tmp_path):
    params = list(named_half(**{"a.weight": (64, 64), "a.bias": (64,)}).values())
    off = plugin_optimizer(fairseq_cfg(), params, "fp16")
    assert off.diagnostics is None
    # the one sync is the overflow test on the grad norm that fairseq's trainer reads anyway
    assert step_syncs(off, params) == 1
    on = plugin_optimizer(
        fairseq_cfg(scale_trace=str(tmp_path / "t.jsonl"), precision_stats_interval=1,
                    precision_stats=str(tmp_path / "s.jsonl")), params, "fp16")
    assert step_syncs(on, params) > 1
    assert json.loads((tmp_path / "t.jsonl").read_text())["update"] == 1
    assert set(json.loads((tmp_path / "s.jsonl").read_text())["layers"]) == {"a"}


def run_updates(opt, params, overflows=()):
    """One update per entry of ``overflows``-or-not: gradients 0.01, or inf where the update
    should overflow (OverflowError, as fairseq's trainer sees it)."""
    for overflow in overflows:
        opt.zero_grad()
        for p in params:
            p.grad = torch.full_like(p, float("inf") if overflow else 0.01)
        if overflow:
            with pytest.raises(OverflowError):
                opt.clip_grad_norm(0.0)
            continue
        opt.clip_grad_norm(0.0)
        opt.step()


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_fresh_run_starts_the_trace_over_and_a_resume_drops_what_came_after_its_checkpoint(
        tmp_path, caplog):
    """A fresh run replaces an earlier run's trace; a run resumed from an update-2 checkpoint
    keeps updates 1-2 and drops the 3-4 that the run it resumes went on to write."""
    caplog.set_level(logging.INFO, logger="fairseq_fp16.optim.traces")
    trace = tmp_path / "t.jsonl"
    params = list(named_half(**{"a.weight": (4, 4)}).values())
    cfg = fairseq_cfg(scale_trace=str(trace))
    run_updates(plugin_optimizer(cfg, params, "fp16"), params, [False] * 5)
    fresh = plugin_optimizer(cfg, params, "fp16")
    run_updates(fresh, params, [False, True])
    at_two = fresh.state_dict()  # 2 attempted, 1 applied
    run_updates(fresh, params, [False, False])
    assert [(r["update"], r["num_updates"]) for r in read_jsonl(trace)] == [(1, 1), (2, 1), (3, 2), (4, 3)]
    assert f"--scale-trace {trace}: a new run; the 5 records of an earlier run in the file are replaced" \
        in caplog.text
    resumed = plugin_optimizer(cfg, params, "fp16")
    resumed.load_state_dict(at_two)
    run_updates(resumed, params, [False])
    lines = read_jsonl(trace)
    assert [(r["update"], r["num_updates"], r["skipped"]) for r in lines] == \
        [(1, 1, False), (2, 1, True), (3, 2, False)]
    assert f"--scale-trace {trace}: resumed at update 3; 2 records from update 3 on" in caplog.text


def test_precision_stats_interval_counts_applied_updates(tmp_path, caplog):
    """--precision-stats-interval 2 with updates 2 and 5 skipped: statistics after applied
    updates 2 and 4 (attempts 3 and 6), each record with both counts."""
    caplog.set_level(logging.INFO, logger="fairseq_fp16.optim.traces")
    stats = tmp_path / "s.jsonl"
    params = list(named_half(**{"a.weight": (4, 4)}).values())
    opt = plugin_optimizer(
        fairseq_cfg(precision_stats_interval=2, precision_stats=str(stats)), params, "fp16")
    run_updates(opt, params, [False, True, False, False, True, False])
    assert [(r["update"], r["num_updates"]) for r in read_jsonl(stats)] == [(3, 2), (6, 4)]
    assert [m.split(":")[0] for m in caplog.messages if m.startswith("precision stats @")] == \
        ["precision stats @ num_updates 2", "precision stats @ num_updates 4"]


@pytest.mark.slow
def test_trace_of_a_restored_checkpoint_continues_from_it(toy_data, tmp_path):
    """fairseq-train: 6 updates, then --restore-file of the update-3 checkpoint up to update 4,
    then a fresh run of 2 updates, all with one --scale-trace file."""
    trace = tmp_path / "t.jsonl"
    flags = ["--fp16", "--scale-trace", trace]
    train(toy_data, tmp_path / "a", *flags, "--max-update", "6", "--save-interval-updates", "3")
    first = read_jsonl(trace)
    assert [r["update"] for r in first] == list(range(1, len(first) + 1)) and first[-1]["num_updates"] == 6
    at_three = next(r["update"] for r in first if r["num_updates"] == 3 and not r["skipped"])
    _, recs = train(toy_data, tmp_path / "b", *flags, "--max-update", "4", "--no-save",
                    "--restore-file", tmp_path / "a" / "checkpoint_1_3.pt")
    assert [r["num_updates"] for r in recs] == [4]
    lines = read_jsonl(trace)
    assert lines[:at_three] == first[:at_three]
    assert [r["update"] for r in lines] == list(range(1, len(lines) + 1)) and lines[-1]["num_updates"] == 4
    train(toy_data, tmp_path / "c", *flags, "--max-update", "2", "--no-save")
    lines = read_jsonl(trace)
    assert [r["update"] for r in lines] == list(range(1, len(lines) + 1)) and lines[-1]["num_updates"] == 2


@pytest.mark.slow
def test_two_processes_write_each_record_once(toy_data, tmp_path):
    """Under --distributed-world-size 2 the ranks hold the same all-reduced gradients: rank 0
    alone writes the trace and the statistics, one record per update."""
    from test_distributed import BASE, BIN, fault_args, run

    trace, stats = tmp_path / "t.jsonl", tmp_path / "s.jsonl"
    _, recs = run([BIN / "fairseq-train", *fault_args(
        toy_data, tmp_path, *BASE, "--distributed-world-size", "2", "--max-update", "4", "--no-save",
        "--scale-trace", trace, "--precision-stats-interval", "2", "--precision-stats", stats)])
    lines = read_jsonl(trace)
    skipped = int(recs[-1]["skipped"])
    assert [(r["rank"], r["update"]) for r in lines] == [(0, u) for u in range(1, 5 + skipped)]
    assert [r["num_updates"] for r in read_jsonl(stats)] == [2, 4]


@pytest.mark.slow
def test_trace_has_one_line_per_update_and_plots(toy_data, tmp_path):
    trace, stats = tmp_path / "trace.jsonl", tmp_path / "stats.jsonl"
    proc, recs = train(toy_data, tmp_path, "--fp16", "--fp16-init-scale", "1048576", "--max-update", "20",
                       "--scale-trace", trace, "--precision-stats-interval", "5",
                       "--precision-stats", stats, "--no-save")
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    skipped = int(recs[-1]["skipped"])
    assert len(lines) == 20 + skipped
    assert [l["update"] for l in lines] == list(range(1, 21 + skipped))
    assert sum(l["overflow"] for l in lines) == skipped > 0
    first = lines[0]
    assert first["overflow"] and first["overflow_params"] and first["overflow_params"][0]["nonfinite"] > 0
    assert all(l["grad_norm"] > 0 for l in lines if not l["overflow"])
    assert lines[-1]["num_updates"] == 20
    text = proc.stdout + proc.stderr
    assert "gradient overflow in: " in text and "precision stats @ num_updates 5: " in text
    st = [json.loads(l) for l in stats.read_text().splitlines()]
    assert [r["num_updates"] for r in st] == [5, 10, 15, 20]
    by_update = {l["update"]: l for l in lines}  # the trace's counts at each measured update
    assert all(by_update[r["update"]]["num_updates"] == r["num_updates"] for r in st)
    assert all({"zero_frac", "subnormal_frac", "headroom_log2", "lost_update_frac"} <= set(v)
               for r in st for v in r["layers"].values())
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run([sys.executable, ROOT / "scripts" / "plot_trace.py", "--scale-trace", trace,
                          "--precision-stats", stats, "--out", tmp_path / "plots"],
                         capture_output=True, text=True, check=True)
    for name in ("scale_trace.png", "precision_stats.png", "precision_stats_over_updates.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG", out.stdout


def test_forward_divergence_every_n_updates_leaves_training_unchanged(toy_data, tmp_path):
    """--precision-divergence-interval 4 over 10 updates: records before updates 1, 5 and 9
    (update_num 0, 4, 8), every module of the model, errors of a few fp16 units in the last
    place; the losses are those of the same run without it (eval-mode passes draw no random
    numbers and change no weight)."""
    out = tmp_path / "div.jsonl"
    acc = ["--half-matmul", "fp32-accumulate", "--max-update", "10", "--no-save"]
    proc, recs = train(toy_data, tmp_path / "a", "--fp16", *acc, "--precision-divergence-interval", "4",
                       "--precision-divergence", out)
    _, plain = train(toy_data, tmp_path / "b", "--fp16", *acc)
    assert [r["loss"] for r in recs] == [r["loss"] for r in plain]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["update"] for r in lines] == [0, 4, 8] and {r["dtype"] for r in lines} == {"float16"}
    mods = lines[-1]["modules"]
    assert "decoder.output_projection" in mods and "encoder.layers.0.fc1" in mods
    assert not any("dropout" in name for name in mods)  # identities in eval mode, left out
    eps = torch.finfo(torch.float16).eps
    assert all(0 <= e < 8 * eps for r in lines for e in r["modules"].values())
    assert max(lines[-1]["modules"].values()) > 0.1 * eps
    assert "forward divergence @ update 8 (relative to fp32): " in proc.stdout + proc.stderr
    import subprocess
    import sys

    from conftest import ROOT

    subprocess.run([sys.executable, ROOT / "scripts" / "plot_trace.py", "--precision-divergence", out,
                    "--out", tmp_path / "plots"], capture_output=True, text=True, check=True)
    assert (tmp_path / "plots" / "precision_divergence.png").read_bytes()[:4] == b"\x89PNG"
    # an fp32 run has no half forward to compare: said once, nothing written
    proc32, _ = train(toy_data, tmp_path / "c", "--max-update", "3", "--no-save",
                      "--precision-divergence-interval", "1", "--precision-divergence", tmp_path / "none.jsonl")
    assert (proc32.stdout + proc32.stderr).count("--precision-divergence-interval: this run has no fp32 "
                                                  "master weights") == 1
    assert not (tmp_path / "none.jsonl").exists()
