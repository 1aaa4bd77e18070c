"""The op census (scripts/op_census.py, run_stats --census-updates): launches, bytes and syncs."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY_MODEL, TRAIN, USER_DIR
from fairseq_fp16_tools.bench.op_census import (OpCensus, classify_op, diff_table, foreach_launches,
                                                 run_census, table)


def test_an_elementwise_op_reads_its_inputs_and_writes_its_output():
    n = 2**20  # 4 MB of fp32
    a, b = torch.ones(n), torch.ones(n)
    with OpCensus() as census:
        c = a + b
        c.view(1024, 1024).t()  # views launch nothing
        c.add_(1.0)  # in place: reads and writes c
        torch.empty(n)  # allocations launch nothing
        float(c.sum())  # a host sync
        line = sys._getframe().f_lineno - 1
    s = census.summary(updates=1)
    assert s["launches"] == 3 and s["syncs"] == 1
    here = "test_an_elementwise_op_reads_its_inputs_and_writes_its_output"
    assert s["sync_sites"] == {f"forward tests/test_op_census.py:{line} ({here})": 1}
    assert s["ops"]["add"] == [1, 12.0] and s["ops"]["add_"] == [1, 8.0]
    assert s["by_phase"]["forward"]["launches"] == 3


def test_indexed_ops_count_the_elements_they_touch():
    x, idx = torch.ones(2**16, 64), torch.zeros(2**16, 1, dtype=torch.long)  # 16 MB of fp32
    with OpCensus() as census:
        x.gather(-1, idx)
    # the index (8 bytes an entry) and the elements it names read and written (4 bytes each)
    assert census.summary(1)["ops"]["gather"] == [1, 1.0]


def test_phases_backward_and_step_and_per_update_averages():
    w = torch.ones(64, requires_grad=True)
    census = OpCensus()
    for _ in range(2):
        with census:
            (w * 2).sum().backward()
            census.in_step = True
            with torch.no_grad():
                w.sub_(w.grad)
            census.in_step = False
            w.grad = None
    s = census.summary(updates=2)
    assert s["by_phase"]["forward"]["launches"] == 3  # mul, sum and the seed gradient (ones_like)
    assert s["by_phase"]["step"]["launches"] == 1  # sub_
    assert s["by_phase"]["backward"]["launches"] >= 1
    assert s["launches"] == sum(p["launches"] for p in s["by_phase"].values())


def test_cpu_half_products_run_in_fp32_and_count_as_the_half_product():
    a = torch.randn(64, 32).half()
    b = torch.randn(32, 16).half()
    census = OpCensus(fp32_products=True)
    with census:
        out = a @ b
        census.counting = False
        a @ b  # run, not counted
    assert out.dtype == torch.float16
    assert torch.equal(out, (a.float() @ b.float()).half())
    s = census.summary(1)
    assert s["ops"]["mm"][0] == 1 and s["by_class"]["matmul"]["launches"] == 1


@pytest.mark.parametrize("name,label", [
    ("_fused_adamw_", "optimizer"), ("_foreach_norm", "optimizer"),
    ("_scaled_dot_product_flash_attention_for_cpu", "attention"), ("addmm", "matmul"),
    ("_linear_pointwise", "matmul"),
    ("_log_softmax", "softmax/norm"), ("native_layer_norm_backward", "softmax/norm"),
    ("_to_copy", "copies"), ("relu", "elementwise/other"),
])
def test_op_classes(name, label):
    assert classify_op(name) == label


def test_the_tables_name_each_run_and_the_largest_differences():
    base = {"launches": 10, "mb": 5.0, "syncs": 1, "by_class": {}, "ops": {"mm": [4, 3.0], "add": [6, 2.0]}}
    other = {**base, "ops": {"mm": [4, 1.5], "add": [6, 2.0], "addcmul": [2, 0.5]}}
    from fairseq_fp16_tools.bench.op_census import CLASSES

    for c in (base, other):
        c["by_class"] = {k: {"launches": 1, "mb": 1.0} for k, _ in CLASSES}
    rows = diff_table(base, other).splitlines()
    assert rows[1].split() == ["addcmul", "+2", "+0.5"] and rows[2].split() == ["mm", "+0", "-1.5"]
    text = table({"fp32": base, "fp16": {"error": "boom"}}).splitlines()
    assert text[2].split()[:4] == ["fp32", "10", "5.0", "1.0"]
    assert text[3] == f"{'fp16':18s} census failed: boom"


@pytest.mark.slow
def test_run_stats_counts_steady_updates_of_a_fairseq_run(toy_data, tmp_path):
    census, stats = tmp_path / "fp16.json", tmp_path / "stats.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "run_stats.py"), "--census-updates", "3:2", str(census),
           str(stats), "fairseq-train", str(toy_data), *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR,
           "--save-dir", str(tmp_path / "ck"), "--no-save", "--fp16", "--max-update", "8",
           "--fused-loss", "stream"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(census.read_text())
    assert (out["name"], out["first_update"], out["updates"]) == ("fp16", 3, 2)
    phases = out["by_phase"]
    assert phases["forward"]["launches"] > 0 and phases["backward"]["launches"] > 0
    # the plugin's step: the fp16 gradients copied to the fp32 masters, a fused AdamW, the
    # masters copied back into the model
    assert {"_foreach_copy_", "_fused_adamw_"} <= set(out["ops"])
    assert 0 < phases["step"]["launches"] < 60
    assert "addcmul" in out["ops"] and "logsumexp" not in out["ops"]  # the stream loss
    assert out["launches"] == pytest.approx(sum(p["launches"] for p in phases.values()), abs=0.1)
    # every sync has its caller: fairseq's encoder tests its padding mask on the device
    assert sum(out["sync_sites"].values()) == pytest.approx(out["syncs"], abs=0.1)
    assert any(s.startswith("forward fairseq/models/transformer/transformer_encoder.py:")
               and s.endswith(" (forward_scriptable)") for s in out["sync_sites"]), out["sync_sites"]


def test_run_stats_takes_one_window_at_a_time(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "run_stats.py"), "--census-updates", "1:0", "c.json",
           str(tmp_path / "s.json"), "fairseq-train", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert "--census-updates FIRST:COUNT needs FIRST >= 1 and COUNT >= 1, got 1:0" in proc.stderr
    both = [cmd[0], cmd[1], "--profile-updates", "1:1", "p.json", "--census-updates", "1:1", "c.json",
            str(tmp_path / "s.json"), "fairseq-train", "--help"]
    proc = subprocess.run(both, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--profile-updates and --census-updates: one at a time" in proc.stderr


def test_multi_tensor_ops_count_as_torchs_cuda_backend_launches_them():
    """One launch on torch's fast path; one a tensor where it would take its slow path."""
    dense = [torch.ones(4, 4), torch.ones(2, 3).t()]  # a transpose is dense
    assert foreach_launches("_foreach_norm", (dense, float("inf")), {}) == 1
    assert foreach_launches("_foreach_norm", (dense, 2), {}) == 1
    assert foreach_launches("_foreach_norm", (dense, 0), {}) == 2  # no order-0 kernel (torch 2.11)
    sliced = [torch.ones(4, 4), torch.ones(4, 4)[:, :2]]
    assert foreach_launches("_foreach_norm", (sliced, 2), {}) == 2
    mixed = [torch.ones(4), torch.ones(4).half()]
    assert foreach_launches("_foreach_mul", (mixed, 0.0), {}) == 2
    halves, floats = [torch.ones(4).half()] * 3, [torch.ones(4)] * 3
    assert foreach_launches("_foreach_copy_", (floats, halves), {}) == 1  # a copy may convert
    assert foreach_launches("_foreach_add_", (floats, halves), {}) == 3
    assert foreach_launches("_foreach_add_", (floats, [torch.ones(2, 2)] * 3), {}) == 3
    with OpCensus() as census:
        torch._foreach_norm(sliced, 2)
        torch._foreach_norm(dense, float("inf"))
    assert census.summary(1)["ops"]["_foreach_norm"][0] == 3


