#!/usr/bin/env python
"""What a GPU session wrote, as the files the docs' tables read.

    python scripts/gpu/collect.py OUT DEST              # OUT: scripts/gpu/session.sh's folder
    python scripts/gpu/collect.py --outcomes OUT/train_16384.jsonl

Writes into DEST (e.g. benchmarks/h200/<run>/): ``train_<tokens>.json`` for each
``train_<tokens>.jsonl`` (its summary line, or a summary made from its mode lines when the
session was cut off first), ``profiles.json`` (``{tokens: {mode: profile}}``: each mode's
first profiled run) and copies of ``optimizer.json`` and ``stock_resume.json``.
``--outcomes`` prints one line: each mode's outcome (ok, failed, timed out, skipped, not run).
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from fairseq_fp16_tools.bench.fairseq_train import read_records, summary_of

COPIED = ("optimizer.json", "stock_resume.json")


def outcomes(path: Path) -> str:
    """``fp32 ok, fp16 timed out, ...`` for one ``--jsonl`` file."""
    try:
        summary = summary_of(path)
    except (OSError, ValueError):
        return "not run (the benchmark did not start)"
    return ", ".join(f"{mode} {outcome}" for mode, outcome in summary["outcomes"].items())


def collect(out: Path, dest: Path) -> list:
    """Write DEST's files from a session's OUT; returns their names."""
    dest.mkdir(parents=True, exist_ok=True)
    written, profiles = [], {}
    for path in sorted(out.glob("train_*.jsonl")):
        tokens = re.fullmatch(r"train_(\d+)\.jsonl", path.name)
        if not tokens:
            continue
        try:
            summary = summary_of(path)
        except ValueError as e:
            print(e, file=sys.stderr)
            continue
        (dest / f"train_{tokens.group(1)}.json").write_text(json.dumps(summary) + "\n")
        written.append(f"train_{tokens.group(1)}.json")
        for r in read_records(path):
            if r.get("record") == "mode" and "profile" in r:
                profiles.setdefault(tokens.group(1), {}).setdefault(r["mode"], r["profile"])
    if profiles:
        (dest / "profiles.json").write_text(json.dumps(profiles) + "\n")
        written.append("profiles.json")
    for name in COPIED:
        if (out / name).is_file():
            shutil.copyfile(out / name, dest / name)
            written.append(name)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outcomes", type=Path, metavar="JSONL", help="print each mode's outcome in JSONL")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("dest", type=Path, nargs="?")
    a = ap.parse_args(argv)
    if a.outcomes:
        print(outcomes(a.outcomes))
        return 0
    if a.out is None or a.dest is None:
        ap.error("OUT and DEST are needed (or --outcomes JSONL)")
    for name in collect(a.out, a.dest):
        print(a.dest / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
