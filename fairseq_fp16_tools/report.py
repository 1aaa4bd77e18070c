"""Read the results of scripts/compare.py and write report.md and PNG plots.

    python scripts/report.py OUT [--bootstrap 1000]

Writes ``OUT/report.md`` (one table, the runs side by side with ratios to
fp32, and sacrebleu's paired bootstrap test of each mixed-precision run
against fp32) and ``OUT/valid_loss_updates.png``, ``OUT/valid_loss_wall.png``,
``OUT/loss_scale.png``, ``OUT/throughput.png``. Prints the table. Runs scored by an
average of checkpoints (``compare.py --average-last N``) get a second table: their
last checkpoints, with their own paired bootstrap.

A run that settings.json asks for and that has no result.json (compare.py stopped before it) is
named at the top of the report and on stderr, and the report exits with status 1; the table
holds the others.
"""

import argparse
import json
import sys
from pathlib import Path

from .plots import comparison_plots
from .runs import base_mode, load_results, missing_line, missing_modes
from .stats import MARGIN, check_margin, check_resamples
from .summary import bootstrap_p, by_precision, memory_key, seed_spread, summary_record
from .tables import equivalence_table, last_table, precision_table, runs_table, short_table


# -- the report's sentences -----------------------------------------------------------------------

def describe_machine(m: dict) -> str:
    """One line of a result.json's ``machine`` record (scripts/run_stats.py)."""
    units = ", ".join(f"{d} units: {'yes' if m.get(f'cpu_native_{d}') else 'no'}" for d in ("bf16", "fp16"))
    device = "the CPU" if m.get("device") == "cpu" else m.get("device")
    isa = f"torch kernels {m['cpu_capability']}; " if m.get("cpu_capability") else ""
    cpu_id = f", {m['cpu_id']}" if m.get("cpu_id") else ""
    return (f"{m.get('cpu')} ({m.get('cpu_cores')} cores{cpu_id}; {isa}{units}), trained on {device}; "
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
    --cpu-length-multiple, which its run_info.json records, or by fairseq's
    --required-seq-len-multiple)."""
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


def control_lines(results, settings) -> list:
    """The report's lines on the runs trained with another seed than the first (fp32) run."""
    lines = []
    controls = [r for r in results[1:] if r.get("seed", settings.get("seed")) != results[0].get("seed")]
    for r in controls:
        base = base_mode(r)
        head = f"- {r['mode']}: {base} trained with seed {r['seed']} instead of {results[0].get('seed')}."
        if base == "fp32":
            lines.append(head + " Its d BLEU and p against fp32 are training-to-training variation, which the "
                         "bootstrap (it resamples test sentences of fixed outputs) does not cover: the yardstick "
                         "for the mixed runs' differences.")
        else:
            lines.append(head + f" Its difference to {base} (not to fp32) is {base}'s training-to-training "
                         "variation.")
    return lines


def spread_lines(spread):
    """The report's sentences on :func:`summary.seed_spread`."""
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


def equivalence_lines(margin: float) -> list:
    """What the equivalence table tests, for the report."""
    return [f"Is each precision within ±{margin:g} BLEU of fp32? Seed-paired test: *d* is the BLEU of a "
            "run minus that of the fp32 run trained with the same seed, one difference per seed, so that "
            "the noise of two trainings parting is counted, which a single pair's bootstrap cannot see. "
            f"*90% CI*: Student's t interval of the mean d; *p (|d| >= margin)*: two one-sided t-tests "
            f"(TOST) of a gap of {margin:g} or more, below 0.05 exactly when the interval lies inside "
            f"±{margin:g}; *p (d = 0)*: the paired t-test of no gap at all. "
            "(`scripts/verdict.py` pools the runs of several comparisons the same way.)"]


# -- the report -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the --out directory of scripts/compare.py")
    ap.add_argument("--bootstrap", type=int, default=1000,
                    help="resamples of sacrebleu's paired bootstrap (a positive number; default 1000)")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help=f"BLEU points within which a precision counts as fp32's equal in the seed-paired "
                    f"test (default {MARGIN})")
    a = ap.parse_args(argv)
    try:
        check_margin(a.margin)
        check_resamples(a.bootstrap)
        settings, results = load_results(a.out)
    except ValueError as e:
        ap.error(str(e))
    missing = missing_modes(a.out, settings)
    pvals = bootstrap_p(a.out, results, a.bootstrap)
    mem_key = memory_key(results)
    tab = runs_table(results, pvals, mem_key)
    pngs = comparison_plots(a.out, results)
    g0 = results[0]["generate"]
    where = machine_lines(results) + loss_line(results)
    mem_note = ("CUDA allocator peak" if mem_key == "peak_cuda_mb"
                else "process peak RSS (includes the Python interpreter and torch)")
    md = [
        "# fp32 vs mixed precision",
        "",
        f"Data: `{settings.get('data', '?')}`; seed {settings.get('seed', '?')}; "
        f"started {settings.get('started', '?')}, "
        + (f"finished {settings['finished']}." if settings.get("finished") else "**not finished**."),
        *(["", f"**Missing:** {missing_line(a.out, missing)}. The tables hold the other runs."] if missing else []),
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
    md += control_lines(results, settings)
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
            short_p = bootstrap_p(a.out, results, a.bootstrap, short["ids"])
        md += [f"Sentences whose source has at most {short['max_words']} words "
               f"({short['n_sentences']} of {g0['n_sentences']}), scored the same way:", "",
               short_table(results, short_p), ""]
    last_p = {}
    if all("generate_last" in r for r in results):
        last_p = bootstrap_p(a.out, results, a.bootstrap, decoded="generate_last")
        md += ["The last checkpoint of each run (not averaged), scored the same way; *gain*: the averaged "
               "checkpoint's BLEU minus the last one's:", "", last_table(results, last_p), ""]
    md += [f"![{p}]({p})" for p in pngs]
    (a.out / "report.md").write_text("\n".join(md) + "\n")
    summary = summary_record(results, pvals, spread, precisions, short_p, last_p)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(tab)
    if short:
        print(f"\nsources of <= {short['max_words']} words:\n" + short_table(results, short_p))
    if all("generate_last" in r for r in results):
        print("\nlast checkpoints (not averaged):\n" + last_table(results, last_p))
    print(f"\nreport: {a.out / 'report.md'}")
    print("plots:  " + ", ".join(str(a.out / p) for p in pngs))
    if missing:
        sys.exit(f"report: {missing_line(a.out, missing)}")
