"""Render the docs' results tables from the committed JSON files.

    python scripts/render_docs.py            # rewrite every table in the docs from its data
    python scripts/render_docs.py --check    # exit 1, naming each table that differs from its data

In a doc (README.md, docs/*.md, examples/translation/*.md) a table sits between two markers:

    <!-- table: NAME -->
    ...
    <!-- /table -->

Everything between them is generated: a one-line italic note naming the JSON file(s), the
command that reproduces the data and the commit the data records (:func:`commit_note`; for a
benchmark table also the torch and CUDA versions, and whether the plugin changed since:
:func:`provenance_note`), then the markdown table. :data:`TABLES` maps each NAME to
its files and its render function (a ``.jsonl`` file loads as a list of records); the
functions read numbers from the JSON only, so a number in a doc changes when its data changes
and nowhere else. ``--check`` (run by the test suite) also refuses an unknown NAME, a marker
left open, and a table whose data is missing.
"""

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .paths import ROOT
from .provenance import PLUGIN, label, source_hashes
from .tables import md_table

#: the docs that may hold tables (globs under the repository root)
DOCS = ("README.md", "docs/*.md", "docs/*/*.md", "examples/translation/*.md")
OPEN = re.compile(r"^<!-- table: (?P<name>[^ ]*) -->$")
CLOSE = "<!-- /table -->"

RESULTS = "examples/translation/results"
BENCH = "benchmarks"
DEMO = "python scripts/demo.py"
#: the machines' names in tables, by folder name
MACHINES = {"avx512-epyc": "AVX512-BF16 EPYC", "amx-xeon": "AMX Xeon", "amx-xeon-480": "AMX Xeon (480 MiB L3)",
            "avx2-epyc": "AVX2 EPYC", "h200": "H200"}
#: report.py's verdict keys, shortened for tables ({m}: the margin)
VERDICTS = {
    "equivalent": "**within ±{m}**",
    "not_worse": "not more than {m} below (within ±{m} not shown)",
    "not_better": "not more than {m} above (within ±{m} not shown)",
    "worse": "more than {m} below",
    "better": "more than {m} above",
    "inconclusive": "inconclusive",
}


# -- formatting ---------------------------------------------------------------------------------

