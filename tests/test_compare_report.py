"""scripts/compare.py and scripts/report.py on the tiny corpus: schema, table, plots, BLEU."""

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch
from sacrebleu.metrics import BLEU

from fairseq_fp16.core.half_matmul import cpu_has_amx, cpu_has_native_half

from conftest import ROOT, TINY_MODEL, TRAIN, parse_json_records, train

pytestmark = pytest.mark.slow
#: the flags of conftest's TRAIN that compare.py sets itself, with their values
FORBIDDEN_HERE = ("--task", "--optimizer", "--seed", "--log-format")


@pytest.fixture(scope="module")
def compared(toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp")
    train_args = " ".join(TINY_MODEL) + (
        " --adam-betas (0.9,0.98) --lr 1e-2 --lr-scheduler inverse_sqrt --warmup-updates 10"
        " --criterion label_smoothed_cross_entropy --max-tokens 1000 --max-update 30 --cpu"
        " --log-interval 5 --no-epoch-checkpoints --num-workers 0"
    )
    subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out,
                    "--modes", "fp16,fp32@seed2", "--train-args", train_args, "--gen-args", "--beam 1 --cpu",
                    "--short-max-words", "7"],
                   check=True, capture_output=True, text=True)
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "200"],
                         check=True, capture_output=True, text=True)
    return out, rep.stdout


def test_result_json_schema(compared):
    out, _ = compared
    for mode in ("fp32", "fp16"):
        r = json.loads((out / mode / "result.json").read_text())
        assert r["mode"] == mode and r["seed"] == 1
        t, g = r["train"], r["generate"]
        assert t["updates"] == 30 and t["updates_per_s"] > 0 and t["words_per_s"] > 0
        assert t["peak_rss_mb"] > 100
        assert [x["num_updates"] for x in t["train_inner"]] == [5, 10, 15, 20, 25, 30]
        assert t["valid"] and all("loss" in v and "wall" in v for v in t["valid"])
        assert g["n_sentences"] == 100 and set(g) >= {"bleu", "chrf", "bleu_signature", "chrf_signature"}
    r16 = json.loads((out / "fp16" / "result.json").read_text())
    assert [x["loss_scale"] for x in r16["train"]["train_inner"]] == [128] * 6
    assert "--fp16" in r16["train_command"] and "translation_fp16" in r16["train_command"]


def test_result_json_records_the_machine_and_the_matmul_path(compared):
    out, _ = compared
    r32, r16 = (json.loads((out / m / "result.json").read_text()) for m in ("fp32", "fp16"))
    m = r16["machine"]
    assert m == r32["machine"]
    assert m["cpu_cores"] == len(os.sched_getaffinity(0)) and m["device"] == "cpu"
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (m["torch"], m["python"]) == (torch.__version__, platform.python_version())
    assert m["fairseq"] == metadata.version("fairseq-fixed")
    assert (m["cpu_native_bf16"], m["cpu_native_fp16"]) == (
        cpu_has_native_half(torch.bfloat16), cpu_has_native_half(torch.float16))
    # --half-matmul auto on the CPU: fp32 accumulation unless the CPU has fp16 units
    path = "native kernels" if m["cpu_native_fp16"] else "fp32 accumulation, rounded to half"
    assert r16["half_matmul"] == f"{path} (--half-matmul auto)"
    assert r32["half_matmul"] is None
    # the code the runs came from: this checkout's commit (what a table's note names)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert r16["provenance"]["commit"] == r32["provenance"]["commit"] == head
    # fp32 accumulation checks its first training step: every product of the transformer routed
    assert r16["native_half_products"] == (None if m["cpu_native_fp16"] else 0)
    assert r32["native_half_products"] is None
    # --cpu-length-multiple auto pads the half run's batch lengths where its products run on AMX tiles
    amx = m["cpu_native_fp16"] and cpu_has_amx(torch.float16)
    assert r16["batch_lengths"] == ("padded to a multiple of 8 (--cpu-length-multiple auto)" if amx else None)
    assert r32["batch_lengths"] is None
    checked = "" if m["cpu_native_fp16"] else ", checked: no product of the first training step on native kernels"
    md = (out / "report.md").read_text()
    cpu_id = f", {m['cpu_id']}" if m.get("cpu_id") else ""
    assert f"\n\nMachine (all runs): {m['cpu']} ({m['cpu_cores']} cores{cpu_id}; torch kernels {m['cpu_capability']}; " in md
    assert f"\n\nCPU half-precision matrix products: fp16: {path} (--half-matmul auto){checked}.\n" in md
    # the half run's loss is the fused one (--fused-loss auto), fp32's is fairseq's
    r2 = json.loads((out / "fp32-seed2" / "result.json").read_text())
    assert (r16["fused_loss"], r32["fused_loss"], r2["fused_loss"]) == (True, False, False)
    assert ("\n\nLoss: fp32, fp32-seed2: fairseq's loss (log-softmax in fp32); fp16: fused fp32 loss from "
            "the logits (--fused-loss).\n") in md


