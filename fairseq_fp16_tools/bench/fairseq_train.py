"""Time per update of real fairseq-train runs, per precision, on the same model and data.

    python scripts/bench_fairseq_train.py [DATA_BIN] [--warmup 10] [--updates 30] [--modes ...] [--model "..."]
                                          [--task-args "--task NAME ..."]

Without DATA_BIN the synthetic corpus (scripts/make_toy_corpus.py) is built in a
temporary folder. Modes: fp32-stock (stock fairseq in fp32: no plugin, fairseq's adam), fp32,
tf32 (CUDA: TF32 products), fp16 / bf16 (the plugin, --half-matmul auto), their -native /
-fp32acc variants, amp / amp-compiled (--amp: torch's autocast with fp32 weights, fp16 and
fairseq's GradScaler on CUDA, bf16 on the CPU; with --compile-layers), fp32-torch-dropout /
bf16-torch-dropout (--cpu-dropout torch: torch's bernoulli_ masks), bf16-cache1024
(--cpu-kernel-cache 1024: torch's default kernel-cache sizes), bf16-unpadded
(--cpu-length-multiple 1: batch lengths as they are, where auto pads them on a CPU
with AMX for small products), bf16-unpadded-cache1024 (those lengths, torch's 1,024 kernels
per cache), bf16-padded (--cpu-length-multiple 8: auto's padding on AMX, for any model and CPU),
bf16-padded-cache64 / bf16-padded-cache8 (lengths padded to a multiple of 8, 64 or 8 kernels
per cache), fp16-padded (--cpu-length-multiple 8), fp32-padded (fairseq's
--required-seq-len-multiple 8), fp16-unfused /
bf16-unfused (--fused-loss off: fairseq's fp32 log-softmax loss), fp32-fused
(--fused-loss on), fp16-cache / bf16-cache (--fused-loss cache: cache-sized chunks, the
CPU's way for small logits, on any device), fp16-loss-compiled (--fused-loss compiled),
fp16-stock (stock fairseq --fp16, no plugin; CUDA only), fp16-fairseq-attn
(--attention-path fairseq: fairseq's own attention, the CPU default), fp16-compiled / bf16-compiled
(--compile-layers, which compiles the fused loss too), fp16-workers4
(--num-workers 4: four batch-loading processes instead of fairseq's one),
fp16-compile-step / bf16-compile-step (--compile-step: the optimizer's update compiled from the
half gradients), fp16-buckets /
bf16-buckets (--length-buckets auto: batches of at most 16 shapes) and fp16-graphs / bf16-graphs (those
batches, with the compiled layers run as CUDA graphs: --compile-layers --cuda-graphs).
Peak memory: the CUDA allocator's peak on --cuda, the process's peak RSS on the
CPU. Each mode runs ``fairseq-train --cpu`` (or on CUDA with --cuda) for --warmup
updates and then --updates timed ones, without validation or checkpoints. fp16's loss
scale starts high and halves on the overflows early in a run; the warm-up keeps those skipped
updates out of the figures. Figures of the timed intervals (fairseq logs every 5 updates):

* ``ms_per_update``, ``words_per_s``: the medians of fairseq's per-interval rates, which count
  applied updates only (a compiled mode's recompile for a new input variant stalls one
  interval, not the figure);
* ``ms_per_attempted_update``: their wall time over every update attempted, skipped ones
  included; ``applied_words_per_s``: the words of the applied updates over that wall time
  (both from the run's own clock: scripts/run_stats.py's ``intervals``);
* ``timed_skipped_updates`` and ``recompiles`` (torch.compile compilations) in them;
  ``skipped_updates``: the whole run's; ``intervals``: each interval's record, with the
  process's resident memory and its peak so far at the interval's end;
  ``memory_before_first_update``: both as the first update began.

The modes run interleaved --repeats times; each reports its median. Prints a table and, as
its last line, one JSON object with the ``provenance`` of the code and software measured
(fairseq_fp16_tools/provenance.py). --jsonl PATH appends to PATH a header line, one line per
run of a mode as soon as it ends (``outcome``: ok, failed, timed out or skipped) and that JSON
last, so a benchmark cut off keeps every mode that finished (:func:`summary_of` reads it back).

With --profile-dir DIR, --profile-updates more updates run after the timed ones under
torch.profiler (outside every logged interval) and DIR/MODE.json gets their summary
(scripts/profile_summary.py: device busy/idle time, kernel classes, launches, host syncs; also
in the mode's --jsonl line). --mode-timeout SECONDS[,MODE=SECONDS...] kills a run that takes
longer (``timed out``; the next mode runs). --deadline SECONDS skips the modes not yet started
once that much time has passed (a device session's time is fixed); the JSON lists them under
"skipped". SIGTERM kills the run in flight and skips the rest, the records still written.
"""

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..paths import USER_DIR, script
from ..provenance import describe

