"""The markdown tables of the comparison tools: the runs side by side (``report.py``), each
precision over its seeds and its seed-paired test (``report.py``, ``verdict.py``), and the decodes
in other precisions (``decode_precision.py``). Each takes the JSON-ready values the other modules
compute and returns the table's text; nothing here computes a statistic.
"""

import statistics
from typing import Sequence

from .stats import MARGIN

COLUMNS = [
    "mode", "updates", "updates/s", "x fp32", "words/s", "x fp32", "peak mem MB", "x fp32",
    "valid loss", "skipped", "final scale", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "sentences",
]
SHORT_COLUMNS = ["mode", "sentences", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "BP"]
LAST_COLUMNS = ["mode", "BLEU", "d BLEU", "p (vs fp32)", "chrF", "averaged BLEU", "gain"]
#: the seed-paired test's verdicts (``stats.paired_equivalence``), in words ({m}: the margin)
VERDICTS = {
    "equivalent": "within ±{m} BLEU of fp32",
    "not_worse": "not more than {m} BLEU below fp32; within ±{m} not shown (upper bound above +{m})",
    "not_better": "not more than {m} BLEU above fp32; within ±{m} not shown (lower bound below -{m})",
    "worse": "more than {m} BLEU below fp32",
    "better": "more than {m} BLEU above fp32",
    "inconclusive": "inconclusive: the interval reaches past -{m} and +{m}; more seeds narrow it",
}


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table: the header, its rule, a line per row (cells written with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a, b):
    return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _p(p) -> str:
    return "-" if p is None else f"{p:.3f}"


def runs_table(results, pvals, mem_key: str) -> str:
    """The runs side by side, with ratios to the first (fp32) and each run's bootstrap p against
    it; ``mem_key``: the train entry of the peak memory (``summary.memory_key``)."""
    base = results[0]
    bt, bg = base["train"], base["generate"]
    rows = []
    for r in results:
        t, g = r["train"], r["generate"]
        valid = t["valid"][-1]["loss"] if t["valid"] else None
        rows.append([
            r["mode"], t["updates"], fmt(t["updates_per_s"]), ratio(t["updates_per_s"], bt["updates_per_s"]),
            fmt(t["words_per_s"], 0), ratio(t["words_per_s"], bt["words_per_s"]),
            fmt(t[mem_key], 0), ratio(t[mem_key], bt[mem_key]), fmt(valid, 3), t["skipped_updates"],
            fmt(t["final_loss_scale"], 0) if t["final_loss_scale"] is not None else "-",
            fmt(g["bleu"]), "-" if r is base else f"{g['bleu'] - bg['bleu']:+.2f}",
            _p(pvals.get(r["mode"])), fmt(g["chrf"]), g["n_sentences"],
        ])
    return md_table(COLUMNS, rows)


def short_table(results, pvals) -> str:
    """BLEU on the short-source subset (compare.py --short-max-words), runs side by side."""
    base = results[0]["generate"]["short"]
    rows = []
    for r in results:
        sh = r["generate"]["short"]
        rows.append([r["mode"], sh["n_sentences"], fmt(sh["bleu"]),
                     "-" if r is results[0] else f"{sh['bleu'] - base['bleu']:+.2f}",
                     _p(pvals.get(r["mode"])), fmt(sh["chrf"]), fmt(sh["bleu_bp"], 3)])
    return md_table(SHORT_COLUMNS, rows)


def last_table(results, pvals) -> str:
    """The last checkpoint's scores of runs scored by an average of checkpoints (compare.py
    --average-last), beside the average's."""
    base = results[0]["generate_last"]
    rows = []
    for r in results:
        g, avg = r["generate_last"], r["generate"]
        rows.append([r["mode"], fmt(g["bleu"]), "-" if r is results[0] else f"{g['bleu'] - base['bleu']:+.2f}",
                     _p(pvals.get(r["mode"])), fmt(g["chrf"]), fmt(avg["bleu"]),
                     f"{avg['bleu'] - g['bleu']:+.2f}"])
    return md_table(LAST_COLUMNS, rows)