def test_report_warns_when_runs_ran_on_different_machines():
    from fairseq_fp16_tools.report import machine_lines

    cpu = {"cpu": "AMD EPYC", "cpu_cores": 2, "cpu_capability": "AVX512", "cpu_native_bf16": True,
           "cpu_native_fp16": False, "device": "cpu", "torch": "2.13.0+cpu", "fairseq": "0.12.3.1",
           "python": "3.11.7"}
    same = ("AMD EPYC (2 cores; torch kernels AVX512; bf16 units: yes, fp16 units: no), trained on the CPU; "
            "torch 2.13.0+cpu, fairseq 0.12.3.1, Python 3.11.7")
    runs = [{"mode": "fp32", "machine": cpu, "half_matmul": None},
            {"mode": "bf16", "machine": cpu, "half_matmul": "native kernels (--half-matmul auto)"}]
    assert machine_lines(runs) == [f"Machine (all runs): {same}.",
                                   "CPU half-precision matrix products: bf16: native kernels (--half-matmul auto)."]
    acc = "fp32 accumulation, rounded to half (--half-matmul auto)"
    checked = [{"mode": "fp16", "machine": cpu, "half_matmul": acc, "native_half_products": 0},
               {"mode": "bf16", "machine": cpu, "half_matmul": acc, "native_half_products": 12}]
    assert machine_lines(checked)[1] == (
        f"CPU half-precision matrix products: fp16: {acc}, checked: no product of the first training step "
        f"on native kernels; bf16: {acc}, checked: **12 products of the first training step on native "
        "kernels** (the train log names them).")
    old = {"mode": "fp32-seed2"}  # written before result.json recorded its machine
    assert machine_lines([old]) == []
    assert machine_lines(runs[:1] + [old]) == [f"Machines: fp32: {same}; fp32-seed2: not recorded."]
    avx2 = dict(cpu, cpu_capability="AVX2", cpu_native_bf16=False)  # same model name, other CPU
    assert machine_lines(runs[:1] + [{"mode": "fp32-seed2", "machine": avx2}])[0].startswith(
        "**The runs ran on different machines")
    # two Xeons a virtual machine names alike, told apart by model and cache
    xeons = [dict(cpu, cpu="Intel(R) Xeon(R) Processor", cpu_id=f"family 6 model {model} stepping 1, cache {kb} KB")
             for model, kb in ((143, 307200), (167, 491520))]
    lines = machine_lines([{"mode": "fp32", "machine": xeons[0]}, {"mode": "bf16", "machine": xeons[1]}])
    assert lines[0].startswith("**The runs ran on different machines")
    assert "Intel(R) Xeon(R) Processor (2 cores, family 6 model 167 stepping 1, cache 491520 KB; torch" in lines[0]
    padded = dict(runs[1], batch_lengths="padded to a multiple of 8 (--cpu-length-multiple auto)")
    fp32_padded = dict(runs[0], train_command=["fairseq-train", "--required-seq-len-multiple", "8", "--cpu"])
    assert machine_lines([runs[0], padded])[2] == (
        "Batch lengths: fp32: as they are; bf16: padded to a multiple of 8 (--cpu-length-multiple auto) "
        "(padded positions are masked; a batch's sentences are the same).")
    assert machine_lines([fp32_padded, padded])[2] == (
        "Batch lengths: fp32: padded to a multiple of 8 (--required-seq-len-multiple); bf16: padded to a "
        "multiple of 8 (--cpu-length-multiple auto) (padded positions are masked; a batch's sentences are "
        "the same).")
    gpu = dict(cpu, device="NVIDIA H200")
    lines = machine_lines(runs + [{"mode": "fp16", "machine": gpu, "half_matmul": None}])
    assert lines[0].startswith("**The runs ran on different machines or versions: their speed and memory "
                               f"do not compare.** Machines: fp32, bf16: {same}; fp16: AMD EPYC (2 cores; ")
    assert "trained on NVIDIA H200;" in lines[0]


def test_seed_control_run_is_fp32_with_another_seed(compared):
    out, _ = compared
    r = json.loads((out / "fp32-seed2" / "result.json").read_text())
    assert (r["mode"], r["base_mode"], r["seed"], r["precision_flags"]) == ("fp32-seed2", "fp32", 2, [])
    cmd = r["train_command"]
    assert cmd[cmd.index("--seed") + 1] == "2" and "--fp16" not in cmd
    r32 = json.loads((out / "fp32" / "result.json").read_text())
    # a different seed is a different trajectory: losses differ from the first logged interval on
    assert r["train"]["train_inner"][0]["loss"] != r32["train"]["train_inner"][0]["loss"]
    md = (out / "report.md").read_text()
    assert "- fp32-seed2: fp32 trained with seed 2 instead of 1. Its d BLEU and p against fp32" in md
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"fp32", "fp16", "fp32-seed2"}


def test_amp_mode_trains_under_torchs_autocast_beside_the_kept_runs(compared, toy_data, tmp_path):
    """--modes amp: fairseq's --amp with the plugin's task and optimizer, on the CPU the step under
    bf16 autocast (fp32 weights, no loss scale), reported beside fp32."""
    out = tmp_path / "cmp"
    shutil.copytree(compared[0], out)
    settings = json.loads((out / "settings.json").read_text())
    subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "amp",
                    "--train-args", settings["train_args"], "--gen-args", settings["gen_args"],
                    "--short-max-words", "7", "--keep-existing"], check=True, capture_output=True, text=True)
    r = json.loads((out / "amp" / "result.json").read_text())
    assert "--amp" in r["train_command"] and "--fp16" not in r["train_command"]
    assert "--amp on the CPU: the training step under torch.autocast('cpu', " in (out / "amp" / "train.out").read_text()
    r32 = json.loads((out / "fp32" / "result.json").read_text())
    losses = [(x["loss"], y["loss"]) for x, y in zip(r["train"]["train_inner"], r32["train"]["train_inner"])]
    assert len(losses) == 6 and all(abs(a - b) < 0.05 for a, b in losses) and losses != [(a, a) for a, _ in losses]
    assert r["generate"]["n_sentences"] == 100
    subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"], check=True,
                   capture_output=True)
    assert "| amp | " in (out / "report.md").read_text()


def test_keep_existing_reuses_finished_runs_only_with_the_same_flags(compared, toy_data):
    out, _ = compared
    before = {m: (out / m / "result.json").read_text() for m in ("fp32", "fp16", "fp32-seed2")}
    settings = json.loads((out / "settings.json").read_text())
    cmd = [sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16,fp32@seed2",
           "--train-args", settings["train_args"], "--gen-args", settings["gen_args"], "--short-max-words", "7",
           "--keep-existing"]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert [l.split("]")[0] for l in proc.stdout.splitlines() if "] kept: " in l] == [
        "=== [fp32", "=== [fp16", "=== [fp32-seed2"]
    assert "training" not in proc.stdout
    assert {m: (out / m / "result.json").read_text() for m in before} == before
    assert json.loads((out / "settings.json").read_text())["started"] == settings["started"]
    cmd[cmd.index("--train-args") + 1] += " --lr 5e-3"
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and "was made with other train_args; use another --out" in proc.stderr