# (flags, plugin?, extra environment)
MODES = {
    "fp32": [],
    "tf32": [],  # fp32 with TF32 tensor-core products (CUDA; env below)
    "fp32-stock": [],  # stock fairseq in fp32
    "fp16-stock": ["--fp16"],  # stock fairseq: no --user-dir, task translation, optimizer adam
    "fp16": ["--fp16"],
    "fp16-native": ["--fp16", "--half-matmul", "native"],
    "fp16-fp32acc": ["--fp16", "--half-matmul", "fp32-accumulate"],
    "bf16": ["--bf16"],
    "bf16-native": ["--bf16", "--half-matmul", "native"],
    # torch's autocast: fp32 weights (CUDA: fairseq's --amp, fp16 with its GradScaler; the CPU:
    # the plugin's bf16 autocast), eager and with the layers compiled
    "amp": ["--amp"],
    "amp-compiled": ["--amp", "--compile-layers"],
    # dropout masks of torch's bernoulli_ (the plugin's CPU default: counter-based masks)
    "fp32-torch-dropout": ["--cpu-dropout", "torch"],
    "bf16-torch-dropout": ["--bf16", "--cpu-dropout", "torch"],
    "bf16-fp32acc": ["--bf16", "--half-matmul", "fp32-accumulate"],
    "bf16-cache1024": ["--bf16", "--cpu-kernel-cache", "1024"],  # torch's own cache sizes
    # batch lengths (--cpu-length-multiple; auto pads where the products run on AMX tiles and
    # a batch's products are small)
    "bf16-unpadded": ["--bf16", "--cpu-length-multiple", "1"],
    "bf16-unpadded-cache1024": ["--bf16", "--cpu-length-multiple", "1", "--cpu-kernel-cache", "1024"],
    "bf16-padded": ["--bf16", "--cpu-length-multiple", "8"],  # auto's AMX padding, always
    "bf16-padded-cache64": ["--bf16", "--cpu-length-multiple", "8", "--cpu-kernel-cache", "64"],
    "bf16-padded-cache8": ["--bf16", "--cpu-length-multiple", "8", "--cpu-kernel-cache", "8"],
    "fp16-padded": ["--fp16", "--cpu-length-multiple", "8"],
    "fp32-padded": ["--required-seq-len-multiple", "8"],  # fairseq's own flag: fp32 the same shapes
    # the loss: fairseq's log-softmax path for the half modes, the fused one for fp32
    "fp16-unfused": ["--fp16", "--fused-loss", "off"],
    "bf16-unfused": ["--bf16", "--fused-loss", "off"],
    "fp32-fused": ["--fused-loss", "on"],
    "fp16-cache": ["--fp16", "--fused-loss", "cache"],  # the fused loss in cache-sized chunks
    "bf16-cache": ["--bf16", "--fused-loss", "cache"],
    "fp16-loss-compiled": ["--fp16", "--fused-loss", "compiled"],  # eager layers, compiled loss
    # the GPU's A/B: attention path, compiled layers, batch-loading processes
    "fp16-fairseq-attn": ["--fp16", "--attention-path", "fairseq"],
    "bf16-torch-attn": ["--bf16", "--attention-path", "torch"],  # the CPU's: torch's attention
    "fp16-compiled": ["--fp16", "--compile-layers"],
    "bf16-compiled": ["--bf16", "--compile-layers"],
    "fp16-workers4": ["--fp16", "--num-workers", "4"],
    # the optimizer's update compiled from the half gradients
    "fp16-compile-step": ["--fp16", "--compile-step"],
    "bf16-compile-step": ["--bf16", "--compile-step"],
    # batches of a few fixed shapes (--length-buckets), eager and as CUDA graphs of the compiled layers
    "fp16-buckets": ["--fp16", "--length-buckets", "auto"],
    "bf16-buckets": ["--bf16", "--length-buckets", "auto"],
    "fp16-graphs": ["--fp16", "--compile-layers", "--cuda-graphs", "--length-buckets", "auto"],
    "bf16-graphs": ["--bf16", "--compile-layers", "--cuda-graphs", "--length-buckets", "auto"],
}
STOCK = {"fp16-stock", "fp32-stock"}
LOG_INTERVAL = 5  # fairseq's --log-interval in every run: the intervals the figures come from
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


