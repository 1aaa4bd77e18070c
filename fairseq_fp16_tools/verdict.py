"""Pool the runs of one or more comparisons and say, per precision, whether it matches fp32.

    python scripts/verdict.py OUT [OUT ...] [--margin 0.5] [--json FILE]

Each OUT is a ``scripts/compare.py --out`` directory. Runs are paired by seed:
a mixed run of seed N against the fp32 run of seed N, from whichever OUT
holds them, so seeds trained in different sittings (``demo.py --seed 5
--modes fp32,bf16,fp32@seed6,bf16@seed6`` beside an earlier four-seed
comparison) are tested together. The OUTs must share their training and
decoding flags, data and checkpoint averaging, and their runs the machine and
versions (each entry that two runs' ``result.json`` ``machine`` records both
hold: runs recorded before an entry existed are not checked on it); each
(precision, seed) may come from one OUT only.

Prints a markdown table: per precision the seed pairs, BLEU, speed and
memory as ratios to fp32 of the same seed, and the seed-paired equivalence
test of ``stats.paired_equivalence`` (90% CI of the mean BLEU difference,
TOST against ``--margin``); ``--json`` writes the same rows. It reads
``result.json`` files only (no hypotheses), so it also runs on the committed
results under ``examples/translation/results/``. A run that an OUT's settings.json
asks for and that has no result.json (compare.py stopped before it) is named on
stderr after the table, and the exit status is 1.
"""

import argparse
import json
import sys
from pathlib import Path

from .provenance import unique_records
from .runs import SETTING_DEFAULTS, base_mode, load_results, missing_line, missing_modes
from .stats import MARGIN, check_margin, paired_equivalence, permutation_p
from .tables import verdict_table

#: settings.json entries that must agree for runs of two comparisons to be paired.
SHARED = ("data", "train_args", "gen_args", "gen_subset", "average_last")


def pool(outs):
    """``{precision: {seed: result}}`` over the OUT directories.

    Raises:
        ValueError: naming the OUT and the setting when two OUTs differ in a :data:`SHARED`
            setting, the runs when two ran on different machines or versions, or the OUTs
            when both hold the same precision and seed; naming the file when one is missing or
            not valid JSON (:func:`runs.load_results`).
    """
    runs, first, where, machines = {}, None, {}, []
    for out in outs:
        settings, results = load_results(out)
        if first is None:
            first = (out, settings)
        for key in SHARED:
            ours, theirs = (s.get(key, SETTING_DEFAULTS.get(key)) for s in (settings, first[1]))
            if ours != theirs:
                raise ValueError(f"{out} and {first[0]} differ in {key} ({ours!r} against "
                                 f"{theirs!r}): their runs are not comparable")
        for r in results:
            mode, seed = base_mode(r), r.get("seed", settings.get("seed"))
            if (mode, seed) in where:
                raise ValueError(f"{mode} with seed {seed} is in both {where[mode, seed]} and {out}: "
                                 "pass the comparison that holds the run once")
            where[mode, seed] = out
            runs.setdefault(mode, {})[seed] = r
            for seen, path in machines if r.get("machine") else ():
                differ = [k for k in sorted(r["machine"].keys() & seen.keys()) if r["machine"][k] != seen[k]]
                if differ:
                    raise ValueError(f"{out / r['mode']} and {path} ran on different machines or versions ("
                                     + ", ".join(f"{k} {r['machine'][k]!r} against {seen[k]!r}" for k in differ)
                                     + "): their runs do not pair")
            if r.get("machine") and all(r["machine"] != seen for seen, _ in machines):
                machines.append((r["machine"], out / r["mode"]))
    return runs


def _mem(r):
    t = r["train"]
    return t.get("peak_cuda_mb") or t.get("peak_rss_mb")


def verdicts(runs, margin: float = MARGIN) -> dict:
    """Per mixed precision: its seed pairs with fp32 and :func:`stats.paired_equivalence`.

    Precisions with fewer than two seed pairs get their pairs and no test.
    """
    fp32 = runs.get("fp32", {})
    rows = {}
    for mode, by_seed in runs.items():
        if mode == "fp32":
            continue
        seeds = sorted(s for s in by_seed if s in fp32)
        pairs = [(by_seed[s], fp32[s]) for s in seeds]
        row = {
            "seeds": seeds,
            "bleu": [m["generate"]["bleu"] for m, _ in pairs],
            "fp32_bleu": [f["generate"]["bleu"] for _, f in pairs],
            "x_updates_per_s": [m["train"]["updates_per_s"] / f["train"]["updates_per_s"] for m, f in pairs],
            "x_peak_mem": [_mem(m) / _mem(f) for m, f in pairs],
        }
        if len(pairs) >= 2:
            # result.json's BLEU has two decimals: so have the differences
            row["equivalence"] = paired_equivalence([round(m - f, 2) for m, f in zip(row["bleu"], row["fp32_bleu"])],
                                                    margin)
            row["permutation_p"] = permutation_p(row["bleu"], row["fp32_bleu"])
        rows[mode] = row
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outs", nargs="+", type=Path, metavar="OUT", help="scripts/compare.py --out directories")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help=f"BLEU points within which a precision counts as fp32's equal (default {MARGIN})")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    try:
        check_margin(a.margin)
        runs = pool(a.outs)
    except ValueError as e:
        ap.error(str(e))
    rows = verdicts(runs, a.margin)
    print(f"Seed-paired comparison with fp32 ({', '.join(map(str, a.outs))}); margin ±{a.margin:g} BLEU; "
          "ratios: mean (range) over the seed pairs.\n")
    print(verdict_table(rows, a.margin))
    if a.json:
        # the code of the runs pooled (their result.json's provenance; older results hold none)
        provenances = unique_records(r.get("provenance") for by_seed in runs.values() for r in by_seed.values())
        a.json.write_text(json.dumps({"outs": [str(o) for o in a.outs], "margin": a.margin, "precisions": rows,
                                      "provenances": provenances}, indent=1))
    missing = [missing_line(out, m) for out in a.outs if (m := missing_modes(out))]
    if missing:
        sys.exit("verdict: the table leaves out " + "; ".join(missing))