def test_redecode_decodes_kept_runs_again_and_keeps_their_training(compared, toy_data, tmp_path):
    src, _ = compared
    out = tmp_path / "cmp"
    shutil.copytree(src, out)
    settings = json.loads((out / "settings.json").read_text())
    before = {m: json.loads((out / m / "result.json").read_text()) for m in ("fp32", "fp16")}
    cmd = [sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16",
           "--train-args", settings["train_args"], "--gen-args", "--beam 3 --lenpen 2 --cpu",
           "--short-max-words", "7", "--keep-existing"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and ("was made with other gen_args; use another --out or the same flags "
                                     "(or --redecode to decode the kept runs with the new ones)") in proc.stderr
    proc = subprocess.run(cmd + ["--redecode"], check=True, capture_output=True, text=True)
    assert "training" not in proc.stdout
    assert [l.split("]")[0] for l in proc.stdout.splitlines() if "] decoding the test split" in l] == [
        "=== [fp32", "=== [fp16"]
    for mode, old in before.items():
        r = json.loads((out / mode / "result.json").read_text())
        assert r["train"] == old["train"] and r["train_command"] == old["train_command"]
        assert (old["generate"]["gen_args"], r["generate"]["gen_args"]) == ("--beam 1 --cpu", "--beam 3 --lenpen 2 --cpu")
        gen = (out / mode / "generate.out").read_text().split("\n", 1)[0]
        assert "--beam 3 --lenpen 2" in gen and str(out / mode / "checkpoints" / "checkpoint_last.pt") in gen
        hyps = (out / mode / "hyps.txt").read_text().splitlines()
        refs = (out / mode / "refs.txt").read_text().splitlines()
        assert r["generate"]["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
    assert json.loads((out / "settings.json").read_text())["gen_args"] == "--beam 3 --lenpen 2 --cpu"
    # the report reads the new decoding
    subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"],
                   check=True, capture_output=True)
    assert "Decoding flags (all runs): `--beam 3 --lenpen 2 --cpu`" in (out / "report.md").read_text()
    # a kept run without its checkpoint cannot be decoded again: say which file is missing
    (out / "fp16" / "checkpoints" / "checkpoint_last.pt").unlink()
    proc = subprocess.run(cmd + ["--redecode"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"[fp16] no checkpoint to decode: {out / 'fp16' / 'checkpoints' / 'checkpoint_last.pt'} is missing" in proc.stderr


def test_redecode_needs_keep_existing(toy_data, tmp_path):
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", tmp_path,
                           "--redecode"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--redecode needs --keep-existing" in proc.stderr


def test_bleu_is_sacrebleu_on_generate_output(compared):
    out, _ = compared
    r = json.loads((out / "fp16" / "result.json").read_text())
    hyps = (out / "fp16" / "hyps.txt").read_text().splitlines()
    refs = (out / "fp16" / "refs.txt").read_text().splitlines()
    assert len(hyps) == len(refs) == 100
    assert r["generate"]["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
    gen = (out / "fp16" / "generate" / "generate-test.txt").read_text()
    assert gen.count("\nH-") + gen.startswith("H-") == 100


def test_short_source_subset_is_scored_and_reported(compared):
    out, stdout = compared
    r = json.loads((out / "fp16" / "result.json").read_text())
    gen = (out / "fp16" / "generate" / "generate-test.txt").read_text().splitlines()
    srcs = {int(l.split("\t")[0][2:]): l.split("\t")[1] for l in gen if l.startswith("S-")}
    ids = [k for k in sorted(srcs) if len(srcs[k].split()) <= 7]
    assert 0 < len(ids) < 100
    hyps = (out / "fp16" / "hyps.txt").read_text().splitlines()
    refs = (out / "fp16" / "refs.txt").read_text().splitlines()
    short = r["generate"]["short"]
    assert (short["max_words"], short["n_sentences"]) == (7, len(ids))
    pos = {k: i for i, k in enumerate(sorted(srcs))}
    assert short["ids"] == [pos[k] for k in ids]
    expected = BLEU().corpus_score([hyps[pos[k]] for k in ids], [[refs[pos[k]] for k in ids]]).score
    assert short["bleu"] == round(expected, 2)
    md = (out / "report.md").read_text()
    assert f"Sentences whose source has at most 7 words ({len(ids)} of 100)" in md
    assert "sources of <= 7 words:" in stdout
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert runs["fp16"]["short_bleu"] == short["bleu"] and runs["fp32"]["short_p_vs_fp32"] is None


def test_report_table_and_plots(compared):
    out, stdout = compared
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    # the data line, the machine, matmul-path and loss lines, then the table
    assert [l.split(":")[0] for l in lines[2:9:2]] == [
        "Data", "Machine (all runs)", "CPU half-precision matrix products", "Loss"]
    header = lines[10]
    for col in ("mode", "updates/s", "x fp32", "peak mem MB", "skipped", "final scale", "BLEU",
                "p (vs fp32)", "chrF"):
        assert f" {col} " in header
    rows = [l for l in md.splitlines() if l.startswith("| fp")]
    # all sentences, each precision over its seeds (fp32 has two), then short ones
    runs = ["| fp32", "| fp16", "| fp32-seed2"]
    assert [r.split(" | ")[0] for r in rows] == runs + ["| fp32", "| fp16"] + runs
    assert rows[0].split(" | ")[3] == "1.00"  # fp32's ratio to itself
    for png in ("valid_loss_updates.png", "valid_loss_wall.png", "loss_scale.png", "throughput.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "| fp16 |" in stdout


def test_compare_refuses_flags_it_sets(toy_data, tmp_path):
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", tmp_path,
                           "--train-args", "--fp16 --max-update 1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--train-args must not contain --fp16" in proc.stderr
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", tmp_path,
                           "--modes", "fp8"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--modes: unknown fp8" in proc.stderr
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", tmp_path,
                           "--modes", "fp16,fp32@seed1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "fp32@seed1 uses the main --seed 1; a control run needs another seed" in proc.stderr


def test_demo_toy_corpus_runs_compare_and_report(tmp_path):
    # scripts/demo.py's wiring (make demo's Debian path has the same stages on real data)
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "demo.py", "--corpus", "toy", "--modes", "fp32",
                           "--max-update", "20", "--out", tmp_path], check=True, capture_output=True, text=True)
    stages = [line[:9] for line in proc.stdout.splitlines() if line.startswith("=== [") and "/3]" in line[:9]]
    assert stages == ["=== [1/3]", "=== [2/3]", "=== [3/3]"]
    assert "=== [fp32] training" in proc.stdout
    r = json.loads((tmp_path / "toy" / "runs" / "fp32" / "result.json").read_text())
    assert r["train"]["updates"] == 20 and r["generate"]["n_sentences"] == 100
    assert "| fp32 | 20 |" in (tmp_path / "toy" / "runs" / "report.md").read_text()


def _fp16_seed2_from_the_control(compared, out, keep_control):
    """A copy of the comparison whose fp32 control run (seed 2) is relabelled, or copied, as fp16-seed2."""
    shutil.copytree(compared[0], out)
    (shutil.copytree if keep_control else shutil.move)(out / "fp32-seed2", out / "fp16-seed2")
    r = json.loads((out / "fp16-seed2" / "result.json").read_text())
    r.update(mode="fp16-seed2", base_mode="fp16", precision_flags=["--fp16"])
    (out / "fp16-seed2" / "result.json").write_text(json.dumps(r))
    settings = json.loads((out / "settings.json").read_text())
    settings["modes"] = ["fp32", "fp16", *(["fp32-seed2"] if keep_control else []), "fp16-seed2"]
    (out / "settings.json").write_text(json.dumps(settings))
    return out


def test_report_names_the_base_of_a_non_fp32_control(compared, tmp_path):
    out = _fp16_seed2_from_the_control(compared, tmp_path / "runs", keep_control=False)
    subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"], check=True,
                   capture_output=True)
    md = (out / "report.md").read_text()
    assert "- fp16-seed2: fp16 trained with seed 2 instead of 1. Its difference to fp16 (not to fp32)" in md
    assert "fp32-seed2" not in md


def _run(mode, seed, bleu, base=None):
    return {"mode": mode, "base_mode": base or mode, "seed": seed, "generate": {"bleu": bleu}}


def test_seed_spread_places_mixed_runs_among_fp32_seeds():
    from fairseq_fp16_tools.report import spread_lines
    from fairseq_fp16_tools.summary import seed_spread

    results = [_run("fp32", 1, 10.0), _run("fp16", 1, 11.2), _run("bf16", 1, 10.3),
               _run("fp32-seed2", 2, 10.4, "fp32"), _run("fp32-seed3", 3, 10.2, "fp32"),
               _run("bf16-seed2", 2, 12.0, "bf16")]
    s = seed_spread(results)
    assert s["seeds"] == [1, 2, 3] and s["bleu"] == [10.0, 10.4, 10.2]
    assert s["mean"] == pytest.approx(10.2) and s["sd"] == pytest.approx(0.2)
    assert list(s["runs"]) == ["fp16", "bf16"]  # bf16-seed2 is bf16's control, not a mixed run of seed 1
    assert s["runs"]["fp16"]["z"] == pytest.approx(5.0) and not s["runs"]["fp16"]["within_range"]
    assert s["runs"]["bf16"]["d_mean"] == pytest.approx(0.1) and s["runs"]["bf16"]["within_range"]
    lines = spread_lines(s)
    assert lines[0] == ("- fp32 trained with 3 seeds: BLEU 10.00 (seed 1), 10.40 (seed 2), 10.20 (seed 3); "
                        "mean 10.20, standard deviation 0.20.")
    assert lines[1] == ("- fp16: BLEU 11.20, +1.00 from the fp32 seeds' mean, +5.0 standard deviations; "
                        "outside their range (10.00 to 10.40).")
    assert seed_spread(results[:3]) is None  # one fp32 seed: no spread


def test_report_tests_two_seed_pairs_for_equivalence(compared, tmp_path):
    # fp16 at seed 2 made from the fp32 control run: the seed-2 pair has the same output (d = 0)
    out = _fp16_seed2_from_the_control(compared, tmp_path / "runs", keep_control=True)
    report = [sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"]
    subprocess.run(report + ["--margin", "100"], check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    bleu = {m: v["bleu"] for m, v in summary["runs"].items()}
    eq = summary["by_precision"]["fp16"]["equivalence"]
    assert eq["diffs"] == pytest.approx([bleu["fp16"] - bleu["fp32"], 0.0]) and eq["margin"] == 100
    assert eq["verdict"] == "equivalent"  # toy BLEU is near 0: any gap is within 100 points
    md = (out / "report.md").read_text()
    assert "Is each precision within ±100 BLEU of fp32? Seed-paired test" in md
    assert "| fp16 | 2 |" in md and "| within ±100 BLEU of fp32 |" in md
    bad = subprocess.run(report + ["--margin", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--margin must be a positive number of BLEU points, got 0" in bad.stderr


def test_report_has_the_seed_spread_of_a_control_run(compared):
    out, _ = compared
    md = (out / "report.md").read_text()
    assert "- fp32 trained with 2 seeds: BLEU" in md and "(two seeds: a rough estimate)" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp32_seed_spread"]["seeds"] == [1, 2]
    assert list(summary["fp32_seed_spread"]["runs"]) == ["fp16"]
    fp16 = summary["by_precision"]["fp16"]  # fp16 against the fp32 run of its own seed
    assert list(fp16["same_seed"]) == ["1"] and 0 < fp16["same_seed"]["1"]["p"] <= 1
    assert "| precision | seeds | BLEU per seed |" in md and "| fp32 | 2 |" in md
    assert "equivalence" not in fp16 and "Seed-paired test" not in md  # one pair: nothing to test


def test_report_names_each_runs_decoding_flags_when_they_differ():
    from fairseq_fp16_tools.report import decoding_line

    runs = [{"mode": "fp32", "generate": {"gen_args": "--beam 4 --lenpen 2.0"}},
            {"mode": "fp16", "generate": {"gen_args": "--beam 4 --lenpen 1.0"}},
            {"mode": "bf16", "generate": {}}]  # written before result.json recorded its flags
    assert decoding_line(runs[:1] + runs[2:], "--beam 4 --lenpen 2.0") == (
        "Decoding flags (all runs): `--beam 4 --lenpen 2.0`")
    assert decoding_line(runs, "--beam 4 --lenpen 2.0") == (
        "**The runs were decoded with different flags, so their BLEU is not comparable:** "
        "fp32: `--beam 4 --lenpen 2.0`; fp16: `--beam 4 --lenpen 1.0`; bf16: `--beam 4 --lenpen 2.0`. "
        "Decode them again alike: `scripts/compare.py ... --keep-existing --redecode`.")


#: the demo's flags (scripts/demo.py's defaults, or --average-last 0: the last checkpoint, as the
#: AMX and AVX2 runs were scored) and the longer recipe's (its scripts/demo.py command)
DEMO, DEMO_LAST = dict(updates=1600, dropout=0.0, average_last=2), dict(updates=1600, dropout=0.0)
LONG = dict(updates=12000, dropout=0.2, beam=4, lenpen=2.0, schedule="inverse-sqrt")


@pytest.mark.parametrize("results, flags", [
    ("demo/avx512-epyc/seeds1-4", DEMO), ("demo/avx512-epyc/seeds5-6", DEMO),
    ("demo/avx512-epyc/seeds7-8", DEMO), ("demo/avx512-epyc/seeds9-10", DEMO),
    ("demo/amx-xeon/seeds1-4", DEMO_LAST), ("demo/avx2-epyc/seeds1-4", DEMO_LAST),
    ("long/avx512-epyc/seed1", LONG), ("long/avx512-epyc/seed2", LONG), ("long/avx512-epyc/seed3", LONG),
])
def test_demo_flags_are_those_of_the_committed_reports(results, flags):
    # make demo (and the longer recipe's documented demo.py flags) reproduce the committed runs'
    # training and decoding flags exactly, so a rerun compares like with like and
    # --keep-existing accepts runs made before.
    from fairseq_fp16_tools.demo import debian_args

    settings = json.loads((ROOT / "examples" / "translation" / "results" / results / "settings.json").read_text())
    assert debian_args(**flags) == (settings["train_args"], settings["gen_args"])


def test_permutation_p_counts_the_splits_as_extreme_as_observed():
    from fairseq_fp16_tools.stats import permutation_p

    # pooled 1..6 split 2 vs 4: only {1,2} and {5,6} differ by >= 3 in mean, of 15 splits
    assert permutation_p([1, 2], [3, 4, 5, 6]) == pytest.approx(2 / 15)
    assert permutation_p([1, 2], [3, 4]) == pytest.approx(2 / 6)  # the observed split and its mirror
    assert permutation_p([3, 4], [3, 4]) == 1.0


def _bleu_run(out, mode, seed, hyps, refs, base=None):
    (out / mode).mkdir()
    (out / mode / "hyps.txt").write_text("\n".join(hyps) + "\n")
    (out / mode / "refs.txt").write_text("\n".join(refs) + "\n")
    bleu = BLEU().corpus_score(hyps, [refs]).score
    return {"mode": mode, "base_mode": base or mode, "seed": seed,
            "generate": {"bleu": bleu, "hyps_file": "hyps.txt", "refs_file": "refs.txt"}}


def test_by_precision_pairs_runs_by_seed_and_tests_over_seeds(tmp_path):
    from fairseq_fp16_tools.summary import by_precision
    from fairseq_fp16_tools.tables import equivalence_table, precision_table

    refs = [f"the {w} sat on the mat number {i} today" for i, w in enumerate(["cat", "dog", "cow"] * 20)]
    worse = [r.replace("sat on", "lay at") if i % 2 else r for i, r in enumerate(refs)]
    runs = [_bleu_run(tmp_path, "fp32", 1, refs, refs), _bleu_run(tmp_path, "fp16", 1, worse, refs),
            _bleu_run(tmp_path, "fp32-seed2", 2, refs, refs, "fp32"),
            _bleu_run(tmp_path, "fp16-seed2", 2, refs, refs, "fp16"),
            _bleu_run(tmp_path, "bf16", 1, refs, refs)]
    rows = by_precision(tmp_path, runs, 200)
    assert list(rows) == ["fp32", "fp16", "bf16"]
    assert rows["fp32"]["seeds"] == [1, 2] and rows["fp32"]["mean"] == pytest.approx(100.0)
    fp16 = rows["fp16"]
    assert fp16["d_mean"] == pytest.approx((runs[1]["generate"]["bleu"] - 100) / 2)
    assert fp16["same_seed"][1]["p"] < 0.05 and fp16["same_seed"][1]["d_bleu"] < -10
    assert fp16["same_seed"][2] == {"d_bleu": 0.0, "p": 1.0}  # identical output
    # per-seed BLEU fp16 (x, 100) vs fp32 (100, 100): every split differs by as much, so p = 1
    assert fp16["permutation_p"] == 1.0 and fp16["min_permutation_p"] == pytest.approx(2 / 6)
    assert rows["bf16"]["sd"] is None and "permutation_p" not in rows["bf16"]
    table = precision_table(rows)
    assert "| fp16 | 2 |" in table and "seed 2: +0.00 (1.000)" in table
    # the two same-seed differences go to the seed-paired test; one pair (bf16) is not tested
    eq = fp16["equivalence"]
    assert eq["diffs"] == [round(fp16["same_seed"][1]["d_bleu"], 2), 0.0] and eq["verdict"] == "inconclusive"
    assert "equivalence" not in rows["bf16"]
    eq_table = equivalence_table(rows)
    assert eq_table.count("\n") == 2 and f"| fp16 | 2 | {eq['diffs'][0]:+.2f}, +0.00 |" in eq_table
    assert by_precision(tmp_path, [runs[0], runs[1], runs[4]], 200) is None  # one seed each: no table


def test_decode_precision_decodes_each_run_in_the_other_precisions(compared, tmp_path):
    src, _ = compared
    out = tmp_path / "cmp"
    shutil.copytree(src, out)
    cmd = [sys.executable, ROOT / "scripts" / "decode_precision.py", out, "--modes", "fp16,fp32"]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads((out / "decode_precision.json").read_text())
    assert (summary["gen_subset"], summary["gen_args"]) == ("test", "--beam 1 --cpu")
    runs = summary["runs"]
    assert list(runs) == ["fp32", "fp16"]  # settings.json's order; fp32-seed2 not asked for
    labels = {m: [(d["weights"], d["decoded_in"]) for d in e["decodes"]] for m, e in runs.items()}
    assert labels == {"fp32": [("checkpoint", "fp16"), ("checkpoint", "bf16")],
                      "fp16": [("checkpoint", "fp32"), ("masters", "fp32")]}
    refs = (out / "fp16" / "refs.txt").read_text().splitlines()
    for mode, e in runs.items():
        r = json.loads((out / mode / "result.json").read_text())["generate"]
        assert e["as_trained"] == {"decoded_in": mode, "bleu": r["bleu"], "chrf": r["chrf"],
                                   "bleu_bp": r["bleu_bp"]}
        trained = (out / mode / "hyps.txt").read_text().splitlines()
        for d in e["decodes"]:  # each score is sacrebleu's on the hypotheses kept
            hyps = (out / mode / "decode_precision" / f"hyps-{d['decoded_in']}-{d['weights']}.txt"
                    ).read_text().splitlines()
            assert len(hyps) == d["n_sentences"] == 100
            assert d["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
            assert d["d_bleu"] == round(d["bleu"] - r["bleu"], 2)
            assert d["same_hypotheses"] == sum(h == t for h, t in zip(hyps, trained))
            # a few roundings apart: most greedy outputs of the tiny model do not change
            assert d["same_hypotheses"] >= 80, (mode, d)
    assert not (out / "fp16" / "decode_precision" / "fp32_masters.pt").exists()  # removed after use
    assert "| fp16 | fp16 | " in proc.stdout and "fp32 decode, fp32 masters: " in proc.stdout
    proc = subprocess.run(cmd[:3] + ["--modes", "fp16,bf16"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--modes: bf16 not among the runs of" in proc.stderr


def test_average_last_scores_the_averaged_checkpoint_beside_the_last(compared, toy_data, tmp_path):
    src, _ = compared
    settings = json.loads((src / "settings.json").read_text())
    base = ["--train-args", settings["train_args"].replace("--max-update 30", "--max-update 30 --save-interval-updates 10"),
            "--gen-args", "--beam 1 --cpu"]
    out = tmp_path / "avg"
    cmd = [sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16",
           *base, "--average-last", "2"]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert "averaging the last 2 checkpoints' weights" in proc.stdout
    for mode, masters in (("fp32", False), ("fp16", True)):
        r = json.loads((out / mode / "result.json").read_text())
        assert r["averaged"] == {"n": 2, "updates": [20, 30], "from_masters": masters}
        g, last = r["generate"], r["generate_last"]
        assert (g["checkpoint"], g["hyps_file"]) == ("checkpoint_avg.pt", "hyps.txt")
        assert (last["checkpoint"], last["hyps_file"]) == ("checkpoint_last.pt", "hyps-last.txt")
        refs = (out / mode / "refs.txt").read_text().splitlines()
        for entry in (g, last):
            hyps = (out / mode / entry["hyps_file"]).read_text().splitlines()
            assert len(hyps) == 100 and entry["bleu"] == round(BLEU().corpus_score(hyps, [refs]).score, 2)
        assert "checkpoint_avg.pt" in (out / mode / "generate.out").read_text().split("\n", 1)[0]
        assert "checkpoint_last.pt" in (out / mode / "generate-last.out").read_text().split("\n", 1)[0]
        # a different model (30 updates of a lr-1e-2 warm-up move the weights): other outputs
        assert (out / mode / "hyps.txt").read_text() != (out / mode / "hyps-last.txt").read_text()
    assert json.loads((out / "settings.json").read_text())["average_last"] == 2
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"],
                         check=True, capture_output=True, text=True)
    md = (out / "report.md").read_text()
    assert ("- Decoded checkpoint: each run's weights averaged over the last 2 checkpoints (updates 20, 30), "
            "a half run's from its fp32 master weights (scripts/average_checkpoints.py)") in md
    assert "| mode | BLEU | d BLEU | p (vs fp32) | chrF | averaged BLEU | gain |" in md
    r16 = json.loads((out / "fp16" / "result.json").read_text())
    gain = f"{r16['generate']['bleu'] - r16['generate_last']['bleu']:+.2f}"
    assert f"| fp16 | {r16['generate_last']['bleu']:.2f} | " in md and md.count(f" | {gain} |") >= 1
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["fp16"]["last_bleu"] == r16["generate_last"]["bleu"] and runs["fp32"]["last_p_vs_fp32"] is None
    assert 0 < runs["fp16"]["last_p_vs_fp32"] <= 1
    assert "last checkpoints (not averaged):" in rep.stdout
    # redecoding without averaging drops the averaged entries
    proc = subprocess.run(cmd[:-2] + ["--keep-existing", "--redecode"], check=True, capture_output=True, text=True)
    r = json.loads((out / "fp16" / "result.json").read_text())
    assert "averaged" not in r and "generate_last" not in r and r["generate"]["checkpoint"] == "checkpoint_last.pt"
    assert r["generate"]["bleu"] == r16["generate_last"]["bleu"]


def test_settings_from_before_average_last_keep_their_runs(compared, toy_data, tmp_path):
    src, _ = compared
    out = tmp_path / "cmp"
    shutil.copytree(src, out)
    settings = json.loads((out / "settings.json").read_text())
    del settings["average_last"]  # as compare.py wrote it before the flag existed: the last checkpoint
    (out / "settings.json").write_text(json.dumps(settings))
    cmd = [sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16,fp32@seed2",
           "--train-args", settings["train_args"], "--gen-args", settings["gen_args"], "--short-max-words", "7",
           "--keep-existing"]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert proc.stdout.count("] kept: ") == 3 and "training" not in proc.stdout


def test_average_last_needs_the_interval_checkpoints(toy_data, tmp_path):
    def run(train_args, n="2"):
        return subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", tmp_path,
                               "--train-args", train_args, "--average-last", n], capture_output=True, text=True)
    proc = run("--max-update 30")
    assert proc.returncode == 2 and ("--average-last 2 needs interval checkpoints: add --save-interval-updates K "
                                     "--keep-interval-updates 2 to --train-args") in proc.stderr
    proc = run("--max-update 30 --save-interval-updates 10 --keep-interval-updates 1")
    assert proc.returncode == 2 and ("--average-last 2 needs --keep-interval-updates 2 or more in --train-args, "
                                     "not 1") in proc.stderr
    proc = run("--max-update 30 --save-interval-updates 10 --keep-interval-updates x")
    assert proc.returncode == 2 and ("--average-last 2 needs --keep-interval-updates 2 or more in --train-args, "
                                     "not x") in proc.stderr
    proc = run("--max-update 30", n="-1")
    assert proc.returncode == 2 and "--average-last must be >= 0 (0 = off), got -1" in proc.stderr
    from fairseq_fp16_tools.compare import flag_value

    assert flag_value(["--a", "1", "--keep-interval-updates=3", "--keep-interval-updates", "4"],
                      "--keep-interval-updates") == "4"
    assert flag_value(["--keep-interval-updates-x", "3"], "--keep-interval-updates") is None


def test_compare_refuses_modes_that_cannot_run_here_before_training(toy_data, tmp_path):
    # stock fairseq's --fp16 needs CUDA: refused before fp32 trains, not after it
    out = tmp_path / "cmp"
    cmd = [sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp32,fp16-stock,fp16",
           "--train-args", " ".join(TINY_MODEL) + " --max-update 1 --cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "compare.py: error: --modes: fp16-stock cannot run here: stock fairseq's --fp16 trains on CUDA only, and "
        "--train-args has --cpu; leave it out of --modes")
    assert "training" not in proc.stdout and not out.exists()
    if not torch.cuda.is_available():
        cmd[cmd.index("--train-args") + 1] = cmd[cmd.index("--train-args") + 1].replace(" --cpu", "")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
            "compare.py: error: --modes: fp16-stock cannot run here: stock fairseq's --fp16 needs CUDA, and torch "
            "sees no CUDA device here (the plugin's fp16 mode trains on the CPU); leave it out of --modes")
        assert not out.exists()


def test_compare_writes_its_settings_before_the_first_run_trains(toy_data, tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16",
                           "--train-args", "--arch no_such_arch --max-update 1"], capture_output=True, text=True)
    assert proc.returncode == 1 and f"fairseq-train failed with exit code 2; see {out / 'fp32' / 'train.out'}" in proc.stderr
    settings = json.loads((out / "settings.json").read_text())
    assert (settings["data"], settings["modes"], settings["train_args"]) == (
        str(toy_data), ["fp32", "fp16"], "--arch no_such_arch --max-update 1")
    assert "started" in settings and "finished" not in settings
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out], capture_output=True, text=True)
    assert rep.returncode == 2 and (f"report.py: error: {out}: no fp32 result.json to compare against: 2 requested "
                                    f"runs without a result.json in {out}: fp32, fp16 (") in rep.stderr


def test_report_names_the_requested_runs_without_a_result_and_fails(compared, tmp_path):
    out = tmp_path / "cmp"
    shutil.copytree(compared[0], out)
    shutil.rmtree(out / "fp16")  # compare.py stopped after fp32, before fp16 had a result
    settings = json.loads((out / "settings.json").read_text())
    del settings["finished"]
    (out / "settings.json").write_text(json.dumps(settings))
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "50"],
                         capture_output=True, text=True)
    missing = (f"1 requested run without a result.json in {out}: fp16 (scripts/compare.py stopped before finishing "
               "it, or is still running; its train.out or generate.out says why); rerun it: delete "
               f"{out}/fp16 and run scripts/compare.py again with the same flags, --out {out} and --keep-existing "
               "(it trains only the runs without a result.json)")
    assert rep.returncode == 1 and rep.stderr == f"report: {missing}\n"
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    assert lines[2] == f"Data: `{settings['data']}`; seed 1; started {settings['started']}, **not finished**."
    assert lines[4] == f"**Missing:** {missing}. The tables hold the other runs."
    rows = [l.split(" | ")[0] for l in lines if l.startswith("| fp")]
    assert rows == ["| fp32", "| fp32-seed2", "| fp32"] + ["| fp32", "| fp32-seed2"]  # runs, precisions, short
    assert "fp16" not in json.loads((out / "summary.json").read_text())["runs"]


