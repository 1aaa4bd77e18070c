"""Time per update of real fairseq-train runs, per precision, on the same model and data.

    python scripts/bench_fairseq_train.py [DATA_BIN] [--updates 30] [--modes ...] [--model "..."]

Without DATA_BIN the synthetic corpus (scripts/make_toy_corpus.py) is built in a
temporary folder. Modes: fp32, tf32 (CUDA: TF32 products), fp16 / bf16 (the
plugin, --half-matmul auto), their -native / -fp32acc variants, bf16-cache1024
(--cpu-kernel-cache 1024: torch's default kernel-cache sizes), bf16-unpadded
(--cpu-length-multiple 1: batch lengths as they are, where auto pads them on a CPU
with AMX), bf16-padded (--cpu-length-multiple 8: the AMX default, on any CPU),
bf16-padded-cache64 (lengths padded to a multiple of 8, 64 kernels per
cache), fp16-padded (--cpu-length-multiple 8), fp32-padded (fairseq's
--required-seq-len-multiple 8), fp16-unfused /
bf16-unfused (--fused-loss off: fairseq's fp32 log-softmax loss), fp32-fused
(--fused-loss on), fp16-cache (--fused-loss cache: the CPU's way on any
device), fp16-loss-compiled (--fused-loss compiled), fp16-stock (stock fairseq
--fp16, no plugin; CUDA only), fp16-fairseq-attn (--attention-path fairseq:
fairseq's own attention, the CPU default), fp16-compiled / bf16-compiled
(--compile-layers, which compiles the fused loss too) and fp16-workers4
(--num-workers 4: four batch-loading processes instead of fairseq's one).
Peak memory: the CUDA allocator's peak on --cuda, the process's peak RSS on the
CPU. Each mode runs ``fairseq-train --cpu`` (or on CUDA with --cuda) for
--updates updates without validation or checkpoints; ms/update is
the median of fairseq's per-interval rate over the intervals after the first (a compiled
mode's recompile for a new input variant stalls one interval, not the figure).
The modes run interleaved --repeats times; each reports its median. Prints a
table and, as its last line, one JSON object; its ``skipped_updates`` counts each mode's
updates skipped for overflow (they cost time but fairseq's ups does not count them).

With --profile-dir DIR, --profile-updates more updates run after the timed ones under
torch.profiler (outside every logged interval) and DIR/MODE.json gets their summary
(scripts/profile_summary.py: device busy/idle time, kernel classes, launches, host syncs).
--deadline SECONDS skips the modes not yet started once that much time has passed (a device
session's time is fixed); the JSON lists them under "skipped".
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..paths import USER_DIR, script

# (flags, plugin?, extra environment)
MODES = {
    "fp32": [],
    "tf32": [],  # fp32 with TF32 tensor-core products (CUDA; env below)
    "fp16-stock": ["--fp16"],  # stock fairseq: no --user-dir, task translation, optimizer adam
    "fp16": ["--fp16"],
    "fp16-native": ["--fp16", "--half-matmul", "native"],
    "fp16-fp32acc": ["--fp16", "--half-matmul", "fp32-accumulate"],
    "bf16": ["--bf16"],
    "bf16-native": ["--bf16", "--half-matmul", "native"],
    "bf16-fp32acc": ["--bf16", "--half-matmul", "fp32-accumulate"],
    "bf16-cache1024": ["--bf16", "--cpu-kernel-cache", "1024"],  # torch's own cache sizes
    # batch lengths (--cpu-length-multiple; auto pads where the products run on AMX tiles)
    "bf16-unpadded": ["--bf16", "--cpu-length-multiple", "1"],
    "bf16-padded": ["--bf16", "--cpu-length-multiple", "8"],  # the AMX default, on any CPU
    "bf16-padded-cache64": ["--bf16", "--cpu-length-multiple", "8", "--cpu-kernel-cache", "64"],
    "fp16-padded": ["--fp16", "--cpu-length-multiple", "8"],
    "fp32-padded": ["--required-seq-len-multiple", "8"],  # fairseq's own flag: fp32 the same shapes
    # the loss: fairseq's log-softmax path for the half modes, the fused one for fp32
    "fp16-unfused": ["--fp16", "--fused-loss", "off"],
    "bf16-unfused": ["--bf16", "--fused-loss", "off"],
    "fp32-fused": ["--fused-loss", "on"],
    "fp16-cache": ["--fp16", "--fused-loss", "cache"],  # the CPU's fused-loss path, on any device
    "fp16-loss-compiled": ["--fp16", "--fused-loss", "compiled"],  # eager layers, compiled loss
    # the GPU's A/B: attention path, compiled layers, batch-loading processes
    "fp16-fairseq-attn": ["--fp16", "--attention-path", "fairseq"],
    "fp16-compiled": ["--fp16", "--compile-layers"],
    "bf16-compiled": ["--bf16", "--compile-layers"],
    "fp16-workers4": ["--fp16", "--num-workers", "4"],
}
STOCK = {"fp16-stock"}
ENV = {"tf32": {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}}
MODEL = ("--arch transformer --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 "
         "--decoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 "
         "--encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings --max-tokens 2048")


def parse_modes(ap: argparse.ArgumentParser, text: str):
    """The modes of a comma-separated ``--modes``; an unknown one is a usage error."""
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; valid: {', '.join(MODES)}")
    return modes


def plugin_args(mode: str) -> list:
    """fairseq-train's plugin, task and optimizer flags for ``mode``: stock fairseq's translation
    and adam for a stock mode, the plugin's otherwise."""
    if mode in STOCK:
        return ["--task", "translation", "--optimizer", "adam"]
    return ["--user-dir", USER_DIR, "--task", "translation_fp16", "--optimizer", "fp16_adam"]


