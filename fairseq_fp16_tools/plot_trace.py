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

from .plots import plot_divergence, plot_scale, plot_stats, pyplot


def read_jsonl(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no records")
    return rows


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
    plt = pyplot()
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