def plugin_args(mode: str, task_args: Optional[str] = None) -> list:
    """fairseq-train's plugin, task and optimizer flags for ``mode``: stock fairseq's adam for a
    stock mode, the plugin's otherwise; the task is ``task_args`` (``--task-args``) where given,
    else stock fairseq's translation or the plugin's translation_fp16."""
    if mode in STOCK:
        return [*shlex.split(task_args or "--task translation"), "--optimizer", "adam"]
    return ["--user-dir", USER_DIR, *shlex.split(task_args or "--task translation_fp16"),
            "--optimizer", "fp16_adam"]


class RunFailed(RuntimeError):
    """One mode's run failed; the others still run and the JSON lists it under "failed"."""


class RunTimedOut(RunFailed):
    """One mode's run passed its time limit and was killed."""


class Stopped(Exception):
    """SIGTERM arrived while a mode ran (a session's time ran out): the run was killed."""


def parse_mode_timeout(ap: argparse.ArgumentParser, text: Optional[str]) -> Dict[str, float]:
    """``--mode-timeout SECONDS[,MODE=SECONDS...]`` as ``{"default": seconds, mode: seconds}``."""
    limits: Dict[str, float] = {}
    for part in (text or "").split(","):
        if not part:
            continue
        mode, _, value = part.rpartition("=")
        if mode and mode not in MODES:
            ap.error(f"--mode-timeout: unknown mode {mode}; valid: {', '.join(MODES)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not seconds > 0:
            ap.error(f"--mode-timeout: {value!r} is not a number of seconds above 0")
        limits[mode or "default"] = seconds
    return limits


def _records(text: str) -> List[Dict[str, str]]:
    """fairseq's train_inner records of a ``--log-format simple`` log, as ``{key: value}``."""
    return [dict(re.findall(r"([a-z_]+)=([^,\s]+)", line)) for line in text.splitlines()
            if "| train_inner |" in line]


def interval_rates(text: str, after: int = 0, upto: Optional[int] = None):
    """(ms/update, words/s): the medians of fairseq's train_inner rates over the records whose
    ``num_updates`` lies in (``after``, ``upto``]. fairseq counts applied updates only: its
    ``ups`` and ``wps`` leave out the updates skipped for overflow but not their time."""
    timed = [r for r in _records(text) if after < int(r.get("num_updates", 0)) <= (upto or 1 << 62)]
    if not timed:
        raise RunFailed(f"no train_inner record after update {after}; raise --updates")
    ups = [float(r["ups"]) for r in timed]
    wps = [float(r["wps"]) for r in timed]
    return 1000.0 / statistics.median(ups), statistics.median(wps)


def timed_figures(intervals: List[Dict], after: int, upto: int) -> Dict:
    """The figures of the intervals (:class:`.run_stats.IntervalLog` records) whose
    ``num_updates`` lies in (``after``, ``upto``]: ``ms_per_attempted_update`` (their wall time
    over every update attempted, skipped ones included), ``applied_words_per_s`` (the words of
    the applied updates over that wall time), ``timed_skipped_updates`` and ``recompiles``
    (torch.compile compilations, each one after the first update a recompile)."""
    timed = [i for i in intervals if after < i["num_updates"] <= upto]
    if not timed:
        raise RunFailed(f"no timed interval between updates {after} and {upto}")
    wall_ms = sum(i["wall_ms"] for i in timed)
    return {"ms_per_attempted_update": round(wall_ms / sum(i["attempted"] for i in timed), 2),
            "applied_words_per_s": round(sum(i["words"] for i in timed) / (wall_ms / 1000.0), 1),
            "timed_skipped_updates": sum(i["skipped"] for i in timed),
            "recompiles": sum(i["compiles"] for i in timed)}


def run(data, mode, updates, model, device, profile=None, warmup=0, timeout=None,
        task_args=None) -> Dict:
    """One fairseq-train run of ``mode``: ``warmup`` updates, then ``updates`` timed ones.

    Returns ``ms_per_update``, ``words_per_s`` (fairseq's rates, median over the timed
    intervals), :func:`timed_figures`, ``peak_mb``, ``skipped_updates`` (the whole run's),
    ``intervals`` (every interval's :class:`.run_stats.IntervalLog` record),
    ``memory_before_first_update`` and ``machine``.
    ``profile``: (updates to profile, JSON path), run after the timed updates. ``timeout``:
    seconds before the run is killed (:class:`RunTimedOut`). ``task_args``: the task and its
    flags (:func:`plugin_args`).
    """
    flags = MODES[mode]
    timed_end = warmup + updates
    total, prof = timed_end, []
    if profile:  # the profiled window: whole updates after the last logged interval
        total = timed_end + profile[0] + 1
        prof = ["--profile-updates", f"{timed_end + 1}:{profile[0]}", str(profile[1])]
    with tempfile.TemporaryDirectory() as tmp:
        stats, log = Path(tmp) / "stats.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, script("run_stats.py"), *prof, str(stats), "fairseq-train",
               str(data), *plugin_args(mode, task_args), "--lr", "1e-3",
               *shlex.split(model), "--max-update", str(total), "--log-format", "simple",
               "--log-interval", str(LOG_INTERVAL), "--no-save", "--disable-validation", "--seed", "1",
               *device, *flags]
        # the log goes to a file, not a pipe: a killed run's loader workers, which end on their
        # own once their parent is gone, cannot hold the benchmark up
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **ENV.get(mode, {})})
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.poll() is None:  # timed out, or Stopped raised in wait()
                    proc.kill()
                    proc.wait()
        text = log.read_text(errors="replace")
        if code is None:
            done = [r["num_updates"] for r in _records(text) if "num_updates" in r]
            raise RunTimedOut(f"fairseq-train ({mode}) timed out after {timeout:g} s (its limit), "
                              f"at update {done[-1] if done else 0} of {total}")
        if code != 0:
            raise RunFailed(f"fairseq-train ({mode}) failed:\n{text[-3000:]}")
        peak = json.loads(stats.read_text())
    logged = len(_records(text))
    if logged < timed_end // LOG_INTERVAL:
        raise RunFailed(f"fairseq-train ({mode}): {logged} train_inner records, {timed_end // LOG_INTERVAL} expected")
    if profile and logged != timed_end // LOG_INTERVAL:
        raise RunFailed(f"fairseq-train ({mode}): the profiled updates reached a logged interval")
    intervals = peak["intervals"]
    ms, wps = interval_rates(text, warmup, timed_end)
    mem = peak["peak_cuda_mb"] if peak["peak_cuda_mb"] else peak["peak_rss_mb"]
    return {"ms_per_update": round(ms, 2), "words_per_s": round(wps, 1),
            **timed_figures(intervals, warmup, timed_end), "peak_mb": round(mem, 1),
            "skipped_updates": sum(i["skipped"] for i in intervals), "intervals": intervals,
            "memory_before_first_update": peak.get("memory_before_first_update"),
            "machine": peak.get("machine")}