class RunFailed(RuntimeError):
    """One mode's run failed; the others still run and the JSON lists it under "failed"."""


def skipped_updates(text: str) -> int:
    """Updates skipped for overflow by the end of a run's log (the plugin's ``skipped``
    counter in fairseq's train_inner records; 0 where there is none)."""
    counts = re.findall(r"\| train_inner \|.* skipped=([0-9]+)", text)
    return int(counts[-1]) if counts else 0


def run(data, mode, updates, model, device, profile=None):
    """(ms/update, target words/s, peak MB, skipped updates, machine) of one fairseq-train run.

    ``profile``: (updates to profile, JSON path), run after the timed updates.
    """
    flags = MODES[mode]
    total, prof = updates, []
    if profile:  # the profiled window: whole updates after the last logged interval
        total = updates + profile[0] + 1
        prof = ["--profile-updates", f"{updates + 1}:{profile[0]}", str(profile[1])]
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        cmd = [sys.executable, script("run_stats.py"), *prof, str(stats), "fairseq-train",
               str(data), *plugin_args(mode), "--lr", "1e-3",
               *shlex.split(model), "--max-update", str(total), "--log-format", "simple",
               "--log-interval", "5", "--no-save", "--disable-validation", "--seed", "1", *device, *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV.get(mode, {})})
        if out.returncode != 0:
            raise RunFailed(f"fairseq-train ({mode}) failed:\n{out.stderr[-3000:]}")
        peak = json.loads(stats.read_text())
    text = out.stdout + out.stderr
    intervals = len(re.findall(r"\| train_inner \|", text))
    if intervals < 2:
        raise RunFailed(f"fairseq-train ({mode}): no train_inner records; raise --updates")
    if profile and intervals != updates // 5:
        raise RunFailed(f"fairseq-train ({mode}): the profiled updates reached a logged interval")
    mem = peak["peak_cuda_mb"] if peak["peak_cuda_mb"] else peak["peak_rss_mb"]
    return (*interval_rates(text), mem, skipped_updates(text), peak.get("machine"))