def precision_table(rows) -> str:
    """Each precision over its seeds (``summary.by_precision``'s rows)."""
    cols = ["precision", "seeds", "BLEU per seed", "mean", "sd", "d mean (vs fp32)", "p over seeds",
            "same seed: d BLEU (p)"]
    lines = []
    for mode, v in rows.items():
        perm = "-"
        if "permutation_p" in v:
            perm = f"{v['permutation_p']:.3f} (smallest possible {v['min_permutation_p']:.3f})"
        same = "; ".join(f"seed {s}: {d['d_bleu']:+.2f} ({d['p']:.3f})" for s, d in v.get("same_seed", {}).items())
        lines.append([
            mode, str(len(v["seeds"])), ", ".join(f"{b:.2f}" for b in v["bleu"]), f"{v['mean']:.2f}",
            "-" if v["sd"] is None else f"{v['sd']:.2f}",
            f"{v['d_mean']:+.2f}" if "d_mean" in v else "-", perm, same or "-"])
    return md_table(cols, lines)


def equivalence_table(rows) -> str:
    """The seed-paired test of each precision that has one (the ``equivalence`` entries of
    ``summary.by_precision``'s rows)."""
    cols = ["precision", "seed pairs", "d BLEU per seed", "mean d", "90% CI", "p (|d| >= margin)",
            "p (d = 0)", "verdict"]
    lines = []
    for mode, v in rows.items():
        e = v.get("equivalence")
        if not e:
            continue
        m = f"{e['margin']:g}"
        lines.append([
            mode, str(e["n"]), ", ".join(f"{d:+.2f}" for d in e["diffs"]), f"{e['mean']:+.2f}",
            f"{e['ci90'][0]:+.2f} to {e['ci90'][1]:+.2f}", f"{e['p_equivalence']:.3f}",
            f"{e['p_difference']:.3f}", VERDICTS[e["verdict"]].format(m=m)])
    return md_table(cols, lines)


def verdict_table(rows, margin: float = MARGIN) -> str:
    """Per precision pooled over comparisons (``verdict.verdicts``' rows): its seed pairs, BLEU,
    speed and memory against fp32 of the same seed, and the seed-paired test."""
    cols = ["precision", "seed pairs", "BLEU mean (fp32's)", "x fp32 updates/s", "x fp32 peak mem",
            "d BLEU per seed", "mean d (90% CI)", "p (|d| >= margin)", "p (d = 0)", "verdict"]
    lines = []
    for mode, v in rows.items():
        n = len(v["seeds"])
        if n == 0:
            continue
        mean = statistics.fmean
        cells = [mode, f"{n} (seeds {', '.join(map(str, v['seeds']))})",
                 f"{mean(v['bleu']):.2f} ({mean(v['fp32_bleu']):.2f})",
                 f"{mean(v['x_updates_per_s']):.2f} ({min(v['x_updates_per_s']):.2f}-{max(v['x_updates_per_s']):.2f})",
                 f"{mean(v['x_peak_mem']):.2f} ({min(v['x_peak_mem']):.2f}-{max(v['x_peak_mem']):.2f})",
                 ", ".join(f"{b - f:+.2f}" for b, f in zip(v["bleu"], v["fp32_bleu"]))]
        e = v.get("equivalence")
        if e:
            cells += [f"{e['mean']:+.2f} ({e['ci90'][0]:+.2f} to {e['ci90'][1]:+.2f})", f"{e['p_equivalence']:.3f}",
                      f"{e['p_difference']:.3f}", VERDICTS[e["verdict"]].format(m=f"{margin:g}")]
        else:
            cells += ["-", "-", "-", "one seed pair: train more seeds (MODE@seedN) to test"]
        lines.append(cells)
    return md_table(cols, lines)


def decode_precision_table(summary: dict) -> str:
    """Each run's BLEU as decoded by compare.py and in the other precisions
    (``decode_precision.json``)."""
    rows = []
    for mode, e in summary["runs"].items():
        other = "; ".join(f"{d['label']}: {d['bleu']:.2f} ({d['d_bleu']:+.2f}, {d['same_hypotheses']}/"
                          f"{d['n_sentences']})" for d in e["decodes"])
        rows.append([mode, e["trained"], f"{e['as_trained']['bleu']:.2f}", other])
    return md_table(["run", "trained in", "BLEU, decoded in it", "other decodes: BLEU (d, same hypotheses)"],
                    rows) + "\n"
