"""The seed-paired equivalence test (fairseq_fp16_tools.stats) and scripts/verdict.py, which pools comparisons."""

import json
import math
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT

from fairseq_fp16_tools.stats import paired_equivalence
from fairseq_fp16_tools.tables import verdict_table as table
from fairseq_fp16_tools.verdict import pool, verdicts

RESULTS = ROOT / "examples" / "translation" / "results"
DEMO_EPYC = RESULTS / "demo" / "avx512-epyc" / "seeds1-4"  # make demo, seeds 1-4, AVX512-BF16 EPYC
#: Student's t quantiles (one-sided 0.95), from the printed tables
T95 = {1: 6.313752, 2: 2.919986, 3: 2.353363, 5: 2.015048}


def test_paired_equivalence_is_student_t_and_tost():
    d = [0.28, -0.16, -0.35, 0.23]  # fp16 - fp32 per seed, demo/avx512-epyc/seeds1-4
    e = paired_equivalence(d)
    se = statistics.stdev(d) / 2
    assert e["n"] == 4 and e["mean"] == pytest.approx(0.0, abs=1e-12)
    assert e["ci90"] == pytest.approx([-T95[3] * se, T95[3] * se], rel=1e-6)
    # TOST: P(T3 > 0.5 / se) with se 0.15259, t = 3.2768 -> 0.0233 (each side alike here)
    assert e["p_equivalence"] == pytest.approx(0.0233, abs=2e-4)
    assert e["p_difference"] == pytest.approx(1.0)
    assert e["verdict"] == "equivalent"


@pytest.mark.parametrize("diffs, verdict", [
    ([0.56, 0.56, -0.31, 0.74], "not_worse"),  # bf16 on the AVX512-BF16 EPYC: 90% CI -0.17 to +0.94
    ([-0.56, -0.56, 0.31, -0.74], "not_better"),
    ([-1.0, -1.1, -0.9], "worse"),  # CI -1.17 to -0.83
    ([1.0, 1.1, 0.9], "better"),
    ([2.0, -2.0, 1.5, -1.5], "inconclusive"),
    ([0.2, 0.2], "equivalent"),  # no spread: the interval is the point
])
def test_paired_equivalence_verdicts(diffs, verdict):
    e = paired_equivalence(diffs)
    assert e["verdict"] == verdict
    lo, hi = e["ci90"]
    n, mean = len(diffs), statistics.fmean(diffs)
    half = T95[n - 1] * statistics.stdev(diffs) / math.sqrt(n)
    assert (lo, hi) == pytest.approx((mean - half, mean + half), abs=1e-6)
    # the TOST p is below 0.05 exactly when the interval lies inside the margin
    assert (e["p_equivalence"] < 0.05) == (-0.5 < lo and hi < 0.5)


def test_paired_equivalence_margin_and_size_are_checked():
    assert paired_equivalence([0.56, 0.56, -0.31, 0.74], margin=1.0)["verdict"] == "equivalent"
    with pytest.raises(ValueError, match="two or more seeds with both runs, got 1"):
        paired_equivalence([0.3])
    with pytest.raises(ValueError, match="--margin must be a positive number of BLEU points, got 0"):
        paired_equivalence([0.3, 0.1], margin=0)


def _comparison(out, seed, runs, train_args="--arch transformer --max-update 100", machine=None, average_last=2):
    """A compare.py --out directory: ``runs`` {mode: (seed, bleu, updates/s, peak RSS)}, each
    recorded as run on ``machine`` (a result.json ``machine`` record) when it is given;
    ``average_last`` None leaves the setting out, as settings.json did before it existed."""
    out.mkdir()
    settings = {"data": "bin", "modes": list(runs), "train_args": train_args, "gen_args": "--beam 4",
                "gen_subset": "test", "average_last": average_last, "seed": seed}
    if average_last is None:
        del settings["average_last"]
    (out / "settings.json").write_text(json.dumps(settings))
    for mode, (s, bleu, ups, mem) in runs.items():
        (out / mode).mkdir()
        (out / mode / "result.json").write_text(json.dumps({
            "mode": mode, "base_mode": mode.split("-")[0], "seed": s, "generate": {"bleu": bleu},
            "train": {"updates_per_s": ups, "peak_rss_mb": mem}, **({"machine": machine} if machine else {})}))
    return out


