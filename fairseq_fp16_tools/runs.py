"""A comparison's files (``scripts/compare.py --out OUT``) and how to read them.

``OUT/settings.json``: the flags shared by the runs (``data``, ``modes``, ``train_args``,
``gen_args``, ``gen_subset``, ``short_max_words``, ``average_last``, ``seed``, ``started``,
``finished``), written before the first run trains; ``finished`` is added once every run has
its result.json. A requested mode without one is missing (:func:`missing_modes`).

``OUT/<mode>/result.json``, one per run:

- ``mode``, ``base_mode`` (``fp32`` for ``fp32-seed2``), ``precision_flags``, ``plugin``,
  ``seed``, ``train_command``;
- ``machine``: the hardware and versions of the training process (``bench/run_stats.py``);
- what the run used, from ``SAVE_DIR/run_info.json`` (:func:`run_info_fields`):
  ``half_matmul``, ``native_half_products``, ``batch_lengths``, ``fused_loss``, ``attention``,
  ``compile_layers``;
- ``train``: ``wall_s``, ``peak_rss_mb``, ``peak_cuda_mb``, ``updates_per_s``, ``words_per_s``;
  ``updates``, ``skipped_updates`` and ``final_loss_scale`` at the run's end (its last
  checkpoint's, whatever the log interval); fairseq's own records (``train_inner``, ``valid``
  with ``wall``, ``epochs``);
- ``generate``: the scores of the decoded checkpoint (``bleu``, ``chrf``, ``bleu_bp``,
  ``sys_len``, ``ref_len``, the signatures, ``short`` on the short sources), ``wall_s``,
  ``subset``, ``n_sentences``, ``gen_args``, ``checkpoint``, ``hyps_file``, ``refs_file``;
  with ``--average-last``, also ``averaged`` and ``generate_last`` (the last checkpoint).

Nothing here imports fairseq.
"""

import json
import re
from pathlib import Path

#: settings.json keys that change training: --keep-existing needs them unchanged
TRAIN_SETTINGS = ("data", "train_args", "seed")
#: settings.json keys that only change decoding: --redecode may change them for kept runs
DECODE_SETTINGS = ("gen_args", "gen_subset", "short_max_words", "average_last")
#: what a settings.json written before a key existed meant by its absence
SETTING_DEFAULTS = {"average_last": 0}
#: what the plugin writes into a run's --save-dir (fairseq_fp16/run_info.py documents its keys)
RUN_INFO = "run_info.json"

_RECORD = re.compile(r"\| (train_inner|valid|train) \| (\{.*\})\s*$")


def parse_json_records(text: str):
    """fairseq --log-format json output -> {'train_inner': [...], 'valid': [...], 'train': [...]}

    Values become numbers where they are; 'valid_'/'train_' key prefixes are dropped.
    """
    out = {"train_inner": [], "valid": [], "train": []}
    for line in text.splitlines():
        m = _RECORD.search(line)
        if not m:
            continue
        tag = m.group(1)
        try:
            rec = json.loads(m.group(2))
        except json.JSONDecodeError:
            continue
        prefix = f"{tag}_" if tag != "train_inner" else ""
        out[tag].append({k[len(prefix):] if prefix and k.startswith(prefix) else k: _num(v)
                         for k, v in rec.items()})
    return out


def _num(v):
    try:
        f = float(v)
        return int(f) if f.is_integer() and "." not in str(v) else f
    except (TypeError, ValueError):
        return v


def run_info_fields(save_dir: Path) -> dict:
    """result.json's entries on what a run used, from ``save_dir/run_info.json``.

    ``half_matmul``: the CPU matrix-product path of a half run, e.g. ``"fp32 accumulation,
    rounded to half (--half-matmul auto)"`` (None: fp32 or CUDA); ``native_half_products``:
    half products of the first training step that fp32 accumulation left on torch's native
    kernels (None: not checked: fp32, native kernels, CUDA); ``batch_lengths``: e.g. ``"padded
    to a multiple of 8 (--cpu-length-multiple auto)"`` (None: as they are, or padded by fairseq's
    --required-seq-len-multiple alone, an fp32 run: see ``train_command``); ``fused_loss``: the
    loss came from the fused loss (--fused-loss), not fairseq's fp32 log-softmax;
    ``attention``: the attention path; ``compile_layers``. A run without the file (stock
    fairseq, which runs without the plugin) gets None and ``fused_loss`` False.
    """
    path = Path(save_dir) / RUN_INFO
    info = json.loads(path.read_text()) if path.is_file() else {}
    return {
        "half_matmul": info.get("half_matmul"),
        "native_half_products": info.get("native_half_products"),
        "batch_lengths": info.get("batch_lengths"),
        "fused_loss": bool(info.get("fused_loss")),
        "attention": info.get("attention"),
        "compile_layers": info.get("compile_layers"),
    }


