#!/usr/bin/env python
"""Read the results of scripts/compare.py and write report.md and PNG plots.

    python scripts/report.py OUT [--bootstrap 1000]

Writes ``OUT/report.md`` (one table, the runs side by side with ratios to
fp32, and sacrebleu's paired bootstrap test of each mixed-precision run
against fp32) and ``OUT/valid_loss_updates.png``, ``OUT/valid_loss_wall.png``,
``OUT/loss_scale.png``, ``OUT/throughput.png``. Prints the table. Runs scored by an
average of checkpoints (``compare.py --average-last N``) get a second table: their
last checkpoints, with their own paired bootstrap.
"""

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

COLUMNS = [
    "mode", "updates", "updates/s", "x fp32", "words/s", "x fp32", "peak mem MB", "x fp32",
    "valid loss", "skipped", "final scale", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "sentences",
]


def load_results(out: Path):
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").exists() else {}
    modes = settings.get("modes") or sorted(p.parent.name for p in out.glob("*/result.json"))
    results = [json.loads((out / m / "result.json").read_text()) for m in modes
               if (out / m / "result.json").exists()]
    if not results or results[0]["mode"] != "fp32":
        raise SystemExit(f"{out}: no fp32 result.json to compare against (run scripts/compare.py)")
    return settings, results