def test_verdict_pools_comparisons_by_seed(tmp_path):
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760),
                                        "fp32-seed2": (2, 11.0, 2.0, 800), "bf16-seed2": (2, 10.9, 5.0, 720)})
    b = _comparison(tmp_path / "b", 3, {"fp32": (3, 12.0, 2.5, 820), "bf16": (3, 12.2, 5.0, 780),
                                        "fp16": (3, 11.0, 2.5, 700)})
    rows = verdicts(pool([a, b]))
    bf16 = rows["bf16"]
    assert bf16["seeds"] == [1, 2, 3] and bf16["bleu"] == [10.3, 10.9, 12.2]
    assert bf16["fp32_bleu"] == [10.0, 11.0, 12.0]
    assert bf16["x_updates_per_s"] == pytest.approx([2.0, 2.5, 2.0])
    assert bf16["x_peak_mem"] == pytest.approx([0.95, 0.9, 780 / 820])
    assert bf16["equivalence"]["diffs"] == pytest.approx([0.3, -0.1, 0.2])
    # six values split 3 against 3: 4 of the 20 splits have means closer than 11.13 against 11.00
    assert bf16["permutation_p"] == pytest.approx(0.8)
    assert "equivalence" not in rows["fp16"] and rows["fp16"]["seeds"] == [3]
    md = table(rows)
    assert "| bf16 | 3 (seeds 1, 2, 3) | 11.13 (11.00) | 2.17 (2.00-2.50) |" in md
    assert "| fp16 | 1 (seeds 3) |" in md and "one seed pair: train more seeds" in md


def test_verdict_refuses_comparisons_that_do_not_pair(tmp_path):
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760)})
    b = _comparison(tmp_path / "b", 2, {"fp32": (2, 11.0, 2.0, 800)}, train_args="--arch transformer --max-update 200")
    c = _comparison(tmp_path / "c", 1, {"fp32": (1, 10.0, 2.0, 800)})
    with pytest.raises(ValueError, match=r"b and .*a differ in train_args"):
        pool([a, b])
    with pytest.raises(ValueError, match=r"fp32 with seed 1 is in both .*a and .*c"):
        pool([a, c])
    # a settings.json written before average_last existed meant 0 by its absence
    d = _comparison(tmp_path / "d", 3, {"fp32": (3, 12.0, 2.0, 800), "bf16": (3, 12.1, 4.0, 760)}, average_last=0)
    e = _comparison(tmp_path / "e", 4, {"fp32": (4, 12.0, 2.0, 800), "bf16": (4, 11.9, 4.0, 760)}, average_last=None)
    assert verdicts(pool([d, e]))["bf16"]["seeds"] == [3, 4]
    with pytest.raises(ValueError, match=r"e and .*a differ in average_last \(0 against 2\)"):
        pool([a, e])


def test_verdict_refuses_runs_of_different_machines(tmp_path):
    epyc = json.loads((DEMO_EPYC / "fp32" / "result.json").read_text())["machine"]
    xeon = json.loads((RESULTS / "demo" / "amx-xeon" / "seeds1-4" / "fp32" / "result.json").read_text())["machine"]
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760)}, machine=epyc)
    b = _comparison(tmp_path / "b", 2, {"fp32": (2, 11.0, 2.0, 800), "bf16": (2, 11.2, 4.0, 760)}, machine=xeon)
    with pytest.raises(ValueError, match=r"b/fp32 and .*a/fp32 ran on different machines or versions \(cpu "
                                         r"'Intel\(R\) Xeon\(R\) Processor' against 'AMD EPYC', cpu_native_fp16 True "
                                         r"against False\): their runs do not pair"):
        pool([a, b])
    # a run recorded before result.json held a machine pools with either
    c = _comparison(tmp_path / "c", 2, {"fp32": (2, 11.0, 2.0, 800), "bf16": (2, 11.2, 4.0, 760)})
    assert verdicts(pool([a, c]))["bf16"]["seeds"] == [1, 2]
    # the same machine with another torch does not pool either
    d = _comparison(tmp_path / "d", 2, {"fp32": (2, 11.0, 2.0, 800)}, machine={**epyc, "torch": "2.12.0+cpu"})
    with pytest.raises(ValueError, match=r"d/fp32 and .*a/fp32 ran on different machines or versions \(torch "
                                         r"'2.12.0\+cpu' against '2.13.0\+cpu'\)"):
        pool([a, d])


def test_verdict_json_lists_the_commits_of_the_runs_it_pooled(tmp_path):
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760),
                                        "fp32-seed2": (2, 11.0, 2.0, 800), "bf16-seed2": (2, 10.9, 5.0, 720)})
    here = {"commit": "c" * 40, "changed": []}
    for run in ("fp32", "bf16", "fp32-seed2"):  # bf16-seed2 ran before result.json held one
        path = a / run / "result.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "provenance": here}))
    out = tmp_path / "verdict.json"
    subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", a, "--json", out], check=True,
                   capture_output=True, text=True)
    assert json.loads(out.read_text())["provenances"] == [here]


