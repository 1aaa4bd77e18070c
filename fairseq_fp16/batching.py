"""A training set's batches in bucket shapes (``--length-buckets``): the dataset's side.

:mod:`fairseq_fp16.core.buckets` fits the buckets and cuts the batches of lengths;
:class:`BucketedBatching` makes a language-pair dataset batch and collate in them, through its
``batch_by_size`` and ``collater`` (swapped on that dataset alone, checked against its class's
source and reversible: :func:`~fairseq_fp16.core.swap.swap_attribute`).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from .core.buckets import LengthBuckets, fit_length_buckets, parse_length_buckets
from .core.swap import swap_attribute

logger = logging.getLogger(__name__)

__all__ = ["BucketedBatching"]

#: the key the dataset keeps its :class:`BucketedBatching` under
_INSTALLED = "_fairseq_fp16_length_buckets"
#: sample keys a padding sentence can be made for (fairseq's LanguagePairDataset items)
_SAMPLE_KEYS = {"id", "source", "target"}


class BucketedBatching:
    """A language-pair dataset's batches in bucket shapes: its ``batch_by_size`` and
    ``collater``.

    The dataset is fairseq's ``LanguagePairDataset`` or one shaped like it: ``src_sizes`` and
    ``tgt_sizes`` (the lengths its items have), ``collater(samples, pad_to_length=...)``,
    ``pad_to_multiple``, ``src_dict`` (``pad()``) and ``eos``. :meth:`install` makes this the
    dataset's batching. The buckets are fitted when fairseq asks for batches (the sentences
    left after its length filter), with its ``--max-tokens``.

    A padding sentence (id -1) is a source of one end-of-sentence token and a target of padding
    alone: every attention row has a token to attend to (a source row of padding alone would
    make its softmax NaN, and the NaN would reach the gradients), and the criterion, which
    ignores padding targets, takes no loss and no gradient from it. ``ntokens`` counts target
    tokens and is unchanged; ``nsentences`` counts the real sentences. A criterion that averages
    over sentences (``--sentence-avg``) divides by the batch's rows, padding sentences included.
    """

    def __init__(self, dataset, choice) -> None:
        if getattr(dataset, "tgt_sizes", None) is None or getattr(dataset, "src_sizes", None) is None:
            raise ValueError(f"--length-buckets: the training set is a {type(dataset).__name__} "
                             "without source and target lengths (a language-pair dataset has them)")
        self.dataset = dataset
        self.choice = parse_length_buckets(choice)
        self.buckets: Optional[LengthBuckets] = None
        self._owner = np.full(len(dataset), -1, dtype=np.int64)  # each sentence's bucket
        self._collate = dataset.collater  # the dataset's own, bound before install replaces it

    @classmethod
    def install(cls, dataset, choice) -> "BucketedBatching":
        """Make ``dataset`` batch and collate in bucket shapes (idempotent)."""
        own = vars(dataset).get(_INSTALLED)
        if own is not None:
            return own
        own = cls(dataset, choice)
        swap_attribute(dataset, "batch_by_size", own.batch_by_size,
                       expects=["required_batch_size_multiple"])
        swap_attribute(dataset, "collater", own.collater, expects=["pad_to_length"])
        setattr(dataset, _INSTALLED, own)
        return own

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        """As ``FairseqDataset.batch_by_size``: ``indices`` (ordered, filtered) as batches, here
        each of one bucket and at most its shape's sentences."""
        indices = np.asarray(indices, dtype=np.int64)
        ds = self.dataset
        src, tgt = ds.src_sizes[indices], ds.tgt_sizes[indices]
        self.buckets = fit_length_buckets(src, tgt, self.choice, max_tokens, max_sentences,
                                          required_batch_size_multiple,
                                          int(getattr(ds, "pad_to_multiple", 1) or 1))
        owner = self.buckets.assign(src, tgt)
        self._owner[:] = -1
        self._owner[indices] = owner
        stats = self.buckets.stats(src, tgt)
        logger.info("--length-buckets %s: %d batch shapes (sentences x source x target): %s; %.1f%% "
                    "of the positions are padding (%d padding sentences)", self.choice,
                    len(self.buckets), self.buckets, 100 * stats["padding"], stats["padding_sentences"])
        return self.buckets.batches(indices, owner)

    def collater(self, samples, pad_to_length=None):
        """The dataset's batch of ``samples`` (one bucket's), padded to the bucket's lengths and
        filled up to its sentences with padding sentences (``pad_to_length`` is not used).

        Raises:
            RuntimeError: the samples are not one bucket's, carry what a padding sentence
                cannot be made for, or collate longer than their bucket.
        """
        if not samples:
            return self._collate(samples)
        owners = {int(self._owner[s["id"]]) for s in samples}
        if len(owners) != 1 or -1 in owners or self.buckets is None:
            raise RuntimeError(f"--length-buckets: a batch of sentences from buckets {sorted(owners)}; "
                               "batches must come from this dataset's batch_by_size")
        shape = self.buckets.shapes[owners.pop()]
        extra = set(samples[0]) - _SAMPLE_KEYS
        if extra:
            raise RuntimeError(f"--length-buckets: samples with {sorted(extra)}, for which no "
                               "padding sentence can be made")
        fill = shape.sentences - len(samples)
        batch = self._collate(list(samples) + [self._padding_sentence(samples[0])] * fill,
                              pad_to_length={"source": shape.source, "target": shape.target})
        got = (batch["net_input"]["src_tokens"].shape, batch["target"].shape)
        if got != ((shape.sentences, shape.source), (shape.sentences, shape.target)):
            raise RuntimeError(f"--length-buckets: a batch of bucket {shape} collated as "
                               f"{tuple(got[0])} and {tuple(got[1])} (items longer than the "
                               "lengths the dataset reports?)")
        batch["nsentences"] = len(samples)
        return batch

    def _padding_sentence(self, like: dict) -> dict:
        ds = self.dataset
        pad = ds.src_dict.pad()
        eos = ds.eos if getattr(ds, "eos", None) is not None else ds.src_dict.eos()
        return {"id": -1,
                "source": torch.full((1,), eos, dtype=like["source"].dtype),
                "target": torch.full((1,), pad, dtype=like["target"].dtype)}
