"""Batch shapes and padding of a data-bin's training batches, as fairseq makes them and bucketed.

    python scripts/bucket_stats.py DATA_BIN [--max-tokens 1024,4096] [--length-buckets auto]
        [--required-batch-size-multiple 8] [--length-multiple 1] [--name NAME]

For each ``--max-tokens``: the training split's batches as ``fairseq-train`` cuts them
(its sentence order, ``data_utils.batch_by_size``) and as ``--length-buckets`` cuts them
(:mod:`fairseq_fp16.core.buckets`), each with

* ``shapes``: distinct batch shapes (sentences x source length x target length), what a CUDA
  graph is recorded for;
* ``padding``: the share of the batches' token positions (source and target) that are
  padding, padding sentences included;
* ``batches``, and for the bucketed batches ``padding_sentences`` and ``buckets`` (the shapes).

Counted from the lengths the data-bin records; nothing is trained. Prints a table and, as its
last line, one JSON object with the ``provenance`` of the code
(fairseq_fp16_tools/provenance.py); ``scripts/render_docs.py`` draws the docs' table from it.
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .provenance import describe
from .tables import md_table


def training_lengths(data_bin: Path, split: str = "train") -> Tuple[np.ndarray, np.ndarray, str]:
    """The source and target lengths (tokens, with end-of-sentence) of ``split`` and its
    ``src-tgt`` language pair."""
    from fairseq.data import indexed_dataset

    found = sorted(data_bin.glob(f"{split}.*-*.*.idx"))
    pairs = {m.group(1, 2) for m in (re.match(rf"{split}\.([^.-]+)-([^.]+)\.", p.name) for p in found) if m}
    if len(pairs) != 1:
        raise SystemExit(f"{data_bin}: expected one language pair of {split}.SRC-TGT.*.idx files, "
                         f"found {sorted(pairs) or 'none'}")
    (src, tgt), = pairs
    lengths = []
    for lang in (src, tgt):
        dataset = indexed_dataset.MMapIndexedDataset(str(data_bin / f"{split}.{src}-{tgt}.{lang}"))
        lengths.append(np.array(dataset.sizes, dtype=np.int64))  # a copy: the file closes with it
    return lengths[0], lengths[1], f"{src}-{tgt}"


def fairseq_order(src: np.ndarray, tgt: np.ndarray, seed: int = 1) -> np.ndarray:
    """The sentence order fairseq's LanguagePairDataset batches in: shuffled under the epoch-1
    seed, then stably sorted by target and then by source length."""
    indices = np.random.RandomState(seed + 1).permutation(len(src)).astype(np.int64)
    indices = indices[np.argsort(tgt[indices], kind="mergesort")]
    return indices[np.argsort(src[indices], kind="mergesort")]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def fairseq_batches(src, tgt, max_tokens: int, batch_multiple: int, length_multiple: int) -> Dict:
    """``shapes``, ``padding`` and ``batches`` of fairseq's own batches."""
    from fairseq.data import data_utils

    order = fairseq_order(src, tgt)
    batches = data_utils.batch_by_size(order, num_tokens_fn=None,
                                       num_tokens_vec=np.maximum(src, tgt)[order],
                                       max_tokens=max_tokens, required_batch_size_multiple=batch_multiple)
    shapes = [(len(b), _round_up(int(src[b].max()), length_multiple),
               _round_up(int(tgt[b].max()), length_multiple)) for b in batches]
    from fairseq_fp16.core.buckets import batch_padding

    return {"shapes": len(set(shapes)), "padding": batch_padding(shapes, int(src.sum() + tgt.sum())),
            "batches": len(batches)}


def bucketed_batches(src, tgt, choice: str, max_tokens: int, batch_multiple: int,
                     length_multiple: int) -> Dict:
    """``shapes``, ``padding``, ``batches``, ``padding_sentences`` and ``buckets`` of the
    ``--length-buckets CHOICE`` batches."""
    from fairseq_fp16.core.buckets import fit_length_buckets

    buckets = fit_length_buckets(src, tgt, choice, max_tokens, None, batch_multiple, length_multiple)
    return {**buckets.stats(src, tgt), "buckets": [str(s) for s in buckets.shapes]}


def measure(data_bin: Path, max_tokens: Sequence[int], choice: str, batch_multiple: int = 8,
            length_multiple: int = 1, name: str = "") -> Dict:
    """The JSON record of :mod:`this script <fairseq_fp16_tools.bucket_stats>`."""
    src, tgt, pair = training_lengths(data_bin)
    results = [{"max_tokens": n, "fairseq": fairseq_batches(src, tgt, n, batch_multiple, length_multiple),
                "bucketed": bucketed_batches(src, tgt, choice, n, batch_multiple, length_multiple)}
               for n in max_tokens]
    return {"name": name or data_bin.name, "data": str(data_bin), "pair": pair, "sentences": len(src),
            "source_tokens": int(src.sum()), "target_tokens": int(tgt.sum()),
            "length_buckets": choice, "required_batch_size_multiple": batch_multiple,
            "length_multiple": length_multiple, "results": results}


def table(records: List[Dict]) -> str:
    """The shapes and padding of each record's batches, fairseq's beside the bucketed ones."""
    rows = []
    for r in records:
        for x in r["results"]:
            f, b = x["fairseq"], x["bucketed"]
            rows.append([r["name"], f"{r['sentences']:,}", f"{x['max_tokens']:,}", f"{f['shapes']:,}",
                         f"{f['padding']:.1%}", b["shapes"], f"{b['padding']:.1%}",
                         f"{b['padding_sentences']:,}"])
    return md_table(["corpus", "sentences", "max tokens", "fairseq: shapes", "padding",
                     f"--length-buckets {records[0]['length_buckets'] if records else ''}: shapes",
                     "padding", "padding sentences"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_bin", type=Path)
    ap.add_argument("--max-tokens", default="1024,4096", help="comma-separated (default 1024,4096)")
    ap.add_argument("--length-buckets", default="auto", help="auto or the most shapes (default auto)")
    ap.add_argument("--required-batch-size-multiple", type=int, default=8, help="fairseq's (default 8)")
    ap.add_argument("--length-multiple", type=int, default=1,
                    help="lengths padded to a multiple of this (--required-seq-len-multiple; default 1)")
    ap.add_argument("--name", default="", help="the corpus's name in the table (default: the folder's)")
    a = ap.parse_args(argv)
    try:
        max_tokens = [int(x) for x in a.max_tokens.split(",") if x]
    except ValueError:
        max_tokens = []
    if not max_tokens or min(max_tokens) < 1:
        ap.error(f"--max-tokens must be integers >= 1, comma-separated, got {a.max_tokens!r}")
    if a.required_batch_size_multiple < 1 or a.length_multiple < 1:
        ap.error("--required-batch-size-multiple and --length-multiple must be >= 1")
    from fairseq_fp16.core.buckets import parse_length_buckets

    try:
        if parse_length_buckets(a.length_buckets) is None:
            raise ValueError("--length-buckets off: nothing to compare; pass auto or a number")
    except ValueError as e:
        ap.error(str(e))
    record = measure(a.data_bin, max_tokens, a.length_buckets, a.required_batch_size_multiple,
                     a.length_multiple, a.name)
    record["provenance"] = describe()
    print(table([record]))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