def test_report_refuses_a_bootstrap_of_no_resamples(compared):
    from fairseq_fp16_tools.stats import paired_bootstrap

    out, _ = compared
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out, "--bootstrap", "0"],
                         capture_output=True, text=True)
    assert rep.returncode == 2
    assert rep.stderr.splitlines()[-1] == "report.py: error: --bootstrap must be a positive number of resamples, got 0"
    # sacrebleu draws its default 1,000 resamples when asked for 0: never behind a label that says 0
    with pytest.raises(ValueError, match=r"^--bootstrap must be a positive number of resamples, got 0$"):
        paired_bootstrap(["a b c"], ["a b c"], {"fp16": ["a b d"]}, 0)


def test_report_names_a_json_file_cut_short(compared, tmp_path):
    out = tmp_path / "cmp"
    shutil.copytree(compared[0], out)
    path = out / "fp16" / "result.json"
    path.write_text(path.read_text()[:1000])  # a run stopped while writing it
    rep = subprocess.run([sys.executable, ROOT / "scripts" / "report.py", out], capture_output=True, text=True)
    assert rep.returncode == 2 and "Traceback" not in rep.stderr
    assert rep.stderr.splitlines()[-1].startswith(f"report.py: error: {path} is not valid JSON (")
    assert rep.stderr.splitlines()[-1].endswith(
        f"perhaps cut short as it was written; rerun it: delete {out}/fp16 and run scripts/compare.py again with "
        f"the same flags, --out {out} and --keep-existing (it trains only the runs without a result.json)")
    # compare.py --keep-existing reads the runs it keeps before it trains any
    settings = json.loads((out / "settings.json").read_text())
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", settings["data"], "--out", out,
                           "--modes", "fp16,fp32@seed2", "--train-args", settings["train_args"], "--gen-args",
                           settings["gen_args"], "--short-max-words", "7", "--keep-existing"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "kept" not in proc.stdout
    assert proc.stderr.splitlines()[-1].startswith(f"compare.py: error: --keep-existing: {path} is not valid JSON (")


