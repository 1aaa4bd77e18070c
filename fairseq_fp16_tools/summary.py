"""The numbers of one comparison (``scripts/compare.py --out OUT``): each run's paired bootstrap
against fp32, fp32's spread over its seeds, each precision over its seeds, and the record
``report.py`` writes as ``OUT/summary.json``.

The statistics themselves are :mod:`fairseq_fp16_tools.stats`'; this module feeds them the runs'
BLEU and hypotheses files.
"""

import statistics
from pathlib import Path

from .runs import base_mode, decoded_lines
from .stats import MARGIN, min_permutation_p, paired_bootstrap, paired_equivalence, permutation_p


def bootstrap_p(out: Path, results, n_samples: int, ids=None, decoded="generate"):
    """{mode: p_value} of each run against the first (fp32), from sacrebleu's paired bootstrap.

    ``ids``: score only these sentence indices (the short-source subset). ``decoded``: the
    result.json entry whose hypotheses are compared ("generate_last": the last checkpoints' of
    runs scored by an average of checkpoints).
    """
    refs = decoded_lines(out, results[0], "refs_file", decoded, ids)
    baseline = decoded_lines(out, results[0], "hyps_file", decoded, ids)
    systems = {r["mode"]: decoded_lines(out, r, "hyps_file", decoded, ids) for r in results[1:]}
    return paired_bootstrap(refs, baseline, systems, n_samples)


def seed_spread(results):
    """fp32's BLEU over its seeds, and where each mixed run of the base seed falls among them.

    The fp32 seeds are the base run and its fp32 control runs (``fp32@seedN``).
    The paired bootstrap resamples the test sentences of two fixed outputs, so
    it calls significant a difference that another training of fp32 can show
    as well; this spread is that training-to-training variation.

    Returns:
        None with fewer than two fp32 seeds; else a dict with the seeds, their
        BLEU, mean, sample standard deviation, range, and per mixed run its
        BLEU, its difference to the mean, that in standard deviations
        (``z``; None when the deviation is 0) and whether it lies within the
        fp32 seeds' range.
    """
    base_seed = results[0].get("seed")
    fp32 = [r for r in results if base_mode(r) == "fp32"]
    if len(fp32) < 2:
        return None
    bleus = [r["generate"]["bleu"] for r in fp32]
    mean, sd = statistics.fmean(bleus), statistics.stdev(bleus)
    runs = {}
    for r in results:
        if base_mode(r) == "fp32" or r.get("seed", base_seed) != base_seed:
            continue
        b = r["generate"]["bleu"]
        runs[r["mode"]] = {"bleu": b, "d_mean": b - mean, "z": (b - mean) / sd if sd else None,
                           "within_range": min(bleus) <= b <= max(bleus)}
    return {"seeds": [r.get("seed") for r in fp32], "bleu": bleus, "mean": mean, "sd": sd,
            "min": min(bleus), "max": max(bleus), "runs": runs}


def by_precision(out: Path, results, n_samples: int, pvals=None, margin: float = MARGIN):
    """BLEU per precision over its seeds, compared with fp32 two ways.

    - same seed: each mixed run against the fp32 run of its seed (``fp32@seedN``),
      d BLEU and sacrebleu's paired bootstrap p: the like-for-like pairs;
    - over seeds: the difference of the mean BLEU to fp32's, and an exact
      permutation test on the per-seed BLEU values (``permutation_p``; its
      smallest possible p with these seed counts is given too). This test counts
      training-to-training variation, which the bootstrap does not;
    - seed-paired equivalence (``equivalence``, with two or more same-seed pairs): the per-seed
      differences tested against ``margin`` (:func:`stats.paired_equivalence`).

    ``pvals``: :func:`bootstrap_p`'s p values against ``results[0]``, reused for the pairs
    with that run instead of drawn again. None unless some precision has runs with two or more
    seeds.
    """
    groups = {}
    for r in results:
        groups.setdefault(base_mode(r), {})[r.get("seed")] = r
    if not any(len(g) > 1 for g in groups.values()):
        return None
    fp32 = groups.get("fp32", {})
    fp32_bleus = [fp32[s]["generate"]["bleu"] for s in sorted(fp32, key=lambda s: (s is None, s))]
    rows = {}
    for mode, runs in groups.items():
        seeds = sorted(runs, key=lambda s: (s is None, s))
        bleus = [runs[s]["generate"]["bleu"] for s in seeds]
        row = {"seeds": seeds, "bleu": bleus, "mean": statistics.fmean(bleus),
               "sd": statistics.stdev(bleus) if len(bleus) > 1 else None}
        if mode != "fp32" and fp32:
            row["d_mean"] = row["mean"] - statistics.fmean(fp32_bleus)
            if len(fp32_bleus) >= 2 and len(bleus) >= 2:
                row["permutation_p"] = permutation_p(bleus, fp32_bleus)
                row["min_permutation_p"] = min_permutation_p(len(bleus), len(fp32_bleus))
            row["same_seed"] = {}
            for s in seeds:
                if s in fp32:
                    if fp32[s] is results[0] and pvals and runs[s]["mode"] in pvals:
                        p = pvals[runs[s]["mode"]]
                    else:
                        p = bootstrap_p(out, [fp32[s], runs[s]], n_samples)[runs[s]["mode"]]
                    row["same_seed"][s] = {"d_bleu": runs[s]["generate"]["bleu"] - fp32[s]["generate"]["bleu"],
                                           "p": p}
            if len(row["same_seed"]) >= 2:
                # result.json's BLEU has two decimals: so have the differences
                row["equivalence"] = paired_equivalence([round(d["d_bleu"], 2) for d in row["same_seed"].values()],
                                                        margin)
        rows[mode] = row
    return rows


def memory_key(results) -> str:
    """The train entry the runs' peak memory is compared by: the CUDA allocator's peak when the
    fp32 run recorded one, else the process's peak RSS."""
    return "peak_cuda_mb" if results[0]["train"].get("peak_cuda_mb") else "peak_rss_mb"


def summary_record(results, pvals, spread, precisions, short_p=None, last_p=None) -> dict:
    """``OUT/summary.json``: per run its BLEU, p against fp32, words/s and peak memory (with the
    short-source and last-checkpoint scores where it has them), the fp32 seed spread
    (:func:`seed_spread`) and each precision over its seeds (:func:`by_precision`)."""
    mem_key = memory_key(results)
    runs = {r["mode"]: {"bleu": r["generate"]["bleu"], "p_vs_fp32": pvals.get(r["mode"]),
                        "words_per_s": r["train"]["words_per_s"], mem_key: r["train"][mem_key]}
            for r in results}
    for r in results:
        if "generate_last" in r:
            runs[r["mode"]]["last_bleu"] = r["generate_last"]["bleu"]
            runs[r["mode"]]["last_p_vs_fp32"] = (last_p or {}).get(r["mode"])
        if "short" in r["generate"]:
            runs[r["mode"]]["short_bleu"] = r["generate"]["short"]["bleu"]
            runs[r["mode"]]["short_p_vs_fp32"] = (short_p or {}).get(r["mode"])
    # run names are user-chosen (fp32@seed7 -> fp32-seed7): keep them apart from the other keys
    return {"runs": runs, "fp32_seed_spread": spread, "by_precision": precisions}
