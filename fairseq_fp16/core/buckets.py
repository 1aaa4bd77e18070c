"""Batches in a few fixed shapes: lengths padded to buckets, sentences per batch fixed per bucket.

fairseq cuts its batches from length-sorted sentences up to ``--max-tokens``, so nearly every
batch has a shape of its own (sentences x source length x target length): hundreds in an epoch.
A CUDA graph replays one recorded shape, and ``torch.compile(mode="reduce-overhead")`` records
a graph for every new one, so graphs pay off only when the shapes are few. Here every sentence
goes to a bucket: a box of lengths (source <= S, target <= T). Every batch of a bucket holds
its sentences padded to exactly S and T, and exactly the same number of them: at most
``max_tokens // max(S, T)`` (the token budget fairseq's batches keep), spread evenly over the
fewest batches that allows, so that the last batch is not left part-filled. What the rounding
leaves free is filled with padding sentences (:class:`fairseq_fp16.batching.BucketedBatching`,
the dataset's side), which carry no target token and add nothing to the loss or the gradients.
No sentence is dropped.

The boxes are fitted to the training data's joint length distribution (:func:`fit_bounds`):
merged bottom-up from the distinct (source, target) pairs, always the two boxes whose union
adds the fewest padded positions, then moved edge by edge while that pads less. Source and
target lengths are correlated but not equal (the Debian corpus's targets run 0.85-1.6 times
their sources), so boxes in two dimensions pad far less than one length for both.
:func:`fit_length_buckets` with ``auto`` takes, among 1 to :data:`AUTO_MAX_SHAPES` boxes, the
count that pads least, padding sentences included: more boxes pad less within a batch, but
each rounds its batches' sentences up to ``--required-batch-size-multiple``.

Pure numpy: the fitter and the batches of lengths, without a dataset or fairseq.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["AUTO_MAX_SHAPES", "BatchShape", "LengthBuckets",
           "assign_buckets", "batch_padding", "fit_bounds", "fit_length_buckets", "parse_length_buckets",
           "round_up"]

#: ``--length-buckets auto``: at most this many batch shapes (a CUDA graph set each)
AUTO_MAX_SHAPES = 16
#: :func:`fit_bounds` merges at most this many boxes (a matrix of their pairs is kept)
SEED_BOXES = 512


def parse_length_buckets(choice) -> Union[None, str, int]:
    """``--length-buckets`` as None (off), ``"auto"`` or the most batch shapes (an int >= 1).

    Raises:
        ValueError: naming the flag and its valid values.
    """
    text = "off" if choice is None else str(choice).strip()
    if text in ("off", "auto"):
        return None if text == "off" else "auto"
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError("--length-buckets must be off, auto or an integer >= 1 (the most batch "
                         f"shapes), got {choice!r}")
    return number


@dataclass(frozen=True)
class BatchShape:
    """One bucket's batches: ``sentences`` x ``source`` (tokens) and ``sentences`` x ``target``."""

    sentences: int
    source: int
    target: int

    def __str__(self) -> str:
        return f"{self.sentences}x{self.source}x{self.target}"


def sentences_per_batch(length: int, max_tokens: Optional[int], max_sentences: Optional[int],
                        multiple: int = 1) -> int:
    """Sentences in a batch whose longer side is ``length`` tokens: ``max_tokens // length``,
    at most ``max_sentences``, rounded down to a multiple of ``multiple`` where it is above it
    (fairseq's ``--required-batch-size-multiple``, as its fixed-shape batches round).

    Raises:
        ValueError: naming ``--max-tokens`` when it holds no sentence of that length.
    """
    if not max_tokens and not max_sentences:
        raise ValueError("--length-buckets needs --max-tokens (or --batch-size): the sentences per "
                         "batch of each bucket are derived from it")
    bsz = int(max_tokens) // length if max_tokens else int(max_sentences)
    if max_sentences:
        bsz = min(bsz, int(max_sentences))
    if multiple > 1 and bsz >= multiple:
        bsz -= bsz % multiple
    if bsz < 1:
        raise ValueError(f"--max-tokens {max_tokens} holds no sentence of {length} tokens (a "
                         "bucket's longer side); raise --max-tokens or filter long sentences "
                         "(--max-source-positions / --max-target-positions)")
    return bsz


