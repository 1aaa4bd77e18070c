"""Train the same model in fp32 and in mixed precision, side by side, and score each.

For each mode (same data, seed and hyper-parameters) this runs ``fairseq-train``
then ``fairseq-generate`` on the test split, scores the detokenised output
with sacrebleu (BLEU and chrF, with signatures), and writes
``OUT/<mode>/result.json`` (timings, peak memory, losses, loss-scale trace,
updates, skipped updates and loss scale at the run's end whatever the
--log-interval, scores, the machine, and what the run used as the plugin's
``SAVE_DIR/run_info.json`` records it: the CPU matrix-product path, batch
lengths, loss, attention; ``fairseq_fp16_tools/runs.py`` has the schema) plus the
hypothesis and reference files. ``OUT/settings.json`` (the shared flags and
the modes asked for) is written before the first run trains. Tables and plots
come from ``scripts/report.py OUT``.

    python scripts/compare.py DATA_BIN --out OUT --modes fp32,fp16,bf16 \\
        --train-args "--arch transformer --lr 1e-3 ... --max-update 500" \\
        --gen-args "--beam 4"

Modes: fp32, fp16, bf16 (the plugin: --task translation_fp16 --optimizer
fp16_adam), amp (fairseq's --amp, torch's autocast with fp32 weights: fp16 on
CUDA, bf16 on the CPU, with the plugin's task and optimizer) and fp16-stock
(stock fairseq --fp16: --task translation --optimizer adam, no --user-dir; it
needs CUDA, and is refused before any training where torch sees none). ``MODE@seedN`` (e.g.
fp32@seed2) adds a run of MODE with seed N: the seed-to-seed control, whose
difference to fp32 shows how much two trainings differ without any change of
precision. Do not put --task, --optimizer, --seed, --save-dir or precision
flags in --train-args.

``--average-last N`` scores each run by the average of the weights of its
last N interval checkpoints (``scripts/average_checkpoints.py``: a half run's
averaged from its fp32 master weights) and also decodes its last checkpoint,
which the report scores beside it.

``--keep-existing`` keeps the runs OUT holds (same data and flags) and runs
the missing modes; with ``--redecode`` the kept runs are decoded again from
their checkpoints with new decoding flags (or another ``--average-last``),
their training unchanged.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from .paths import USER_DIR, script
from .provenance import describe
from .runs import (DECODE_SETTINGS, RUN_INFO, SETTING_DEFAULTS, TRAIN_SETTINGS, parse_json_records,
                   read_generate_output, read_json, rerun_hint, run_info_fields)

MODES = {
    "fp32": {"flags": [], "plugin": True},
    "fp16": {"flags": ["--fp16"], "plugin": True},
    "bf16": {"flags": ["--bf16"], "plugin": True},
    "fp16-stock": {"flags": ["--fp16"], "plugin": False},
    # torch's autocast with fp32 weights, fairseq's --amp (fp16 and its GradScaler on CUDA; on the
    # CPU the plugin runs the step under bf16 autocast): the peer most PyTorch users would pick
    "amp": {"flags": ["--amp"], "plugin": True},
}
#: ``MODE@seedN``: the mode trained with another seed, e.g. ``fp32@seed2``: a control run whose
#: difference to fp32 is training-to-training variation alone.
MODE_SPEC = re.compile(r"^(?P<base>[a-z0-9-]+?)(?:@seed(?P<seed>\d+))?$")
FORBIDDEN = ("--task", "--optimizer", "--seed", "--save-dir", "--fp16", "--bf16", "--amp", "--user-dir")
#: what fairseq's trainer logs for each update stock fairseq skips (it keeps no count of them)
STOCK_OVERFLOW = "gradient overflow detected"


def cannot_run(base: str, train_args: str):
    """Why the mode ``base`` cannot train here with ``train_args`` (None when it can): stock
    fairseq's ``--fp16`` (fp16-stock) runs on CUDA only; the plugin's modes run anywhere."""
    if base != "fp16-stock":
        return None
    if "--cpu" in shlex.split(train_args):
        return "stock fairseq's --fp16 trains on CUDA only, and --train-args has --cpu"
    import torch

    if not torch.cuda.is_available():
        return ("stock fairseq's --fp16 needs CUDA, and torch sees no CUDA device here "
                "(the plugin's fp16 mode trains on the CPU)")
    return None


def flag_value(tokens, flag: str):
    """The value of ``flag`` in a split command line (``--flag V`` or ``--flag=V``, the last one
    wins, as in argparse); None when it is absent."""
    value = None
    for i, t in enumerate(tokens):
        if t == flag and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif t.startswith(flag + "="):
            value = t[len(flag) + 1:]
    return value


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def run_with_stats(stats: Path, tool: str, args, log: Path) -> dict:
    """Run a fairseq CLI via fairseq_fp16.run_stats, teeing its output to log."""
    cmd = [sys.executable, script("run_stats.py"), str(stats), tool, *map(str, args)]
    with open(log, "w") as f:
        f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore"))
        for line in proc.stdout:
            f.write(line)
            if any(tag in line for tag in ("| train_inner |", "| valid |", "| train |", "overflow",
                                           "fairseq_fp16", "Error", "Translated", "BLEU")):
                print("   " + line.rstrip()[:220], flush=True)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"{tool} failed with exit code {code}; see {log}")
    return json.loads(stats.read_text())


def short_ids(sources, max_words: int):
    """Indices of the sentences whose source has at most ``max_words`` words."""
    return [i for i, s in enumerate(sources) if len(s.split()) <= max_words]


def score(hyps, refs) -> dict:
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_bp": round(b.bp, 3),
            "sys_len": b.sys_len, "ref_len": b.ref_len,
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}


def parse_mode(text: str, seed: int):
    """``"fp16"`` -> ``("fp16", "fp16", seed)``; ``"fp32@seed2"`` -> ``("fp32-seed2", "fp32", 2)``.
    None when the base mode is unknown or the text is malformed."""
    m = MODE_SPEC.match(text)
    if not m or m["base"] not in MODES:
        return None
    if m["seed"] is None:
        return text, text, seed
    return f"{m['base']}-seed{int(m['seed'])}", m["base"], int(m["seed"])


def task_and_plugin(spec: dict):
    """The mode's fairseq task and its --user-dir arguments (none for stock fairseq)."""
    if spec["plugin"]:
        return "translation_fp16", ["--user-dir", USER_DIR]
    return "translation", []