class JsonLines:
    """Appends one JSON object a line to ``path`` (nothing when None), each flushed to disk as it
    is written, so that a session cut off keeps every line before the cut."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def write(self, record: Dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_records(path) -> List[Dict]:
    """The records of a ``--jsonl`` file; a last line cut off mid-write is left out."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def summarize(header: Dict, records: List[Dict]) -> Dict:
    """The benchmark's JSON from its ``run`` header and ``mode`` records (one per run of a
    mode): each figure the median over a mode's repeats (peak memory and skips: the most), the
    modes in the header's order (peak memory from the runs without a profile, where a mode has
    any: the profiler keeps its trace in memory); ``outcomes``: each mode's ``ok`` (a run finished), else its
    last run's ``failed``, ``timed out`` or ``skipped``, or ``not run`` (no record: the
    benchmark was cut off first)."""
    ok: Dict[str, List[Dict]] = {}
    for r in records:
        if r["outcome"] == "ok":
            ok.setdefault(r["mode"], []).append(r)
    modes = [m for m in header["modes"] if m in ok]
    last = {r["mode"]: r["outcome"] for r in records}
    outcomes = {m: "ok" if m in ok else last.get(m, "not run") for m in header["modes"]}
    failed: Dict[str, str] = {}
    for r in records:
        if r["outcome"] in ("failed", "timed out"):
            failed.setdefault(r["mode"], r["error"].splitlines()[-1][:500])

    def median(key, digits=1):
        return {m: round(statistics.median(r[key] for r in ok[m]), digits) for m in modes}

    def most(key):
        return {m: max(r[key] for r in ok[m]) for m in modes}

    # the profiler holds its trace in memory: peaks from the runs without one, where there are any
    unprofiled = {m: [r for r in ok[m] if "profile" not in r] or ok[m] for m in modes}
    ms, wps = median("ms_per_update"), median("words_per_s")
    peak_run = {m: max(unprofiled[m], key=lambda r: r["peak_mb"]) for m in modes}
    mem = {m: peak_run[m]["peak_mb"] for m in modes}
    first = modes[0] if modes else None
    return {
        "record": "summary", "model": header["model"], "task_args": header.get("task_args"),
        "device": header["device"],
        "updates": header["updates"], "warmup_updates": header["warmup_updates"],
        "repeats": header["repeats"], "statistic": "median",
        # native half modes on a CPU without units for their dtype: one run of --native-updates
        "run_once": {m: ok[m][0]["updates"] for m in modes if ok[m][0].get("run_once")},
        "cpu_native_fp16": header["cpu_native_fp16"], "cpu_native_bf16": header["cpu_native_bf16"],
        "ms_per_update": ms,
        "ratio_to_first": {k: round(v / ms[first], 3) for k, v in ms.items()},
        "words_per_s": wps,
        "words_ratio_to_first": {k: round(v / wps[first], 3) for k, v in wps.items()},
        "ms_per_attempted_update": median("ms_per_attempted_update", 2),
        "applied_words_per_s": median("applied_words_per_s"),
        "peak_mb": mem, "peak_kind": "CUDA allocator peak" if header["device"] == "cuda" else "process peak RSS",
        "peak_ratio_to_first": {k: round(v / mem[first], 3) for k, v in mem.items()},
        # updates skipped for overflow (the most over a mode's repeats): in the whole run, and
        # in its timed intervals; a skipped update costs its time but fairseq's ups omits it
        "skipped_updates": most("skipped_updates"), "timed_skipped_updates": most("timed_skipped_updates"),
        "recompiles": most("recompiles"),
        # each interval of a mode's first run (every run's are in its own record)
        "intervals": {m: ok[m][0]["intervals"] for m in modes},
        # resident memory as the first update began (imports, data, model), in the run of peak_mb
        "memory_before_first_update": {m: peak_run[m].get("memory_before_first_update") for m in modes},
        # each mode's --profile-dir summary (its first run's)
        "profiles": {m: r["profile"] for m in modes for r in ok[m][:1] if "profile" in r},
        "outcomes": outcomes,
        "skipped": [f"{r['mode']} (repeat {r['repeat']})" for r in records if r["outcome"] == "skipped"],
        "failed": failed, "machine": ok[modes[-1]][-1]["machine"] if modes else None,
        "provenance": header["provenance"],
    }