def interval_rates(text: str):
    """(ms/update, words/s): the medians of fairseq's train_inner rates after the first interval,
    which holds the start-up."""
    ups = [float(x) for x in re.findall(r"\| train_inner \|.* ups=([0-9.]+)", text)][1:]
    wps = [float(x) for x in re.findall(r"\| train_inner \|.* wps=([0-9.]+)", text)][1:]
    return 1000.0 / statistics.median(ups), statistics.median(wps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", help="data-bin directory (default: the synthetic corpus)")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--modes", default="fp32,fp16,fp16-native,bf16,bf16-native,bf16-fp32acc")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--cuda", action="store_true", help="train on the GPU instead of --cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-dir", help="profile each mode after its timed updates; summaries here")
    ap.add_argument("--profile-updates", type=int, default=3)
    ap.add_argument("--deadline", type=float, help="seconds after which no further mode starts")
    ap.add_argument("--native-updates", type=int, default=10,
                    help="updates for fp16-native / bf16-native on a CPU without units for their "
                    "dtype (slow; run once, not --repeats times)")
    a = ap.parse_args(argv)
    modes = parse_modes(ap, a.modes)
    if a.updates < 10 or a.updates % 5:
        ap.error(f"--updates must be a multiple of 5 (the log interval), at least 10; got {a.updates}")
    if a.profile_dir:
        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
    data = a.data
    if data is None:
        from ..corpus import write_corpus

        data = write_corpus(Path(tempfile.mkdtemp(prefix="bench_toy_")))
    device = [] if a.cuda else ["--cpu"]
    from fairseq_fp16.core.half_matmul import cpu_has_native_half
    import torch

    runs, once, skipped, failed, machine = {m: [] for m in modes}, [], [], {}, None
    began = time.monotonic()
    for rep in range(a.repeats):
        for mode in modes:
            if a.deadline is not None and time.monotonic() - began > a.deadline:
                skipped.append(f"{mode} (repeat {rep + 1})")
                continue
            native = {"fp16-native": torch.float16, "bf16-native": torch.bfloat16}.get(mode)
            slow = native is not None and not a.cuda and not cpu_has_native_half(native)
            if slow and runs[mode]:
                continue  # once is enough for the slow one
            if slow:
                once.append(mode)
            profile = None
            if a.profile_dir and not runs[mode]:
                profile = (a.profile_updates, Path(a.profile_dir) / f"{mode}.json")
            if mode in failed:
                continue
            try:
                *result, machine = run(data, mode, a.native_updates if slow else a.updates, a.model,
                                       device, profile)
            except RunFailed as e:
                print(e, file=sys.stderr, flush=True)
                failed[mode] = str(e).splitlines()[-1][:500]
                continue
            runs[mode].append(tuple(result))
            ms_, wps_, mem_, _ = runs[mode][-1]  # as it goes, so a run cut short still says something
            print(f"  {mode}: {ms_:.1f} ms/update, {wps_:.0f} words/s, {mem_:.0f} MB",
                  file=sys.stderr, flush=True)
    runs = {m: v for m, v in runs.items() if v}
    modes = [m for m in modes if m in runs]
    if not modes:
        raise SystemExit(f"no mode ran: failed {failed}, skipped {skipped}")
    ms = {m: statistics.median(r[0] for r in v) for m, v in runs.items()}
    wps = {m: statistics.median(r[1] for r in v) for m, v in runs.items()}
    mem = {m: max(r[2] for r in v) for m, v in runs.items()}
    mem_kind = "CUDA allocator peak" if a.cuda else "process peak RSS"
    first = modes[0]
    for mode in modes:
        print(f"{mode:14s} {ms[mode]:9.1f} ms/update  x{ms[mode] / ms[first]:.2f}  "
              f"{wps[mode]:9.0f} words/s  x{wps[mode] / wps[first]:.2f}  "
              f"{mem[mode]:8.0f} MB  x{mem[mode] / mem[first]:.2f}  "
              f"(runs: {', '.join(f'{r[0]:.0f}' for r in runs[mode])} ms)", flush=True)
    print(json.dumps({
        "model": a.model, "device": "cuda" if a.cuda else "cpu", "updates": a.updates,
        "repeats": a.repeats, "statistic": "median",
        # native half modes on a CPU without units for their dtype: one run of --native-updates
        "run_once": {m: a.native_updates for m in once},
        "cpu_native_fp16": cpu_has_native_half(torch.float16),
        "cpu_native_bf16": cpu_has_native_half(torch.bfloat16),
        "ms_per_update": {k: round(v, 1) for k, v in ms.items()},
        "ratio_to_first": {k: round(v / ms[modes[0]], 3) for k, v in ms.items()},
        "words_per_s": {k: round(v, 1) for k, v in wps.items()},
        "words_ratio_to_first": {k: round(v / wps[first], 3) for k, v in wps.items()},
        "peak_mb": {k: round(v, 1) for k, v in mem.items()}, "peak_kind": mem_kind,
        "peak_ratio_to_first": {k: round(v / mem[first], 3) for k, v in mem.items()},
        # updates skipped for overflow in each mode's run (the most over its repeats): a skipped
        # update costs its time but is not counted in ups
        "skipped_updates": {k: max(r[3] for r in v) for k, v in runs.items()},
        "skipped": skipped, "failed": failed, "machine": machine,
    }))

