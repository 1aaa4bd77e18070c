#!/usr/bin/env python
"""Draw a mixed-precision run's traces (PNG).

    python scripts/plot_trace.py --scale-trace TRACE.jsonl [--precision-stats STATS.jsonl] --out DIR

From ``--scale-trace``: the loss scale over attempted updates with the
overflows marked (``scale_trace.png``). From ``--precision-stats``: per layer,
the fraction of gradient elements that are zero or subnormal in half precision,
the headroom before overflow, and the fraction of master-weight updates that
half-precision weights would lose, at the last measured update
(``precision_stats.png``), and their model-wide values over updates
(``precision_stats_over_updates.png``). From ``--precision-divergence`` (one
file or more, e.g. an fp16 and a bf16 run): each module's relative forward error
against fp32, in forward order, one line per measured update
(``precision_divergence.png``).
"""

import argparse
import json
from pathlib import Path


def read_jsonl(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no records")
    return rows


def plot_scale(trace, out: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.step([r["update"] for r in trace], [r["loss_scale"] for r in trace], where="post",
            label="loss scale (after the update)")
    over = [r for r in trace if r["overflow"]]
    if over:
        ax.scatter([r["update"] for r in over], [r["loss_scale"] for r in over], marker="x",
                   color="red", zorder=3, label=f"overflow, update skipped ({len(over)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("attempted update")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss scale trace")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "scale_trace.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_stats(stats, out: Path, plt):
    last = stats[-1]
    layers = list(last["layers"])
    vals = last["layers"]
    fig, axes = plt.subplots(1, 3, figsize=(13, max(3.5, 0.22 * len(layers) + 1)), sharey=True)
    y = range(len(layers))
    axes[0].barh(y, [vals[l]["zero_frac"] for l in layers], label="zero")
    axes[0].barh(y, [vals[l]["subnormal_frac"] for l in layers], left=[vals[l]["zero_frac"] for l in layers],
                 label="subnormal")
    axes[0].set_xlabel("fraction of gradient elements")
    axes[0].legend()
    axes[0].set_title("Underflow (scaled half grads)")
    head = [min(vals[l]["headroom_log2"], 40) for l in layers]
    axes[1].barh(y, head, color="#2ca02c")
    axes[1].set_xlabel("log2(max finite / max|g|)")
    axes[1].set_title("Headroom before overflow")
    axes[2].barh(y, [vals[l].get("lost_update_frac", 0) for l in layers], color="#d62728")
    axes[2].set_xlabel("fraction of master updates")
    axes[2].set_title("Updates lost without fp32 masters")
    axes[0].set_yticks(list(y))
    axes[0].set_yticklabels(layers, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(f"Precision statistics at update {last['update']} ({last.get('dtype', '')}, "
                 f"loss scale {last['loss_scale']:g})")
    fig.tight_layout()
    p1 = out / "precision_stats.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    def weighted(rec, key):
        tot = sum(v["numel"] for v in rec["layers"].values()) or 1
        return sum(v.get(key, 0) * v["numel"] for v in rec["layers"].values()) / tot

    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = [r["update"] for r in stats]
    for key, label in (("zero_frac", "zero"), ("subnormal_frac", "subnormal"),
                       ("lost_update_frac", "lost updates")):
        ax.plot(xs, [weighted(r, key) for r in stats], marker="o", label=label)
    ax2 = ax.twinx()
    ax2.plot(xs, [min(v["headroom_log2"] for v in r["layers"].values()) for r in stats], color="gray",
             linestyle="--", label="least headroom (bits)")
    ax.set_xlabel("attempted update")
    ax.set_ylabel("fraction (element-weighted)")
    ax2.set_ylabel("least headroom, log2")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("Precision statistics over updates")
    fig.tight_layout()
    p2 = out / "precision_stats_over_updates.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def plot_divergence(runs, out: Path, plt) -> Path:
    """runs: [(label, records)]; x: the modules in forward order (of the first record)."""
    names = list(runs[0][1][0]["modules"])
    fig, ax = plt.subplots(figsize=(max(8, 0.16 * len(names)), 5.5))
    styles = ["-", "--", ":", "-."]
    for k, (label, records) in enumerate(runs):
        for i, rec in enumerate(records):
            # an exact output (0: e.g. an embedding before the weights moved) has no place on a log axis
            ys = [rec["modules"].get(n) or float("nan") for n in names]
            ax.plot(range(len(names)), ys, styles[i % len(styles)], marker=".", color=f"C{k}",
                    alpha=0.35 + 0.65 * (i + 1) / len(records),
                    label=f"{label} ({rec['dtype']}) @ update {rec['update']}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=6)
    ax.set_ylabel("||half - fp32|| / ||fp32||")
    fig.suptitle("Forward divergence from fp32, module by module (eval mode, the update's batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=len(runs), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    path = out / "precision_divergence.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale-trace", type=Path)
    ap.add_argument("--precision-stats", type=Path)
    ap.add_argument("--precision-divergence", type=Path, nargs="+", default=[],
                    help="--precision-divergence files of one or more runs (labelled by file name)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not a.scale_trace and not a.precision_stats and not a.precision_divergence:
        ap.error("give --scale-trace, --precision-stats and/or --precision-divergence")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a.out.mkdir(parents=True, exist_ok=True)
    written = []
    if a.scale_trace:
        written.append(plot_scale(read_jsonl(a.scale_trace), a.out, plt))
    if a.precision_stats:
        written += plot_stats(read_jsonl(a.precision_stats), a.out, plt)
    if a.precision_divergence:
        runs = [(p.stem, read_jsonl(p)) for p in a.precision_divergence]
        written.append(plot_divergence(runs, a.out, plt))
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