def summary_of(path) -> Dict:
    """The summary of a ``--jsonl`` file: its summary line, or one made from its mode records
    when the benchmark was cut off before writing it.

    Raises:
        ValueError: the file has no ``run`` header (the benchmark never started).
    """
    records = read_records(path)
    if not records or records[0].get("record") != "run":
        raise ValueError(f"{path}: no run header; the benchmark did not start")
    if records[-1].get("record") == "summary":
        return records[-1]
    return summarize(records[0], [r for r in records if r.get("record") == "mode"])


class _StopOnSigterm:
    """While entered, SIGTERM ends the run of the mode in flight (:class:`Stopped`) and starts
    no other; the records and the summary are still written. Outside a run it only sets
    ``requested``. The previous handler is put back on exit."""

    def __init__(self) -> None:
        self.requested = False
        self.in_run = False
        self._previous = None

    def __enter__(self) -> "_StopOnSigterm":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if self.in_run:
            self.in_run = False
            raise Stopped("stopped by SIGTERM (the session's time ran out)")


def run_mode(data, mode, updates, a, device, profile, timeout, stop) -> Dict:
    """The record of one run of ``mode`` (:func:`run`): ``outcome`` ok with its figures and
    profile, or failed / timed out with the ``error``; ``wall_s`` either way."""
    start = time.monotonic()
    try:
        stop.in_run = True
        record = {"outcome": "ok", "updates": updates,
                  **run(data, mode, updates, a.model, device, profile, a.warmup, timeout, a.task_args)}
        stop.in_run = False
        if profile and profile[1].exists():
            record["profile"] = json.loads(profile[1].read_text())
    except (RunTimedOut, Stopped) as e:
        record = {"outcome": "timed out", "error": str(e)}
    except RunFailed as e:
        record = {"outcome": "failed", "error": str(e)}
    finally:
        stop.in_run = False
    record["wall_s"] = round(time.monotonic() - start, 1)
    return record