def test_export_refuses_its_own_output_as_already_exported(compared, tmp_path):
    from fairseq_fp16_tools.checkpoints import export_main as main

    out, _ = compared
    exported = tmp_path / "fp32.pt"
    main([str(out / "fp16" / "checkpoints" / "checkpoint_last.pt"), str(exported)])
    with pytest.raises(SystemExit, match=(
            rf"^export_fp32_checkpoint: {exported} is already exported \(scripts/export_fp32_checkpoint\.py's "
            r"output\): its model weights are the fp32 masters themselves \('[\w.]+' is not rounded to fp16\), so "
            r"it is an fp32 checkpoint with no masters left to export$")):
        main([str(exported), str(tmp_path / "again.pt")])
    assert not (tmp_path / "again.pt").exists()


def test_result_json_takes_updates_skips_and_scale_from_the_runs_end(toy_data, tmp_path):
    # --log-interval 5 with --max-update 12: the last train_inner record is of update 10. A scale
    # that grows after every clean update overflows now and then, so skips and scale move after it.
    flags = ["--max-update", "12", "--fp16-init-scale", "4096", "--fp16-scale-window", "1"]
    # conftest's training flags less those compare.py sets: the same training as train()'s
    shared = [a for i, a in enumerate(TRAIN) if a not in FORBIDDEN_HERE and TRAIN[i - 1] not in FORBIDDEN_HERE]
    out = tmp_path / "cmp"
    subprocess.run([sys.executable, ROOT / "scripts" / "compare.py", toy_data, "--out", out, "--modes", "fp16",
                    "--train-args", shlex.join([*TINY_MODEL, *shared, *flags, "--log-interval", "5"]),
                    "--gen-args", "--beam 1 --max-len-b 5 --cpu"], check=True, capture_output=True, text=True)
    _, every = train(toy_data, tmp_path / "every", "--fp16", *flags)  # --log-interval 1: each update's record
    r16, r32 = (json.loads((out / m / "result.json").read_text())["train"] for m in ("fp16", "fp32"))
    assert [r["num_updates"] for r in r16["train_inner"]] == [5, 10] and every[-1]["num_updates"] == 12
    end = {"updates": 12, "skipped_updates": every[-1]["skipped"], "final_loss_scale": every[-1]["loss_scale"]}
    assert {k: r16[k] for k in end} == end
    assert (r16["train_inner"][-1]["skipped"], r16["train_inner"][-1]["loss_scale"]) != (
        end["skipped_updates"], end["final_loss_scale"])  # the last logged interval is two updates old
    assert (r32["updates"], r32["skipped_updates"], r32["final_loss_scale"]) == (12, 0, None)
    # read from the last checkpoint; saved without its optimizer state, from fairseq's record of the last epoch
    from fairseq_fp16_tools.compare import train_end

    log_text = (out / "fp16" / "train.out").read_text()
    state = torch.load(out / "fp16" / "checkpoints" / "checkpoint_last.pt", weights_only=False)
    del state["last_optimizer_state"]
    torch.save(state, tmp_path / "bare.pt")
    assert train_end(tmp_path / "bare.pt", parse_json_records(log_text), log_text) == end
    # stock fairseq --fp16 saves its scale and no count of skips; it logs each skip
    state["last_optimizer_state"] = {"loss_scale": 64.0, "state": {}, "param_groups": []}
    torch.save(state, tmp_path / "stock.pt")
    stock_log = "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0\n" * 3
    assert train_end(tmp_path / "stock.pt", {"train": [{"num_updates": 12, "loss_scale": 64}]}, stock_log) == {
        "updates": 12, "skipped_updates": 3, "final_loss_scale": 64.0}