def read_generate_output(path: Path):
    """Hypotheses (D- lines, else H-), references (T-) and sources (S-) in sentence-id order."""
    hyps, dets, refs, srcs = {}, {}, {}, {}
    for line in path.read_text().splitlines():
        head, _, rest = line.partition("\t")
        if head.startswith("T-"):
            refs[int(head[2:])] = rest
        elif head.startswith("S-"):
            srcs[int(head[2:])] = rest
        elif head.startswith("H-"):
            hyps[int(head[2:])] = rest.split("\t", 1)[1] if "\t" in rest else ""
        elif head.startswith("D-"):
            dets[int(head[2:])] = rest.split("\t", 1)[1] if "\t" in rest else ""
    hyps = dets or hyps
    ids = sorted(refs)
    missing = [i for i in ids if i not in hyps]
    if missing:
        raise SystemExit(f"{path}: no hypothesis for {len(missing)} sentences (e.g. {missing[:5]})")
    return [hyps[i] for i in ids], [refs[i] for i in ids], [srcs.get(i, "") for i in ids]


def read_json(path: Path, remedy: str):
    """The JSON of ``path``.

    Raises:
        ValueError: naming ``path`` and saying what to do (``remedy``) when it is not valid
            JSON, e.g. cut short by a run that stopped while writing it.
    """
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}), "
                         f"perhaps cut short as it was written; {remedy}") from None


def rerun_hint(out: Path, modes) -> str:
    """How to train ``modes`` of the comparison ``out`` again, keeping its other runs."""
    folders = ", ".join(str(Path(out) / m) for m in modes)
    return (f"rerun {'it' if len(modes) == 1 else 'them'}: delete {folders} and run scripts/compare.py "
            f"again with the same flags, --out {out} and --keep-existing (it trains only the runs "
            "without a result.json)")


def missing_modes(out: Path, settings=None) -> list:
    """The runs settings.json (``settings``, or read from ``out``) asks for that have no
    ``<mode>/result.json`` (compare.py stopped before them, or is still running), in its order."""
    if settings is None:
        settings = read_json(Path(out) / "settings.json", f"run scripts/compare.py with --out {out}")
    return [m for m in settings.get("modes", []) if not (Path(out) / m / "result.json").is_file()]


def missing_line(out: Path, missing) -> str:
    """The sentence of report.py and verdict.py on the requested runs that have no result."""
    one = len(missing) == 1
    return (f"{len(missing)} requested run{'' if one else 's'} without a result.json in {out}: "
            f"{', '.join(missing)} (scripts/compare.py stopped before finishing {'it' if one else 'them'}, "
            f"or is still running; {'its' if one else 'their'} train.out or generate.out says why); "
            + rerun_hint(out, missing))


def load_results(out: Path):
    """(settings, results) of a comparison: settings.json and the runs it asks for that have a
    result.json (:func:`missing_modes` lists the others), in its order (fp32 first).

    Raises:
        ValueError: naming the file when settings.json is missing or a file is not valid JSON,
            or when the fp32 run has no result.json.
    """
    out = Path(out)
    path = out / "settings.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: {out} is not the --out of scripts/compare.py, or one that "
                         "stopped before it wrote its settings; the requested runs are unknown: run "
                         f"scripts/compare.py with --out {out}")
    settings = read_json(path, f"run scripts/compare.py with the comparison's flags and --out {out} to "
                               "write it again")
    results = [read_json(out / m / "result.json", rerun_hint(out, [m])) for m in settings.get("modes", [])
               if (out / m / "result.json").is_file()]
    if not results or results[0]["mode"] != "fp32":
        missing = missing_modes(out, settings)
        raise ValueError(f"{out}: no fp32 result.json to compare against"
                         + (f": {missing_line(out, missing)}" if missing else " (run scripts/compare.py)"))
    return settings, results


def base_mode(r) -> str:
    """The mode a run was trained in: ``fp32`` for ``fp32-seed2`` (results before compare.py
    stored ``base_mode`` are their own mode)."""
    return r.get("base_mode", r["mode"])


def decoded_lines(out: Path, r, key: str, decoded: str = "generate", ids=None):
    """The lines of one of a run's decoding files (``key``: ``hyps_file`` or ``refs_file`` of its
    result.json entry ``decoded``); ``ids``: only these sentence indices."""
    text = (out / r["mode"] / r[decoded][key]).read_text().splitlines()
    return text if ids is None else [text[i] for i in ids]
