"""Decode a comparison's checkpoints in other precisions: is a BLEU gap made in training or decoding?

    python scripts/decode_precision.py OUT [--modes fp16,bf16,...]

OUT is a ``scripts/compare.py`` output. Each run decoded the test split in the
precision it trained in. This decodes its last checkpoint again, with the same
decoding flags (``OUT/settings.json``):

- a half run (fp16, bf16): in fp32 with the weights as saved (the half model's,
  rounded), then in fp32 with its exact fp32 master weights
  (``scripts/export_fp32_checkpoint.py``);
- an fp32 run: in fp16 and in bf16.

If a half run scores the same in all three ways, neither its rounded weights nor
the half arithmetic of decoding cost it anything: a gap to fp32 was made in
training. Writes ``OUT/decode_precision.json`` and prints a table; each decode's
hypotheses go to ``OUT/<mode>/decode_precision/``. Runs of stock fairseq are
skipped (their checkpoints hold no plugin masters).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .compare import MODES, generate_args, score, task_and_plugin
from .provenance import describe
from .runs import read_generate_output
from .tables import decode_precision_table

BIN = Path(sys.executable).parent


def decodes_of(precision: str):
    """(label, weights, decoding precision) of the decodes a run of ``precision`` gets."""
    if precision == "fp32":
        return [("fp16 decode", "checkpoint", "fp16"), ("bf16 decode", "checkpoint", "bf16")]
    return [("fp32 decode", "checkpoint", "fp32"), ("fp32 decode, fp32 masters", "masters", "fp32")]


def generate(settings: dict, ckpt: Path, precision: str, work: Path) -> dict:
    """fairseq-generate of ``settings``' split with ``ckpt`` in ``precision``; its scores."""
    subset = settings["gen_subset"]
    spec = MODES[precision]
    task, plugin = task_and_plugin(spec)
    args = [str(BIN / "fairseq-generate"), *map(str, generate_args(
        settings["data"], task, plugin, ckpt, subset, work, settings["gen_args"], spec["flags"]))]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"fairseq-generate failed ({proc.returncode}): {' '.join(args)}\n"
                         f"{proc.stderr[-3000:]}")
    hyps, refs, _ = read_generate_output(work / f"generate-{subset}.txt")
    return {"hyps": hyps, "wall_s": round(time.perf_counter() - t0, 2), **score(hyps, refs)}


def run(out: Path, modes=None) -> dict:
    """Decode every run of ``out`` (or of ``modes``); returns what decode_precision.json holds."""
    from .checkpoints import export  # imports torch and the plugin

    settings = json.loads((out / "settings.json").read_text())
    runs = {}
    for mode in settings["modes"]:
        if modes and mode not in modes:
            continue
        result = json.loads((out / mode / "result.json").read_text())
        base = result["base_mode"]
        if not MODES[base]["plugin"]:
            print(f"{mode}: skipped (stock fairseq)", flush=True)
            continue
        precision = base
        ckpt = out / mode / "checkpoints" / "checkpoint_last.pt"
        if not ckpt.is_file():
            raise SystemExit(f"[{mode}] no checkpoint to decode: {ckpt} is missing")
        work = out / mode / "decode_precision"
        work.mkdir(exist_ok=True)
        g = result["generate"]
        trained_hyps = (out / mode / "hyps.txt").read_text().splitlines()
        entry = {"trained": precision,
                 "as_trained": {"decoded_in": precision, "bleu": g["bleu"], "chrf": g["chrf"],
                                "bleu_bp": g["bleu_bp"]},
                 "decodes": []}
        for label, weights, dec in decodes_of(precision):
            path = ckpt
            if weights == "masters":
                path = work / "fp32_masters.pt"
                export(ckpt, path)
            try:
                s = generate(settings, path, dec, work / label.replace(" ", "_").replace(",", ""))
            finally:
                if weights == "masters":
                    path.unlink(missing_ok=True)  # the size of the checkpoint; rebuilt on a rerun
            hyps = s.pop("hyps")
            (work / f"hyps-{dec}-{weights}.txt").write_text("".join(h + "\n" for h in hyps))
            same = sum(h == t for h, t in zip(hyps, trained_hyps))
            entry["decodes"].append({"label": label, "weights": weights, "decoded_in": dec,
                                     "bleu": s["bleu"], "chrf": s["chrf"], "bleu_bp": s["bleu_bp"],
                                     "d_bleu": round(s["bleu"] - g["bleu"], 2),
                                     "same_hypotheses": same, "n_sentences": len(hyps),
                                     "wall_s": s["wall_s"]})
            print(f"{mode}: {label}: BLEU {s['bleu']:.2f} ({s['bleu'] - g['bleu']:+.2f} against "
                  f"{g['bleu']:.2f} decoded in {precision}; {same} of {len(hyps)} hypotheses the same)",
                  flush=True)
        runs[mode] = entry
    return {"gen_subset": settings["gen_subset"], "gen_args": settings["gen_args"], "runs": runs,
            "provenance": describe()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a scripts/compare.py output directory")
    ap.add_argument("--modes", help="comma-separated runs of OUT to decode (default: all)")
    a = ap.parse_args(argv)
    if not (a.out / "settings.json").is_file():
        ap.error(f"{a.out} holds no settings.json: not a scripts/compare.py output")
    modes = a.modes.split(",") if a.modes else None
    if modes:
        known = json.loads((a.out / "settings.json").read_text())["modes"]
        unknown = [m for m in modes if m not in known]
        if unknown:
            ap.error(f"--modes: {', '.join(unknown)} not among the runs of {a.out} ({', '.join(known)})")
    summary = run(a.out, modes)
    (a.out / "decode_precision.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(decode_precision_table(summary), end="")
    print(f"wrote {a.out / 'decode_precision.json'}")