def num(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def signed(x: float) -> str:
    return f"{x:+.2f}"


def thousands(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.0f}"


def p_value(p: Optional[float]) -> str:
    return "-" if p is None else f"{p:.3f}"


def mean_range(values: Sequence[float]) -> str:
    """``1.80x (1.36-2.35)``: the mean and range of a list of ratios."""
    return f"{statistics.fmean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def verdict(eq: dict) -> str:
    m = f"{eq['margin']:g}"
    return VERDICTS[eq["verdict"]].format(m=m)


def machine_of(path: str) -> str:
    """The machine named by a results or benchmarks path (``.../demo/amx-xeon/...``)."""
    for part in Path(path).parts:
        if part in MACHINES:
            return MACHINES[part]
    raise ValueError(f"no machine folder in {path}")


# -- render functions: (loaded JSON of each source, the source paths) -> markdown table -----------

def verdict_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """The seed-paired test per machine and precision (scripts/verdict.py's JSON)."""
    rows = []
    for v, path in zip(data, paths):
        for mode, r in v["precisions"].items():
            eq = r.get("equivalence")
            if eq is None:
                continue
            rows.append([machine_of(path), mode, eq["n"],
                         f"{statistics.fmean(r['bleu']):.2f} ({statistics.fmean(r['fp32_bleu']):.2f})",
                         f"{signed(eq['mean'])} ({signed(eq['ci90'][0])} to {signed(eq['ci90'][1])})",
                         p_value(eq["p_equivalence"]), p_value(eq["p_difference"]), verdict(eq),
                         mean_range(r["x_updates_per_s"]), mean_range(r["x_peak_mem"])])
    return md_table(["machine", "precision", "seed pairs", "mean BLEU (fp32's)", "mean d BLEU (90% CI)",
                     "p, gap >= margin", "p, gap = 0", "verdict", "x fp32 updates/s", "x fp32 peak RSS"], rows)


def seed_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """Each seed's BLEU, fp32 beside each mixed precision (one verdict.json)."""
    (v,) = data
    precisions = list(v["precisions"])
    by_seed: Dict[int, Dict[str, float]] = {}
    for mode, r in v["precisions"].items():
        for seed, bleu, base in zip(r["seeds"], r["bleu"], r["fp32_bleu"]):
            by_seed.setdefault(seed, {})["fp32"] = base
            by_seed[seed][mode] = bleu
    rows = []
    for seed in sorted(by_seed):
        b = by_seed[seed]
        rows.append([seed, num(b["fp32"])] + [
            f"{num(b[m])} ({signed(b[m] - b['fp32'])})" if m in b else "-" for m in precisions])
    return md_table(["seed", "fp32 BLEU"] + [f"{m} BLEU (d)" for m in precisions], rows)


def seed1_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """The seed-1 runs of each machine's comparison (compare.py's result.json, fp32 first):
    what ``make demo`` reproduces on that machine, and how long each run took."""
    rows = []
    base = None
    for r, path in zip(data, paths):
        if r["mode"] == "fp32":
            base = r
        g, last, t = r["generate"], r.get("generate_last"), r["train"]
        minutes = (t["wall_s"] + g["wall_s"] + (last["wall_s"] if last else 0)) / 60
        rows.append([machine_of(path), r["mode"], num(g["bleu"]), num(last["bleu"]) if last else "-", num(g["chrf"]),
                     thousands(t["words_per_s"]), ratio(t["words_per_s"] / base["train"]["words_per_s"]),
                     thousands(t["peak_rss_mb"]), ratio(t["peak_rss_mb"] / base["train"]["peak_rss_mb"]),
                     f"{minutes:.1f}"])
    return md_table(["machine", "mode", "BLEU", "BLEU, last checkpoint", "chrF", "words/s", "x fp32",
                     "peak RSS MB", "x fp32", "minutes"], rows)


def toy_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    (s,) = data
    runs = s.get("runs", s)
    base = runs["fp32"]
    rows = [[mode, num(r["bleu"]), p_value(r["p_vs_fp32"]), thousands(r["words_per_s"]),
             ratio(r["words_per_s"] / base["words_per_s"]), thousands(r["peak_rss_mb"])]
            for mode, r in runs.items()]
    return md_table(["mode", "BLEU", "p vs fp32", "words/s", "x fp32", "peak RSS MB"], rows)


def decode_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/decode_precision.py: each checkpoint decoded in the other precisions."""
    (d,) = data
    rows = []
    for mode, e in d["runs"].items():
        for dec in e["decodes"]:
            weights = "fp32 masters" if dec["weights"] == "masters" else "checkpoint"
            rows.append([mode, num(e["as_trained"]["bleu"]), f"{dec['decoded_in']}, {weights}",
                         num(dec["bleu"]), signed(dec["d_bleu"]), f"{dec['same_hypotheses']} of {dec['n_sentences']}"])
    return md_table(["trained in", "BLEU as trained", "decoded in", "BLEU", "d BLEU", "same hypotheses"], rows)


def headline_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """Per machine: each half precision's speed and memory against fp32 and its BLEU verdict.
    CPU rows: the demo's seed-paired test (verdict.json); GPU rows: bench_fairseq_train.py."""
    rows = []
    for d, path in zip(data, paths):
        if "precisions" in d:  # a demo verdict
            for mode, r in d["precisions"].items():
                eq = r.get("equivalence")
                rows.append([f"{machine_of(path)} (CPU)", mode, ratio(statistics.fmean(r["x_updates_per_s"])),
                             ratio(statistics.fmean(r["x_peak_mem"])),
                             f"{verdict(eq)}, {eq['n']} seeds" if eq else "-"])
        else:  # a GPU benchmark
            ms, mem = d["words_per_s"], d["peak_mb"]
            for mode in ("tf32", "fp16", "bf16"):
                if mode in ms:
                    rows.append([f"{machine_of(path)} (GPU)", mode, ratio(ms[mode] / ms["fp32"]),
                                 ratio(mem[mode] / mem["fp32"]), "not measured"])
    return md_table(["machine", "precision", "speed, x fp32", "peak memory, x fp32", "BLEU against fp32"], rows)


def train_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """One scripts/bench_fairseq_train.py run: ms/update, words/s and peak memory per mode."""
    (d,) = data
    ms, wps, mem = d["ms_per_update"], d["words_per_s"], d.get("peak_mb", {})
    base = "fp32" if "fp32" in ms else next(iter(ms))
    rows = [[mode, num(ms[mode], 1), ratio(ms[mode] / ms[base]), thousands(wps.get(mode)),
             thousands(mem.get(mode)), ratio(mem[mode] / mem[base]) if mode in mem and base in mem else "-"]
            for mode in ms]
    return md_table(["mode", "ms/update", f"x {base}", "words/s", "peak MB", f"x {base}"], rows)


def task_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """bench_fairseq_train.py runs of other tasks (--task-args): per task and model, each mode's
    updates/s and peak memory against fp32's."""
    rows = []
    for d in data:
        task = re.search(r"--task (\S+)", d.get("task_args") or "--task translation_fp16").group(1)
        arch = re.search(r"--arch (\S+)", d["model"]).group(1)
        ms, wps, mem = d["ms_per_update"], d["words_per_s"], d["peak_mb"]
        for mode in ms:
            rows.append([f"`{task}`, `{arch}`", mode, num(ms[mode], 1), ratio(ms["fp32"] / ms[mode]),
                         thousands(wps[mode]), thousands(mem[mode]), ratio(mem[mode] / mem["fp32"])])
    return md_table(["task, model", "mode", "ms/update", "updates/s, x fp32", "words/s", "peak MB",
                     "x fp32"], rows)


def train_side_by_side(data: Sequence[dict], paths: Sequence[str]) -> str:
    """Several bench_fairseq_train.py runs of the same modes, one column group per run
    (labelled by its --max-tokens)."""
    modes = list(data[0]["ms_per_update"])
    header = ["mode"]
    for d in data:
        tokens = re.search(r"--max-tokens (\d+)", d["model"]).group(1)
        header += [f"ms/update, {tokens} tokens", "x fp32", "peak MB", "x fp32"]
    rows = []
    for mode in modes:
        row = [mode]
        for d in data:
            ms, mem = d["ms_per_update"], d["peak_mb"]
            row += [num(ms[mode], 1), ratio(ms[mode] / ms["fp32"]), thousands(mem[mode]),
                    ratio(mem[mode] / mem["fp32"])]
        rows.append(row)
    return md_table(header, rows)


def before_after_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    before, after = (d["peak_mb"] for d in data)
    rows = [[mode, thousands(before[mode]), thousands(after[mode]), f"{after[mode] - before[mode]:+,.0f}",
             ratio(after[mode] / after["fp32"])] for mode in after]
    return md_table(["mode", "peak RSS MB, master grads kept", "released", "change", "x fp32, released"], rows)


def change_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """bench_fairseq_train.py runs of successive commits (a file each, named for the change it
    measures; one of them runs stock fp32 too): each mode's figures, memory against stock fp32."""
    stock = next(d["peak_mb"]["fp32-stock"] for d in data if "fp32-stock" in d["peak_mb"])
    rows = []
    for d, path in zip(data, paths):
        commit = (d.get("provenance") or {}).get("commit") or "?"
        for mode, ms in d["ms_per_update"].items():
            mem = d["peak_mb"][mode]
            rows.append([Path(path).stem.replace("_", " "), commit[:7], mode, num(ms, 0),
                         thousands(d["words_per_s"][mode]), thousands(mem), ratio(mem / stock)])
    return md_table(["change", "commit", "mode", "ms/update", "words/s", "peak RSS MB",
                     "x stock fp32"], rows)


def gpu_precision_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """The H200 run per precision, with ratios to fp32 and to TF32."""
    (d,) = data
    ms, wps, mem = d["ms_per_update"], d["words_per_s"], d["peak_mb"]
    order = [m for m in ("fp32", "tf32", "amp", "fp16", "bf16", "fp16-stock") if m in ms]
    rows = [[mode, num(ms[mode], 1), thousands(wps[mode]), ratio(wps[mode] / wps["fp32"]),
             ratio(wps[mode] / wps["tf32"]), thousands(mem[mode]), ratio(mem[mode] / mem["fp32"]),
             ratio(mem[mode] / mem["tf32"])] for mode in order]
    return md_table(["mode", "ms/update", "words/s", "x fp32", "x TF32", "peak CUDA MB", "x fp32", "x TF32"], rows)


PROFILE_CLASSES = ("matmul", "attention", "softmax/norm", "elementwise/other", "copies", "optimizer")


def census_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/op_census.py: launches per applied update by phase, MB moved, host syncs, per
    mode; where the run had them, the launches of an update that overflowed (after another:
    the non-finite watch armed) and the forward launches of an applied update with the watch
    armed."""
    (d,) = data
    rows = []
    for mode, c in d["census"].items():
        if "error" in c:
            continue
        phase, cls, kinds = c["by_phase"], c["by_class"], c.get("kinds", {})
        other = [thousands(kinds["armed_overflowed"]["launches"]) if "armed_overflowed" in kinds else "-",
                 thousands(kinds["armed_applied"]["by_phase"]["forward"]["launches"])
                 if "armed_applied" in kinds else "-"]
        rows.append([mode, thousands(c["launches"]), thousands(phase["forward"]["launches"]),
                     thousands(phase["backward"]["launches"]), thousands(phase["step"]["launches"]),
                     thousands(c["mb"]), thousands(cls["elementwise/other"]["mb"] + cls["softmax/norm"]["mb"]),
                     thousands(cls["copies"]["mb"]), num(c["syncs"], 0)] + other)
    return md_table(["mode", "launches", "forward", "backward", "step", "MB moved",
                     "elementwise + softmax/norm MB", "copies MB", "host syncs",
                     "launches, overflowing", "forward, watch armed"], rows)


def profile_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/profile_summary.py's records, per batch size and mode (ms per update)."""
    (d,) = data
    rows = []
    for tokens, runs in d.items():
        for mode, r in runs.items():
            rows.append([f"{int(tokens):,}", mode, num(r["wall_ms"], 1), num(r["gpu_busy_ms"], 1),
                         f"{r['gpu_idle_frac']:.0%}", num(r["host_ms"], 1), thousands(r["launches"])]
                        + [num(r["kernel_ms"][k], 1) for k in PROFILE_CLASSES])
    return md_table(["tokens", "mode", "wall", "GPU busy", "GPU idle", "host", "launches"]
                    + list(PROFILE_CLASSES), rows)


def gpu_batch_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """The modes run at both batch sizes: speed, memory and the profile's GPU share at each."""
    *runs, profiles = data
    rows = []
    for mode in runs[-1]["ms_per_update"]:
        for d in runs:
            tokens = re.search(r"--max-tokens (\d+)", d["model"]).group(1)
            prof = profiles.get(tokens, {}).get(mode)
            rows.append([f"{int(tokens):,}", mode, num(d["ms_per_update"][mode], 1), thousands(d["words_per_s"][mode]),
                         thousands(d["peak_mb"][mode]), num(prof["gpu_busy_ms"], 1) if prof else "-",
                         f"{prof['gpu_idle_frac']:.0%}" if prof else "-"])
    return md_table(["tokens", "mode", "ms/update", "words/s", "peak CUDA MB", "GPU busy ms (profile)",
                     "GPU idle (profile)"], rows)


def _corpus(path: str) -> str:
    return Path(path).stem


#: fairseq's dictionary of examples/translation/prepare_debian.py's 8,000-piece vocabulary
DEBIAN_SYMBOLS = 7992


#: fairseq's ``--arch transformer`` sizes where a model's arguments do not give them
TRANSFORMER_DEFAULTS = {"encoder-layers": 6, "decoder-layers": 6, "encoder-embed-dim": 512,
                        "decoder-embed-dim": 512, "encoder-ffn-embed-dim": 2048,
                        "decoder-ffn-embed-dim": 2048}


def model_arg(model_args: str, name: str) -> int:
    """The integer ``--NAME N`` of a benchmark's model arguments, else the transformer's default
    (:data:`TRANSFORMER_DEFAULTS`; KeyError for another name missing)."""
    found = re.search(rf"--{name}[= ](\d+)", model_args)
    return int(found.group(1)) if found else TRANSFORMER_DEFAULTS[name]


def transformer_linear_weights(model_args: str, symbols: int) -> int:
    """The ``nn.Linear`` weights of a fairseq ``--arch transformer`` given its arguments (its
    defaults where they are not given; shared embeddings): per encoder layer four attention
    projections and two feed-forward matrices, per decoder layer eight and two, and the output
    projection, as :func:`fairseq_fp16.core.cpu_kernel_cache.batch_products` counts them."""
    def arg(name: str) -> int:
        return model_arg(model_args, name)

    width = arg("encoder-embed-dim")
    ffn = arg("encoder-ffn-embed-dim")
    dec_width, dec_ffn = arg("decoder-embed-dim"), arg("decoder-ffn-embed-dim")
    return (arg("encoder-layers") * (4 * width * width + 2 * width * ffn)
            + arg("decoder-layers") * (8 * dec_width * dec_width + 2 * dec_width * dec_ffn)
            + symbols * dec_width)


def length_multiple_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """bench_fairseq_train.py's bf16 runs padded (``bf16-padded``, or ``bf16`` measured where
    ``auto`` padded every AMX run) and unpadded (``bf16-unpadded``) on Debian, one model and
    --max-tokens a file, ordered by a batch's products (--max-tokens x the linear weights)."""
    rows = []
    for d in data:
        args = d["model"]
        tokens = model_arg(args, "max-tokens")
        products = tokens * transformer_linear_weights(args, DEBIAN_SYMBOLS)
        wps, mem = d["words_per_s"], d["peak_mb"]
        padded = "bf16-padded" if "bf16-padded" in wps else "bf16"
        model = (f"{model_arg(args, 'encoder-layers')}+{model_arg(args, 'decoder-layers')} layers, "
                 f"width {model_arg(args, 'encoder-embed-dim')}")
        rows.append((products, [model, thousands(tokens), num(products / 1e9, 0), thousands(wps[padded]),
                                thousands(wps["bf16-unpadded"]), ratio(wps["bf16-unpadded"] / wps[padded]),
                                thousands(mem[padded]), thousands(mem["bf16-unpadded"]),
                                ratio(mem["bf16-unpadded"] / mem[padded])]))
    return md_table(["model", "--max-tokens", "G multiply-adds a batch", "padded words/s", "unpadded words/s",
                     "x padded", "padded peak RSS MB", "unpadded MB", "x padded"],
                    [r for _, r in sorted(rows, key=lambda r: r[0])])


def cpu_goal_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """bench_fairseq_train.py runs of the CPU goal (one per corpus): words/s against stock
    fairseq's fp32 and the plugin's, peak memory, and the products' share of the profiled
    update."""
    rows = []
    for d, path in zip(data, paths):
        wps, mem, ms, profiles = d["words_per_s"], d["peak_mb"], d["ms_per_update"], d.get("profiles", {})
        for mode in ms:
            frac = (profiles.get(mode) or {}).get("products_frac")
            rows.append([machine_of(path), _corpus(path), mode, num(ms[mode], 0), thousands(wps[mode]),
                         ratio(wps[mode] / wps["fp32-stock"]), ratio(wps[mode] / wps["fp32"]),
                         thousands(mem[mode]), ratio(mem[mode] / mem["fp32-stock"]),
                         "-" if frac is None else f"{frac:.0%}"])
    return md_table(["machine", "corpus", "mode", "ms/update", "words/s", "x stock fp32", "x plugin fp32",
                     "peak RSS MB", "x stock fp32", "products' share"], rows)


def shape_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """bench_fairseq_train.py's batch-shape modes, one run per corpus (``shapes_NAME.json``):
    words a batch, words/s and peak memory against stock fairseq's fp32."""
    rows = []
    for d, path in zip(data, paths):
        wps, mem, ms = d["words_per_s"], d["peak_mb"], d["ms_per_update"]
        rows += [[_corpus(path).removeprefix("shapes_"), mode, num(ms[mode], 0),
                  thousands(wps[mode] * ms[mode] / 1000), thousands(wps[mode]), ratio(wps[mode] / wps["fp32-stock"]),
                  thousands(mem[mode]), ratio(mem[mode] / mem["fp32-stock"])] for mode in ms]
    return md_table(["corpus", "mode", "ms/update", "words/update", "words/s", "x stock fp32", "peak RSS MB",
                     "x stock fp32"], rows)


def cpu_profile_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """The profiled updates of the CPU goal's runs: ms per update by class
    (bench/profile_summary.py's ``cpu_ms``)."""
    from .bench.profile_summary import CPU_CLASSES

    rows = []
    for d, path in zip(data, paths):
        for mode, p in (d.get("profiles") or {}).items():
            cpu = p.get("cpu_ms")
            if cpu:
                rows.append([machine_of(path), _corpus(path), mode, num(p["wall_ms"], 0)]
                            + [num(cpu[c], 0) for c in CPU_CLASSES])
    return md_table(["machine", "corpus", "mode", "wall"] + list(CPU_CLASSES), rows)


def copies_rows(data: Sequence[dict], paths: Sequence[str], top: int = 7) -> str:
    """A profiled bench_fairseq_train.py run: each mode's copies per update by what asked for
    them (profile_summary's ``copies_by_asker``: the ``top`` largest in any mode, the rest
    summed), their total, the self time of torch's fused attention kernels (from ``top_cpu_self``)
    and the update's time, profiled and timed, one column a mode."""
    (d,) = data
    profiles = {m: p for m, p in (d.get("profiles") or {}).items() if p.get("copies_by_asker")}
    by_mode = {m: {a: (n, ms) for a, n, ms in p["copies_by_asker"]} for m, p in profiles.items()}
    largest = {}
    for copies in by_mode.values():
        for a, (_, ms) in copies.items():
            largest[a] = max(largest.get(a, 0.0), ms)
    askers = sorted(largest, key=lambda a: -largest[a])[:top]

    def cell(n: float, ms: float) -> str:
        return f"{num(ms, 0)} ({n:,.0f})"

    rows = [[f"`{a}`"] + [cell(*by_mode[m][a]) if a in by_mode[m] else "-" for m in by_mode] for a in askers]
    rows.append(["the rest"] + [cell(sum(n for a, (n, _) in c.items() if a not in askers),
                                     sum(ms for a, (_, ms) in c.items() if a not in askers))
                                for c in by_mode.values()])
    rows.append(["all copies"] + [cell(sum(n for n, _ in c.values()), sum(ms for _, ms in c.values()))
                                  for c in by_mode.values()])
    fused = [sum(ms for _, name, _, ms in profiles[m].get("top_cpu_self") or () if "scaled_dot_product" in name)
             for m in by_mode]
    rows.append(["torch's fused attention kernels themselves (not copies)"] + [num(f, 0) if f else "-" for f in fused])
    rows.append(["the update, profiled"] + [num(profiles[m]["wall_ms"], 0) for m in by_mode])
    rows.append(["the update, timed"] + [num(d["ms_per_update"][m], 0) for m in by_mode])
    return md_table(["copies asked by: ms per update (copies)"] + [f"`{m}`" for m in by_mode], rows)


def product_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_half_matmul.py --products on each machine: TFLOP/s per kernel choice and
    shape."""
    shapes = list(dict.fromkeys(s for d in data for v in d["tflops"].values() for s in v))
    ffn = "4096x2048x512"
    rows = [[machine_of(path), name] + [num(v.get(s), 3) for s in shapes]
            + [ratio(v[ffn] / d["tflops"]["fp32"][ffn]) if ffn in v else "-"]
            for d, path in zip(data, paths) for name, v in d["tflops"].items()]
    return md_table(["machine", "kernel"] + [f"{s}, TFLOP/s" for s in shapes] + [f"x fp32 ({ffn})"], rows)


def weight_gradient_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """:func:`product_rows` of fp32's and native bf16's kernels only."""
    kept = [{**d, "tflops": {k: v for k, v in d["tflops"].items() if k == "fp32" or k.startswith("bf16 native")}}
            for d in data]
    return product_rows(kept, paths)


def dropout_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_dropout.py: torch's masks against the counter-based ones, per dtype and size."""
    (d,) = data
    rows = [[dtype, f"{r['numel']:,}", num(r["torch_fwd_ms"], 3), num(r["counter_fwd_ms"], 3),
             num(r["torch_fwd_bwd_ms"], 3), num(r["counter_fwd_bwd_ms"], 3), ratio(r["speedup_fwd_bwd"]),
             num(r["mul_ms"], 3)]
            for dtype, results in d["results"].items() for r in results]
    return md_table(["dtype", "elements", "torch fwd ms", "counter fwd ms", "torch fwd+bwd ms",
                     "counter fwd+bwd ms", "speed-up", "x * x ms"], rows)


def cpu_pass_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_cpu_passes.py: each pass's time against its floor, and its alternatives, one
    block of rows per shape."""
    rows = []
    for d in data:
        s = d["shape"]
        shape = f"{s['length']} x {s['batch']}, width {s['width']}"
        for r in d["results"]:
            alts = "; ".join(f"{name} {ratio(a['x_current'])}" for name, a in r["alternatives"].items())
            rows.append([shape, r["pass"], num(r["ms"], 2), num(r["floor_ms"], 2), ratio(r["over_floor"]),
                         thousands(r["page_faults"]), alts or "-"])
    return md_table(["tokens (length x sentences)", "pass, forward and backward", "ms", "floor ms",
                     "x floor", "page faults", "another way in torch: its time x the pass's"], rows)


def demo_memory_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_fairseq_train.py's resident memory of each mode's run on the CPU: before its
    first update, at the end of its first log interval and its peak, and what training added (the
    peak less the memory before), against the same file's stock fp32; and its words/s against
    stock fp32's. A mode without the memory readings (an older record) shows "-"."""
    rows = []
    for d, path in zip(data, paths):
        if d["peak_kind"] != "process peak RSS" or "fp32-stock" not in d["peak_mb"]:
            raise ValueError(f"{path}: the table needs CPU runs (process peak RSS) with fp32-stock")
        tokens = model_arg(d["model"], "max-tokens")
        before = {m: (d.get("memory_before_first_update", {}).get(m) or {}).get("rss_mb") for m in d["peak_mb"]}
        added = {m: d["peak_mb"][m] - b if b is not None else None for m, b in before.items()}
        stock_added = added["fp32-stock"]
        for m, peak in d["peak_mb"].items():
            first = d["intervals"][m][0].get("peak_rss_mb") if d["intervals"].get(m) else None
            rows.append([f"{tokens:,}", m, ratio(d["words_per_s"][m] / d["words_per_s"]["fp32-stock"]),
                         thousands(before[m]), thousands(first), thousands(peak),
                         ratio(peak / d["peak_mb"]["fp32-stock"]), thousands(added[m]),
                         ratio(added[m] / stock_added) if added[m] is not None and stock_added else "-"])
    return md_table(["tokens a batch", "mode", "words/s x stock fp32", "MB before the first update",
                     "peak MB, first log interval (5 updates)", "peak MB", "x stock fp32",
                     "training added MB", "x stock fp32's"], rows)


def fused_loss_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_fused_loss.py: fairseq's loss and each fused path, per dtype and shape."""
    (d,) = data
    rows = [[dtype, f"{r['rows']:,} x {r['vocab']:,}", num(r["fairseq_ms"], 1), num(r["cache_ms"], 1),
             num(r["stream_ms"], 1), num(r["compiled_ms"], 1), r["default"],
             ratio(r["default_over_fairseq"]), num(r["pass_ms"], 2)]
            for dtype, results in d["results"].items() for r in results]
    return md_table(["dtype", "tokens x vocabulary", "fairseq's ms", "cache ms", "stream ms",
                     "compiled ms", "default", "default / fairseq's", "x * x ms"], rows)


def optimizer_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_optimizer.py on each machine."""
    rows = []
    for d, path in zip(data, paths):
        for r in d["results"]:
            rows.append([machine_of(path), d.get("dtype", "fp16"), f"{r['params']:,}", num(r["step_ms"]),
                         num(r["achieved_gbps"], 1), num(r["copy_gbps"], 1), num(r["ratio_to_copy"]),
                         r["host_syncs_per_step"], num(r["fp32_fused_adamw_ms"]), ratio(r["wrapper_over_adamw"]),
                         num(r.get("compiled_step_ms")), ratio(r.get("compiled_over_adamw"))])
    return md_table(["machine", "dtype", "params", "step ms", "GB/s", "copy GB/s", "x copy", "host syncs",
                     "fused fp32 AdamW ms", "step / AdamW", "--compile-step ms", "compiled / AdamW"], rows)


def optimizer_pass_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_optimizer.py's passes alone, eager and compiled (--compile-step), against
    fused fp32 AdamW (sizes measured with them)."""
    rows = []
    for d, path in zip(data, paths):
        for r in d["results"]:
            if "passes_ms" not in r or "compiled_passes_ms" not in r:
                continue
            p, c = r["passes_ms"], r["compiled_passes_ms"]
            rows.append([machine_of(path), f"{r['params']:,}", num(r["fp32_fused_adamw_ms"]), num(r["step_ms"]),
                         " + ".join(num(p[k]) for k in ("grad_copy", "norm", "adamw", "copy_back")),
                         num(r["compiled_step_ms"]), f"{num(c['norm'])} + {num(c['update'])}",
                         ratio(c["update"] / r["fp32_fused_adamw_ms"]), num(r["compile_s"], 0)])
    return md_table(["machine", "params", "fused fp32 AdamW ms", "eager step ms", "its passes alone, ms: "
                     "grad copy + norm + AdamW + copy back", "--compile-step ms", "its parts alone, ms: "
                     "norm + update", "update / AdamW", "compile s"], rows)


def optimizer_fixed_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_optimizer.py's fixed cost: a step over many tiny tensors."""
    rows = [[machine_of(path), d["fixed"]["tensors"], f"{d['fixed']['params']:,}", num(d["fixed"]["step_ms"]),
             num(d["fixed"].get("torch_step_ms")), f"{d['fixed']['launches']:.0f}"] for d, path in zip(data, paths)]
    return md_table(["machine", "tensors", "params", "step ms", "through torch's AdamW.step, ms",
                     "kernel launches"], rows)


def half_matmul_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bench_half_matmul.py: each variant's step time against fp32, one column per model
    and machine."""
    variants: List[str] = []
    for d in data:
        variants += [v for v in d["ms_per_step"] if v not in variants]
    header = ["variant"] + [f"{d['model'].split()[1]}, {machine_of(p)}" for d, p in zip(data, paths)]
    rows = [["fp32 ms/step"] + [num(d["ms_per_step"]["fp32"], 1) for d in data]]
    rows += [[v] + [ratio(d["ratio_to_fp32"].get(v)) for d in data] for v in variants if v != "fp32"]
    return md_table(header, rows)


def divergence_rows(data: Sequence[list], paths: Sequence[str]) -> str:
    """--precision-divergence files: per measurement, the modules' relative errors against fp32
    (modules whose output is exact left out of the median)."""
    rows = []
    for records in data:
        for r in records:
            errors = {m: e for m, e in r["modules"].items() if e > 0}
            worst = max(errors, key=errors.get)
            rows.append([{"float16": "fp16", "bfloat16": "bf16"}.get(r["dtype"], r["dtype"]), r["update"],
                         len(r["modules"]), f"{statistics.median(errors.values()):.1e}",
                         f"`{worst}` {errors[worst]:.1e}"])
    return md_table(["precision", "update", "modules", "median relative error", "largest"], rows)


def scale_trace_rows(data: Sequence[list], paths: Sequence[str]) -> str:
    """A --scale-trace file, summarised: the scale's course and the parameters overflows named."""
    (trace,) = data
    scales = [r["loss_scale"] for r in trace]
    skipped = [r for r in trace if r["skipped"]]
    first_ok = next(i for i, r in enumerate(trace) if not r["skipped"])
    named: Dict[str, int] = {}
    for r in skipped:
        for p in r.get("overflow_params", []):
            named[p["param"]] = named.get(p["param"], 0) + 1
    top = sorted(named.items(), key=lambda kv: -kv[1])[:3]
    rows = [["updates attempted", len(trace)],
            ["skipped for overflow", f"{len(skipped)} ({first_ok} before the first update that was kept)"],
            ["loss scale: first, lowest, last", f"{scales[0]:g}, {min(scales):g}, {scales[-1]:g}"],
            ["parameters named most often by overflows", ", ".join(f"`{p}` ({n})" for p, n in top)]]
    return md_table(["scale trace", ""], rows)


def length_bucket_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """scripts/bucket_stats.py on each corpus: batch shapes and padding, fairseq's and bucketed."""
    from .bucket_stats import table

    return table(list(data))


def machine_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    (d,) = data
    rows = [[f"`{name}`", m["hardware"], m["half_units"], m["half_matmul_auto"], m["software"]]
            for name, m in d.items()]
    return md_table(["folder", "machine", "half-precision units", "`--half-matmul auto`, padding", "software"],
                    rows)


WRITERS = {"stock": "stock fairseq", "stock-apex": "stock fairseq with apex (GPU)", "plugin": "the plugin"}
#: what a stock writer's checkpoint is: a real CPU run in fp32, the layout a GPU writes otherwise
LAYOUTS = {("stock", "fp32"): "a real run", ("stock", "fp16"): "FP16Optimizer's layout",
           ("stock", "bf16"): "FP16Optimizer's layout", ("stock-apex", "fp32"): "FusedAdam's layout",
           ("stock-apex", "fp16"): "FP16Optimizer over FusedAdam", ("stock-apex", "bf16"): "FP16Optimizer over FusedAdam"}


def _outcome_counts(cells: Sequence[dict]) -> str:
    kept = sum(c["outcome"] == "kept" for c in cells)
    text = f"{kept} of {len(cells)} kept"
    refused = sum(c["outcome"] == "refused" for c in cells)
    if refused:
        text += f", {refused} refused"
    continued = sum(c.get("continued") == "equal" for c in cells)
    return text + (f"; {continued} continued as uninterrupted" if continued else "")


def resume_matrix_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """tests/test_resume_matrix.py's outcomes by writer and precision written (rows) and
    precision resumed (columns), over its optimizers and EMA on/off."""
    (d,) = data
    cells: Dict[Tuple[str, str, str], List[dict]] = {}
    for key, cell in d["cells"].items():
        writer, precisions = key.split("/")[:2]
        written, resumed = precisions.split("->")
        cells.setdefault((writer, written, resumed), []).append(cell)
    precisions = ("fp32", "fp16", "bf16")
    rows = []
    for writer, who in WRITERS.items():
        for written in precisions:
            if not any((writer, written, r) in cells for r in precisions):
                continue
            what = f"{who}, {written}" + (f" ({LAYOUTS[writer, written]})" if writer != "plugin" else "")
            rows.append([what] + [_outcome_counts(cells.get((writer, written, r), [])) for r in precisions])
    return md_table(["checkpoint written by", "resumed in fp32", "resumed in --fp16", "resumed in --bf16"], rows)


def resume_change_rows(data: Sequence[dict], paths: Sequence[str]) -> str:
    """tests/test_resume_matrix.py's resumes with another --optimizer (in --fp16)."""
    (d,) = data
    rows = []
    for key, change in d["changes"].items():
        writer, optimizers = key.split("/")
        saved, resumed = optimizers.split("->")
        if change["outcome"] == "refused":
            flags = ", ".join(f"`{f}`" for f in dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", change["message"]))
                              if f != "--optimizer")
            outcome = f"refused, naming {flags}"
        else:
            outcome = "kept (the moments carried parameter by parameter)"
        rows.append([WRITERS[writer], f"`{saved}`", f"`{resumed}`", outcome])
    return md_table(["checkpoint written by", "--optimizer written", "--optimizer resumed", "outcome"], rows)


# -- provenance -----------------------------------------------------------------------------------

def _provenances(d) -> List[dict]:
    """The provenance records of one loaded JSON: its own, or those of the records it holds
    (profiles.json: ``{tokens: {mode: profile}}``); for a file without any, one record of
    what it says (the torch version under ``torch`` or ``machine``), its commit unknown."""
    if isinstance(d, dict) and isinstance(d.get("provenance"), dict):
        return [d["provenance"]]
    if isinstance(d, dict) and isinstance(d.get("provenances"), list) and d["provenances"]:
        return d["provenances"]  # verdict.json: the runs it pooled
    held = [r["provenance"] for runs in (d.values() if isinstance(d, dict) else []) if isinstance(runs, dict)
            for r in runs.values() if isinstance(r, dict) and isinstance(r.get("provenance"), dict)]
    if held:
        return held
    machine = d.get("machine") if isinstance(d, dict) else None
    torch = (d.get("torch") if isinstance(d, dict) else None) or (machine or {}).get("torch")
    return [{"commit": None, "torch": torch}]


def plugin_changed_since(root: Path, record: dict) -> Optional[bool]:
    """Whether ``fairseq_fp16/`` in ``root`` differs from the plugin a benchmark measured: its
    content hash against the one ``record`` (a provenance record) holds; None where the record
    has none. Read from the files, not from git: the same answer in any checkout of a commit."""
    measured = (record.get("source_hashes") or {}).get(PLUGIN)
    if not measured:
        return None
    return source_hashes(root)[PLUGIN] != measured


def _unique(values) -> List[str]:
    return list(dict.fromkeys(v for v in values if v))


def provenance_note(data: Sequence, root: Path) -> str:
    """``Measured at COMMIT (torch X, CUDA Y): ...``: the commits and versions the data records,
    and whether its rows are stale (the plugin's source differs from the one measured), current,
    or may be stale (the data records no source hash)."""
    records = [p for d in data for p in _provenances(d)]
    stale, unknown = [], False
    for p in records:
        changed = plugin_changed_since(root, p)
        if changed:
            stale.append(label(p))
        unknown = unknown or changed is None
    torches, cudas = _unique(p.get("torch") for p in records), _unique(p.get("cuda") for p in records)
    cpu_only = bool(torches) and all(t.endswith("+cpu") for t in torches)  # a CPU build has no CUDA
    versions = (f"torch {', '.join(torches) or 'unknown'}, "
                + ("no CUDA" if cpu_only and not cudas else f"CUDA {', '.join(cudas) or 'unknown'}"))
    measured = _unique(label(p) for p in records)
    if stale and len(_unique(stale)) == len(measured):  # every record: the label is said once
        verdict = f"stale: {PLUGIN}/ has changed since"
    elif stale:
        verdict = f"stale: {PLUGIN}/ has changed since {' and '.join(_unique(stale))}"
    elif unknown:
        verdict = "the rows may be stale"
    else:
        verdict = f"{PLUGIN}/ unchanged since"
    return f"Measured at {' and '.join(measured)} ({versions}): {verdict}."


#: a table note's provenance where the data records none: said once a page, at its first table
NO_COMMIT = "The data records no commit."


def commit_note(data: Sequence) -> str:
    """``Data from COMMIT.``: the commits the data records (a table's note names where its
    numbers came from), or that it records none."""
    records = [p for d in data for p in _provenances(d)]
    known = _unique(label(p) for p in records if p.get("commit"))
    if not known:
        return NO_COMMIT
    partial = " (part of it records none)" if any(not p.get("commit") for p in records) else ""
    return f"Data from {' and '.join(known)}{partial}."


# -- the registry ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Table:
    sources: Tuple[str, ...]  # JSON files, relative to the repository root
    command: Optional[str]  # what reproduces the data; None: the file is written by hand
    render: Callable[[Sequence[dict], Sequence[str]], str]
    provenance: bool = False  # a benchmark's table: its note names the data's commit and versions


def _demo_verdicts(*machines: str) -> Tuple[str, ...]:
    return tuple(f"{RESULTS}/demo/{m}/verdict.json" for m in machines)


BENCH_DEMO_MODEL = "bench_fairseq_train.py data/debian-ende/bin-max40 --model \"<the demo's model>\""
RESUME_MATRIX = ("docs/resume_matrix.json",)
RESUME_COMMAND = 'RESUME_MATRIX_WRITE=1 pytest -m "soak or not soak" tests/test_resume_matrix.py'

#: the machines of the CPU goal's tables (docs/cpu-speed.md): an AMX Xeon (the goal's kind of CPU)
#: first; the demo's table and the optimizer's passes are the Xeon's
CPU_GOAL_MACHINES = ("amx-xeon-480", "avx512-epyc")
#: the demo's data, and its model, loss and batch as the benchmark runs them (docs/cpu-speed.md
#: names the model so; fairseq_fp16_tools/demo.py has it)
DEMO_DATA, DEMO_BENCH_MODEL = "data/debian-ende/bin-max40", "<the demo's model, --dropout 0>"

TABLES: Dict[str, Table] = {
    "resume-matrix": Table(RESUME_MATRIX, RESUME_COMMAND, resume_matrix_rows),
    "resume-changes": Table(RESUME_MATRIX, RESUME_COMMAND, resume_change_rows),
    "headline": Table(
        _demo_verdicts("avx512-epyc", "amx-xeon", "avx2-epyc") + (f"{BENCH}/h200/precisions/train_16384.json",),
        f"{DEMO} --seed N ... and scripts/verdict.py (CPUs); scripts/gpu/session.sh (GPU)", headline_rows),
    "demo-verdicts": Table(_demo_verdicts("avx512-epyc", "amx-xeon", "avx2-epyc"),
                           f"{DEMO} --modes ...@seedN, then scripts/verdict.py OUT... --json", verdict_rows),
    "demo-seed1": Table(tuple(f"{RESULTS}/demo/{m}/seeds1-4/{mode}/result.json"
                              for m in ("avx512-epyc", "amx-xeon", "avx2-epyc") for mode in ("fp32", "fp16", "bf16")),
                        f"make demo (AMX, AVX2: {DEMO} --average-last 0)", seed1_rows),
    "demo-seeds": Table(_demo_verdicts("avx512-epyc"), "scripts/verdict.py on the four comparisons", seed_rows),
    "long-verdicts": Table((f"{RESULTS}/long/avx512-epyc/verdict.json",),
                           "the longer recipe's demo.py command, then scripts/verdict.py", verdict_rows),
    "long-decode-precision": Table((f"{RESULTS}/long/avx512-epyc/seed1/decode_precision.json",),
                                   "python scripts/decode_precision.py OUT", decode_rows),
    "toy": Table((f"{RESULTS}/toy/summary.json",), f"{DEMO} --corpus toy", toy_rows),
    "divergence": Table(tuple(f"docs/diagnostics/divergence_{p}.jsonl" for p in ("fp16", "bf16")),
                        "the fairseq-train loop in docs/diagnostics.md", divergence_rows),
    "scale-trace": Table(("docs/diagnostics/trace.jsonl",), "the fairseq-train command in docs/diagnostics.md",
                         scale_trace_rows),
    "machines": Table((f"{BENCH}/machines.json",), None, machine_rows),
    "h200-precisions": Table((f"{BENCH}/h200/precisions/train_16384.json",), "bash scripts/gpu/session.sh OUT",
                             gpu_precision_rows, provenance=True),
    "h200-profiles": Table((f"{BENCH}/h200/precisions/profiles.json",), "bash scripts/gpu/session.sh OUT",
                           profile_rows, provenance=True),
    "h200-batch-sizes": Table(tuple(f"{BENCH}/h200/precisions/{n}.json"
                                    for n in ("train_16384", "train_32768", "profiles")),
                              "bash scripts/gpu/session.sh OUT", gpu_batch_rows, provenance=True),
    "op-census": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/op_census.json",),
                       "python scripts/op_census.py data/gpu-bench/bin --model \"--arch transformer "
                       "--share-all-embeddings --dropout 0.1 --max-tokens 4096\"", census_rows,
                       provenance=True),
    "optimizer": Table(tuple(f"{BENCH}/{m}/optimizer.json" for m in ("avx512-epyc", "avx2-epyc", CPU_GOAL_MACHINES[0]))
                       + (f"{BENCH}/h200/ab-16k/optimizer.json",),
                       "python scripts/bench_optimizer.py --params 1e6,1e7,1e8 [--device cuda] [--dtype bf16]",
                       optimizer_rows),
    "optimizer-passes": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/optimizer.json",),
                              "python scripts/bench_optimizer.py --params 1e6,1e7,1e8 --dtype bf16",
                              optimizer_pass_rows, provenance=True),
    "optimizer-fixed": Table((f"{BENCH}/avx512-epyc/optimizer.json",),
                             "python scripts/bench_optimizer.py [--device cuda]", optimizer_fixed_rows),
    "avx2-train": Table((f"{BENCH}/avx2-epyc/fairseq_train.json",),
                        "python scripts/bench_fairseq_train.py --modes fp32,fp16,bf16 --repeats 3", train_rows),
    "half-matmul": Table(tuple(f"{BENCH}/avx2-epyc/half_matmul_{m}.json" for m in ("fairseq", "fconv", "lstm"))
                         + (f"{BENCH}/amx-xeon/half_matmul_fairseq.json",),
                         "python scripts/bench_half_matmul.py --fairseq|--fconv|--lstm ...", half_matmul_rows),
    "length-multiple-epyc": Table((f"{BENCH}/avx512-epyc/length_multiple.json",),
                                  f"python scripts/{BENCH_DEMO_MODEL} --updates 300 --repeats 2", train_rows),
    "compile-layers-epyc": Table((f"{BENCH}/avx512-epyc/compile_layers.json",),
                                 "python scripts/bench_fairseq_train.py --modes "
                                 "bf16,bf16-compiled,fp16,fp16-compiled --updates 60 --repeats 1",
                                 train_rows),
    "compile-layers-amx": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/compile_layers.json",),
                                "python scripts/bench_fairseq_train.py DATA_BIN --modes bf16,bf16-compiled "
                                "--updates 10 --warmup 5 --repeats 1 --model \"--arch transformer "
                                "--share-all-embeddings --max-tokens 4096\"",
                                train_rows, provenance=True),
    "kernel-cache-epyc": Table((f"{BENCH}/avx512-epyc/kernel_cache.json",),
                               f"python scripts/{BENCH_DEMO_MODEL} --updates 1000", train_rows),
    "fused-loss": Table(tuple(f"{BENCH}/avx2-epyc/fairseq_train_fused_loss_{n}.json" for n in (1024, 4096)),
                        f"python scripts/{BENCH_DEMO_MODEL} --modes fp32,fp32-fused,fp16,fp16-unfused,...",
                        train_side_by_side),
    "master-grads": Table(tuple(f"{BENCH}/avx512-epyc/master-grads/{n}.json" for n in ("before", "after")),
                          "python scripts/bench_fairseq_train.py data/debian-ende/bin --modes fp32,fp16,bf16 "
                          "--updates 10 (before and after the change)", before_after_rows),
    "fp16-memory": Table(tuple(f"{BENCH}/avx512-epyc/fp16_memory/{n}.json"
                               for n in ("before", "watch_64_MiB", "cast_buffers")),
                         "python scripts/bench_fairseq_train.py --modes fp16 --updates 10 --warmup 5 "
                         "--model \"--arch transformer --share-all-embeddings --max-tokens 4096\" at "
                         "each commit (the last with --modes fp32-stock,fp16,bf16)", change_rows,
                         provenance=True),
    "cpu-goal": Table(tuple(f"{BENCH}/{m}/cpu_goal/{n}.json" for m in CPU_GOAL_MACHINES for n in ("short", "long")),
                      "python scripts/bench_fairseq_train.py DATA_BIN --modes fp32-stock,fp32,bf16,fp16,"
                      "amp,amp-compiled[,bf16-compile-step] --updates 10 --warmup 5 --profile-dir DIR "
                      "--model \"--arch transformer --share-all-embeddings --max-tokens 4096\"", cpu_goal_rows,
                      provenance=True),
    "cpu-profile": Table(tuple(f"{BENCH}/{m}/cpu_goal/{n}.json" for m in CPU_GOAL_MACHINES for n in ("short", "long")),
                         "the cpu-goal command's --profile-dir (3 updates after the timed ones)",
                         cpu_profile_rows, provenance=True),
    "cpu-products": Table(tuple(f"{BENCH}/{m}/products.json" for m in CPU_GOAL_MACHINES),
                          "python scripts/bench_half_matmul.py --products --steps 10", product_rows,
                          provenance=True),
    "cpu-demo": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/cpu_goal/demo.json",),
                      f"python scripts/bench_fairseq_train.py {DEMO_DATA} --modes fp32-stock,fp32,bf16,fp16,amp"
                      f"[,bf16-cache,bf16-compile-step] --updates 100 --warmup 20 --profile-dir DIR "
                      f"--model \"{DEMO_BENCH_MODEL}\"", cpu_goal_rows,
                      provenance=True),
    "cpu-shapes-amx": Table(tuple(f"{BENCH}/{CPU_GOAL_MACHINES[0]}/cpu_goal/shapes_{n}.json"
                                  for n in ("short", "long", "demo")),
                            "python scripts/bench_fairseq_train.py DATA_BIN --modes fp32-stock,bf16,bf16-padded,bf16-unpadded,"
                            "bf16-buckets --updates 10 --warmup 5 --repeats 2 --model \"--arch transformer "
                            "--share-all-embeddings --max-tokens 4096\"; the demo's: python "
                            f"scripts/bench_fairseq_train.py {DEMO_DATA} --modes fp32-stock,bf16,bf16-unpadded,"
                            f"bf16-buckets --updates 600 --warmup 20 --repeats 1 --model \"{DEMO_BENCH_MODEL}\"", shape_rows,
                            provenance=True),
    "length-multiple-amx": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/cpu_goal/shapes_demo.json",)
                                 + tuple(f"{BENCH}/{CPU_GOAL_MACHINES[0]}/length_multiple/{n}_debian.json"
                                         for n in ("default", "default3072", "default4096", "base1024",
                                                   "default8192", "base")),
                                 "python scripts/bench_fairseq_train.py data/debian-ende/bin-max40 --modes "
                                 "bf16-padded,bf16-unpadded --updates 40-200 --repeats 1 --model \"MODEL "
                                 "--max-tokens N\"", length_multiple_rows, provenance=True),
    "cpu-copies": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/cpu_copies/short.json",),
                        "python scripts/bench_fairseq_train.py DATA_BIN --modes fp32-stock,bf16,bf16-torch-attn "
                        "--updates 10 --warmup 5 --repeats 2 --profile-dir DIR --model \"--arch transformer "
                        "--share-all-embeddings --max-tokens 4096\"", copies_rows, provenance=True),
    "weight-gradients": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/products.json",),
                              "python scripts/bench_half_matmul.py --products --steps 10",
                              weight_gradient_rows, provenance=True),
    "dropout": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/dropout.json",), "python scripts/bench_dropout.py",
                     dropout_rows, provenance=True),
    "cpu-passes": Table(tuple(f"{BENCH}/{CPU_GOAL_MACHINES[0]}/cpu_passes/{n}.json"
                              for n in ("base_short", "base_long", "demo")),
                        "python scripts/bench_cpu_passes.py --repeats 30 [--length 36 --batch 112] "
                        "[--length 20 --batch 51 --width 256 --ffn 512 --heads 4]", cpu_pass_rows,
                        provenance=True),
    "demo-memory": Table(tuple(f"{BENCH}/{CPU_GOAL_MACHINES[0]}/demo_memory/{n}.json"
                               for n in ("tokens512", "tokens1024", "tokens2048", "ways1024")),
                         f"python scripts/bench_fairseq_train.py {DEMO_DATA} --modes fp32-stock,fp32,bf16 "
                         "[--modes fp32-stock,bf16,bf16-padded-cache64,bf16-padded-cache8,bf16-cache,bf16-buckets] --updates 100 "
                         f"--warmup 20 --repeats 1 --model \"{DEMO_BENCH_MODEL} --max-tokens N\"",
                         demo_memory_rows, provenance=True),
    "cpu-loss": Table((f"{BENCH}/{CPU_GOAL_MACHINES[0]}/fused_loss.json",), "python scripts/bench_fused_loss.py",
                      fused_loss_rows, provenance=True),
    "other-tasks": Table(tuple(f"{BENCH}/{CPU_GOAL_MACHINES[0]}/other_tasks/{n}.json" for n in ("multilingual", "bart_base")),
                         "python scripts/bench_fairseq_train.py --modes fp32,fp16,bf16 --task-args "
                         "\"--task ...\" --model \"--arch ...\" (the commands in docs/benchmarks.md)",
                         task_rows, provenance=True),
    "length-buckets": Table(tuple(f"{BENCH}/amx-xeon/length_buckets/{n}.json"
                                  for n in ("debian_demo", "debian_all", "wmt_like", "wide")),
                            "python scripts/bucket_stats.py DATA_BIN --max-tokens 1024,4096,16384 --name NAME",
                            length_bucket_rows),
}


