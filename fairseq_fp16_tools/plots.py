"""The PNG plots (matplotlib, drawn off screen): a comparison's curves and throughput
(``report.py``) and a mixed-precision run's diagnostic traces (``plot_trace.py``).

Each function takes records already read and writes its files; matplotlib is imported when a
plot is drawn.
"""

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- a comparison (scripts/report.py) -------------------------------------------------------------

def comparison_plots(out: Path, results):
    """``valid_loss_updates.png``, ``valid_loss_wall.png``, ``loss_scale.png`` and
    ``throughput.png`` of the runs in ``out``; returns the file names written."""
    plt = pyplot()
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


# -- a run's diagnostics (scripts/plot_trace.py) --------------------------------------------------

def plot_scale(trace, out: Path, plt) -> Path:
    """``scale_trace.png``: the loss scale over attempted updates, overflows marked."""
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
    """``precision_stats.png`` (per layer, at the last measured update) and
    ``precision_stats_over_updates.png`` (model-wide, over the updates)."""
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