def print_table(summary: Dict) -> None:
    ms, wps, mem = summary["ms_per_update"], summary["words_per_s"], summary["peak_mb"]
    if not ms:
        return
    first = next(iter(ms))
    for mode in ms:
        print(f"{mode:14s} {ms[mode]:9.1f} ms/update  x{ms[mode] / ms[first]:.2f}  "
              f"{wps[mode]:9.0f} words/s  x{wps[mode] / wps[first]:.2f}  "
              f"{mem[mode]:8.0f} MB  x{mem[mode] / mem[first]:.2f}  "
              f"{summary['ms_per_attempted_update'][mode]:9.1f} ms/attempted update  "
              f"{summary['timed_skipped_updates'][mode]} skipped, {summary['recompiles'][mode]} recompiles",
              flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", help="data-bin directory (default: the synthetic corpus)")
    ap.add_argument("--updates", type=int, default=30, help="timed updates, after --warmup")
    ap.add_argument("--warmup", type=int, default=10, help="updates before the timed ones")
    ap.add_argument("--modes", default="fp32,fp16,fp16-native,bf16,bf16-native,bf16-fp32acc")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--task-args", metavar="'--task NAME ...'",
                    help="the task and its flags (default: --task translation_fp16, stock modes "
                    "--task translation); the plugin's flags apply under any task")
    ap.add_argument("--cuda", action="store_true", help="train on the GPU instead of --cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-dir", help="profile each mode after its timed updates; summaries here")
    ap.add_argument("--profile-updates", type=int, default=3)
    ap.add_argument("--deadline", type=float, help="seconds after which no further mode starts")
    ap.add_argument("--mode-timeout", metavar="SECONDS[,MODE=SECONDS...]",
                    help="seconds a run of a mode may take before it is killed (per mode after it)")
    ap.add_argument("--jsonl", help="append the header, each run's record as it ends, and the summary here")
    ap.add_argument("--native-updates", type=int, default=10,
                    help="updates for fp16-native / bf16-native on a CPU without units for their "
                    "dtype (slow; run once, not --repeats times)")
    a = ap.parse_args(argv)
    modes = parse_modes(ap, a.modes)
    limits = parse_mode_timeout(ap, a.mode_timeout)
    if a.updates < 10 or a.updates % LOG_INTERVAL:
        ap.error(f"--updates must be a multiple of 5 (the log interval), at least 10; got {a.updates}")
    if a.warmup < 0 or a.warmup % LOG_INTERVAL:
        ap.error(f"--warmup must be a multiple of 5 (the log interval); got {a.warmup}")
    if a.profile_dir:
        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
    data = a.data
    if data is None:
        from ..corpus import write_corpus

        data = write_corpus(Path(tempfile.mkdtemp(prefix="bench_toy_")))
    device = [] if a.cuda else ["--cpu"]
    from fairseq_fp16.core.half_matmul import cpu_has_native_half
    import torch

    sink = JsonLines(a.jsonl)
    header = {"record": "run", "model": a.model, "task_args": a.task_args,
              "device": "cuda" if a.cuda else "cpu", "modes": modes,
              "updates": a.updates, "warmup_updates": a.warmup, "repeats": a.repeats,
              "mode_timeout_s": limits, "cpu_native_fp16": cpu_has_native_half(torch.float16),
              "cpu_native_bf16": cpu_has_native_half(torch.bfloat16), "provenance": describe()}
    sink.write(header)
    records: List[Dict] = []
    began = time.monotonic()
    with _StopOnSigterm() as stop:
        for rep in range(a.repeats):
            for mode in modes:
                native = {"fp16-native": torch.float16, "bf16-native": torch.bfloat16}.get(mode)
                slow = native is not None and not a.cuda and not cpu_has_native_half(native)
                done = [r["outcome"] for r in records if r["mode"] == mode]
                if "failed" in done or "timed out" in done or (slow and "ok" in done):
                    continue  # a failed mode is not retried; once is enough for the slow one
                record = {"record": "mode", "mode": mode, "repeat": rep + 1}
                if stop.requested:
                    record.update(outcome="skipped", reason="the session's time ran out")
                elif a.deadline is not None and time.monotonic() - began > a.deadline:
                    record.update(outcome="skipped", reason=f"not started within --deadline {a.deadline:g} s")
                else:
                    profile = None
                    if a.profile_dir and "ok" not in done:
                        profile = (a.profile_updates, Path(a.profile_dir) / f"{mode}.json")
                    record.update(run_mode(data, mode, a.native_updates if slow else a.updates, a, device,
                                           profile, limits.get(mode, limits.get("default")), stop),
                                  run_once=slow)
                records.append(record)
                sink.write(record)
                if record["outcome"] == "ok":  # as it goes, so a run cut short still says something
                    print(f"  {mode}: {record['ms_per_update']:.1f} ms/update, {record['words_per_s']:.0f} "
                          f"words/s, {record['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
                else:
                    print(f"  {mode}: {record['outcome']}: {record.get('error') or record['reason']}",
                          file=sys.stderr, flush=True)
    summary = summarize(header, records)
    sink.write(summary)
    if not summary["ms_per_update"]:
        raise SystemExit(f"no mode ran: failed {summary['failed']}, skipped {summary['skipped']}")
    print_table(summary)
    print(json.dumps(summary))