def paired_bootstrap(out: Path, results, n_samples: int, ids=None, decoded="generate"):
    """{mode: p_value} of each run against the first (fp32), from sacrebleu's paired bootstrap.

    ``ids``: score only these sentence indices (the short-source subset). ``decoded``: the
    result.json entry whose hypotheses are compared ("generate_last": the last checkpoints' of
    runs scored by an average of checkpoints).
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    def lines(r, key):
        text = (out / r["mode"] / r[decoded][key]).read_text().splitlines()
        return text if ids is None else [text[i] for i in ids]

    refs = lines(results[0], "refs_file")
    baseline = lines(results[0], "hyps_file")
    pvals, systems = {}, [("baseline", baseline)]
    for r in results[1:]:
        hyps = lines(r, "hyps_file")
        if hyps == baseline:
            # sacrebleu gives identical systems p = 1/(n+1); there is no difference at all.
            pvals[r["mode"]] = 1.0
        else:
            systems.append((r["mode"], hyps))
    if len(systems) < 2:
        return pvals
    test = PairedTest(systems, {"BLEU": BLEU()}, [refs], test_type="bs", n_samples=n_samples)
    _, scores = test()
    for name, res in zip([s[0] for s in systems], scores["BLEU"]):
        if name != "baseline":
            pvals[name] = res.p_value
    return pvals


def ratio(a, b):
    return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(results, pvals):
    base = results[0]
    bt, bg = base["train"], base["generate"]
    mem_key = "peak_cuda_mb" if bt.get("peak_cuda_mb") else "peak_rss_mb"
    rows = []
    for r in results:
        t, g = r["train"], r["generate"]
        valid = t["valid"][-1]["loss"] if t["valid"] else None
        p = pvals.get(r["mode"])
        rows.append([
            r["mode"], t["updates"], fmt(t["updates_per_s"]), ratio(t["updates_per_s"], bt["updates_per_s"]),
            fmt(t["words_per_s"], 0), ratio(t["words_per_s"], bt["words_per_s"]),
            fmt(t[mem_key], 0), ratio(t[mem_key], bt[mem_key]), fmt(valid, 3), t["skipped_updates"],
            fmt(t["final_loss_scale"], 0) if t["final_loss_scale"] is not None else "-",
            fmt(g["bleu"]), "-" if r is base else f"{g['bleu'] - bg['bleu']:+.2f}",
            "-" if p is None else f"{p:.3f}", fmt(g["chrf"]), g["n_sentences"],
        ])
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines), mem_key


SHORT_COLUMNS = ["mode", "sentences", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "BP"]


def short_table(results, pvals):
    """BLEU on the short-source subset (compare.py --short-max-words), runs side by side."""
    base = results[0]["generate"]["short"]
    rows = []
    for r in results:
        sh = r["generate"]["short"]
        p = pvals.get(r["mode"])
        rows.append([r["mode"], sh["n_sentences"], fmt(sh["bleu"]),
                     "-" if r is results[0] else f"{sh['bleu'] - base['bleu']:+.2f}",
                     "-" if p is None else f"{p:.3f}", fmt(sh["chrf"]), fmt(sh["bleu_bp"], 3)])
    lines = ["| " + " | ".join(SHORT_COLUMNS) + " |", "|" + "---|" * len(SHORT_COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


LAST_COLUMNS = ["mode", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "averaged BLEU", "gain"]


def last_table(results, pvals):
    """The last checkpoint's scores of runs scored by an average of checkpoints (compare.py
    --average-last), beside the average's."""
    base = results[0]["generate_last"]
    rows = []
    for r in results:
        g, avg = r["generate_last"], r["generate"]
        p = pvals.get(r["mode"])
        rows.append([r["mode"], fmt(g["bleu"]), "-" if r is results[0] else f"{g['bleu'] - base['bleu']:+.2f}",
                     "-" if p is None else f"{p:.3f}", fmt(g["chrf"]), fmt(avg["bleu"]),
                     f"{avg['bleu'] - g['bleu']:+.2f}"])
    lines = ["| " + " | ".join(LAST_COLUMNS) + " |", "|" + "---|" * len(LAST_COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def averaged_line(results) -> str:
    """What the runs' BLEU was decoded from, when it is an average of checkpoints; "" otherwise."""
    avgs = {r["mode"]: r["averaged"] for r in results if r.get("averaged")}
    if not avgs:
        return ""
    kinds = {(a["n"], tuple(a["updates"] or ())) for a in avgs.values()}
    if len(kinds) == 1 and len(avgs) == len(results):
        n, updates = kinds.pop()
        which = f"the last {n} checkpoints (updates {', '.join(map(str, updates))})"
    else:
        which = "; ".join(f"{m}: the last {a['n']} checkpoints (updates {', '.join(map(str, a['updates'] or ()))})"
                          for m, a in avgs.items())
    return (f"- Decoded checkpoint: each run's weights averaged over {which}, a half run's from its fp32 "
            "master weights (scripts/average_checkpoints.py); its last checkpoint is scored below.")


def base_mode(r) -> str:
    """The mode a run was trained in: ``fp32`` for ``fp32-seed2`` (results before compare.py
    stored ``base_mode`` are their own mode)."""
    return r.get("base_mode", r["mode"])


def seed_spread(results):
    """fp32's BLEU over its seeds, and where each mixed run of the base seed falls among them.

    The fp32 seeds are the base run and its fp32 control runs (``fp32@seedN``).
    The paired bootstrap resamples the test sentences of two fixed outputs, so
    it calls significant a difference that another training of fp32 can show
    as well; this spread is that training-to-training variation.

    Returns:
        None with fewer than two fp32 seeds; else a dict with the seeds, their
        BLEU, mean, sample standard deviation, range, and per mixed run its
        BLEU, its difference to the mean, that in standard deviations
        (``z``; None when the deviation is 0) and whether it lies within the
        fp32 seeds' range.
    """
    base_seed = results[0].get("seed")
    fp32 = [r for r in results if base_mode(r) == "fp32"]
    if len(fp32) < 2:
        return None
    bleus = [r["generate"]["bleu"] for r in fp32]
    mean, sd = statistics.fmean(bleus), statistics.stdev(bleus)
    runs = {}
    for r in results:
        if base_mode(r) == "fp32" or r.get("seed", base_seed) != base_seed:
            continue
        b = r["generate"]["bleu"]
        runs[r["mode"]] = {"bleu": b, "d_mean": b - mean, "z": (b - mean) / sd if sd else None,
                           "within_range": min(bleus) <= b <= max(bleus)}
    return {"seeds": [r.get("seed") for r in fp32], "bleu": bleus, "mean": mean, "sd": sd,
            "min": min(bleus), "max": max(bleus), "runs": runs}


def spread_lines(spread):
    """The report's sentences on :func:`seed_spread`."""
    seeds = ", ".join(f"{b:.2f} (seed {s})" for s, b in zip(spread["seeds"], spread["bleu"]))
    n = len(spread["bleu"])
    lines = [f"- fp32 trained with {n} seeds: BLEU {seeds}; mean {spread['mean']:.2f}, standard deviation "
             f"{spread['sd']:.2f}" + (" (two seeds: a rough estimate)" if n == 2 else "") + "."]
    for mode, v in spread["runs"].items():
        z = "" if v["z"] is None or n < 3 else f", {v['z']:+.1f} standard deviations"
        where = "within" if v["within_range"] else "outside"
        lines.append(f"- {mode}: BLEU {v['bleu']:.2f}, {v['d_mean']:+.2f} from the fp32 seeds' mean{z}; "
                     f"{where} their range ({spread['min']:.2f} to {spread['max']:.2f}).")
    return lines


def permutation_p(a, b) -> float:
    """Exact two-sided permutation test of the difference of means of two small samples.

    Every split of the pooled values into groups of len(a) and len(b) is equally
    likely if the label does not matter; p is the share of splits whose
    difference of means is at least as large (in absolute value) as the observed one.
    """
    pooled, n = [*a, *b], len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    splits = list(itertools.combinations(range(len(pooled)), n))
    hits = 0
    for idx in splits:
        x = [pooled[i] for i in idx]
        y = [v for i, v in enumerate(pooled) if i not in idx]
        hits += abs(statistics.fmean(x) - statistics.fmean(y)) >= observed - 1e-9
    return hits / len(splits)


#: The issue's tolerance for "the same BLEU": a mixed precision within this many BLEU points of fp32.
MARGIN = 0.5


def check_margin(margin: float) -> float:
    """``margin`` if it is a positive number of BLEU points; else ValueError naming ``--margin``."""
    if not margin > 0:
        raise ValueError(f"--margin must be a positive number of BLEU points, got {margin:g}")
    return margin


def paired_equivalence(diffs, margin: float = MARGIN) -> dict:
    """Is a precision's BLEU within ``margin`` of fp32's, counting training-to-training variation?

    ``diffs``: BLEU(mixed) - BLEU(fp32) of runs trained with the same seed, one per seed. Pairing
    by seed takes out what the two runs share (initialisation, batch order); what is left is the
    precision's effect plus the noise of two trainings parting, which one pair's paired bootstrap
    (test sentences resampled, outputs fixed) does not see. Student's t on the differences gives:

    - ``ci90``: the 90% confidence interval of the mean difference;
    - two one-sided tests (TOST) of "|mean difference| >= margin": ``p_equivalence``, the larger
      of their p values; below 0.05 exactly when ``ci90`` lies inside (-margin, +margin);
    - ``p_difference``: the two-sided paired t-test of "mean difference = 0".

    ``verdict`` is one of ``equivalent`` (``ci90`` inside the margin), ``not_worse`` (the lower
    bound above -margin, the upper one not below +margin), ``not_better`` (the mirror),
    ``worse`` / ``better`` (the whole interval beyond -margin / +margin) or ``inconclusive``
    (the interval reaches past both).

    Raises:
        ValueError: with fewer than two differences, or a margin that is not positive.
    """
    from scipy import stats

    check_margin(margin)
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a seed-paired test needs two or more seeds with both runs, got {n}")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    t = stats.t(df=n - 1)
    if se > 0:
        half = t.ppf(0.95) * se
        p_low = t.sf((mean + margin) / se)  # H0: mean <= -margin
        p_high = t.cdf((mean - margin) / se)  # H0: mean >= +margin
        p_diff = 2 * t.sf(abs(mean) / se)
    else:  # every seed gave the same difference: no spread to test against
        half = 0.0
        p_low, p_high = float(mean <= -margin), float(mean >= margin)
        p_diff = float(mean == 0)
    lo, hi = mean - half, mean + half
    if -margin < lo and hi < margin:
        verdict = "equivalent"
    elif hi <= -margin:
        verdict = "worse"
    elif lo >= margin:
        verdict = "better"
    elif lo > -margin:
        verdict = "not_worse"
    elif hi < margin:
        verdict = "not_better"
    else:
        verdict = "inconclusive"
    return {"n": n, "diffs": list(diffs), "mean": mean, "sd": sd, "ci90": [float(lo), float(hi)],
            "margin": margin, "p_equivalence": float(max(p_low, p_high)), "p_difference": float(p_diff),
            "verdict": verdict}


VERDICTS = {
    "equivalent": "within ±{m} BLEU of fp32",
    "not_worse": "not more than {m} BLEU below fp32; within ±{m} not shown (upper bound above +{m})",
    "not_better": "not more than {m} BLEU above fp32; within ±{m} not shown (lower bound below -{m})",
    "worse": "more than {m} BLEU below fp32",
    "better": "more than {m} BLEU above fp32",
    "inconclusive": "inconclusive: the interval reaches past -{m} and +{m}; more seeds narrow it",
}


def equivalence_table(rows) -> str:
    """The report's table of the ``equivalence`` entries of :func:`by_precision`'s rows."""
    cols = ["precision", "seed pairs", "d BLEU per seed", "mean d", "90% CI", "p (|d| >= margin)",
            "p (d = 0)", "verdict"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for mode, v in rows.items():
        e = v.get("equivalence")
        if not e:
            continue
        m = f"{e['margin']:g}"
        lines.append("| " + " | ".join([
            mode, str(e["n"]), ", ".join(f"{d:+.2f}" for d in e["diffs"]), f"{e['mean']:+.2f}",
            f"{e['ci90'][0]:+.2f} to {e['ci90'][1]:+.2f}", f"{e['p_equivalence']:.3f}",
            f"{e['p_difference']:.3f}", VERDICTS[e["verdict"]].format(m=m)]) + " |")
    return "\n".join(lines)


def equivalence_lines(margin: float) -> list:
    """What the equivalence table tests, for the report."""
    return [f"Is each precision within ±{margin:g} BLEU of fp32? Seed-paired test: *d* is the BLEU of a "
            "run minus that of the fp32 run trained with the same seed, one difference per seed, so that "
            "the noise of two trainings parting is counted, which a single pair's bootstrap cannot see. "
            f"*90% CI*: Student's t interval of the mean d; *p (|d| >= margin)*: two one-sided t-tests "
            f"(TOST) of a gap of {margin:g} or more, below 0.05 exactly when the interval lies inside "
            f"±{margin:g}; *p (d = 0)*: the paired t-test of no gap at all. "
            "(`scripts/verdict.py` pools the runs of several comparisons the same way.)"]


def by_precision(out: Path, results, n_samples: int, pvals=None, margin: float = MARGIN):
    """BLEU per precision over its seeds, compared with fp32 two ways.

    - same seed: each mixed run against the fp32 run of its seed (``fp32@seedN``),
      d BLEU and sacrebleu's paired bootstrap p: the like-for-like pairs;
    - over seeds: the difference of the mean BLEU to fp32's, and an exact
      permutation test on the per-seed BLEU values (``permutation_p``; its
      smallest possible p with these seed counts is given too). This test counts
      training-to-training variation, which the bootstrap does not;
    - seed-paired equivalence (``equivalence``, with two or more same-seed pairs): the per-seed
      differences tested against ``margin`` (:func:`paired_equivalence`).

    ``pvals``: :func:`paired_bootstrap`'s p values against ``results[0]``, reused for the pairs
    with that run instead of drawn again. None unless some precision has runs with two or more
    seeds.
    """
    groups = {}
    for r in results:
        groups.setdefault(base_mode(r), {})[r.get("seed")] = r
    if not any(len(g) > 1 for g in groups.values()):
        return None
    fp32 = groups.get("fp32", {})
    fp32_bleus = [fp32[s]["generate"]["bleu"] for s in sorted(fp32, key=lambda s: (s is None, s))]
    rows = {}
    for mode, runs in groups.items():
        seeds = sorted(runs, key=lambda s: (s is None, s))
        bleus = [runs[s]["generate"]["bleu"] for s in seeds]
        row = {"seeds": seeds, "bleu": bleus, "mean": statistics.fmean(bleus),
               "sd": statistics.stdev(bleus) if len(bleus) > 1 else None}
        if mode != "fp32" and fp32:
            row["d_mean"] = row["mean"] - statistics.fmean(fp32_bleus)
            if len(fp32_bleus) >= 2 and len(bleus) >= 2:
                row["permutation_p"] = permutation_p(bleus, fp32_bleus)
                row["min_permutation_p"] = 1 / math.comb(len(fp32_bleus) + len(bleus), len(bleus)) * (
                    2 if len(fp32_bleus) == len(bleus) else 1)
            row["same_seed"] = {}
            for s in seeds:
                if s in fp32:
                    if fp32[s] is results[0] and pvals and runs[s]["mode"] in pvals:
                        p = pvals[runs[s]["mode"]]
                    else:
                        p = paired_bootstrap(out, [fp32[s], runs[s]], n_samples)[runs[s]["mode"]]
                    row["same_seed"][s] = {"d_bleu": runs[s]["generate"]["bleu"] - fp32[s]["generate"]["bleu"],
                                           "p": p}
            if len(row["same_seed"]) >= 2:
                # result.json's BLEU has two decimals: so have the differences
                row["equivalence"] = paired_equivalence([round(d["d_bleu"], 2) for d in row["same_seed"].values()],
                                                        margin)
        rows[mode] = row
    return rows


def precision_table(rows) -> str:
    """The report's table of :func:`by_precision`."""
    cols = ["precision", "seeds", "BLEU per seed", "mean", "sd", "d mean (vs fp32)", "p over seeds",
            "same seed: d BLEU (p)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for mode, v in rows.items():
        perm = "-"
        if "permutation_p" in v:
            perm = f"{v['permutation_p']:.3f} (smallest possible {v['min_permutation_p']:.3f})"
        same = "; ".join(f"seed {s}: {d['d_bleu']:+.2f} ({d['p']:.3f})" for s, d in v.get("same_seed", {}).items())
        lines.append("| " + " | ".join([
            mode, str(len(v["seeds"])), ", ".join(f"{b:.2f}" for b in v["bleu"]), f"{v['mean']:.2f}",
            "-" if v["sd"] is None else f"{v['sd']:.2f}",
            f"{v['d_mean']:+.2f}" if "d_mean" in v else "-", perm, same or "-"]) + " |")
    return "\n".join(lines)


def describe_machine(m: dict) -> str:
    """One line of a result.json's ``machine`` record (scripts/run_stats.py)."""
    units = ", ".join(f"{d} units: {'yes' if m.get(f'cpu_native_{d}') else 'no'}" for d in ("bf16", "fp16"))
    device = "the CPU" if m.get("device") == "cpu" else m.get("device")
    isa = f"torch kernels {m['cpu_capability']}; " if m.get("cpu_capability") else ""
    return (f"{m.get('cpu')} ({m.get('cpu_cores')} cores; {isa}{units}), trained on {device}; "
            f"torch {m.get('torch')}, fairseq {m.get('fairseq')}, Python {m.get('python')}")


def machine_lines(results) -> list:
    """The report's lines on where the runs ran, which CPU matrix-product path each half run
    took and, when any run's were padded, how each run's batch lengths were. Runs recorded
    before result.json held a machine are listed as not recorded; runs on different machines or
    versions get a warning, as their speed and memory do not compare."""
    groups = {}
    for r in results:
        key = describe_machine(r["machine"]) if r.get("machine") else None
        groups.setdefault(key, []).append(r["mode"])
    if set(groups) == {None}:
        return []
    if len(groups) == 1:
        lines = [f"Machine (all runs): {next(iter(groups))}."]
    else:
        lines = ["Machines: " + "; ".join(f"{', '.join(modes)}: {key or 'not recorded'}"
                                          for key, modes in groups.items()) + "."]
        if len([k for k in groups if k]) > 1:
            lines[0] = ("**The runs ran on different machines or versions: their speed and memory "
                        "do not compare.** " + lines[0])
    paths = {}
    for r in results:
        if r.get("half_matmul"):
            path, escaped = r["half_matmul"], r.get("native_half_products")
            if escaped == 0:
                path += ", checked: no product of the first training step on native kernels"
            elif escaped:
                path += (f", checked: **{escaped} products of the first training step on native "
                         "kernels** (the train log names them)")
            paths.setdefault(path, []).append(r["mode"])
    if paths:
        lines.append("CPU half-precision matrix products: " + "; ".join(
            f"{', '.join(modes)}: {path}" for path, modes in paths.items()) + ".")
    lengths = {}
    for r in results:
        lengths.setdefault(batch_lengths(r), []).append(r["mode"])
    if set(lengths) != {"as they are"}:
        lines.append("Batch lengths: " + "; ".join(f"{', '.join(modes)}: {how}" for how, modes in lengths.items())
                     + " (padded positions are masked; a batch's sentences are the same).")
    return lines


def batch_lengths(r) -> str:
    """How a run's batch lengths were shaped: as they are, or padded to a multiple (by the plugin's
    --cpu-length-multiple, which its log records, or by fairseq's --required-seq-len-multiple)."""
    if r.get("batch_lengths"):
        return r["batch_lengths"]
    cmd = r.get("train_command") or []
    for i, arg in enumerate(cmd[:-1]):
        if arg == "--required-seq-len-multiple" and int(cmd[i + 1]) > 1:
            return f"padded to a multiple of {cmd[i + 1]} (--required-seq-len-multiple)"
    return "as they are"


def loss_line(results) -> list:
    """The report's line on how each run computed its loss ([] when no run recorded it:
    result.json has said since 2026-12-01)."""
    kinds = {True: "fused fp32 loss from the logits (--fused-loss)",
             False: "fairseq's loss (log-softmax in fp32)", None: "not recorded"}
    groups = {}
    for r in results:
        groups.setdefault(r.get("fused_loss"), []).append(r["mode"])
    if set(groups) == {None}:
        return []
    return ["Loss: " + "; ".join(f"{', '.join(modes)}: {kinds[k]}" for k, modes in groups.items()) + "."]


def decoding_line(results, gen_args: str) -> str:
    """The report's line on the decoding flags; it names each run's flags when they differ
    (a ``compare.py --redecode`` that stopped part-way leaves runs decoded with other flags)."""
    per_run = {r["mode"]: r["generate"].get("gen_args", gen_args) for r in results}
    if len(set(per_run.values())) <= 1:
        return f"Decoding flags (all runs): `{gen_args}`"
    return ("**The runs were decoded with different flags, so their BLEU is not comparable:** "
            + "; ".join(f"{m}: `{g}`" for m, g in per_run.items())
            + ". Decode them again alike: `scripts/compare.py ... --keep-existing --redecode`.")


def plots(out: Path, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    # One colour per precision, one line style and marker per seed: with several seeds a
    # precision's runs read as one family, and ten runs do not run out of colours.
    bases = list(dict.fromkeys(r.get("base_mode", r["mode"]) for r in results))
    seeds = sorted({r.get("seed") for r in results}, key=lambda x: (x is None, x))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def style(r):
        i, j = bases.index(r.get("base_mode", r["mode"])), seeds.index(r.get("seed"))
        return dict(color=palette[i % len(palette)], linestyle=("-", "--", ":", "-.")[j % 4],
                    label=r["mode"])

    def legend(ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", ncol=2 if len(results) > 6 else 1)

    for xkey, name, label in (("num_updates", "valid_loss_updates.png", "updates"),
                              ("wall", "valid_loss_wall.png", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            pts = [(v.get(xkey), v["loss"]) for v in r["train"]["valid"] if v.get(xkey) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="osD^v"[seeds.index(r.get("seed")) % 5], markersize=4, **style(r))
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (base 2)")
        ax.set_title(f"Validation loss against {label}")
        ax.grid(alpha=0.3)
        legend(ax)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        pts = [(x["num_updates"], x["loss_scale"]) for x in r["train"]["train_inner"] if "loss_scale" in x]
        if pts:
            ax.step(*zip(*pts), where="post", **style(r))
    ax.set_yscale("log", base=2)
    ax.set_xlabel("updates")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss scale over updates (log interval samples)")
    ax.grid(alpha=0.3)
    legend(ax)
    save(fig, "loss_scale.png")

    names = [r["mode"] for r in results]
    wps = [r["train"]["words_per_s"] or 0 for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(names) + 1.5), 4))  # 0.6 inch a bar
    bars = ax.bar(names, wps, color=["#777777"] + ["#1f77b4"] * (len(names) - 1))
    for b, v in zip(bars, wps):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v / wps[0]:.2f}x" if wps[0] else "", ha="center",
                va="bottom", fontsize="small")
    if len(names) > 4:  # names like fp16-seed2 overlap side by side
        plt.setp(ax.get_xticklabels(), rotation=35, ha="right")
    ax.set_ylabel("target words / s (train)")
    ax.set_title("Training throughput (ratio to fp32)")
    save(fig, "throughput.png")
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the --out directory of scripts/compare.py")
    ap.add_argument("--bootstrap", type=int, default=1000, help="paired bootstrap resamples")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help=f"BLEU points within which a precision counts as fp32's equal in the seed-paired "
                    f"test (default {MARGIN})")
    a = ap.parse_args(argv)
    try:
        check_margin(a.margin)
    except ValueError as e:
        ap.error(str(e))
    settings, results = load_results(a.out)
    pvals = paired_bootstrap(a.out, results, a.bootstrap)
    tab, mem_key = table(results, pvals)
    pngs = plots(a.out, results)
    g0 = results[0]["generate"]
    where = machine_lines(results) + loss_line(results)
    mem_note = ("CUDA allocator peak" if mem_key == "peak_cuda_mb"
                else "process peak RSS (includes the Python interpreter and torch)")
    md = [
        "# fp32 vs mixed precision",
        "",
        f"Data: `{settings.get('data', '?')}`; seed {settings.get('seed', '?')}; "
        f"started {settings.get('started', '?')}, finished {settings.get('finished', '?')}.",
        *[x for line in where for x in ("", line)],
        "",
        tab,
        "",
        f"- updates/s and words/s: mean of fairseq's per-interval rates after the first interval; "
        f"peak memory: {mem_note}.",
        f"- BLEU and chrF: sacrebleu on all {g0['n_sentences']} sentences of `{g0['subset']}`, "
        f"detokenised; `{g0['bleu_signature']}`, `{g0['chrf_signature']}`.",
        f"- p: sacrebleu paired bootstrap ({a.bootstrap} resamples) of each run against fp32; "
        "p > 0.05 means the BLEU difference is within resampling noise (1.000: identical output).",
    ]
    averaged = averaged_line(results)
    if averaged:
        md.append(averaged)
    controls = [r for r in results[1:] if r.get("seed", settings.get("seed")) != results[0].get("seed")]
    for r in controls:
        base = base_mode(r)
        head = f"- {r['mode']}: {base} trained with seed {r['seed']} instead of {results[0].get('seed')}."
        if base == "fp32":
            md.append(head + " Its d BLEU and p against fp32 are training-to-training variation, which the "
                      "bootstrap (it resamples test sentences of fixed outputs) does not cover: the yardstick "
                      "for the mixed runs' differences.")
        else:
            md.append(head + f" Its difference to {base} (not to fp32) is {base}'s training-to-training "
                      "variation.")
    spread = seed_spread(results)
    if spread:
        md += ["", "Training-to-training variation (BLEU on the whole split):", "", *spread_lines(spread)]
    precisions = by_precision(a.out, results, a.bootstrap, pvals, a.margin)
    if precisions:
        md += ["", "Each precision over its seeds (BLEU on the whole split). *same seed*: each run against "
               "the fp32 run of its seed, paired bootstrap p; *p over seeds*: exact permutation test of the "
               "mean BLEU against fp32's over the per-seed values, which counts training-to-training "
               "variation (with few seeds it cannot go below the smallest possible p):", "",
               precision_table(precisions)]
        if any("equivalence" in v for v in precisions.values()):
            md += ["", *equivalence_lines(a.margin), "", equivalence_table(precisions)]
    md += [
        "",
        "Training flags (all runs): `" + settings.get("train_args", "") + "`",
        "",
        decoding_line(results, settings.get("gen_args", "")),
        "",
    ]
    short = results[0]["generate"].get("short")
    short_p = {}
    if short and all("short" in r["generate"] for r in results):
        if short.get("ids") is not None:  # results written before compare.py stored the ids
            short_p = paired_bootstrap(a.out, results, a.bootstrap, short["ids"])
        md += [f"Sentences whose source has at most {short['max_words']} words "
               f"({short['n_sentences']} of {g0['n_sentences']}), scored the same way:", "",
               short_table(results, short_p), ""]
    last_p = {}
    if all("generate_last" in r for r in results):
        last_p = paired_bootstrap(a.out, results, a.bootstrap, decoded="generate_last")
        md += ["The last checkpoint of each run (not averaged), scored the same way; *gain*: the averaged "
               "checkpoint's BLEU minus the last one's:", "", last_table(results, last_p), ""]
    md += [f"![{p}]({p})" for p in pngs]
    (a.out / "report.md").write_text("\n".join(md) + "\n")
    runs = {r["mode"]: {"bleu": r["generate"]["bleu"], "p_vs_fp32": pvals.get(r["mode"]),
                        "words_per_s": r["train"]["words_per_s"], mem_key: r["train"][mem_key]}
            for r in results}
    for r in results:
        if "generate_last" in r:
            runs[r["mode"]]["last_bleu"] = r["generate_last"]["bleu"]
            runs[r["mode"]]["last_p_vs_fp32"] = last_p.get(r["mode"])
        if "short" in r["generate"]:
            runs[r["mode"]]["short_bleu"] = r["generate"]["short"]["bleu"]
            runs[r["mode"]]["short_p_vs_fp32"] = short_p.get(r["mode"])
    # run names are user-chosen (fp32@seed7 -> fp32-seed7): keep them apart from the other keys
    summary = {"runs": runs, "fp32_seed_spread": spread, "by_precision": precisions}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(tab)
    if short:
        print(f"\nsources of <= {short['max_words']} words:\n" + short_table(results, short_p))
    if all("generate_last" in r for r in results):
        print("\nlast checkpoints (not averaged):\n" + last_table(results, last_p))
    print(f"\nreport: {a.out / 'report.md'}")
    print("plots:  " + ", ".join(str(a.out / p) for p in pngs))


if __name__ == "__main__":
    main()