# -- rendering and checking -----------------------------------------------------------------------

def render_table(name: str, root: Path, tables: Dict[str, Table]) -> str:
    """The generated block of table ``name``: the source note and the markdown table.

    Raises:
        KeyError: ``name`` is not in ``tables``.
        FileNotFoundError: one of its data files is missing.
    """
    table = tables[name]
    data = []
    for src in table.sources:
        path = root / src
        if not path.is_file():
            raise FileNotFoundError(f"table '{name}': its data {src} is missing")
        text = path.read_text()
        # a .jsonl file (one JSON record a line, as the diagnostics write) loads as a list of records
        data.append([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
                    else json.loads(text))
    files = ", ".join(f"`{s}`" for s in table.sources)
    common = os.path.commonpath(table.sources) if len(table.sources) > 3 else ""
    if common and common not in table.sources:  # many files in one folder: name it once
        files = f"`{common}/`: " + ", ".join(f"`{Path(s).relative_to(common).as_posix()}`" for s in table.sources)
    data_note = f"data: `{table.command}`" if table.command else "written by hand"
    if table.provenance:
        measured = f" {provenance_note(data, root)}"
    else:
        measured = f" {commit_note(data)}" if table.command else ""
    note = f"*Generated by `scripts/render_docs.py` from {files}; {data_note}.{measured}*"
    return f"{note}\n\n{table.render(data, table.sources)}"


def render_doc(text: str, root: Path, tables: Dict[str, Table], where: str = "") -> Tuple[str, List[str]]:
    """``text`` with every table block regenerated (:data:`NO_COMMIT` in the first note that has
    it only), and the problems found (unknown names, open markers, missing data) as
    ``where:LINE: ...`` messages."""
    lines = text.split("\n")
    out: List[str] = []
    problems: List[str] = []
    no_commit_said = False
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            continue
        name, start = m.group("name"), i
        try:
            end = lines.index(CLOSE, i)
        except ValueError:
            problems.append(f"{where}:{start}: table '{name}' has no closing {CLOSE}")
            out += lines[i:]
            break
        nested = [j for j in range(i, end) if OPEN.match(lines[j])]
        if nested:
            problems.append(f"{where}:{start}: table '{name}' has no closing {CLOSE} before the next table "
                            f"(line {nested[0] + 1})")
        if name not in tables:
            problems.append(f"{where}:{start}: unknown table '{name}'; known: {', '.join(sorted(tables))}")
            out += lines[i:end]
        else:
            try:
                block = render_table(name, root, tables)
                if NO_COMMIT in block:  # once a page
                    block = block.replace(f" {NO_COMMIT}", "") if no_commit_said else block
                    no_commit_said = True
                out += ["", block, ""]
            except FileNotFoundError as e:
                problems.append(f"{where}:{start}: {e}")
                out += lines[i:end]
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                problems.append(f"{where}:{start}: table '{name}' cannot be rendered from its data: "
                                f"{type(e).__name__}: {e}")
                out += lines[i:end]
        out.append(CLOSE)
        i = end + 1
    return "\n".join(out), problems


def docs(root: Path) -> List[Path]:
    found = {p for pattern in DOCS for p in root.glob(pattern)}
    return sorted(found)


def main(argv=None, root: Path = ROOT, tables: Dict[str, Table] = TABLES) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each doc and table that differs from its data")
    ap.add_argument("--root", type=Path, default=root, help="the repository (default: this checkout)")
    a = ap.parse_args(argv)
    problems: List[str] = []
    stale: List[str] = []
    for path in docs(a.root):
        rel = path.relative_to(a.root).as_posix()
        text = path.read_text()
        new, found = render_doc(text, a.root, tables, rel)
        problems += found
        if new == text:
            continue
        if a.check:
            old_blocks, new_blocks = _blocks(text), _blocks(new)
            for name in sorted(set(old_blocks) | set(new_blocks)):
                if old_blocks.get(name) != new_blocks.get(name):
                    stale.append(f"{rel}: table '{name}' differs from its data")
        else:
            path.write_text(new)
            print(f"rewrote {rel}")
    for p in problems + stale:
        print(p, file=sys.stderr)
    if stale:
        print("python scripts/render_docs.py rewrites the tables from their data", file=sys.stderr)
    return 1 if problems or stale else 0


def _blocks(text: str) -> Dict[str, str]:
    """``{name: block}`` of a doc's tables (a repeated name keeps its blocks joined)."""
    blocks: Dict[str, str] = {}
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = OPEN.match(line)
        if m:
            end = lines.index(CLOSE, i) if CLOSE in lines[i:] else len(lines)
            blocks[m.group("name")] = blocks.get(m.group("name"), "") + "\n".join(lines[i + 1:end])
    return blocks

