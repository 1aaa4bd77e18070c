"""The statistics of the comparisons, on plain values: sacrebleu's paired bootstrap, an exact
permutation test, and the seed-paired equivalence test (Student's t, TOST).

Nothing here reads files or imports fairseq; ``summary`` and ``verdict`` hand these functions the
values of a comparison's runs.
"""

import itertools
import math
import statistics
from typing import Dict, List, Sequence

#: The issue's tolerance for "the same BLEU": a mixed precision within this many BLEU points of fp32.
MARGIN = 0.5


def check_margin(margin: float) -> float:
    """``margin`` if it is a positive number of BLEU points; else ValueError naming ``--margin``."""
    if not margin > 0:
        raise ValueError(f"--margin must be a positive number of BLEU points, got {margin:g}")
    return margin


def check_resamples(n_samples: int) -> int:
    """``n_samples`` if it is a positive number of bootstrap resamples; else ValueError naming
    ``--bootstrap`` (sacrebleu would quietly draw its default 1,000 for 0 or less)."""
    if not (isinstance(n_samples, int) and n_samples >= 1):
        raise ValueError(f"--bootstrap must be a positive number of resamples, got {n_samples}")
    return n_samples


def paired_bootstrap(refs: List[str], baseline: List[str], systems: Dict[str, List[str]],
                     n_samples: int) -> Dict[str, float]:
    """{name: p_value} of each of ``systems`` (name -> hypotheses) against ``baseline``, from
    sacrebleu's paired bootstrap of BLEU with ``n_samples`` resamples of the test sentences.

    A system whose output is the baseline's gets p = 1.0 (sacrebleu would give identical
    systems 1/(n+1); there is no difference at all).

    Raises:
        ValueError: when ``n_samples`` is not a positive integer (:func:`check_resamples`).
    """
    check_resamples(n_samples)
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    pvals, tested = {}, [("baseline", baseline)]
    for name, hyps in systems.items():
        if hyps == baseline:
            pvals[name] = 1.0
        else:
            tested.append((name, hyps))
    if len(tested) < 2:
        return pvals
    test = PairedTest(tested, {"BLEU": BLEU()}, [refs], test_type="bs", n_samples=n_samples)
    _, scores = test()
    for name, res in zip([s[0] for s in tested], scores["BLEU"]):
        if name != "baseline":
            pvals[name] = res.p_value
    return pvals


def permutation_p(a, b) -> float:
    """Exact two-sided permutation test of the difference of means of two small samples.

    Every split of the pooled values into groups of len(a) and len(b) is equally
    likely if the label does not matter; p is the share of splits whose
    difference of means is at least as large (in absolute value) as the observed one.
    """
    pooled, n = [*a, *b], len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    splits = list(itertools.combinations(range(len(pooled)), n))
    hits = 0
    for idx in splits:
        x = [pooled[i] for i in idx]
        y = [v for i, v in enumerate(pooled) if i not in idx]
        hits += abs(statistics.fmean(x) - statistics.fmean(y)) >= observed - 1e-9
    return hits / len(splits)


def min_permutation_p(n_a: int, n_b: int) -> float:
    """The smallest p :func:`permutation_p` can give with samples of ``n_a`` and ``n_b`` values
    (the observed split alone, and its mirror when the groups are the same size)."""
    return 1 / math.comb(n_a + n_b, n_a) * (2 if n_a == n_b else 1)


def paired_equivalence(diffs: Sequence[float], margin: float = MARGIN) -> dict:
    """Is a precision's BLEU within ``margin`` of fp32's, counting training-to-training variation?

    ``diffs``: BLEU(mixed) - BLEU(fp32) of runs trained with the same seed, one per seed. Pairing
    by seed takes out what the two runs share (initialisation, batch order); what is left is the
    precision's effect plus the noise of two trainings parting, which one pair's paired bootstrap
    (test sentences resampled, outputs fixed) does not see. Student's t on the differences gives:

    - ``ci90``: the 90% confidence interval of the mean difference;
    - two one-sided tests (TOST) of "|mean difference| >= margin": ``p_equivalence``, the larger
      of their p values; below 0.05 exactly when ``ci90`` lies inside (-margin, +margin);
    - ``p_difference``: the two-sided paired t-test of "mean difference = 0".

    ``verdict`` is one of ``equivalent`` (``ci90`` inside the margin), ``not_worse`` (the lower
    bound above -margin, the upper one not below +margin), ``not_better`` (the mirror),
    ``worse`` / ``better`` (the whole interval beyond -margin / +margin) or ``inconclusive``
    (the interval reaches past both).

    Raises:
        ValueError: with fewer than two differences, or a margin that is not positive.
    """
    from scipy import stats

    check_margin(margin)
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a seed-paired test needs two or more seeds with both runs, got {n}")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    t = stats.t(df=n - 1)
    if se > 0:
        half = t.ppf(0.95) * se
        p_low = t.sf((mean + margin) / se)  # H0: mean <= -margin
        p_high = t.cdf((mean - margin) / se)  # H0: mean >= +margin
        p_diff = 2 * t.sf(abs(mean) / se)
    else:  # every seed gave the same difference: no spread to test against
        half = 0.0
        p_low, p_high = float(mean <= -margin), float(mean >= margin)
        p_diff = float(mean == 0)
    lo, hi = mean - half, mean + half
    if -margin < lo and hi < margin:
        verdict = "equivalent"
    elif hi <= -margin:
        verdict = "worse"
    elif lo >= margin:
        verdict = "better"
    elif lo > -margin:
        verdict = "not_worse"
    elif hi < margin:
        verdict = "not_better"
    else:
        verdict = "inconclusive"
    return {"n": n, "diffs": list(diffs), "mean": mean, "sd": sd, "ci90": [float(lo), float(hi)],
            "margin": margin, "p_equivalence": float(max(p_low, p_high)), "p_difference": float(p_diff),
            "verdict": verdict}