def _even(count: int, most: int, multiple: int) -> int:
    """Sentences per batch that spread ``count`` sentences over as few batches as batches of
    ``most`` need, rounded up to ``multiple`` (never above ``most``)."""
    if count <= 0:
        return most
    batches = -(-count // most)
    even = -(-count // batches)
    if multiple > 1 and most >= multiple:
        even = -(-even // multiple) * multiple
    return min(even, most)


def _distinct_pairs(src, tgt):
    """(pairs (P x 2), each sentence's pair, each pair's count) of the (src, tgt) lengths."""
    src, tgt = np.asarray(src, dtype=np.int64), np.asarray(tgt, dtype=np.int64)
    keys, inverse, counts = np.unique((src << 32) | tgt, return_inverse=True, return_counts=True)
    return np.stack([keys >> 32, keys & 0xFFFFFFFF], 1), inverse.reshape(-1), counts


def round_up(lengths, multiple: int):
    """``lengths`` (an int or an array) rounded up to a multiple of ``multiple``."""
    return lengths if multiple <= 1 else -(-lengths // multiple) * multiple


def _cheapest_holding(bounds: np.ndarray, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """For each (src, tgt) pair, the index of the box of ``bounds`` (K x 2) with the fewest
    positions (S + T) that holds it; -1 where none does."""
    out = np.full(len(src), -1, dtype=np.int64)
    if not len(bounds):
        return out
    cost = bounds.sum(1)
    best = np.full(len(src), np.iinfo(np.int64).max)
    for k in np.argsort(cost, kind="stable")[::-1]:  # cheapest last, so it wins ties too
        fits = (src <= bounds[k, 0]) & (tgt <= bounds[k, 1]) & (cost[k] <= best)
        out[fits], best[fits] = k, cost[k]
    return out


def _best_split(s: np.ndarray, t: np.ndarray, w: np.ndarray):
    """(saving, dimension, cut) of the best cut of one box of pairs into two, or None; a box's
    cost is its pairs' weight times S + T, where S and T are the box's largest lengths."""
    total = w.sum() * (s.max() + t.max())
    best = None
    for dim, (a, b) in enumerate(((s, t), (t, s))):
        order = np.lexsort((b, a))
        a, b, ws = a[order], b[order], w[order]
        cut = np.flatnonzero(a[:-1] < a[1:])  # between distinct lengths of this dimension
        if not len(cut):
            continue
        left_w = np.cumsum(ws)[cut]
        left = left_w * (a[cut] + np.maximum.accumulate(b)[cut])
        right_b = np.maximum.accumulate(b[::-1])[::-1][cut + 1]
        right = (ws.sum() - left_w) * (a[-1] + right_b)
        i = int(np.argmax(total - left - right))
        saving = float(total - left[i] - right[i])
        if saving > 0 and (best is None or saving > best[0]):
            best = (saving, dim, int(a[cut[i]]))
    return best


def fit_bounds(src: np.ndarray, tgt: np.ndarray, max_shapes: int, weights=None) -> List[np.ndarray]:
    """Boxes of (source, target) lengths for 1 to ``max_shapes`` buckets, fitted to the pairs.

    The distinct pairs (above :data:`SEED_BOXES` of them, the corners of the boxes of a k-d
    tree grown to that many) are merged two at a time, always the two whose merged box adds the
    fewest padded positions, as in agglomerative clustering. Each count of boxes is then
    improved by a local search (:func:`_improve`) and shrunk around the pairs (:func:`_refine`).
    On the Debian corpus's demo split, 16 boxes pad 10.1% of the positions after merging and
    9.4% after the search; a k-d tree alone, split from one box, pads 11.9%.

    Args:
        src, tgt: the sentences' lengths.
        max_shapes: the most boxes.
        weights: how many sentences each (src, tgt) stands for (default 1 each).

    Returns:
        one array of bounds (K x 2: S, T per box) per K = 1, 2, ... up to ``max_shapes`` (or the
        distinct pairs); every pair is held by a box of each.
    """
    pairs, inverse, counts = _distinct_pairs(src, tgt)
    if weights is not None:
        counts = np.bincount(inverse, weights=np.asarray(weights, np.float64), minlength=len(pairs))
    s, t, w = pairs[:, 0], pairs[:, 1], counts.astype(np.float64)
    ps, pt, pw = _kd_boxes(s, t, w, SEED_BOXES)  # the points the boxes are fitted to
    return [_refine(_improve(_refine(bounds, ps, pt, pw), ps, pt, pw), s, t, w)
            for bounds in _merge_boxes(ps, pt, pw, max_shapes)]


def _kd_boxes(s: np.ndarray, t: np.ndarray, w: np.ndarray, leaves: int):
    """(S, T, W) of the boxes of a k-d tree of at most ``leaves`` leaves over the pairs: the
    box and the cut that save the most positions split first; each pair a box when there are
    no more pairs than ``leaves``."""
    if len(s) <= leaves:
        return s, t, w
    members = [np.arange(len(s))]
    splits = [_best_split(s, t, w)]
    while len(members) < leaves:
        i = max(range(len(members)), key=lambda j: splits[j][0] if splits[j] else -1.0)
        if splits[i] is None:
            break
        _, dim, cut = splits[i]
        low = (s if dim == 0 else t)[members[i]] <= cut
        new = [members[i][low], members[i][~low]]
        members[i:i + 1] = new
        splits[i:i + 1] = [_best_split(s[m], t[m], w[m]) for m in new]
    return (np.array([s[m].max() for m in members], dtype=np.int64),
            np.array([t[m].max() for m in members], dtype=np.int64),
            np.array([w[m].sum() for m in members]))


def _merge_boxes(S: np.ndarray, T: np.ndarray, W: np.ndarray, max_shapes: int) -> List[np.ndarray]:
    """Merge the boxes (S, T, weight W) two at a time, the pair whose merged box (the larger S
    and T) adds the fewest positions first; the bounds at each count from ``max_shapes`` (or
    the boxes given) down to 1, returned from 1 up."""
    S, T, W = S.astype(np.float64), T.astype(np.float64), W.astype(np.float64)
    n = len(S)
    alive = np.ones(n, dtype=bool)

    def added(i):  # positions added by merging box i with each box
        cost = (W[i] + W) * (np.maximum(S[i], S) + np.maximum(T[i], T)) - W[i] * (S[i] + T[i]) - W * (S + T)
        cost[~alive] = np.inf
        cost[i] = np.inf
        return cost

    added_by = np.stack([added(i) for i in range(n)])
    out = []
    for count in range(n, 0, -1):
        if count <= max_shapes:
            out.append(np.stack([S[alive], T[alive]], 1).astype(np.int64))
        if count == 1:
            break
        i, j = divmod(int(np.argmin(added_by)), n)
        S[i], T[i], W[i] = max(S[i], S[j]), max(T[i], T[j]), W[i] + W[j]
        alive[j] = False
        added_by[j, :] = added_by[:, j] = np.inf
        added_by[i, :] = added_by[:, i] = added(i)
    return out[::-1]


def _refine(bounds: np.ndarray, s: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Move each pair to the cheapest box that holds it and shrink each box around its pairs,
    until nothing moves (each round pads no more than the one before); empty boxes go."""
    for _ in range(50):
        owner = _cheapest_holding(bounds, s, t)
        used = np.unique(owner)
        new = np.array([[s[owner == k].max(), t[owner == k].max()] for k in used])
        if new.shape == bounds.shape and (new == bounds).all():
            break
        bounds = new
    return bounds[np.lexsort((bounds[:, 1], bounds[:, 0]))]


def _improve(bounds: np.ndarray, s: np.ndarray, t: np.ndarray, w: np.ndarray,
             sweeps: int = 8) -> np.ndarray:
    """Local search: move one bound of one box at a time to the length (among the pairs') that
    pads least, every pair going to the cheapest box that holds it; sweep the boxes until no
    move helps. Merging never undoes an early merge; this moves the boxes' edges after it."""
    bounds = bounds.astype(np.int64).copy()
    values = (np.unique(s), np.unique(t))
    for _ in range(sweeps):
        moved = False
        for k in range(len(bounds)):
            others = np.delete(bounds, k, 0)
            held = (s[:, None] <= others[None, :, 0]) & (t[:, None] <= others[None, :, 1])
            elsewhere = np.where(held, others.sum(1)[None, :], np.inf).min(1, initial=np.inf)
            current = float(w @ np.minimum(elsewhere, np.where(
                (s <= bounds[k, 0]) & (t <= bounds[k, 1]), bounds[k].sum(), np.inf)))
            for dim, (mine, other) in enumerate(((s, t), (t, s))):
                cands = values[dim]
                holds = (mine[:, None] <= cands[None, :]) & (other <= bounds[k, 1 - dim])[:, None]
                cost = np.where(holds, np.minimum(elsewhere[:, None], cands + bounds[k, 1 - dim]),
                                elsewhere[:, None])
                totals = w @ cost
                best = int(np.argmin(totals))
                if totals[best] < current - 1e-6:
                    bounds[k, dim], current, moved = cands[best], float(totals[best]), True
        bounds = _refine(bounds, s, t, w)
        if not moved:
            break
    return bounds


def assign_buckets(bounds, src, tgt) -> np.ndarray:
    """Each sentence's bucket among ``bounds`` (K x 2): the one of fewest positions (S + T)
    that holds its lengths.

    Raises:
        ValueError: a sentence is longer than every bucket.
    """
    bounds = np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
    pairs, inverse, _ = _distinct_pairs(src, tgt)
    owner = _cheapest_holding(bounds, pairs[:, 0], pairs[:, 1])
    if (owner < 0).any():
        s, t = pairs[int(np.flatnonzero(owner < 0)[0])]
        raise ValueError(f"--length-buckets: a sentence of {s} source and {t} target tokens fits no "
                         f"bucket (largest lengths {bounds.tolist()})")
    return owner[inverse]


def batch_padding(shapes: Sequence[Tuple[int, int, int]], real_positions: int) -> float:
    """The share of the token positions of batches of ``shapes`` ((sentences, source, target)
    each) that are padding, given the ``real_positions`` their sentences hold."""
    total = sum(n * (s + t) for n, s, t in shapes)
    return 1.0 - real_positions / total if total else 0.0


class LengthBuckets:
    """Buckets of (source, target) lengths, each with the one shape of its batches.

    Args:
        bounds: the largest (source, target) length of each bucket.
        max_tokens, max_sentences, batch_multiple: fairseq's ``--max-tokens``,
            ``--batch-size`` and ``--required-batch-size-multiple``: a bucket's batches hold at
            most :func:`sentences_per_batch` of its longer side.
        counts: the sentences in each bucket, if known: they are then spread evenly over the
            fewest batches the most sentences allow (rounded up to ``batch_multiple``), so the
            last batch is not left part-filled; the batches are as many, a little smaller.
    """

    def __init__(self, bounds, max_tokens: Optional[int] = None, max_sentences: Optional[int] = None,
                 batch_multiple: int = 1, counts: Optional[Sequence[int]] = None) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
        most = [sentences_per_batch(int(max(s, t)), max_tokens, max_sentences, batch_multiple)
                for s, t in self.bounds]
        if counts is not None:
            most = [_even(int(n), m, batch_multiple) for n, m in zip(counts, most)]
        self.shapes: List[BatchShape] = [BatchShape(m, int(s), int(t))
                                         for m, (s, t) in zip(most, self.bounds)]

    def __len__(self) -> int:
        return len(self.shapes)

    def assign(self, src, tgt) -> np.ndarray:
        """Each sentence's bucket: the one of fewest positions that holds its lengths.

        Raises:
            ValueError: a sentence is longer than every bucket.
        """
        return assign_buckets(self.bounds, src, tgt)

    def batches(self, indices, owner: np.ndarray) -> List[np.ndarray]:
        """``indices`` cut into batches: each bucket's sentences, in the order given, in runs of
        its batch's sentences (the last run may be short; the collater fills it up)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = []
        for k, shape in enumerate(self.shapes):
            mine = indices[owner == k]
            out += [mine[i:i + shape.sentences] for i in range(0, len(mine), shape.sentences)]
        return out

    def stats(self, src, tgt, weights=None) -> Dict[str, object]:
        """``shapes`` (distinct batch shapes), ``padding`` (share of padded positions, padding
        sentences included), ``batches`` and ``padding_sentences`` of these sentences' batches
        (``weights``: how many sentences each (src, tgt) stands for; default 1 each)."""
        src, tgt = np.asarray(src, dtype=np.int64), np.asarray(tgt, dtype=np.int64)
        weights = np.ones(len(src), dtype=np.int64) if weights is None else np.asarray(weights, np.int64)
        counts = np.bincount(self.assign(src, tgt), weights=weights, minlength=len(self)).astype(np.int64)
        shapes, filled = [], 0
        for shape, n in zip(self.shapes, counts.tolist()):
            batches = -(-n // shape.sentences)
            shapes += [(shape.sentences, shape.source, shape.target)] * batches
            filled += batches * shape.sentences - n
        real = int(weights @ (src + tgt))
        return {"shapes": len(set(shapes)), "padding": batch_padding(shapes, real),
                "batches": len(shapes), "padding_sentences": filled}

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.shapes)


def fit_length_buckets(src, tgt, choice, max_tokens: Optional[int], max_sentences: Optional[int] = None,
                       batch_multiple: int = 1, length_multiple: int = 1) -> LengthBuckets:
    """The buckets of ``--length-buckets CHOICE`` for sentences of these lengths.

    Args:
        src, tgt: the training sentences' source and target lengths (tokens).
        choice: ``"auto"`` or the most shapes (see :func:`parse_length_buckets`).
        max_tokens, max_sentences, batch_multiple: as :class:`LengthBuckets`.
        length_multiple: bucket lengths are multiples of it (``--required-seq-len-multiple``,
            ``--cpu-length-multiple``).

    Raises:
        ValueError: a bad ``choice``, or no batch size (see :func:`sentences_per_batch`).
    """
    choice = parse_length_buckets(choice)
    if choice is None:
        raise ValueError("--length-buckets off: there are no buckets to fit")
    pairs, _, weights = _distinct_pairs(src, tgt)  # the sentences, as distinct length pairs
    s, t = pairs[:, 0], pairs[:, 1]
    fitted = fit_bounds(round_up(s, length_multiple), round_up(t, length_multiple),
                        AUTO_MAX_SHAPES if choice == "auto" else choice, weights)

    def build(bounds):
        counts = np.bincount(assign_buckets(bounds, s, t), weights=weights, minlength=len(bounds))
        return LengthBuckets(bounds, max_tokens, max_sentences, batch_multiple, counts.astype(np.int64))

    if choice != "auto":
        return build(fitted[-1])
    options = [build(bounds) for bounds in fitted]
    padding = [b.stats(s, t, weights)["padding"] for b in options]
    return options[int(np.argmin(padding))]  # the first of the least: the fewest shapes