def test_the_census_runs_the_operators_a_cuda_run_would():
    """torch's dropout in every plugin mode (the CPU's counter-based masks are CPU-only), the CUDA
    paths of the half precisions, a mode's own choice kept, stock fairseq as it is."""
    from fairseq_fp16_tools.bench.op_census import census_flags

    assert census_flags("fp32") == ["--cpu-dropout", "torch"]
    assert census_flags("fp16") == ["--fp16", "--cpu-dropout", "torch", "--half-matmul", "native",
                                    "--attention-path", "torch", "--cpu-length-multiple", "1",
                                    "--fused-loss", "stream"]
    assert census_flags("fp16-cache")[:3] == ["--fp16", "--fused-loss", "cache"]
    assert census_flags("fp16-cache").count("--fused-loss") == 1
    assert census_flags("fp32-stock") == []


@pytest.mark.slow
def test_an_update_that_overflows_launches_no_more_than_one_that_applies(toy_data):
    """The census by kind of a fairseq fp16 run whose first updates overflow (a scale of 2**24):
    the watch armed after an overflow adds a few launches to a forward, the attribution of an
    overflow a few more, and the step it skips more than pays for them."""
    census = run_census(toy_data, "fp16", " ".join(TINY_MODEL) + " --max-tokens 1000 --fp16-init-scale 16777216",
                        first=1, count=2)
    kinds = census["kinds"]
    assert {"applied", "overflowed", "armed_overflowed"} <= set(kinds), set(kinds)
    applied, armed = kinds["applied"], kinds["armed_overflowed"]
    assert census["launches"] == applied["launches"] and applied["updates"] == 2
    forward = applied["by_phase"]["forward"]["launches"]
    assert armed["by_phase"]["forward"]["launches"] <= forward + 10
    assert armed["by_phase"]["step"]["launches"] == 0
    assert armed["launches"] <= applied["launches"]
    if "armed_applied" in kinds:  # the first step also builds the optimizer's state
        assert kinds["armed_applied"]["by_phase"]["forward"]["launches"] <= forward + 6