def generate_args(data, task: str, plugin, ckpt, subset: str, results: Path, gen_args: str, flags):
    """fairseq-generate's arguments: decode ``subset`` of ``data`` with ``ckpt`` into ``results``."""
    return [data, *plugin, "--task", task, "--path", ckpt, "--gen-subset", subset,
            "--results-path", results,
            # fairseq-generate silently drops a last batch that is not a multiple
            # of --required-batch-size-multiple (default 8): score every sentence.
            "--required-batch-size-multiple", "1", *shlex.split(gen_args), *flags]


def average_last(mode: str, run_dir: Path, n: int, data) -> dict:
    """Average the run's last ``n`` interval checkpoints (scripts/average_checkpoints.py: a half
    run's from its fp32 masters) into ``checkpoints/checkpoint_avg.pt``; returns what was averaged."""
    ckpt_dir = run_dir / "checkpoints"
    dst = ckpt_dir / "checkpoint_avg.pt"
    banner(f"[{mode}] averaging the last {n} checkpoints' weights: scripts/average_checkpoints.py")
    summary = ckpt_dir / "checkpoint_avg.json"  # average_checkpoints.py writes it whenever it exits 0
    proc = subprocess.run([sys.executable, script("average_checkpoints.py"), str(dst),
                           "--last", str(n), "--dir", str(ckpt_dir), "--data", str(data),
                           "--summary", str(summary)], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise SystemExit(f"[{mode}] averaging failed: {why}")
    print(f"   {proc.stdout.strip().splitlines()[-1]}", flush=True)
    s = json.loads(summary.read_text())
    return {"n": s["n"], "updates": s["updates"], "from_masters": s["masters"]}


def decode(mode: str, spec: dict, a, run_dir: Path, ckpt_name: str = "checkpoint_last.pt",
           tag: str = "") -> dict:
    """Decode ``a.gen_subset`` with one of the run's checkpoints and score it: result.json's
    "generate" (``tag`` "": the checkpoint the run is scored by) or "generate_last"
    (``tag`` "-last": the last checkpoint, when the run is scored by an average)."""
    ckpt = run_dir / "checkpoints" / ckpt_name
    if not ckpt.is_file():
        raise SystemExit(f"[{mode}] no checkpoint to decode: {ckpt} is missing")
    task, plugin = task_and_plugin(spec)
    what = "the averaged checkpoint" if ckpt_name == "checkpoint_avg.pt" else "the last checkpoint"
    banner(f"[{mode}] decoding the {a.gen_subset} split with {what}: fairseq-generate "
           f"{' '.join(spec['flags']) or '(fp32)'}")
    gen_dir = run_dir / f"generate{tag}"
    gen_args = generate_args(a.data, task, plugin, ckpt, a.gen_subset, gen_dir, a.gen_args, spec["flags"])
    g_stats = run_with_stats(run_dir / f"generate{tag}_stats.json", "fairseq-generate", gen_args,
                             run_dir / f"generate{tag}.out")
    hyps, refs, srcs = read_generate_output(gen_dir / f"generate-{a.gen_subset}.txt")
    (run_dir / f"hyps{tag}.txt").write_text("".join(h + "\n" for h in hyps))
    (run_dir / "refs.txt").write_text("".join(r + "\n" for r in refs))
    scores = score(hyps, refs)
    print(f"   [{mode}] BLEU {scores['bleu']}  chrF {scores['chrf']}  ({len(hyps)} sentences)",
          flush=True)
    if a.short_max_words:
        ids = short_ids(srcs, a.short_max_words)
        scores["short"] = {"max_words": a.short_max_words, "n_sentences": len(ids), "ids": ids,
                           **score([hyps[i] for i in ids], [refs[i] for i in ids])}
        print(f"   [{mode}] sources of <= {a.short_max_words} words: BLEU {scores['short']['bleu']}  "
              f"chrF {scores['short']['chrf']}  ({len(ids)} sentences)", flush=True)
    return {"wall_s": round(g_stats["wall_s"], 2), "subset": a.gen_subset, "n_sentences": len(hyps),
            "gen_args": a.gen_args, "checkpoint": ckpt_name, "hyps_file": f"hyps{tag}.txt",
            "refs_file": "refs.txt", **scores}


def decode_run(mode: str, spec: dict, a, run_dir: Path) -> dict:
    """result.json's decoding entries: "generate" (the last checkpoint, or with ``--average-last N``
    the average of the last N, then also "generate_last" and "averaged")."""
    if not a.average_last:
        return {"generate": decode(mode, spec, a, run_dir)}
    averaged = average_last(mode, run_dir, a.average_last, a.data)
    return {"averaged": averaged, "generate": decode(mode, spec, a, run_dir, "checkpoint_avg.pt"),
            "generate_last": decode(mode, spec, a, run_dir, tag="-last")}


def train_end(ckpt: Path, log: dict, log_text: str) -> dict:
    """result.json's ``updates``, ``skipped_updates`` and ``final_loss_scale``: the run's at its
    end, whatever --log-interval was (the last train_inner record can be an interval old).

    From the last checkpoint (:func:`checkpoints.run_end`); where it lacks them (saved without
    its optimizer state) from fairseq's record of the last epoch, whose ``skipped`` and
    ``loss_scale`` are the last update's (logged with weight 0, so never averaged); stock
    fairseq counts no skipped updates, but logs each (:data:`STOCK_OVERFLOW`).
    """
    from .checkpoints import run_end

    end = run_end(ckpt)
    epoch = log["train"][-1] if log["train"] else {}
    if end["skipped_updates"] is None:
        end["skipped_updates"] = int(epoch.get("skipped", log_text.count(STOCK_OVERFLOW)))
    if end["final_loss_scale"] is None:
        end["final_loss_scale"] = epoch.get("loss_scale")
    return end


def run_mode(name: str, base: str, seed: int, a, out: Path) -> dict:
    mode, spec = name, MODES[base]
    run_dir = out / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / "checkpoints"
    task, plugin = task_and_plugin(spec)
    optimizer = "fp16_adam" if spec["plugin"] else "adam"
    log_file = run_dir / "train.out"
    # a leftover of an earlier training in this folder is not this run's (a stock run writes none)
    (ckpt_dir / RUN_INFO).unlink(missing_ok=True)
    train_args = [a.data, *plugin, "--task", task, "--optimizer", optimizer, "--seed", seed,
                  "--save-dir", ckpt_dir, "--log-format", "json",
                  *shlex.split(a.train_args), *spec["flags"]]
    banner(f"[{mode}] training: fairseq-train {' '.join(spec['flags']) or '(fp32)'}")
    t_stats = run_with_stats(run_dir / "train_stats.json", "fairseq-train", train_args, log_file)
    log_text = log_file.read_text()
    log = parse_json_records(log_text)
    inner = log["train_inner"]
    if not inner:
        raise SystemExit(f"[{mode}] no train_inner records in {log_file}; use --log-interval")
    if not (ckpt_dir / "checkpoint_last.pt").is_file():
        raise SystemExit(f"[{mode}] {ckpt_dir / 'checkpoint_last.pt'} is missing: compare.py reads the run's "
                         "end from it and decodes it (no --no-save or --no-last-checkpoints in --train-args)")
    end = train_end(ckpt_dir / "checkpoint_last.pt", log, log_text)
    # fairseq's per-interval rates; the first interval includes start-up, so skip it
    steady = inner[1:] or inner
    ups = [r["ups"] for r in steady if isinstance(r.get("ups"), (int, float))]
    wps = [r["wps"] for r in steady if isinstance(r.get("wps"), (int, float))]

    def wall_at(update):
        walls = [r["wall"] for r in inner if r["num_updates"] <= update and "wall" in r]
        return walls[-1] if walls else None
    result = {
        "mode": mode,
        "base_mode": base,
        "precision_flags": spec["flags"],
        "plugin": spec["plugin"],
        "seed": seed,
        "train_command": ["fairseq-train", *map(str, train_args)],
        # the code that trained and decoded it (the commit its figures come from)
        "provenance": describe(),
        # the hardware and versions of the training process (scripts/run_stats.py)
        "machine": t_stats.get("machine"),
        # what the run used (the plugin's SAVE_DIR/run_info.json; None/False for stock fairseq)
        **run_info_fields(ckpt_dir),
        "train": {
            "wall_s": round(t_stats["wall_s"], 2),
            "peak_rss_mb": round(t_stats["peak_rss_mb"], 1),
            "peak_cuda_mb": t_stats["peak_cuda_mb"],
            "updates": end["updates"],
            "updates_per_s": round(sum(ups) / len(ups), 3) if ups else None,
            "words_per_s": round(sum(wps) / len(wps), 1) if wps else None,
            # at the run's end, not at its last logged interval
            "skipped_updates": end["skipped_updates"],
            "final_loss_scale": end["final_loss_scale"],
            "train_inner": inner,
            "valid": [dict(v, wall=wall_at(v.get("num_updates", 0))) for v in log["valid"]],
            "epochs": log["train"],
        },
        **decode_run(mode, spec, a, run_dir),
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("data", help="fairseq-preprocess output (data-bin) directory")
    ap.add_argument("--out", required=True, type=Path, help="results directory")
    ap.add_argument("--modes", default="fp32,fp16,bf16",
                    help=f"comma-separated, from {', '.join(MODES)} (fp32 is always run first); "
                    "MODE@seedN adds a run of MODE with seed N, e.g. fp32@seed2: the seed-to-seed "
                    "control for judging the mixed runs' differences")
    ap.add_argument("--train-args", default="", help="model and optimisation flags shared by all modes")
    ap.add_argument("--gen-args", default="--beam 4", help="fairseq-generate flags shared by all modes")
    ap.add_argument("--gen-subset", default="test")
    ap.add_argument("--short-max-words", type=int, default=0,
                    help="also score the sentences whose source has at most N words (0 = off)")
    ap.add_argument("--average-last", type=int, default=0, metavar="N",
                    help="score each run by the average of its last N interval checkpoints' weights "
                    "(scripts/average_checkpoints.py: a half run's from its fp32 masters) and also decode "
                    "its last checkpoint; --train-args must save them (--save-interval-updates K "
                    "--keep-interval-updates N or more, or -1, fairseq's default: all). 0 (default): score the last "
                    "checkpoint")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-existing", action="store_true",
                    help="keep the runs OUT already holds (result.json) when OUT was made with the same "
                    "data and flags, and run only the missing modes (e.g. add fp32@seed2 to a finished comparison)")
    ap.add_argument("--redecode", action="store_true",
                    help="with --keep-existing: decode the kept runs again from their checkpoints with "
                    "this --gen-args, --gen-subset, --short-max-words and --average-last, keeping their "
                    "training (e.g. another --lenpen, chosen on the valid split)")
    a = ap.parse_args(argv)
    if a.redecode and not a.keep_existing:
        ap.error("--redecode needs --keep-existing: it decodes the runs OUT already holds")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    parsed = [parse_mode(m, a.seed) for m in modes]
    bad = [m for m, p in zip(modes, parsed) if p is None]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; valid: {', '.join(MODES)}, each optionally "
                 "with @seedN (e.g. fp32@seed2)")
    same = [m for m, p in zip(modes, parsed) if p[0] != p[1] and p[2] == a.seed]
    if same:
        ap.error(f"--modes: {', '.join(same)} uses the main --seed {a.seed}; a control run needs another seed")
    for flag in FORBIDDEN:
        if flag in shlex.split(a.train_args):
            ap.error(f"--train-args must not contain {flag}: compare.py sets it per mode")
    if not Path(a.data).is_dir():
        ap.error(f"data directory not found: {a.data}")
    if a.short_max_words < 0:
        ap.error(f"--short-max-words must be >= 0 (0 = off), got {a.short_max_words}")
    if a.average_last < 0:
        ap.error(f"--average-last must be >= 0 (0 = off), got {a.average_last}")
    if a.average_last:
        tokens = shlex.split(a.train_args)
        every, keep_n = flag_value(tokens, "--save-interval-updates"), flag_value(tokens, "--keep-interval-updates")
        if not every or not every.isdigit() or int(every) <= 0:
            ap.error(f"--average-last {a.average_last} needs interval checkpoints: add --save-interval-updates K "
                     f"--keep-interval-updates {a.average_last} to --train-args")
        if keep_n is not None and (not keep_n.lstrip("-").isdigit()  # fairseq's default -1 keeps all
                                   or 0 <= int(keep_n) < a.average_last):
            ap.error(f"--average-last {a.average_last} needs --keep-interval-updates {a.average_last} or more "
                     f"in --train-args, not {keep_n}")
    runs = [("fp32", "fp32", a.seed)] + list(dict.fromkeys(p for p in parsed if p[0] != "fp32"))
    modes = [name for name, _, _ in runs]
    settings = {"data": str(a.data), "modes": modes, "train_args": a.train_args, "gen_args": a.gen_args,
                "gen_subset": a.gen_subset, "short_max_words": a.short_max_words,
                "average_last": a.average_last, "seed": a.seed,
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    keep = {}
    if a.keep_existing and (a.out / "settings.json").exists():
        try:
            old = read_json(a.out / "settings.json", "delete it to train every run again, or use another --out")
        except ValueError as e:
            ap.error(f"--keep-existing: {e}")
        differ = [k for k in (*TRAIN_SETTINGS, *(() if a.redecode else DECODE_SETTINGS))
                  if old.get(k, SETTING_DEFAULTS.get(k)) != settings[k]]
        if differ:
            hint = ("" if a.redecode or set(TRAIN_SETTINGS) & set(differ)
                    else " (or --redecode to decode the kept runs with the new ones)")
            ap.error(f"--keep-existing: {a.out} was made with other {', '.join(differ)}; "
                     f"use another --out or the same flags{hint}")
        try:  # read now: a result.json cut short stops the comparison before any training
            keep = {name: read_json(a.out / name / "result.json", rerun_hint(a.out, [name]))
                    for name in modes if (a.out / name / "result.json").exists()}
        except ValueError as e:
            ap.error(f"--keep-existing: {e}")
        settings["started"] = old.get("started", settings["started"])
    blocked = [f"{name} cannot run here: {why}" for name, base, _ in runs
               if (name not in keep or a.redecode) and (why := cannot_run(base, a.train_args))]
    if blocked:
        ap.error(f"--modes: {'; '.join(blocked)}; leave {'it' if len(blocked) == 1 else 'them'} out of --modes")
    # written before the first run trains: a comparison that stops part-way still says what it asked for
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "settings.json").write_text(json.dumps(settings, indent=1))
    results = []
    for name, base, seed in runs:
        if name in keep:
            banner(f"[{name}] kept: {a.out / name / 'result.json'}")
            result = keep[name]
            if a.redecode:
                for key in ("averaged", "generate_last"):
                    result.pop(key, None)
                result.update(decode_run(name, MODES[base], a, a.out / name))
                (a.out / name / "result.json").write_text(json.dumps(result, indent=1))
            results.append(result)
        else:
            results.append(run_mode(name, base, seed, a, a.out))
    settings["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (a.out / "settings.json").write_text(json.dumps(settings, indent=1))
    banner(f"done: {len(results)} runs in {a.out}; tables and plots: python scripts/report.py {a.out}")