def test_verdict_cli_on_the_committed_demo_runs(tmp_path):
    # the four seeds of make demo's recipe on the AVX512-BF16 EPYC, as committed
    out = tmp_path / "verdict.json"
    cli = subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", DEMO_EPYC,
                          "--json", out], check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())["precisions"]
    fp16, bf16 = rows["fp16"]["equivalence"], rows["bf16"]["equivalence"]
    assert fp16["diffs"] == pytest.approx([0.28, -0.16, -0.35, 0.23])
    assert fp16["verdict"] == "equivalent" and fp16["ci90"] == pytest.approx([-0.359, 0.359], abs=1e-3)
    assert bf16["verdict"] == "not_worse" and bf16["ci90"] == pytest.approx([-0.169, 0.944], abs=1e-3)
    assert "| fp16 | 4 (seeds 1, 2, 3, 4) | 12.10 (12.10) |" in cli.stdout
    bad = subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", DEMO_EPYC,
                          "--margin", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--margin must be a positive number of BLEU points, got -1" in bad.stderr


COMMITTED = sorted(p.parent.relative_to(RESULTS).as_posix() for p in RESULTS.glob("**/verdict.json"))


@pytest.mark.parametrize("folder", COMMITTED)
def test_committed_verdicts_are_those_of_their_runs(folder):
    # each verdict.json is what scripts/verdict.py computes from the committed result.json files now
    saved = json.loads((RESULTS / folder / "verdict.json").read_text())
    rows = json.loads(json.dumps(verdicts(pool([ROOT / o for o in saved["outs"]]), saved["margin"])))
    assert _leaves(rows) == pytest.approx(_leaves(saved["precisions"]))  # every number, speed ratios too
    assert {m: r.get("equivalence", {}).get("verdict") for m, r in rows.items()} == {
        m: r.get("equivalence", {}).get("verdict") for m, r in saved["precisions"].items()}


def _leaves(tree, path=""):
    """``{path: number}`` of every number in a JSON tree (strings left out), for pytest.approx."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}/{i}").items()}
    return {} if isinstance(tree, str) else {path: tree}


def test_verdict_cli_names_the_requested_runs_without_a_result(tmp_path):
    # compare.py stopped after fp32 (fp16-stock failed): settings.json asks for three runs, one is there
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760)})
    b = _comparison(tmp_path / "b", 2, {"fp32": (2, 11.0, 2.0, 800), "fp16-stock": (2, 0, 0, 0),
                                        "fp16": (2, 0, 0, 0)})
    for mode in ("fp16-stock", "fp16"):
        (b / mode / "result.json").unlink()
    cli = subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", a, b], capture_output=True, text=True)
    assert cli.returncode == 1
    assert cli.stderr == (
        f"verdict: the table leaves out 2 requested runs without a result.json in {b}: fp16-stock, fp16 "
        "(scripts/compare.py stopped before finishing them, or is still running; their train.out or generate.out "
        f"says why); rerun them: delete {b}/fp16-stock, {b}/fp16 and run scripts/compare.py again with the same "
        f"flags, --out {b} and --keep-existing (it trains only the runs without a result.json)\n")
    assert "| bf16 | 1 (seeds 1) |" in cli.stdout and "fp16" not in cli.stdout
    # without its fp32 run a comparison has nothing to pair with
    (b / "fp32" / "result.json").unlink()
    cli = subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", a, b], capture_output=True, text=True)
    assert cli.returncode == 2 and (f"{b}: no fp32 result.json to compare against: 3 requested runs without a "
                                    f"result.json in {b}: fp32, fp16-stock, fp16 (") in cli.stderr


def test_verdict_cli_names_a_result_json_cut_short(tmp_path):
    a = _comparison(tmp_path / "a", 1, {"fp32": (1, 10.0, 2.0, 800), "bf16": (1, 10.3, 4.0, 760)})
    path = a / "bf16" / "result.json"
    path.write_text(path.read_text()[:30])
    cli = subprocess.run([sys.executable, ROOT / "scripts" / "verdict.py", a], capture_output=True, text=True)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert (f"verdict.py: error: {path} is not valid JSON (Expecting value: line 1 column 31), perhaps cut "
            f"short as it was written; rerun it: delete {a}/bf16 and run scripts/compare.py again with the same "
            f"flags, --out {a} and --keep-existing") in cli.stderr
